"""The suffix mode's graph side: nothing to draft in the graph; the step graph verifies the tree the runtime's
drafter proposes, so only the step size and the drafter's settings are set here, checked before any work."""

from __future__ import annotations

from specbuild.builder.network.mode_plugin import HostDraftedPlugin
from specbuild.errors import SpecbuildError
from specbuild.plugins.suffix import (
    DEFAULT_DEPTH,
    DEFAULT_MIN_PROB,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_POOL_NODES,
    DEFAULT_SHAPE,
    DEFAULT_SPEC_FACTOR,
    SHAPES,
)
from specbuild.tree import MAX_TREE_SIZE


class SuffixPlugin(HostDraftedPlugin):
    name = "suffix"

    def chain_drafts(self) -> bool:
        return self.settings["shape"] == "chain"

    @classmethod
    def check_options(cls, checkpoint, options) -> dict:
        def pick(name, default, kind=int):
            value = getattr(options, name, None)
            return default if value is None else kind(value)

        k = pick("num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS)
        depth = pick("suffix_depth", DEFAULT_DEPTH)
        min_prob = pick("suffix_min_prob", DEFAULT_MIN_PROB, float)
        factor = pick("suffix_spec_factor", DEFAULT_SPEC_FACTOR, float)
        shape = getattr(options, "suffix_shape", None) or DEFAULT_SHAPE
        pool = pick("suffix_pool_nodes", DEFAULT_POOL_NODES)
        if shape not in SHAPES:
            raise SpecbuildError(f"--suffix-shape must be one of {', '.join(SHAPES)}, got {shape!r}")
        if not 0 < min_prob <= 1:
            raise SpecbuildError(f"--suffix-min-prob must be in (0, 1], got {min_prob}")
        if not factor > 0:
            raise SpecbuildError(f"--suffix-spec-factor must be > 0, got {factor}")
        max_draft = getattr(options, "max_draft_len", None)
        if max_draft is not None and k > max_draft:
            raise SpecbuildError(f"--num-draft-tokens {k} but --max-draft-len is {max_draft}")
        if 1 + k > MAX_TREE_SIZE:
            raise SpecbuildError(f"--num-draft-tokens {k}: at most {MAX_TREE_SIZE - 1} per step")
        return {
            "num_draft_tokens": k,
            "depth": depth,
            "min_prob": min_prob,
            "spec_factor": factor,
            "shape": shape,
            "pool_nodes": pool,
            "tokens_per_step": 1 + k,
        }

    def manifest(self) -> dict:
        s = self.settings
        keys = ("num_draft_tokens", "depth", "min_prob", "spec_factor", "shape", "pool_nodes")
        return {"drafter": {key: s[key] for key in keys}}
