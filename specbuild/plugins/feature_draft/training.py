"""Training-time-test training of a feature-conditioned draft network, shared by the modes that specialise it.

Data: feature rows of the base model's greedy sequences (`specbuild.training.distill`'s shards, or teacher-forced
from a corpus by `specbuild.training.teacher_forced`), cut per sequence; the mode's
`DraftFamily` says which features (its `read_rows`), which network, how it starts from the base model and which
logits the loss reads.

Training uses the engine's own module (the family's DraftNet) and its semantics: the draft pairs feature f_t with
token x_{t+1} at rope position t and its output h_t predicts x_{t+2}, the base model's greedy token after x_{t+1}.
Training-time test: step 0 runs on the true features; in step j the feature at position t is the step-(j-1) output
h_{t-1} (the engine feeds a node's draft output to its children), and position t attends to the step-0 keys at
positions <= t-j plus its own unrolled ancestors of steps 1..j-1 (exactly the engine's expansion memories: draft
cache + tree ancestors). Loss per step 0.8^j * CE over the training vocabulary (targets outside it masked), plus the
family's feature loss. The loop is specbuild.training.loop's (ProgressCosine schedule).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from specbuild import engine_format as ef
from specbuild.plugins.feature_draft.draft_net import DraftNet
from specbuild.plugins.feature_draft.graph import PUBLISHED_DEFAULTS
from specbuild.training import distill, teacher_forced
from specbuild.training.base_weights import BaseParts, load_base_weights
from specbuild.training.features import LayerFeatures
from specbuild.training.heldout import heldout_mask
from specbuild.training.loop import ProgressCosine, epoch_batches, train_loop
from specbuild.training.settings import TrainSettings, read_train
from specbuild.training.vocab import draft_vocabulary

# EAGLE's defaults of what every trainer shares (the other trainers' epochs, batch, warm-up and logging differ)
SETTINGS = TrainSettings(epochs=4.0, lr=1e-3, batch=16, warmup=50, time_budget_s=1200.0, log_every=20,
                         draft_vocab_size=8192)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TTTKnobs:
    """The training-time-test trainer's own knobs (`train:` keys of the same names)."""

    intermediate_size: int = 768  # the draft's MLP
    ttt_steps: int = 3  # step 0 on the true features + unrolled steps
    step_decay: float = 0.8  # the loss weight of step j: step_decay^j
    l1_weight: float = 0.1  # the feature loss's weight (families with feature_loss)
    chunk_len: int = 256  # positions per training item (sequences are cut into chunks)
    feature_noise: float = 0.0  # uniform noise of this width added to the input features
    epoch_eval_sequences: int = 0  # held-out sequences evaluated after every epoch (0: none)


class DraftFamily:
    """What a mode tells the shared trainer about its draft network; subclassed in the mode's training module."""

    net_class: type[DraftNet]
    feature_loss = False  # add SmoothL1(h_t, f_{t+1}): the draft output regresses the true next feature
    layer_features: LayerFeatures | None = None  # the decoder-layer inputs it reads (None: final normed hidden)

    def read_rows(self, features_dir: str | Path, prompt_len: dict[int, int]) -> dict[str, np.ndarray]:
        """Feature rows: `feat` [N,F], `token` [N] (x_{p+1}), `seq` [N], `pos` [N] (absolute position p);
        `prompt_len`: sequence number -> prompt length."""
        raise NotImplementedError

    def head_config(self, base, intermediate_size: int, draft_vocab_size: int) -> dict:
        """The head config (as a converter writes it) of a fresh draft for `base` (a ModelConfig)."""
        return {
            "num_heads": base.num_heads,
            "num_kv_heads": base.num_kv_heads,
            "head_dim": base.head_dim,
            "intermediate_size": intermediate_size,
            "rms_norm_eps": base.rms_norm_eps,
            "rope_theta": base.rope_theta,
            "has_embed": False,
        }

    def vocabulary(self, train: list[dict], init: dict | None, size: int, vocab: int) -> np.ndarray:
        """The sorted target ids the draft is trained on (the training draft vocabulary)."""
        return draft_vocab(train, size, vocab)

    def start_from_base(self, draft, net, used: np.ndarray) -> None:
        """Initialise from the base model's output space: the (last) feature passes through fc."""
        h = draft.c["hidden"]
        draft.fc.weight[:, -h:] += torch.eye(h)

    def subset_rows(self, net, used: np.ndarray) -> torch.Tensor | None:
        """The lm_head rows the training logits use, when the draft has no vocabulary projection of its own."""
        return None

    def train_logits(self, draft, h: torch.Tensor, net, sub_w: torch.Tensor | None) -> torch.Tensor:
        return draft.logits(h, net)


