"""Medusa "version 2" heads: ResBlocks trained on precomputed base hidden states, scored by the frozen base lm_head.

Head k (0-based here, k = 0..K-1) reads the base's final normed hidden state at position t and predicts the
token at t+2+k (the base itself predicts t+1). Training is self-distillation: a soft cross-entropy to the base's
own distribution at t+1+k (its logits come from the stored hidden state there) plus a hard cross-entropy to the
base's greedy token, weighted 0.8^(k+1) per head. To stay affordable on a CPU the softmax runs over a per-step
vocabulary subset: the tokens seen as targets in training, this batch's targets and random negatives;
evaluation always uses the full vocabulary.

`choose_tree` picks a prefix-closed tree of rank paths that maximises the empirical expected accepted length on
held-out rows (joint rank statistics of all heads, so no independence assumption is needed), and
`save_medusa_v2` writes the published v2 layout: `config.json` + `medusa_lm_head.safetensors` (`{k}.{j}.linear.*`).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specbuild.training import distill, teacher_forced
from specbuild.training.base_weights import load_base_weights
from specbuild.training.distill import load_features, setup_torch
from specbuild.training.heldout import heldout_mask
from specbuild.training.loop import FittedCosine, LoopResult, row_batches, train_loop
from specbuild.training.recipe import prepare_data
from specbuild.training.settings import TrainSettings, read_train
from specbuild.training.teacher_forced import loop_facts
from specbuild.training.vocab import draft_vocabulary

TOPK = 10

# Medusa's defaults of what every trainer shares (the other trainers' lr, batch, warm-up and logging differ)
SETTINGS = TrainSettings(epochs=2.0, lr=1e-3, batch=512, warmup=50, time_budget_s=1200.0, log_every=50)


@dataclasses.dataclass(frozen=True)
class MedusaKnobs:
    """Medusa's own training knobs (`train:` keys of the same names)."""

    num_heads: int = 4
    num_layers: int = 1  # ResBlocks per head
    head_decay: float = 0.8  # the loss weight of head k: head_decay^(k+1)
    n_negatives: int = 1024  # random ids added to each step's vocabulary subset
    soft_weight: float = 0.5  # the soft cross-entropy's share (to the base's distribution)


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaV2Heads(nn.Module):
    """`num_heads` heads of `num_layers` independent ResBlocks each; logits come from the (external) base lm_head."""

    def __init__(self, hidden: int, num_heads: int, num_layers: int):
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads)
        )

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [head(x) for head in self.medusa_head]


# ----------------------------------------------------------------------------------------------- data


def target_index(feats: dict[str, np.ndarray], num_heads: int) -> np.ndarray:
    """valid[i, k]: row i+1+k is in the same sequence and its next token is a generated one."""
    seq, goff = feats["seq"], feats["gen_offset"]
    n = len(seq)
    valid = np.zeros((n, num_heads), dtype=bool)
    for k in range(num_heads):
        s = k + 1
        ok = np.zeros(n, dtype=bool)
        ok[: n - s] = (seq[s:] == seq[: n - s]) & (goff[s:] >= 0)
        valid[:, k] = ok
    return valid


# ----------------------------------------------------------------------------------------------- training


