"""The draft-target mode's build side. The target's step graph drafts nothing: it verifies the chain (or top-k tree)
the runtime's drafter proposes as every mode's drafts are verified (a draft is accepted when it is the target's own
draw at its position; plugins/draft_target/drafter.py draws sampled drafts coupled to it). The draft model becomes
an engine of its own, built inside the engine directory
(DRAFT_ENGINE_DIR): plain decoding of the draft network with its logits as an output, optionally projected onto
the draft's most frequent tokens only (--draft-vocab-size; the ids of the kept rows are a file beside it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specbuild import engine_format as ef
from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.builder.network.mode_plugin import HostDraftedPlugin
from specbuild.errors import SpecbuildError
from specbuild.plugins.draft_target import DRAFT_ENGINE_DIR, DRAFT_VOCAB_TENSOR, MODE
from specbuild.tree import MAX_TREE_SIZE

DEFAULT_NUM_DRAFT_TOKENS = 4  # when the draft records no measured choice
VOCAB_IDS_FILE = "vocab_ids.npy"  # in the draft engine: the token id of each row of its logits (subset drafts)


@dataclasses.dataclass
class DraftCheckpoint(Checkpoint):
    """The draft model inside a target checkpoint, as a checkpoint of its own (its tokenizer is the target's)."""

    target: Checkpoint | None = None

    def tensors(self, device: str = "cpu") -> dict:
        tensors = self.target.head_tensors(MODE.name)
        tensors.pop(DRAFT_VOCAB_TENSOR, None)
        return tensors

    def head_tensors(self, name: str) -> dict:
        raise SpecbuildError(f"{self.path}: a draft model has no heads")


class DraftTargetPlugin(HostDraftedPlugin):
    name = MODE.name

    @classmethod
    def check_options(cls, checkpoint, options) -> dict:
        head = checkpoint.heads.get(MODE.name)
        if head is None:
            raise SpecbuildError(
                f"{checkpoint.path}: checkpoint holds no draft model; convert with `specbuild convert "
                f"{MODE.head_option} DIR` (e.g. specbuild/data/heads/smollm2-draft for SmolLM2)"
            )
        # the draft's measured defaults, for these --weights where it recorded another choice for them
        chosen = {**head, **(head.get("defaults_by_weights") or {}).get(options.weights or "fp32", {})}
        depth = _chain_length(options, chosen)
        top_k = options.draft_top_k or chosen.get("default_draft_top_k") or 1
        if 1 + top_k * depth > MAX_TREE_SIZE:
            raise SpecbuildError(
                f"--draft-top-k {top_k} x --draft-depth {depth}: at most {MAX_TREE_SIZE - 1} draft tokens per step"
            )
        weights = options.draft_weights or chosen.get("default_draft_weights")
        if weights is not None and weights not in ef.WEIGHTS:
            raise SpecbuildError(f"--draft-weights {weights!r} is not one of {', '.join(ef.WEIGHTS)}")
        if weights in ef.ONNXRUNTIME_ONLY_WEIGHTS and ef.BACKEND_TENSORRT in options.backends:
            raise SpecbuildError(
                "--draft-weights int8 builds the draft's onnxruntime graph only (its integer GEMMs are ONNX Runtime "
                "kernels): pass --backends onnxruntime, or use --draft-weights int4, fp16 or fp32"
            )
        listed = head.get("draft_vocab_size")
        vocab = options.draft_vocab_size or chosen.get("default_vocab_size")
        if options.draft_vocab_size is not None and not listed:
            raise SpecbuildError(
                f"--draft-vocab-size {vocab}: the draft model lists no token frequencies (no draft_vocab.json)"
            )
        if vocab is not None and listed and vocab > listed:
            raise SpecbuildError(
                f"--draft-vocab-size {vocab}: the draft model lists {listed} tokens (draft_vocab.json)"
            )
        vocab = int(vocab) if vocab and listed else None
        drafted_from = vocab or head["model"]["vocab_size"]
        if top_k > drafted_from:
            raise SpecbuildError(f"--draft-top-k {top_k}: the draft proposes from {drafted_from} tokens")
        return {
            "num_draft_tokens": int(depth),
            "top_k": int(top_k),
            "draft_weights": weights,
            "vocab_size": vocab,
            "tokens_per_step": 1 + int(top_k) * int(depth),
        }

    def chain_drafts(self) -> bool:
        return self.settings["top_k"] == 1

    def manifest(self) -> dict:
        s = self.settings
        head = self.checkpoint.heads[MODE.name]
        return {
            "drafter": {
                "num_draft_tokens": s["num_draft_tokens"],
                "top_k": s["top_k"],
                "engine": DRAFT_ENGINE_DIR,
                "vocab_ids": VOCAB_IDS_FILE if s["vocab_size"] else None,
            },
            "draft_model": {
                "num_layers": head["model"]["num_layers"],
                "hidden_size": head["model"]["hidden_size"],
                "vocab_size": s["vocab_size"] or head["model"]["vocab_size"],
                "source": head.get("source"),
                "lineage": head.get("lineage"),
            },
        }

    def companion_engines(self, plan) -> list:
        """The draft model's engine: plain decoding with logits, at --draft-weights (default the target's)."""
        from specbuild.builder.network.llama import LlamaNetwork

        head = self.checkpoint.heads[MODE.name]
        ckpt = DraftCheckpoint(
            path=self.checkpoint.path,
            model=ModelConfig.from_dict(head["model"], source=f"{self.checkpoint.path}: heads.{MODE.name}.model"),
            dtype=self.checkpoint.dtype,
            heads={},
            chat_template=self.checkpoint.chat_template,
            target=self.checkpoint,
        )
        weights = self.settings["draft_weights"] or plan.weights
        # the draft's roundings never change the output (the target decides every token), so its blockwise weights
        # take ONNX Runtime's int8-activation kernels: faster, and 1-row calls are not padded here
        sub = plan.companion(ckpt, weights, output_logits=True, int8_activations=weights in ef.BLOCKWISE_WEIGHTS)
        net = LlamaNetwork.from_tensors(ckpt.model, ckpt.tensors(), sub.engine_dtype)
        extra = {}
        if self.settings["vocab_size"]:
            ids = self.checkpoint.head_tensors(MODE.name)[DRAFT_VOCAB_TENSOR][: self.settings["vocab_size"]]
            project_onto(net, ids)
            extra[VOCAB_IDS_FILE] = np.ascontiguousarray(ids.numpy().astype(np.int64))
        return [(DRAFT_ENGINE_DIR, sub, net, extra)]


def _chain_length(options, chosen: dict) -> int:
    """The draft's chain length (draft calls a step): --draft-depth, or --num-draft-tokens (the same for a chain),
    else the draft's measured default."""
    depth, count = options.draft_depth, options.num_draft_tokens
    if depth is not None and count is not None and depth != count:
        raise SpecbuildError(
            f"--draft-depth {depth} and --num-draft-tokens {count} disagree: both are the draft's chain length "
            "(--draft-top-k adds tokens beside it)"
        )
    return depth or count or chosen.get("default_num_draft_tokens") or DEFAULT_NUM_DRAFT_TOKENS


def project_onto(net, ids: torch.Tensor) -> None:
    """The network's lm_head keeps the rows of token `ids` only (its logits are over them, in that order)."""
    weight = net.lm_head.weight.detach()[ids].clone()
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    head.weight.data.copy_(weight)
    net.lm_head = head