def load_shards(features_dir: str | Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    shards = sorted(Path(features_dir).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no feature shards in {features_dir}")
    parts: dict[str, list] = {k: [] for k in keys}
    for s in shards:
        with safe_open(str(s), framework="numpy") as f:
            for k in keys:
                parts[k].append(f.get_tensor(k))
    return {k: np.concatenate(v) for k, v in parts.items()}


def load_sequences(family: DraftFamily, features_dir: str | Path, sequences_jsonl: str | Path) -> list[dict]:
    """Per sequence: `feat` [n,F] fp16, `token` [n] (x_{p+1}), `valid` [n] (x_{p+2} is a greedy base token, i.e. a
    generated one), `pos` [n], `seq`."""
    prompt_len = {distill._seq_no(r["id"]): len(r["prompt_ids"]) for r in distill.read_sequences(sequences_jsonl)}
    return cut_sequences(family.read_rows(features_dir, prompt_len), prompt_len)


def cut_sequences(d: dict[str, np.ndarray], prompt_len: dict[int, int]) -> list[dict]:
    """The per-sequence dicts of `load_sequences` from rows {feat, token, seq, pos} grouped by sequence (views, no
    copy); `prompt_len`: sequence number -> prompt length."""
    seq = d["seq"]
    cuts = np.nonzero(np.diff(seq) != 0)[0] + 1
    out = []
    for a, e in zip(np.r_[0, cuts], np.r_[cuts, len(seq)]):
        s = int(seq[a])
        if s not in prompt_len or e - a < 3:
            continue
        P = prompt_len[s]
        p = d["pos"][a:e].astype(np.int64)
        valid = np.zeros(e - a, dtype=bool)
        valid[:-1] = p[1:] + 1 >= P  # target x_{p+2} = token[t+1] is generated
        out.append({"seq": s, "feat": d["feat"][a:e], "token": d["token"][a:e].astype(np.int64), "valid": valid,
                    "pos": p})  # fmt: skip
    return out


def split_heldout(seqs: list[dict], frac: float) -> tuple[list[dict], list[dict]]:
    """(training, held-out) sequences: the split of `heldout_mask`."""
    held = heldout_mask(np.array([s["seq"] for s in seqs], dtype=np.int64), frac)
    return [s for s, h in zip(seqs, held) if not h], [s for s, h in zip(seqs, held) if h]


def draft_vocab(seqs: list[dict], size: int | None, vocab: int) -> np.ndarray:
    """The draft vocabulary (specbuild.training.vocab) of the sequences' generated targets, at most `size` ids and
    at least the published EAGLE-2 top-k, sorted by id."""
    targets = [s["token"][1:][s["valid"][:-1]] for s in seqs]
    targets = np.concatenate(targets) if targets else np.zeros(0, np.int64)
    return draft_vocabulary(targets, vocab=vocab, max_size=size, min_size=PUBLISHED_DEFAULTS["eagle_top_k"])


def chunks(seqs: list[dict], length: int) -> list[dict]:
    out = []
    for s in seqs:
        n = len(s["token"])
        for a in range(0, n, length):
            e = min(n, a + length)
            if e - a >= 3 and s["valid"][a:e].any():
                out.append({k: (v[a:e] if isinstance(v, np.ndarray) else v) for k, v in s.items()})
    return out


def collate(items: list[dict], device: str = "cpu") -> dict[str, torch.Tensor]:
    """A padded batch on `device` (features float32 there; they travel as stored, float16)."""
    b, n = len(items), max(len(it["token"]) for it in items)
    f = items[0]["feat"].shape[1]
    feat = torch.zeros(b, n, f, dtype=torch.from_numpy(items[0]["feat"][:0]).dtype)
    token = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    pos = torch.zeros(b, n, dtype=torch.long)
    for i, it in enumerate(items):
        m = len(it["token"])
        feat[i, :m] = torch.from_numpy(it["feat"])
        token[i, :m] = torch.from_numpy(it["token"])
        valid[i, :m] = torch.from_numpy(it["valid"])
        pos[i, :m] = torch.from_numpy(it["pos"]) if it["pos"][0] >= 0 else torch.arange(m)
        pos[i, m:] = pos[i, m - 1] + 1 + torch.arange(n - m)
    batch = {"feat": feat, "token": token, "valid": valid, "pos": pos}
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    batch["feat"] = batch["feat"].float()
    return batch


def base_config(hf_dir: str | Path):
    from specbuild.builder.checkpoint.model_config import ModelConfig

    return ModelConfig.from_hf(json.loads((Path(hf_dir) / "config.json").read_text()))


def build_draft(family: DraftFamily, hf_dir, intermediate_size: int, draft_vocab_size: int | None, seed: int = 0):
    torch.manual_seed(seed)
    base = base_config(hf_dir)
    draft = family.net_class(family.head_config(base, intermediate_size, draft_vocab_size), base)
    for m in draft.modules():  # LLaMA init
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    return draft


def ttt_forward(draft, net, batch: dict, steps: int):
    """Training-time test. Returns the per-step draft outputs [B,n,H] (list of `steps`).

    Step 0 runs on the true features (causal). In step j, position t gets feature h^{(j-1)}_{t-1} and attends to
    step-0 keys at positions <= t-j, step-i keys at position t-j+i (i = 1..j-1) and itself."""
    feat, token, pos = batch["feat"], batch["token"], batch["pos"]
    b, n = token.shape
    r = torch.arange(n, device=token.device)
    rows, cols = r.view(n, 1), r.view(1, n)
    eye = (rows == cols).unsqueeze(0).expand(b, n, n)
    f0 = draft.project(feat)
    causal = (cols <= rows).unsqueeze(0).expand(b, n, n)
    empty = [[] for _ in draft.layers]
    h, ks, vs = draft.run(token, f0, pos, net, empty, [[] for _ in draft.layers], [], causal)
    outs, mem_k, mem_v = [h], [[k] for k in ks], [[v] for v in vs]
    for j in range(1, steps):
        feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        masks = [(cols <= rows - j).unsqueeze(0).expand(b, n, n)]
        masks += [(cols == rows - j + i).unsqueeze(0).expand(b, n, n) for i in range(1, j)]
        h, ks, vs = draft.run(token, feats, pos, net, mem_k, mem_v, masks, eye)
        outs.append(h)
        for li in range(len(ks)):
            mem_k[li] = mem_k[li] + [ks[li]]
            mem_v[li] = mem_v[li] + [vs[li]]
    return outs


def step_losses(family, draft, net, outs, batch, tgt_map: torch.Tensor, sub_w: torch.Tensor | None, l1_weight: float):
    """Per-step (loss, correct, count). tgt_map [V] maps a target id to its logit column (-1: masked).

    Logits are the family's training logits (the draft's own, or base lm_head rows `sub_w` of a frequent-token
    subset); a family with `feature_loss` adds l1_weight * SmoothL1(h_t, f_{t+1})."""
    token, valid, feat = batch["token"], batch["valid"], batch["feat"]
    b, n = token.shape
    target_ids = torch.cat([token[:, 1:], token[:, :1]], dim=1)
    col = tgt_map[target_ids]
    res = []
    for j, h in enumerate(outs):
        m = valid & (col >= 0)
        if j:
            m[:, :j] = False
        logits = family.train_logits(draft, h[m], net, sub_w)
        tgt = col[m]
        loss = torch.nn.functional.cross_entropy(logits.float(), tgt) if tgt.numel() else h.sum() * 0
        if family.feature_loss and l1_weight:
            mf = valid.clone()
            if j:
                mf[:, :j] = False
            nxt = torch.cat([feat[:, 1:], feat[:, :1]], dim=1)
            loss = loss + l1_weight * torch.nn.functional.smooth_l1_loss(h[mf], nxt[mf])
        correct = (logits.argmax(-1) == tgt).sum().item() if tgt.numel() else 0
        res.append((loss, correct, int(tgt.numel())))
    return res


def _target_map(used: np.ndarray, vocab: int) -> torch.Tensor:
    m = torch.full((vocab,), -1, dtype=torch.long)
    m[torch.from_numpy(used)] = torch.arange(len(used))
    return m


@torch.no_grad()
def evaluate(
    family, draft, net, seqs: list[dict], tgt_map, sub_w, steps: int = 4, length: int = 256, batch: int = 16,
    device: str = "cpu",
) -> dict:  # fmt: skip
    """Per-step top-1 accuracy (training-time-test unroll) over `seqs`, on `device` (where draft, net, tgt_map and
    sub_w are); positions whose target is outside the draft vocab count as misses (acc_all) and are excluded
    (acc_in_vocab)."""
    draft.eval()
    items = chunks(seqs, length)
    corr, cnt, total = np.zeros(steps), np.zeros(steps), np.zeros(steps)
    for i in range(0, len(items), batch):
        bt = collate(items[i : i + batch], device)
        outs = ttt_forward(draft, net, bt, steps)
        for j, (_, c, k) in enumerate(step_losses(family, draft, net, outs, bt, tgt_map, sub_w, 0.0)):
            corr[j] += c
            cnt[j] += k
            v = bt["valid"].clone()
            v[:, :j] = False
            total[j] += int(v.sum())
    draft.train()
    return {
        "acc_in_vocab": [round(float(c / max(k, 1)), 4) for c, k in zip(corr, cnt)],
        "acc_all": [round(float(c / max(t, 1)), 4) for c, t in zip(corr, total)],
        "positions": int(total[0]),
    }


def _load_head(head_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {
        k: v.float() if v.is_floating_point() else v
        for k, v in load_file(str(Path(head_dir) / "model.safetensors")).items()
    }


def train_draft(
    family: DraftFamily,
    hf_dir: str | Path,
    seqs: list[dict],
    settings: TrainSettings = SETTINGS,
    knobs: TTTKnobs = TTTKnobs(),
    eval_sets: dict[str, list[dict]] | None = None,
    log=print,
) -> dict:
    """Train the family's draft with training-time test on `settings.device` (bf16 autocast on cuda). Returns
    {draft, used, metrics, losses} (the draft on the CPU, float32; losses: one per optimizer step).

    seqs: per-sequence features (`load_sequences` or `cut_sequences`), split into training and held-out here.
    eval_sets: {name: sequences} evaluated after training (never trained on). knobs.epoch_eval_sequences: after every
    epoch, the per-step held-out accuracy on that many held-out sequences is logged (metrics `per_epoch`).
    settings.init_from: a head directory this function wrote before (model.safetensors); training continues from its
    weights (and a head with its own vocabulary keeps it, see DraftFamily.vocabulary)."""
    s, k, device = settings, knobs, settings.device
    distill.setup_torch()
    net = BaseParts(load_base_weights(hf_dir))
    train, held = split_heldout(seqs, s.heldout_frac)
    draft, used, tgt_map, sub_w = _start_draft(family, hf_dir, net, train, k.intermediate_size, s.draft_vocab_size,
                                               s.init_from, s.seed, log)  # fmt: skip
    items = chunks(train, k.chunk_len)
    batch = max(1, min(s.batch, len(items)))  # a tiny subset still trains (epoch_batches needs one full batch)
    n_tok = sum(int(it["valid"].sum()) for it in items)
    steps_per_epoch = max(1, len(items) // batch)
    total_steps = max(1, int(s.epochs * len(items) / batch))
    log(
        f"{family.net_class.__name__}: {len(train)} train / {len(held)} held-out sequences, {len(items)} chunks, "
        f"{n_tok} targets, {total_steps} optimizer steps max ({steps_per_epoch} per epoch), draft vocab coverage "
        f"{float(tgt_map[torch.from_numpy(np.concatenate([q['token'] for q in train]))].ge(0).float().mean()):.3f}"
    )
    draft.to(device)
    net.to(device)
    tgt_map = tgt_map.to(device)
    sub_w = sub_w.to(device) if sub_w is not None else None
    ema: list[float] = []
    seen = [0, time.time()]  # targets trained on, start time

    def loss_of(items_batch):
        bt = collate(items_batch, device)
        if k.feature_noise:
            bt["feat"] = bt["feat"] + (torch.rand_like(bt["feat"]) - 0.5) * k.feature_noise
        outs = ttt_forward(draft, net, bt, k.ttt_steps)
        res = step_losses(family, draft, net, outs, bt, tgt_map, sub_w, k.l1_weight)
        accs = [r[1] / max(r[2], 1) for r in res]
        ema[:] = accs if not ema else [0.95 * e + 0.05 * a for e, a in zip(ema, accs)]
        seen[0] += res[0][2]
        return sum(k.step_decay**j * r[0] for j, r in enumerate(res))

    per_epoch: list[dict] = []

    def epoch_eval(step: int) -> None:
        n_eval = k.epoch_eval_sequences
        acc = evaluate(family, draft, net, held[:n_eval], tgt_map, sub_w, device=device)["acc_all"]
        per_epoch.append({"epoch": round(step / steps_per_epoch, 2), "step": step, "heldout_acc_all": acc,
                          "s": round(time.time() - seen[1], 1)})  # fmt: skip
        log(f"epoch {per_epoch[-1]['epoch']}: held-out acc_all {acc} ({min(len(held), n_eval)} seqs)")

    def note() -> str:
        return f"acc {[round(a, 3) for a in ema]} {seen[0] / (time.time() - seen[1]):.0f} tok/s"

    schedule = ProgressCosine(s.lr, total_steps, s.warmup, s.loop_budget())
    every = (steps_per_epoch, epoch_eval) if k.epoch_eval_sequences and held else None
    result = train_loop(draft, epoch_batches(items, batch, random.Random(s.seed)), loss_of, schedule, device,
                        betas=(0.9, 0.95), grad_clip=0.5, log_every=s.log_every, note=note, log=log,
                        every=every)  # fmt: skip
    metrics = {"version": draft.version, "train_s": round(result.seconds, 1), "optimizer_steps": result.steps}
    metrics.update(epochs=round(result.steps / steps_per_epoch, 2), train_sequences=len(train),
                   train_targets_seen=seen[0], tokens_per_s=round(seen[0] / max(result.seconds, 1e-9)))  # fmt: skip
    metrics.update(device=device, hardware=hardware(device), per_epoch=per_epoch)
    for name, ev in {"heldout": held, **(eval_sets or {})}.items():
        metrics[name] = evaluate(family, draft, net, ev, tgt_map, sub_w, device=device)
        log(f"{name}: {metrics[name]}")
    draft.float().cpu()
    return {"draft": draft, "used": used, "metrics": metrics, "losses": result.losses}


def _start_draft(family, hf_dir, net, train, intermediate_size, draft_vocab_size, init_from, seed, log):
    """(draft, training vocabulary, target map, lm_head subset rows) of a fresh draft, or one continuing the head
    at `init_from`."""
    init = _load_head(init_from) if init_from else None
    vocab = base_config(hf_dir).vocab_size
    used = family.vocabulary(train, init, draft_vocab_size, vocab)
    tgt_map = _target_map(used, vocab)
    sub_w = family.subset_rows(net, used)
    draft = build_draft(family, hf_dir, intermediate_size, len(used), seed)
    with torch.no_grad():
        family.start_from_base(draft, net, used)
    if init is not None:
        own = draft.state_dict()
        state = {k: v.to(own[k].dtype) for k, v in init.items() if k in own and k != "d2t"}
        draft.load_state_dict({**own, **state})
        log(f"continuing from {init_from} ({len(state)} tensors)")
    return draft, used, tgt_map, sub_w


def evaluate_head_dirs(family: DraftFamily, heads: list, hf_dir, records: list[dict], device: str = "cpu",
                       log=print) -> list[dict]:  # fmt: skip
    """Per-step held-out accuracy (`evaluate`) of each head directory (as `save_eagle1`/`save_eagle3` write them)
    on the teacher-forced features of corpus `records`, computed once for all heads."""
    rows = teacher_forced.rows_for(hf_dir, records, family.layer_features, device, log=log)
    seqs = cut_sequences(rows, teacher_forced.prompt_lengths(records))
    net = BaseParts(load_base_weights(hf_dir))
    vocab = base_config(hf_dir).vocab_size
    drafts = [_head_draft(family, head, hf_dir, net, vocab) for head in heads]
    net.to(device)
    out = []
    for draft, used in drafts:
        sub_w = family.subset_rows(net, used)
        out.append(evaluate(family, draft.to(device), net, seqs, _target_map(used, vocab).to(device),
                            sub_w.to(device) if sub_w is not None else None, device=device))  # fmt: skip
    return out


def _head_draft(family: DraftFamily, head, hf_dir, net: BaseParts, vocab: int):
    """(the draft of a head directory, its vocabulary): the full one, or the one its `d2t` lists."""
    init = _load_head(head)
    used = (torch.arange(len(init["d2t"])) + init["d2t"]).numpy() if "d2t" in init else np.arange(vocab)
    draft = build_draft(family, hf_dir, json.loads((Path(head) / "config.json").read_text())["intermediate_size"],
                        len(used))  # fmt: skip
    with torch.no_grad():
        family.start_from_base(draft, net, used)  # the vocabulary buffers (d2t), as training set them
    own = draft.state_dict()
    draft.load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in init.items() if k in own and k != "d2t"}})
    return draft, used


def hardware(device: str) -> str:
    from specbuild.training.corpus_grow import hardware as name

    return name(device)


@torch.no_grad()
def simulate_tau(draft, net, seqs: list[dict], top_k: int, depth: int, total_tokens: int, max_new: int = 128) -> dict:
    """Mean accepted tokens per step (tau, bonus included) of greedy dynamic-tree decoding (EAGLE-2's expansion),
    simulated with the engine's own `expand_dynamic` on known greedy continuations (`seqs` need whole-prompt
    features).

    Greedy verification is lossless, so the accepted length of a step is the longest tree path that matches the
    base model's greedy continuation; the draft cache holds the step-0 (true-feature) KV of the prefix."""
    from types import SimpleNamespace

    from specbuild.plugins.feature_draft.draft_net import expand_dynamic

    draft.eval()
    steps = tokens = 0
    for s in seqs:
        bt = collate([s])
        n = bt["token"].shape[1]
        full_len = n + 1
        prompt_len = full_len - int(s["valid"].sum())
        f0 = draft.project(bt["feat"])
        r = torch.arange(n)
        causal = (r.view(1, n) <= r.view(n, 1)).unsqueeze(0)
        empty = [[] for _ in draft.layers]
        h, ks, vs = draft.run(bt["token"], f0, bt["pos"], net, empty, [[] for _ in draft.layers], [], causal)
        kv = torch.stack([torch.stack(ks), torch.stack(vs)], dim=1)  # [Ld,2,1,Hkv,n,D]
        x = [None] + bt["token"][0].tolist()  # x[p+1] = token[p]
        a = prompt_len - 1
        end = min(full_len - 1, prompt_len - 1 + max_new)
        while a < end - 1:
            ctx = SimpleNamespace(
                net=net,
                input_ids=torch.tensor([[0]]),
                position_ids=bt["pos"][:, a : a + 1],
                past_length=torch.tensor([a]),
                tree_mask=torch.ones(1, 1, 1, dtype=torch.bool),
                last_node=torch.tensor([0]),
                bonus=bt["token"][:, a],
            )
            cached = kv[..., :a, :]
            held = torch.ones(1, a, dtype=torch.bool)  # the draft cache holds every earlier position
            out = expand_dynamic(
                draft, ctx, h[:, a : a + 1], cached, held, kv[..., a : a + 1, :], top_k, depth, total_tokens
            )
            ids, paths = out[ef.NEXT_INPUT_IDS][0].tolist(), out[ef.NEXT_PATHS][0].tolist()
            best = 0
            for path in paths:
                nodes = [i for i in path if i >= 0][1:]
                d = 0
                for d_i, node in enumerate(nodes, start=1):
                    p = a + 1 + d_i
                    if p > end or ids[node] != x[p]:
                        break
                    d = d_i
                best = max(best, d)
            steps += 1
            tokens += best + 1
            a += best + 1
    draft.train()
    return {"tau": round(tokens / max(steps, 1), 3), "steps": steps, "tokens": tokens}


def draft_config_json(hf_dir, draft, base_model_name: str, defaults: dict, metrics: dict | None) -> dict:
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    c = draft.c
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float16",
        "hidden_size": c["hidden"],
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_heads"],
        "num_key_value_heads": c["num_kv_heads"],
        "head_dim": c["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": hf.get("rms_norm_eps", c["rms_norm_eps"]),
        "rope_theta": float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "vocab_size": hf["vocab_size"],
        "num_hidden_layers": 1,
        "bias": draft.fc.bias is not None,
        "base_model": base_model_name,
        "specbuild_defaults": dict(defaults),
    }
    if metrics:
        cfg["specbuild_training"] = metrics
    return cfg


def write_head(out_dir: str | Path, tensors: dict[str, torch.Tensor], cfg: dict) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def train_from_recipe(cfg: dict, family: DraftFamily, train_dir: Path | None, humaneval_dir: Path | None,
                      log=print) -> dict:  # fmt: skip
    """The training stage of a draft recipe (`load_recipe`'s dict): train on the features of `recipe_sequences`,
    evaluate on the held-out ones (and the HumanEval ones of a shard recipe); returns train_draft's result, with
    the corpus lineage in its metrics. The metrics go to `work_dir`/metrics-<mode>.json."""
    seqs, eval_sets, lineage = recipe_sequences(cfg, family, train_dir, humaneval_dir, log)
    settings, knobs = TrainSettings.from_recipe(cfg, SETTINGS), read_train(cfg, TTTKnobs())
    res = train_draft(family, cfg["base_model"], seqs, settings, knobs, eval_sets=eval_sets, log=log)
    res["metrics"].update(lineage)
    work = Path(cfg["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    (work / f"metrics-{cfg['kind']}.json").write_text(json.dumps(res["metrics"], indent=1) + "\n")
    return res


def recipe_sequences(cfg: dict, family: DraftFamily, train_dir: Path | None, humaneval_dir: Path | None, log=print):
    """(sequences, eval sets, lineage) of a draft recipe: teacher-forced from its `corpus_dir` (no eval set beyond
    the held-out split), or read from the data stage's shards `train_dir` and `humaneval_dir` (`distill_dir`)."""
    if cfg.get("corpus_dir"):
        rows, records, lineage = teacher_forced.from_recipe(cfg, family.layer_features, log=log)
        return cut_sequences(rows, teacher_forced.prompt_lengths(records)), {}, lineage
    dd = Path(cfg["distill_dir"])
    seqs = load_sequences(family, train_dir, dd / "train.jsonl")
    try:
        return seqs, {"humaneval": load_sequences(family, humaneval_dir, dd / "humaneval.jsonl")}, {}
    except FileNotFoundError as e:
        log(f"eval set humaneval skipped: {e}")
        return seqs, {}, {}


def recipe_defaults(cfg: dict) -> dict:
    """The build defaults a recipe records with the head (replaced by its `choose` stage's measurement)."""
    return cfg.get("specbuild_defaults", {"eagle_top_k": 6, "eagle_depth": 5, "eagle_total_tokens": 24})
