"""`--speculative-mode medusa`: head converter for every published Medusa format, and in-graph drafting.

Canonical head tensors: `heads.{h}.blocks.{j}.weight|bias` (ResBlock j of head h) and, for heads with their
own vocabulary projection (Medusa-1), `heads.{h}.lm_head.weight`. Head h (0-based) reads the final-normed
hidden state of the last accepted token and proposes the token at depth h+1 of the next tree; the tree is
a Cartesian product (a node's token depends only on its depth and rank), as in Medusa.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from specbuild import engine_format as ef
from specbuild.builder.checkpoint.canonical import read_json, recorded_defaults
from specbuild.builder.checkpoint.weights_io import load_hf_weights, load_tensor_file
from specbuild.builder.network.mode_plugin import DraftContext, ModePlugin, OutputSpec
from specbuild.errors import SpecbuildError
from specbuild.tree import MAX_TOP_K, Tree, parse_tree

DEFAULT_TOP_K = 10
DEFAULT_TREE = "mc_sim_7b_63"
HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")
KEY = re.compile(r"^(?:medusa_head\.)?(?:h\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _read_medusa_tensors(head_dir: Path) -> tuple[dict, str]:
    for name in HEAD_FILES:
        if (head_dir / name).is_file():
            return load_tensor_file(head_dir / name), str(head_dir / name)
    # Medusa-2 full model (or our own v2 export): heads stored beside/as model weights with a medusa_head. prefix
    tensors = load_hf_weights(head_dir, progress=False)
    heads = {k: v for k, v in tensors.items() if k.startswith("medusa_head.")}
    if not heads:
        raise SpecbuildError(
            f"{head_dir}: no Medusa heads found (expected one of {', '.join(HEAD_FILES)} or medusa_head.* tensors)"
        )
    return heads, str(head_dir)


def convert_medusa(head_dir: Path, model, base: dict, base_dir: Path | None = None) -> tuple[dict, dict]:
    """v0.1 (.pt), legacy .safetensors, "version 2" (ResBlocks only, base lm_head), Medusa-2 full models."""
    head_dir = Path(head_dir)
    raw, source = _read_medusa_tensors(head_dir)
    cfg = read_json(head_dir / "config.json") if (head_dir / "config.json").is_file() else {}
    h = model.hidden_size
    per_head: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    draft_vocab = raw.pop("draft_vocab", None)
    for key, value in raw.items():
        m = KEY.match(key)
        if not m:
            raise SpecbuildError(f"{source}: unexpected tensor {key} in Medusa heads")
        head, idx, kind = int(m[1]), int(m[2]), m[3]
        per_head.setdefault(head, {}).setdefault(idx, {})[kind] = value
    if not per_head:
        raise SpecbuildError(f"{source}: holds no Medusa head tensors")
    num_heads = max(per_head) + 1  # from the tensors: configs are known to lie (v0.1 Vicuna says 2, holds 5)
    out: dict[str, torch.Tensor] = {}
    layers_seen = set()
    own_lm_head = None
    for head in range(num_heads):
        parts = per_head.get(head)
        if parts is None:
            raise SpecbuildError(f"{source}: Medusa head {head} is missing (heads 0..{num_heads - 1} expected)")
        blocks = sorted(i for i, p in parts.items() if "linear.weight" in p)
        projections = [i for i, p in parts.items() if "weight" in p]
        if blocks != list(range(len(blocks))):
            raise SpecbuildError(f"{source}: head {head} ResBlocks are not numbered 0..n-1 (found {blocks})")
        for j in blocks:
            w, b = parts[j]["linear.weight"], parts[j].get("linear.bias")
            name = f"h.{head}.{j}.linear"
            if tuple(w.shape) != (h, h):
                raise SpecbuildError(f"{source}: {name}.weight has shape {list(w.shape)}, expected {[h, h]}")
            if b is None:
                raise SpecbuildError(f"{source}: {name}.bias is missing")
            if tuple(b.shape) != (h,):
                raise SpecbuildError(f"{source}: {name}.bias has shape {list(b.shape)}, expected {[h]}")
            out[f"heads.{head}.blocks.{j}.weight"] = w
            out[f"heads.{head}.blocks.{j}.bias"] = b
        has_proj = bool(projections)
        if has_proj:
            if projections != [len(blocks)]:
                raise SpecbuildError(f"{source}: head {head} has an unexpected projection index {projections}")
            w = parts[projections[0]]["weight"]
            if tuple(w.shape) != (model.vocab_size, h):
                raise SpecbuildError(
                    f"{source}: h.{head}.{projections[0]}.weight has shape {list(w.shape)}, expected "
                    f"{[model.vocab_size, h]} (vocab_size {model.vocab_size} of the base model)"
                )
            out[f"heads.{head}.lm_head.weight"] = w
        if own_lm_head is not None and own_lm_head != has_proj:
            raise SpecbuildError(f"{source}: some Medusa heads have their own lm_head and some do not")
        own_lm_head = has_proj
        layers_seen.add(len(blocks))
    if len(layers_seen) != 1:
        raise SpecbuildError(f"{source}: Medusa heads have different ResBlock counts {sorted(layers_seen)}")
    head_cfg = {
        "num_heads": num_heads,
        "num_layers": layers_seen.pop(),
        "own_lm_head": bool(own_lm_head),
        "format": "medusa-1" if own_lm_head else "medusa-v2",
        "source": str(head_dir),
    }
    # a tree measured fastest by a recipe's choose stage wins
    defaults = recorded_defaults(cfg, head_dir / "config.json")
    head_cfg["defaults"] = defaults
    choices = defaults.get("tree") or cfg.get("medusa_choices")
    if choices:
        head_cfg["medusa_choices"] = Tree.from_choices(choices, source=f"{head_dir / 'config.json'}: tree").to_list()
    if draft_vocab is not None:
        # specbuild extension: v2 heads may carry the ids their proposals are restricted to (frequent tokens), so
        # each head projects onto those rows of the base lm_head only; verification is unchanged (lossless)
        ids = draft_vocab.to(torch.int64).flatten()
        if own_lm_head:
            raise SpecbuildError(f"{source}: draft_vocab is only supported for heads that share the base lm_head")
        if (
            ids.numel() == 0
            or int(ids.min()) < 0
            or int(ids.max()) >= model.vocab_size
            or not bool((ids[1:] > ids[:-1]).all())
        ):
            raise SpecbuildError(
                f"{source}: draft_vocab must hold strictly increasing token ids in [0, {model.vocab_size})"
            )
        out["draft_vocab"] = ids
        head_cfg["draft_vocab_size"] = int(ids.numel())
    return head_cfg, out


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int, own_lm_head: bool):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers)) for _ in range(num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads)) if own_lm_head else None
        )

    def forward(self, x, head: int, base_lm_head):
        for block in self.blocks[head]:
            x = x + nn.functional.silu(block(x))
        return (self.lm_heads[head] if self.lm_heads is not None else base_lm_head)(x)


class MedusaPlugin(ModePlugin):
    name = "medusa"
    head_key = "medusa"
    selects_rows = True

    def draft_outputs(self) -> list[OutputSpec]:
        return [OutputSpec(ef.NEXT_INPUT_IDS, "int64", ("B", self._tree.size))]

    @classmethod
    def check_options(cls, checkpoint, options) -> dict:
        cfg = checkpoint.heads.get("medusa")
        if cfg is None:
            raise SpecbuildError(
                f"{checkpoint.path}: checkpoint holds no Medusa heads; convert with `--medusa-dir DIR`"
            )
        num_heads = int(cfg["num_heads"])
        # proposals come from the draft vocabulary when the heads carry one, else from the whole vocabulary
        vocab = int(cfg.get("draft_vocab_size") or checkpoint.model.vocab_size)
        limit = min(vocab, MAX_TOP_K)
        top_k = getattr(options, "medusa_top_k", None)
        top_k = min(DEFAULT_TOP_K, limit) if top_k is None else top_k
        if not 1 <= top_k <= limit:
            raise SpecbuildError(
                f"--medusa-top-k {top_k} must be between 1 and {limit} (the heads propose from {vocab} tokens)"
            )
        spec = getattr(options, "tree", None)
        recorded = cls.recorded_defaults(checkpoint, options).get("tree")
        if spec is not None:
            tree = parse_tree(spec)
        elif recorded or cfg.get("medusa_choices"):  # the measured tree for these weights, else the heads' own
            tree = Tree.from_choices(recorded or cfg["medusa_choices"])
        else:
            tree = parse_tree(DEFAULT_TREE)
            tree = Tree.from_choices([c for c in tree.choices if len(c) <= num_heads])
        tree.check(
            top_k=top_k,
            max_depth=num_heads,
            max_draft_len=getattr(options, "max_draft_len", None),
            source="--tree",
            depth_limit_name="Medusa heads",
        )
        return {"tree": tree, "top_k": top_k, "num_heads": num_heads, "tokens_per_step": tree.size}

    def __init__(self, checkpoint, net, settings):
        super().__init__()
        cfg = checkpoint.heads["medusa"]
        self.num_heads, self.top_k, tree = settings["num_heads"], settings["top_k"], settings["tree"]
        self._tree = tree
        self.heads = MedusaHeads(
            net.cfg.hidden_size,
            net.cfg.vocab_size,
            self.num_heads,
            int(cfg["num_layers"]),
            bool(cfg.get("own_lm_head")),
        )
        state = {}
        self.draft_lm_head = None
        for key, value in checkpoint.head_tensors("medusa").items():
            if key == "draft_vocab":
                self.register_buffer("draft_ids", value.to(torch.long), persistent=False)
                self.draft_lm_head = nn.Linear(net.cfg.hidden_size, value.numel(), bias=False)
                self.draft_lm_head.weight.data = net.output_weight()[value.to(torch.long)].clone()
                continue
            parts = key.split(".")
            if parts[2] == "blocks":
                state[f"blocks.{parts[1]}.{parts[3]}.{parts[4]}"] = value
            else:
                state[f"lm_heads.{parts[1]}.weight"] = value
        self.heads.load_state_dict(state, strict=True)
        self.heads.to(net.embed_tokens.weight.dtype)
        depths = tree.depths[1:] - 1
        self.register_buffer(
            "gather_index", torch.tensor(depths * tree.max_top_k + tree.ranks[1:], dtype=torch.long), persistent=False
        )

    def tree(self) -> Tree:
        return self._tree

    def draft(self, ctx: DraftContext) -> dict:
        ctx = ctx.drafting()
        b, _, hsize = ctx.hidden.shape
        last = ctx.hidden.gather(1, ctx.last_node.view(b, 1, 1).expand(b, 1, hsize)).squeeze(1)  # [B,H]
        k = self._tree.max_top_k
        if self._tree.depth == 0:
            return {ef.NEXT_INPUT_IDS: ctx.bonus.unsqueeze(1)}
        candidates = []
        for head in range(self._tree.depth):
            if self.draft_lm_head is not None:  # proposals from the draft vocabulary's rows of the base lm_head
                idx = torch.topk(self.heads(last, head, self.draft_lm_head).float(), k=k, dim=-1).indices
                candidates.append(self.draft_ids[idx])
            else:
                logits = self.heads(last, head, ctx.net.lm_head)
                candidates.append(torch.topk(logits.float(), k=k, dim=-1).indices)
        flat = torch.cat(candidates, dim=1)  # [B, depth*k]
        drafts = flat.index_select(1, self.gather_index)
        return {ef.NEXT_INPUT_IDS: torch.cat([ctx.bonus.unsqueeze(1), drafts], dim=1)}

    def manifest(self) -> dict:
        return {
            "num_heads": self.num_heads,
            "top_k": self.top_k,
            "draft_vocab_size": None if self.draft_lm_head is None else int(self.draft_ids.numel()),
        }
