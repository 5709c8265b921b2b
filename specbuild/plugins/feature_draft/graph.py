"""The graph plugin of feature-conditioned draft modes: a static `--tree` or a dynamic top-k tree (EAGLE-2's
expansion) drafted in the graph by the mode's draft network (`net_class`).

The draft network's KV for accepted positions is engine state (`state_draft_kv`, committed by the runtime
at the accepted nodes like the base cache); expansion happens inside the graph after acceptance.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch import nn

from specbuild import engine_format as ef
from specbuild.builder.network.mode_plugin import DraftContext, ModePlugin, OutputSpec, StateSpec
from specbuild.errors import SpecbuildError
from specbuild.plugins.feature_draft.draft_net import commit_pass, expand_dynamic, expand_static, static_relations
from specbuild.tree import MAX_TOP_K, MAX_TREE_SIZE, Tree, parse_tree

# EAGLE-2 published defaults (EaModel evaluation scripts): total_token 60, depth 5, top_k 10
PUBLISHED_DEFAULTS = {"eagle_top_k": 10, "eagle_depth": 5, "eagle_total_tokens": 60}
# The graph unrolls one draft pass per level: published trees use depth 5-8; export time grows with depth.
MAX_DEPTH = 16
DRAFT_KV = "draft_kv"  # the draft network's KV cache, a state that grows with the base cache
# [B,C] whether the draft KV holds each position: a call that drafts for no row skips the draft network (its draft
# KV rows stay zeros, flagged False), and drafting resumes over the positions it saw
DRAFT_VALID = "draft_valid"


class FeatureDraftPlugin(ModePlugin):
    """A subclass names its mode (`name`, `head_key`: the checkpoint's heads) and its DraftNet (`net_class`)."""

    name = ""
    head_key = ""
    net_class = None
    selects_rows = True

    @classmethod
    def check_options(cls, checkpoint, options) -> dict:
        """A static --tree (EAGLE-1) or the dynamic top-k / depth / total-tokens tree (EAGLE-2), bounded."""
        cfg = checkpoint.heads.get(cls.head_key)
        if cfg is None:
            raise SpecbuildError(
                f"{checkpoint.path}: checkpoint holds no {cls.head_key} heads; convert with `--{cls.head_key}-dir DIR`"
            )
        defaults = {**PUBLISHED_DEFAULTS, **cls.recorded_defaults(checkpoint, options)}
        vocab = int(cfg.get("draft_vocab_size") or checkpoint.model.vocab_size)  # the draft proposes from these
        max_draft = getattr(options, "max_draft_len", None)
        given_tree = getattr(options, "tree", None)
        given_dynamic = [k for k in PUBLISHED_DEFAULTS if getattr(options, k, None) is not None]
        if given_tree is not None and given_dynamic:
            flags = ", ".join("--" + k.replace("_", "-") for k in given_dynamic)
            raise SpecbuildError(
                f"--tree (a static EAGLE-1 tree) and {flags} (the dynamic EAGLE-2 tree) exclude each other"
            )
        tree_spec = given_tree if given_tree is not None else (None if given_dynamic else defaults.get("tree"))
        if tree_spec is not None:
            tree = parse_tree(tree_spec)
            tree.check(top_k=min(vocab, MAX_TOP_K), max_draft_len=max_draft, source="--tree")
            return {"tree": tree, "tokens_per_step": tree.size}

        def pick(key):
            value = getattr(options, key, None)
            return int(defaults[key] if value is None else value)

        k, depth, total = pick("eagle_top_k"), pick("eagle_depth"), pick("eagle_total_tokens")
        if not 1 <= k <= min(vocab, MAX_TOP_K):
            raise SpecbuildError(
                f"--eagle-top-k {k} must be between 1 and {min(vocab, MAX_TOP_K)} (the draft proposes from "
                f"{vocab} tokens)"
            )
        if not 1 <= depth <= MAX_DEPTH:
            raise SpecbuildError(f"--eagle-depth {depth} must be between 1 and {MAX_DEPTH}")
        candidates = k + (depth - 1) * k * k
        high = min(candidates + 1, MAX_TREE_SIZE)
        if not 2 <= total <= high:
            raise SpecbuildError(
                f"--eagle-total-tokens {total} must be between 2 and {high} (top-k {k}, depth {depth} draft "
                f"{candidates} candidates; at most {MAX_TREE_SIZE} tokens per step)"
            )
        if max_draft is not None and total - 1 > max_draft:
            raise SpecbuildError(
                f"--eagle-total-tokens {total} gives {total - 1} draft nodes but --max-draft-len is {max_draft}"
            )
        return {"tree": None, "top_k": k, "depth": depth, "total_tokens": total, "tokens_per_step": total}

    def __init__(self, checkpoint, net, settings):
        super().__init__()
        cfg = checkpoint.heads[self.head_key]
        with _uninitialized():  # load() overwrites every weight (strictly)
            self.drafter = self.net_class(cfg, net.cfg)
        self.drafter.load(checkpoint.head_tensors(self.head_key))
        self.drafter.to(net.embed_tokens.weight.dtype)
        self._tree = settings["tree"]
        if self._tree is not None:
            self.expansion = {"type": "static", "tree_size": self._tree.size}
            relations = static_relations(self._tree)  # buffers: read inside the drafting's If (draft_net)
            self._relation_depths = list(relations)
            for depth, relation in relations.items():
                self.register_buffer(f"static_relation_{depth}", relation, persistent=False)
        else:
            self.top_k, self.depth, self.total_tokens = settings["top_k"], settings["depth"], settings["total_tokens"]
            self.expansion = {
                "type": "dynamic",
                "top_k": self.top_k,
                "depth": self.depth,
                "total_tokens": self.total_tokens,
            }

    def draft_outputs(self) -> list[OutputSpec]:
        if self._tree is not None:
            return [OutputSpec(ef.NEXT_INPUT_IDS, "int64", ("B", self._tree.size))]
        n, depth = self.total_tokens, self.depth + 1
        return [
            OutputSpec(ef.NEXT_INPUT_IDS, "int64", ("B", n)),
            OutputSpec(ef.NEXT_TREE_MASK, "bool", ("B", n, n)),
            OutputSpec(ef.NEXT_POSITION_OFFSETS, "int64", ("B", n)),
            OutputSpec(ef.NEXT_PATHS, "int64", ("B", n, depth)),
        ]

    def tree(self) -> Tree | None:
        return self._tree

    def chain_drafts(self) -> bool:
        """A static chain, or a dynamic tree of top-k 1: its depth candidates are one chain and the nodes kept are
        the most probable, i.e. a prefix of it (cumulative scores only fall along a chain)."""
        return self._tree.is_chain if self._tree is not None else self.top_k == 1

    def max_new_tokens_per_step(self) -> int:
        return self._tree.size if self._tree is not None else self.total_tokens

    def state_specs(self) -> list[StateSpec]:
        c = self.drafter.c
        return [
            StateSpec(
                DRAFT_KV,
                (self.drafter.num_layers, 2, "B", c["num_kv_heads"], "C", c["head_dim"]),
                "float32",
                0.0,
                grow_axis=4,
            ),
            StateSpec(DRAFT_VALID, ("B", "C"), "bool", 0, grow_axis=1),
        ]

    def draft(self, ctx: DraftContext) -> dict:
        draft_kv, valid = ctx.states[DRAFT_KV], ctx.states[DRAFT_VALID]
        h_all, new_kv = commit_pass(self.drafter, ctx, draft_kv, valid)  # every row: its draft KV stays in step
        rows = ctx.drafting()
        h_rows, kv_rows, new_rows = ctx.select_rows(h_all), ctx.select_rows(draft_kv, 2), ctx.select_rows(new_kv, 2)
        valid_rows = ctx.select_rows(valid)
        if self._tree is not None:
            relations = {d: getattr(self, f"static_relation_{d}") for d in self._relation_depths}
            out = expand_static(self.drafter, rows, h_rows, kv_rows, valid_rows, new_rows, self._tree, relations)
        else:
            out = expand_dynamic(
                self.drafter, rows, h_rows, kv_rows, valid_rows, new_rows, self.top_k, self.depth, self.total_tokens
            )
        out[ef.NEW_STATE_PREFIX + DRAFT_KV] = new_kv
        out[ef.NEW_STATE_PREFIX + DRAFT_VALID] = torch.ones(ctx.input_ids.shape, dtype=torch.bool)
        return out

    def manifest(self) -> dict:
        return {
            "draft_version": self.drafter.version,
            "draft_layers": self.drafter.num_layers,
            "draft_vocab_size": self.drafter.draft_vocab,
            "expansion": self.expansion,
        }


@contextlib.contextmanager
def _uninitialized():
    """Within: Linear and Embedding layers are made without their random initialisation, for a network whose
    weights are all loaded next (the numbers drawn and then overwritten cost a large head's build time:
    docs/benchmarks/design-measurements.md)."""
    with (
        mock.patch.object(nn.Linear, "reset_parameters", lambda self: None),
        mock.patch.object(nn.Embedding, "reset_parameters", lambda self: None),
    ):
        yield
