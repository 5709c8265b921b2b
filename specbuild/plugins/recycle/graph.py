"""The recycle mode's graph side: the step graph verifies the tree the runtime's drafter proposes and returns each
window row's top K next tokens (ef.ROW_TOP_K), which the drafter recycles. The static tree, K and the longest copy
grafted onto it are checked before any work and recorded in engine.yaml."""

from __future__ import annotations

import torch

from specbuild import engine_format as ef
from specbuild.builder.network.mode_plugin import DraftContext, HostDraftedPlugin, OutputSpec
from specbuild.errors import SpecbuildError
from specbuild.plugins.recycle import (
    CONTEXTS,
    DEFAULT_CONTEXT,
    DEFAULT_DEPTH,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_TOP_K,
    MAX_TOP_K,
    static_tree,
)
from specbuild.tree import MAX_TREE_SIZE


class RecyclePlugin(HostDraftedPlugin):
    name = "recycle"

    @classmethod
    def check_options(cls, checkpoint, options) -> dict:
        def pick(name, default):
            value = getattr(options, name, None)
            return default if value is None else int(value)

        k = pick("recycle_top_k", DEFAULT_TOP_K)
        drafts = pick("num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS)
        depth = pick("recycle_depth", DEFAULT_DEPTH)
        vocab = checkpoint.model.vocab_size if checkpoint is not None else None
        if k > MAX_TOP_K or (vocab is not None and k > vocab):
            raise SpecbuildError(
                f"--recycle-top-k {k} is invalid: expected at most {min(MAX_TOP_K, vocab or MAX_TOP_K)}"
            )
        max_draft = getattr(options, "max_draft_len", None)
        if max_draft is not None and drafts > max_draft:
            raise SpecbuildError(f"--num-draft-tokens {drafts} but --max-draft-len is {max_draft}")
        if 1 + drafts > MAX_TREE_SIZE:
            raise SpecbuildError(f"--num-draft-tokens {drafts}: at most {MAX_TREE_SIZE - 1} per step")
        context = getattr(options, "recycle_context", None) or DEFAULT_CONTEXT
        if context not in CONTEXTS:
            raise SpecbuildError(f"--recycle-context must be one of {', '.join(CONTEXTS)}, got {context!r}")
        copy = pick("recycle_copy", drafts)
        if copy > drafts:
            raise SpecbuildError(f"--recycle-copy {copy} is invalid: expected at most --num-draft-tokens {drafts}")
        choices = static_tree(drafts, k, depth)
        settings = {"top_k": k, "depth": depth, "context": context, "copy": copy, "choices": choices}
        return {**settings, "tokens_per_step": 1 + len(choices)}

    def draft_outputs(self) -> list[OutputSpec]:
        return [*super().draft_outputs(), OutputSpec(ef.ROW_TOP_K, "int64", ("B", "W", self.settings["top_k"]))]

    def draft(self, ctx: DraftContext) -> dict:
        # [B,W,V] -> [B,W,K]: ONNX TopK, larger values first (the order the table keeps)
        top = torch.topk(ctx.logits, self.settings["top_k"], dim=-1).indices
        return {**super().draft(ctx), ef.ROW_TOP_K: top}

    def manifest(self) -> dict:
        s = self.settings
        choices = [list(c) for c in s["choices"]]
        fields = ("top_k", "depth", "context", "copy")
        return {"drafter": {**{key: s[key] for key in fields}, "choices": choices}}
