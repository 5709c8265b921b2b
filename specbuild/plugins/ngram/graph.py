"""The n-gram mode's graph side: nothing to draft in the graph; the step graph verifies the tree the runtime's
drafter proposes (tokens, mask and paths are inputs), so only the step size and the drafter's settings are set
here, and checked before any work."""

from __future__ import annotations

from specbuild.builder.network.mode_plugin import HostDraftedPlugin
from specbuild.errors import SpecbuildError
from specbuild.plugins.ngram import (
    DEFAULT_CANDIDATES,
    DEFAULT_DRAFT_LENGTH,
    DEFAULT_MAX_NGRAM_SIZE,
    DEFAULT_NUM_DRAFT_TOKENS,
    DRAFT_LENGTHS,
)
from specbuild.tree import MAX_TREE_SIZE


class NgramPlugin(HostDraftedPlugin):
    name = "ngram"

    def chain_drafts(self) -> bool:
        return self.settings["chain_drafts"]

    @classmethod
    def check_options(cls, checkpoint, options) -> dict:
        def pick(name, default):
            value = getattr(options, name, None)
            return default if value is None else int(value)

        n = pick("max_ngram_size", DEFAULT_MAX_NGRAM_SIZE)
        k = pick("num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS)
        c = pick("ngram_candidates", DEFAULT_CANDIDATES)
        length = getattr(options, "ngram_draft_length", None) or DEFAULT_DRAFT_LENGTH
        if length not in DRAFT_LENGTHS:
            raise SpecbuildError(f"--ngram-draft-length must be one of {', '.join(DRAFT_LENGTHS)}, got {length!r}")
        max_draft = getattr(options, "max_draft_len", None)
        if max_draft is not None and c * k > max_draft:
            raise SpecbuildError(
                f"--num-draft-tokens {k} x --ngram-candidates {c} = {c * k} draft tokens but --max-draft-len is "
                f"{max_draft}"
            )
        if 1 + c * k > MAX_TREE_SIZE:
            raise SpecbuildError(
                f"--num-draft-tokens {k} x --ngram-candidates {c} = {c * k} draft tokens: at most "
                f"{MAX_TREE_SIZE - 1} per step"
            )
        return {
            "max_ngram_size": n,
            "num_draft_tokens": k,
            "candidates": c,
            "draft_length": length,
            "tokens_per_step": 1 + c * k,
            "chain_drafts": c == 1,  # one candidate: each call verifies the root and one continuation
        }

    def manifest(self) -> dict:
        s = self.settings
        return {
            "drafter": {
                "max_ngram_size": s["max_ngram_size"],
                "num_draft_tokens": s["num_draft_tokens"],
                "candidates": s["candidates"],
                "draft_length": s["draft_length"],
            }
        }