def train_medusa(
    features_dir: str | Path | dict,
    hf_dir: str | Path,
    settings: TrainSettings = SETTINGS,
    knobs: MedusaKnobs = MedusaKnobs(),
    log=print,
) -> tuple[dict[str, torch.Tensor], LoopResult]:
    """Train the ResBlocks on `settings.device` (bf16 autocast on cuda), from the heads at `settings.init_from` if
    given; returns the heads' state dict (`medusa_head.{k}.{j}.linear.weight|bias`, float32, on the CPU) and the
    loop's facts."""
    s, device = settings, settings.device
    setup_torch()
    torch.manual_seed(s.seed)
    feats = features_dir if isinstance(features_dir, dict) else load_features(features_dir)
    W = load_base_weights(hf_dir).lm_head
    V, H = W.shape
    valid = target_index(feats, knobs.num_heads)
    held = heldout_mask(feats["seq"], s.heldout_frac, s.seed)
    rows = np.nonzero(valid[:, 0] & ~held)[0]
    base_vocab = torch.from_numpy(draft_vocabulary(feats["next_token"][~held]))
    log(f"train rows {len(rows)}, held-out rows {int(held.sum())}, vocab subset {len(base_vocab)} of {V}")
    model = MedusaV2Heads(H, knobs.num_heads, knobs.num_layers)
    if s.init_from:  # continue training heads this trainer wrote before (Medusa v2 layout)
        model.load_state_dict(load_heads(s.init_from))
        log(f"continuing from {s.init_from}")
    model.to(device)
    loss_fn = _loss_fn(model, feats, valid, W.to(device), base_vocab, knobs, device)
    total = max(1, int(max(1, len(rows) // s.batch) * s.epochs))
    schedule = FittedCosine(s.lr, total, min(s.warmup, total // 10), s.loop_budget())
    result = train_loop(model, row_batches(rows, s.batch, np.random.default_rng(s.seed)), loss_fn, schedule, device,
                        log_every=s.log_every, log=log)  # fmt: skip
    state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return state, result


def load_heads(head_dir: str | Path) -> dict[str, torch.Tensor]:
    """The ResBlocks' state (as MedusaV2Heads names it, float32) of heads written by save_medusa_v2."""
    from safetensors.torch import load_file

    raw = load_file(str(Path(head_dir) / "medusa_lm_head.safetensors"))
    return {f"medusa_head.{k}": v.float() for k, v in raw.items() if k != "draft_vocab"}


def _loss_fn(model, feats, valid, W, base_vocab, knobs: MedusaKnobs, device):
    """Loss of a batch of rows: per head a hard and a soft cross-entropy over a vocabulary subset (see the module)."""
    hidden = torch.from_numpy(feats["hidden"])  # fp16, converted per batch
    next_tok = torch.from_numpy(feats["next_token"].astype(np.int64))
    valid_t = torch.from_numpy(valid)
    V, num_heads = W.shape[0], valid.shape[1]
    weights = [knobs.head_decay ** (k + 1) for k in range(num_heads)]
    n_negatives, soft_weight = knobs.n_negatives, knobs.soft_weight

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        x = hidden[idx].float().to(device)
        tgt_rows = [torch.clamp(idx + k + 1, max=len(next_tok) - 1) for k in range(num_heads)]
        targets = torch.stack([next_tok[r] for r in tgt_rows], 1)  # [B, K]: token at t+2+k
        vmask = valid_t[idx]
        negs = torch.randint(0, V, (n_negatives,))
        sub = torch.unique(torch.cat([base_vocab, targets[vmask], negs]))
        Ws = W[sub.to(device)]
        remap = torch.full((V,), -1, dtype=torch.long)
        remap[sub] = torch.arange(len(sub))
        outs = model(x)
        loss = torch.zeros((), device=device)
        for k in range(num_heads):
            m = vmask[:, k]
            if not bool(m.any()):
                continue
            logits = (outs[k][m.to(device)] @ Ws.T).float()
            with torch.no_grad():
                teacher = torch.softmax((hidden[tgt_rows[k][m]].float().to(device) @ Ws.T).float(), dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
            hard = nn.functional.nll_loss(logp, remap[targets[m, k]].to(device))
            soft = -(teacher * logp).sum(-1).mean()
            loss = loss + weights[k] * ((1 - soft_weight) * hard + soft_weight * soft)
        return loss

    return loss_of


# ----------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def head_ranks(
    state: dict[str, torch.Tensor],
    feats: dict[str, np.ndarray],
    hf_dir: str | Path,
    num_heads: int,
    num_layers: int,
    rows: np.ndarray | None = None,
    max_rows: int = 4000,
    seed: int = 0,
    chunk: int = 256,
) -> tuple[np.ndarray, np.ndarray]:
    """Full-vocabulary rank of the base's greedy token for every head: (ranks [N, K+1], valid [N, K+1]).

    Column 0 is the base itself (sanity check: rank 0 everywhere); column k+1 is Medusa head k.
    """
    setup_torch()
    W = load_base_weights(hf_dir).lm_head
    valid = target_index(feats, num_heads)
    if rows is None:
        rows = np.arange(len(feats["seq"]))
    rows = rows[valid[rows, 0]]
    if len(rows) > max_rows:
        rows = np.sort(np.random.default_rng(seed).choice(rows, max_rows, replace=False))
    model = MedusaV2Heads(W.shape[1], num_heads, num_layers)
    model.load_state_dict(state)
    model.float()
    n = len(feats["seq"])
    ranks = np.full((len(rows), num_heads + 1), TOPK * 100, dtype=np.int64)
    ok = np.zeros((len(rows), num_heads + 1), dtype=bool)
    nt = feats["next_token"]
    for s in range(0, len(rows), chunk):
        r = rows[s : s + chunk]
        x = torch.from_numpy(feats["hidden"][r]).float()
        outs = [x] + model(x)
        for c, o in enumerate(outs):
            tr = np.minimum(r + c, n - 1)
            tgt = torch.from_numpy(nt[tr].astype(np.int64))
            logits = o @ W.T
            tl = logits.gather(1, tgt[:, None])
            ranks[s : s + len(r), c] = (logits > tl).sum(1).numpy()
            ok[s : s + len(r), c] = True if c == 0 else valid[r, c - 1]
    return ranks, ok


def accuracy_table(ranks: np.ndarray, ok: np.ndarray, ks=(1, 5, 10)) -> list[dict]:
    out = []
    for c in range(ranks.shape[1]):
        m = ok[:, c]
        row = {"head": c, "n": int(m.sum())}
        for k in ks:
            row[f"top{k}"] = float((ranks[m, c] < k).mean()) if m.any() else float("nan")
        out.append(row)
    return out


def evaluate(state, feats, hf_dir, num_heads, num_layers, rows=None, max_rows: int = 4000) -> dict:
    """Per-head top-1/5/10 on `rows` (full vocabulary); head 0 of the table is the base model (sanity)."""
    ranks, ok = head_ranks(state, feats, hf_dir, num_heads, num_layers, rows=rows, max_rows=max_rows)
    return {"accuracy": accuracy_table(ranks, ok), "ranks": ranks, "ok": ok}


def tree_tau(choices: list[list[int]], ranks: np.ndarray, ok: np.ndarray) -> float:
    """Empirical mean accepted tokens per step (base token included) of a Medusa tree on rows' head ranks."""
    paths = {tuple(c) for c in choices}
    depth = max(len(c) for c in choices)
    total = 0.0
    for r, m in zip(ranks[:, 1:], ok[:, 1:]):
        acc = 0
        for d in range(1, depth + 1):
            if d - 1 < len(m) and m[d - 1] and tuple(int(v) for v in r[:d]) in paths:
                acc = d
            else:
                break
        total += 1 + acc
    return total / len(ranks)


def choose_tree(ranks: np.ndarray, ok: np.ndarray, max_nodes: int = 24, topk: int = TOPK) -> list[list[int]]:
    """Prefix-closed tree (rank paths) maximising empirical expected accepted length on held-out rows.

    A node's gain is the fraction of rows whose rank prefix equals its path; gains only shrink along a path, so
    greedy addition (best node among the children of the tree so far) stays prefix-closed.
    """
    K = ranks.shape[1] - 1
    counts: Counter = Counter()
    for r, m in zip(ranks[:, 1:], ok[:, 1:]):
        path = []
        for d in range(K):
            if not m[d] or r[d] >= topk:
                break
            path.append(int(r[d]))
            counts[tuple(path)] += 1
    chosen: list[tuple[int, ...]] = []
    frontier = {(i,) for i in range(topk)}
    while len(chosen) < max_nodes and frontier:
        best = max(frontier, key=lambda p: (counts.get(p, 0), -len(p), [-v for v in p]))
        if counts.get(best, 0) == 0:
            break
        chosen.append(best)
        frontier.remove(best)
        if len(best) < K:
            frontier |= {best + (i,) for i in range(topk)}
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


def expected_tau_independent(choices: list[list[int]], ranks: np.ndarray, ok: np.ndarray) -> float:
    """tau from per-depth rank probabilities multiplied along each path (independence assumption)."""
    p = []
    for c in range(1, ranks.shape[1]):
        m = ok[:, c]
        p.append(np.bincount(np.minimum(ranks[m, c], TOPK), minlength=TOPK + 1)[:TOPK] / max(1, m.sum()))
    return 1.0 + sum(float(np.prod([p[d][i] for d, i in enumerate(ch)])) for ch in choices)


# ----------------------------------------------------------------------------------------------- export


def save_medusa_v2(
    out_dir: str | Path,
    state: dict[str, torch.Tensor],
    num_heads: int,
    num_layers: int,
    hidden: int,
    base_model_name: str,
    medusa_choices: list[list[int]],
    vocab_size: int = 49152,
    extra: dict | None = None,
    draft_vocab: np.ndarray | None = None,
) -> Path:
    """Published Medusa "version 2" layout: config.json (`version: "2"`) + medusa_lm_head.safetensors (float16,
    `{k}.{j}.linear.weight|bias`, no per-head lm_head: heads reuse the base lm_head)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k in range(num_heads):
        for j in range(num_layers):
            for p in ("weight", "bias"):
                t = state[f"medusa_head.{k}.{j}.linear.{p}"]
                tensors[f"{k}.{j}.linear.{p}"] = t.to(torch.float16).contiguous()
    if draft_vocab is not None:  # specbuild extension: sorted target ids whose base lm_head rows the heads use
        tensors["draft_vocab"] = torch.from_numpy(np.asarray(draft_vocab, dtype=np.int64))
    save_file(tensors, str(out / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    cfg = {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "hidden_size": hidden,
        "vocab_size": vocab_size,
        "base_model_name_or_path": base_model_name,
        "version": "2",
        "medusa_choices": medusa_choices,
    }
    if extra:
        cfg.update(extra)
    text = json.dumps({k: v for k, v in cfg.items() if k != "medusa_choices"}, indent=1)
    text = text[:-2] + f',\n "medusa_choices": {json.dumps(medusa_choices)}\n}}\n'
    (out / "config.json").write_text(text)
    return out


def train_and_export(cfg: dict, log=print) -> dict:
    """Train on the recipe's rows (`teacher_forced.recipe_hidden_rows`: a corpus or the data stage's shards), then
    `finish`."""
    settings, knobs = TrainSettings.from_recipe(cfg, SETTINGS), read_train(cfg, MedusaKnobs())
    feats, lineage = teacher_forced.recipe_hidden_rows(cfg, log=log)
    state, result = train_medusa(feats, cfg["base_model"], settings, knobs, log=log)
    work = Path(cfg["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    torch.save(state, work / "heads_state.pt")
    held = heldout_mask(feats["seq"], settings.heldout_frac, settings.seed)
    train_rows = int((target_index(feats, knobs.num_heads)[:, 0] & ~held).sum())
    facts = loop_facts(result.steps, result.seconds, settings.batch, train_rows, settings.device)
    return finish(cfg, settings, knobs, state, feats, {**facts, **lineage}, log=log)


def finish(cfg: dict, settings: TrainSettings, knobs: MedusaKnobs, state, feats: dict, facts: dict, log=print) -> dict:
    """Evaluate, choose the tree, write the heads and metrics (`facts`: the training's, kept under
    `specbuild_training` in the config with the held-out metrics)."""
    t, tr, work, hf = cfg.get("train", {}), cfg.get("tree", {}), Path(cfg["work_dir"]), cfg["base_model"]
    K, nl = knobs.num_heads, knobs.num_layers
    held = heldout_mask(feats["seq"], settings.heldout_frac, settings.seed)
    ev_held = evaluate(state, feats, hf, K, nl, rows=np.nonzero(held)[0], max_rows=4000)
    he_feats = distill.load_features(work / "feat_humaneval") if (work / "feat_humaneval").is_dir() else None
    ev_he = evaluate(state, he_feats, hf, K, nl, max_rows=4000) if he_feats else None
    sel = ev_he if (tr.get("select_on") == "humaneval" and ev_he) else ev_held
    chosen = choose_tree(sel["ranks"], sel["ok"], int(tr.get("max_nodes", 24)))
    shipped = tr.get("choices") or chosen  # an explicit tree (picked by `specbuild bench`) wins
    metrics = {**facts, "tree_nodes": len(chosen), "medusa_choices": chosen}
    for name, ev in (("heldout", ev_held), ("humaneval", ev_he)):
        if ev is None:
            continue
        metrics[name] = {
            "accuracy": ev["accuracy"],
            "tau_empirical": tree_tau(chosen, ev["ranks"], ev["ok"]),
            "tau_independent": expected_tau_independent(chosen, ev["ranks"], ev["ok"]),
            "tau_empirical_shipped_tree": tree_tau(shipped, ev["ranks"], ev["ok"]),
        }
        log(f"{name}: {json.dumps(metrics[name])}")
    vocab = None
    if t.get("draft_vocab", True):  # specbuild extension: project onto the training targets seen twice or more
        vocab = draft_vocabulary(feats["next_token"][~held], max_size=settings.draft_vocab_size)
        metrics["draft_vocab_size"] = int(len(vocab))
    extra = {"specbuild_training": {k: v for k, v in metrics.items() if k != "medusa_choices"}}
    if tr.get("note"):
        extra["specbuild_note"] = tr["note"]
    if cfg.get("specbuild_defaults"):  # build defaults measured before (the `choose` stage replaces them)
        extra["specbuild_defaults"] = dict(cfg["specbuild_defaults"])
    save_medusa_v2(
        cfg["output_dir"],
        state,
        K,
        nl,
        int(feats["hidden"].shape[1]),
        cfg.get("base_model_name", str(hf)),
        shipped,
        extra=extra,
        draft_vocab=vocab,
    )
    Path(work / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def evaluate_heads(heads: list, hf_dir, records: list[dict], device: str = "cpu", log=print) -> list[dict]:
    """Per-head top-1/5/10 (full vocabulary) and the empirical tau of each head directory's own tree
    (`medusa_choices`) on the teacher-forced final hidden states of corpus `records` (held-out ones)."""
    feats = teacher_forced.as_shard_rows(teacher_forced.rows_for(hf_dir, records, None, device, log=log))
    out = []
    for head in heads:
        cfg = json.loads((Path(head) / "config.json").read_text())
        state = load_heads(head)
        K, nl = int(cfg["medusa_num_heads"]), int(cfg["medusa_num_layers"])
        ev = evaluate(state, feats, hf_dir, K, nl, max_rows=4000)
        tree = cfg["medusa_choices"]
        out.append({"accuracy": ev["accuracy"], "tau_empirical_own_tree": tree_tau(tree, ev["ranks"], ev["ok"])})
    return out


def run_medusa_recipe(cfg: dict, log=print) -> dict:
    """A Medusa recipe (`load_recipe`'s dict): data generation (or a `corpus_dir`), head training, evaluation, tree
    choice, export (Medusa v2 layout)."""
    setup_torch()
    if not cfg.get("corpus_dir"):  # a corpus recipe trains on teacher-forced features of its corpus instead
        prepare_data(cfg, log=log)
    return train_and_export(cfg, log=log)
