"""Self-distilled EAGLE-1 and EAGLE-3 draft heads: feature extraction, training-time-test training, export.

Data: the greedy sequences of `specbuild.training.distill` (prompt_ids + gen_ids per JSON line). One base forward
per sequence gives, for positions p = prompt_len-PROMPT_TAIL .. len-2 (shards under `features_dir`):
`h_low`, `h_mid`, `h_high` [N,H] fp16 (inputs of base layers 2, L//2, L-3 = HF hidden_states[i], EAGLE-3),
`hidden` [N,H] fp16 (final normed hidden = input of lm_head, EAGLE-1), `token` [N] (x_{p+1}),
`greedy` [N] (the base model's argmax at p), `seq` [N] and `pos` [N] (absolute position p).

Training uses the engine's own module (`specbuild.plugins.eagle.draft_net.DraftNet`) and its semantics: the draft
pairs feature f_t with token x_{t+1} at rope position t and its output h_t predicts x_{t+2}, the base model's
greedy token after x_{t+1} (`greedy[t+1]`). Training-time test: step 0 runs on the true features; in step j the
feature at position t is the step-(j-1) output h_{t-1} (the engine feeds a node's draft output to its children),
and position t attends to the step-0 keys at positions <= t-j plus its own unrolled ancestors of steps 1..j-1
(exactly the engine's expansion memories: draft cache + tree ancestors). Loss per step 0.8^j * CE (EAGLE-3:
over the draft vocab, targets outside it masked; EAGLE-1: over the base lm_head restricted to a frequent-token
subset for speed) + for EAGLE-1 a SmoothL1 between h_t and the true f_{t+1}.

Export: `save_eagle3` (SafeAILab original layout, fc/midlayer/norm/lm_head/d2t/t2d) and `save_eagle1`
(fc with bias, layers.0.* without input_layernorm, no embed_tokens, base lm_head), fp16 safetensors + config.json.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from specbuild import engine_format as ef
from specbuild.training import distill
from specbuild.training.base_weights import BaseParts, load_base_weights
from specbuild.training.distill import FEATURE_KEYS, capture_layers
from specbuild.training.heldout import heldout_mask
from specbuild.training.loop import ProgressCosine, epoch_batches, train_loop

PROMPT_TAIL = 8


# ----------------------------------------------------------------------------------------------- features


@torch.inference_mode()
def extract_features(
    hf_dir: str | Path,
    sequences_jsonl: str | Path,
    out_dir: str | Path,
    batch_tokens: int = 2048,
    time_budget_s: float = 1e9,
    max_sequences: int | None = None,
    prompt_tail: int | None = PROMPT_TAIL,
    log=print,
    device: str = "cpu",
) -> int:
    """One base forward per sequence; writes one shard per batch (resumes: sequences with shards are skipped).

    prompt_tail: rows start this many positions before the end of the prompt (None: the whole prompt, as needed
    by `simulate_tau`). Returns the number of sequences with features."""
    distill.setup_torch()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done_file = out_dir / "done.txt"
    done = set(done_file.read_text().split()) if done_file.exists() else set()
    seqs = [r for r in distill.read_sequences(sequences_jsonl) if len(r["gen_ids"]) >= 2]
    if max_sequences is not None:
        seqs = seqs[:max_sequences]
    todo = [r for r in seqs if r["id"] not in done]
    todo.sort(key=lambda r: len(r["prompt_ids"]) + len(r["gen_ids"]))
    if not todo:
        return len(done)
    model, tok = distill.load_model(hf_dir, device)
    n_layers = model.config.num_hidden_layers
    cap = capture_layers(n_layers)
    captured: dict[int, torch.Tensor] = {}

    def hook(idx):
        def f(mod, args, kwargs):
            captured[idx] = args[0] if args else kwargs["hidden_states"]

        return f

    for i in sorted(set(cap)):
        model.model.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True)
    # nothing after the last captured layer's input is needed (the final hidden comes from distill's shards)
    model.model.layers = model.model.layers[: max(cap) + 1]
    model.model.norm = torch.nn.Identity()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0 = time.time()
    i = 0
    while i < len(todo):
        if time.time() - t0 > time_budget_s:
            log(f"feature time budget reached: {len(done)} sequences")
            break
        n_max = len(todo[i]["prompt_ids"]) + len(todo[i]["gen_ids"])
        j = i + 1
        while j < len(todo) and (j - i + 1) * (len(todo[j]["prompt_ids"]) + len(todo[j]["gen_ids"])) <= batch_tokens:
            j += 1
        batch = todo[i:j]
        fulls = [r["prompt_ids"] + r["gen_ids"] for r in batch]
        ids, mask, pos = distill._left_pad(fulls, pad)
        captured.clear()
        model.model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device))
        rows: dict[str, list] = {k: [] for k in (*FEATURE_KEYS, "token", "seq", "pos")}
        L = ids.shape[1]
        for b, r in enumerate(batch):
            n_full, P = len(fulls[b]), len(r["prompt_ids"])
            p0 = 0 if prompt_tail is None else P - min(prompt_tail, P)
            a, e = L - n_full + p0, L - 1  # positions p0 .. n_full-2
            for key, li in zip(FEATURE_KEYS, cap):
                rows[key].append(captured[li][b, a:e].to(torch.float16).cpu().numpy())
            for key, value in distill.layer_row_index(fulls[b], p0, r["id"]).items():
                rows[key].append(value)
        from safetensors.numpy import save_file

        name = f"fwd-{batch[0]['id']}-{len(batch)}"
        save_file({k: np.ascontiguousarray(np.concatenate(v)) for k, v in rows.items()}, str(out_dir / f".{name}"))
        (out_dir / f".{name}").rename(out_dir / f"{name}.safetensors")
        done.update(r["id"] for r in batch)
        done_file.write_text("\n".join(sorted(done)) + "\n")
        i = j
        log(f"features {len(done)} sequences ({i}/{len(todo)} of this run), max len {n_max}, {time.time() - t0:.0f}s")
    return len(done)


def check_hidden_states(hf_dir: str | Path) -> dict:
    """Whether HF's hidden_states[-1] is the normed final hidden and hidden_states[i] the input of layer i."""
    model, _ = distill.load_model(hf_dir)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.inference_mode():
        out = model.model(input_ids=ids, output_hidden_states=True)
        hs = out.hidden_states
        captured = {}

        def hook(idx):
            def f(mod, args, kwargs):
                x = args[0] if args else kwargs["hidden_states"]
                captured[idx] = x.clone()

            return f

        handles = [model.model.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in (2, 15, 27)]
        model.model(input_ids=ids)
        for h in handles:
            h.remove()
    return {
        "n_hidden_states": len(hs),
        "last_is_normed": bool(torch.allclose(hs[-1], out.last_hidden_state)),
        "last_is_norm_of_prev": bool(torch.allclose(hs[-1], model.model.norm(hs[-2]), atol=1e-5)),
        "layer_inputs_match": all(bool(torch.allclose(hs[i], captured[i])) for i in captured),
    }


# ----------------------------------------------------------------------------------------------- data


def _load_shards(features_dir: str | Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
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


def load_sequences(version: int, features_dir: str | Path, sequences_jsonl: str | Path) -> list[dict]:
    """Per sequence: `feat` [n,F] fp16 (EAGLE-3: h_low|h_mid|h_high; EAGLE-1: final normed hidden), `token` [n]
    (x_{p+1}), `valid` [n] (x_{p+2} is a greedy base token, i.e. a generated one), `pos` [n], `seq`."""
    prompt_len = {distill._seq_no(r["id"]): len(r["prompt_ids"]) for r in distill.read_sequences(sequences_jsonl)}
    if version == 3:
        d = _load_shards(features_dir, (*FEATURE_KEYS, "token", "seq", "pos"))
        feat = np.concatenate([d[k] for k in FEATURE_KEYS], axis=1)
        pos = d["pos"]
    else:  # distill's shards: hidden, next_token, seq, gen_offset (gen_offset = p - (P - 1))
        d = _load_shards(features_dir, ("hidden", "next_token", "seq", "gen_offset"))
        feat, d["token"] = d["hidden"], d["next_token"]
        pos = np.zeros_like(d["seq"])
    seq = d["seq"]
    cuts = np.nonzero(np.diff(seq) != 0)[0] + 1
    out = []
    for a, e in zip(np.r_[0, cuts], np.r_[cuts, len(seq)]):
        s = int(seq[a])
        if s not in prompt_len or e - a < 3:
            continue
        P = prompt_len[s]
        if version == 3:
            p = pos[a:e].astype(np.int64)
        else:
            p = d["gen_offset"][a:e].astype(np.int64) + P - 1
        valid = np.zeros(e - a, dtype=bool)
        valid[:-1] = p[1:] + 1 >= P  # target x_{p+2} = token[t+1] is generated
        out.append({"seq": s, "feat": feat[a:e], "token": d["token"][a:e].astype(np.int64), "valid": valid, "pos": p})
    return out


def split_heldout(seqs: list[dict], frac: float) -> tuple[list[dict], list[dict]]:
    """(training, held-out) sequences: the split of `heldout_mask`."""
    held = heldout_mask(np.array([s["seq"] for s in seqs], dtype=np.int64), frac)
    return [s for s, h in zip(seqs, held) if not h], [s for s, h in zip(seqs, held) if h]


def draft_vocab(seqs: list[dict], size: int, vocab: int) -> np.ndarray:
    """The `size` most frequent target tokens of the training generations, sorted by id."""
    counts = np.zeros(vocab, dtype=np.int64)
    for s in seqs:
        np.add.at(counts, s["token"][1:][s["valid"][:-1]], 1)
    counts += np.bincount(np.concatenate([s["token"] for s in seqs]), minlength=vocab)[:vocab] > 0  # tie-break
    top = np.argsort(-counts, kind="stable")[:size]
    return np.sort(top)


def chunks(seqs: list[dict], length: int) -> list[dict]:
    out = []
    for s in seqs:
        n = len(s["token"])
        for a in range(0, n, length):
            e = min(n, a + length)
            if e - a >= 3 and s["valid"][a:e].any():
                out.append({k: (v[a:e] if isinstance(v, np.ndarray) else v) for k, v in s.items()})
    return out


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    b, n = len(items), max(len(it["token"]) for it in items)
    f = items[0]["feat"].shape[1]
    feat = torch.zeros(b, n, f)
    token = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    pos = torch.zeros(b, n, dtype=torch.long)
    for i, it in enumerate(items):
        m = len(it["token"])
        feat[i, :m] = torch.from_numpy(it["feat"].astype(np.float32))
        token[i, :m] = torch.from_numpy(it["token"])
        valid[i, :m] = torch.from_numpy(it["valid"])
        pos[i, :m] = torch.from_numpy(it["pos"]) if it["pos"][0] >= 0 else torch.arange(m)
        pos[i, m:] = pos[i, m - 1] + 1 + torch.arange(n - m)
    return {"feat": feat, "token": token, "valid": valid, "pos": pos}


# ----------------------------------------------------------------------------------------------- model


def base_config(hf_dir: str | Path):
    from specbuild.builder.model_config import ModelConfig

    return ModelConfig.from_hf(json.loads((Path(hf_dir) / "config.json").read_text()))


def head_config(version: int, base, intermediate_size: int, draft_vocab_size: int | None) -> dict:
    cfg = {
        "version": version,
        "num_heads": base.num_heads,
        "num_kv_heads": base.num_kv_heads,
        "head_dim": base.head_dim,
        "intermediate_size": intermediate_size,
        "rms_norm_eps": base.rms_norm_eps,
        "rope_theta": base.rope_theta,
        "has_embed": False,
    }
    if version == 3:
        cfg["draft_vocab_size"] = draft_vocab_size
    else:
        cfg.update({"num_layers": 1, "fc_bias": True, "qkv_bias": False, "draft_vocab_size": None})
    return cfg


def build_draft(version: int, hf_dir, intermediate_size: int, draft_vocab_size: int | None, seed: int = 0):
    from specbuild.plugins.eagle.draft_net import DraftNet

    torch.manual_seed(seed)
    base = base_config(hf_dir)
    draft = DraftNet(head_config(version, base, intermediate_size, draft_vocab_size), base, version)
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
    f0 = draft.fc(feat) if draft.version == 3 else feat
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


def step_losses(draft, net, outs, batch, tgt_map: torch.Tensor, sub_w: torch.Tensor | None, l1_weight: float):
    """Per-step (loss, correct, count). tgt_map [V] maps a target id to its logit column (-1: masked).

    EAGLE-3: logits = lm_head(norm(h)) over the draft vocab. EAGLE-1: h @ sub_w.T (base lm_head rows of a
    frequent-token subset) + l1_weight * SmoothL1(h_t, f_{t+1})."""
    token, valid, feat = batch["token"], batch["valid"], batch["feat"]
    b, n = token.shape
    target_ids = torch.cat([token[:, 1:], token[:, :1]], dim=1)
    col = tgt_map[target_ids]
    res = []
    for j, h in enumerate(outs):
        m = valid & (col >= 0)
        if j:
            m[:, :j] = False
        logits = draft.lm_head(draft.norm(h[m])) if draft.version == 3 else h[m] @ sub_w.t()
        tgt = col[m]
        loss = torch.nn.functional.cross_entropy(logits.float(), tgt) if tgt.numel() else h.sum() * 0
        if draft.version == 1 and l1_weight:
            mf = valid.clone()
            if j:
                mf[:, :j] = False
            nxt = torch.cat([feat[:, 1:], feat[:, :1]], dim=1)
            loss = loss + l1_weight * torch.nn.functional.smooth_l1_loss(h[mf], nxt[mf])
        correct = (logits.argmax(-1) == tgt).sum().item() if tgt.numel() else 0
        res.append((loss, correct, int(tgt.numel())))
    return res


def _target_map(version: int, used: np.ndarray, vocab: int) -> torch.Tensor:
    m = torch.full((vocab,), -1, dtype=torch.long)
    m[torch.from_numpy(used)] = torch.arange(len(used))
    return m


@torch.no_grad()
def evaluate(draft, net, seqs: list[dict], tgt_map, sub_w, steps: int = 4, length: int = 256, batch: int = 16) -> dict:
    """Per-step top-1 accuracy (training-time-test unroll) over `seqs`; for EAGLE-3 positions whose target is
    outside the draft vocab count as misses (acc_all) and are excluded (acc_in_vocab)."""
    draft.eval()
    items = chunks(seqs, length)
    corr, cnt, total = np.zeros(steps), np.zeros(steps), np.zeros(steps)
    for i in range(0, len(items), batch):
        bt = collate(items[i : i + batch])
        outs = ttt_forward(draft, net, bt, steps)
        for j, (_, c, k) in enumerate(step_losses(draft, net, outs, bt, tgt_map, sub_w, 0.0)):
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


def train_eagle(
    version: int,
    hf_dir: str | Path,
    features_dir: str | Path,
    sequences_jsonl: str | Path,
    eval_sets: dict | None = None,
    intermediate_size: int = 768,
    draft_vocab_size: int = 8192,
    steps: int = 3,
    step_decay: float = 0.8,
    l1_weight: float = 0.1,
    chunk_len: int = 256,
    batch: int = 16,
    lr: float = 1e-3,
    warmup: int = 50,
    epochs: float = 4.0,
    time_budget_s: float = 1200.0,
    heldout_frac: float = 0.05,
    feature_noise: float = 0.0,
    seed: int = 0,
    log_every: int = 20,
    init_from: str | Path | None = None,
    log=print,
    device: str = "cpu",
) -> dict:
    """Train an EAGLE draft (version 1 or 3) with training-time test on `device` (bf16 autocast on cuda). Returns
    {draft, used, metrics, losses} (the draft on the CPU, float32; losses: one per optimizer step).

    eval_sets: {name: (features_dir, sequences_jsonl)} evaluated after training (never trained on).
    init_from: a head directory this function wrote before (model.safetensors); training continues from its
    weights, and an EAGLE-3 head keeps its draft vocabulary."""
    distill.setup_torch()
    base = base_config(hf_dir)
    net = BaseParts(load_base_weights(hf_dir))
    seqs = load_sequences(version, features_dir, sequences_jsonl)
    train, held = split_heldout(seqs, heldout_frac)
    init = _load_head(init_from) if init_from else None
    if init is not None and version == 3:
        used = (torch.arange(len(init["d2t"])) + init["d2t"]).numpy()
        draft_vocab_size = len(used)
    else:
        used = draft_vocab(train, draft_vocab_size, base.vocab_size)
    tgt_map = _target_map(version, used, base.vocab_size)
    sub_w = net.lm_head.weight[torch.from_numpy(used)] if version == 1 else None
    draft = build_draft(version, hf_dir, intermediate_size, draft_vocab_size if version == 3 else None, seed)
    h = base.hidden_size
    with torch.no_grad():  # start from the base model's output space: pass the (last) feature through fc
        draft.fc.weight[:, -h:] += torch.eye(h)
        if version == 3:
            draft.d2t.copy_(torch.from_numpy(used).long() - torch.arange(len(used)))
            draft.lm_head.weight.copy_(net.lm_head.weight[torch.from_numpy(used)])
            draft.norm.weight.copy_(net.final_norm)
    if init is not None:
        own = draft.state_dict()
        state = {k: v.to(own[k].dtype) for k, v in init.items() if k in own and k != "d2t"}
        draft.load_state_dict({**own, **state})
        log(f"continuing from {init_from} ({len(state)} tensors)")
    items = chunks(train, chunk_len)
    n_tok = sum(int(it["valid"].sum()) for it in items)
    total_steps = max(1, int(epochs * len(items) / batch))
    log(
        f"EAGLE-{version}: {len(train)} train / {len(held)} held-out sequences, {len(items)} chunks, {n_tok} targets, "
        f"{total_steps} optimizer steps max, draft vocab coverage "
        f"{float(tgt_map[torch.from_numpy(np.concatenate([s['token'] for s in train]))].ge(0).float().mean()):.3f}"
    )
    draft.to(device)
    net.to(device)
    tgt_map = tgt_map.to(device)
    sub_w = sub_w.to(device) if sub_w is not None else None
    ema: list[float] = []

    def loss_of(items_batch):
        bt = {k: v.to(device) for k, v in collate(items_batch).items()}
        if feature_noise:
            bt["feat"] = bt["feat"] + (torch.rand_like(bt["feat"]) - 0.5) * feature_noise
        res = step_losses(draft, net, ttt_forward(draft, net, bt, steps), bt, tgt_map, sub_w, l1_weight)
        accs = [r[1] / max(r[2], 1) for r in res]
        ema[:] = accs if not ema else [0.95 * e + 0.05 * a for e, a in zip(ema, accs)]
        return sum(step_decay**j * r[0] for j, r in enumerate(res))

    schedule = ProgressCosine(lr, total_steps, warmup, time_budget_s)
    result = train_loop(draft, epoch_batches(items, batch, random.Random(seed)), loss_of, schedule, device,
                        betas=(0.9, 0.95), grad_clip=0.5, log_every=log_every,
                        note=lambda: f"acc {[round(a, 3) for a in ema]}", log=log)  # fmt: skip
    draft.float().cpu()
    net.cpu()
    tgt_map = tgt_map.cpu()
    sub_w = sub_w.cpu() if sub_w is not None else None
    metrics = {"version": version, "train_s": round(result.seconds, 1), "optimizer_steps": result.steps}
    metrics["train_sequences"] = len(train)
    metrics["device"] = device
    metrics["heldout"] = evaluate(draft, net, held, tgt_map, sub_w)
    log(f"held-out: {metrics['heldout']}")
    for name, (fd, js) in (eval_sets or {}).items():
        try:
            ev = load_sequences(version, fd, js)
        except FileNotFoundError as e:
            log(f"eval set {name} skipped: {e}")
            continue
        metrics[name] = evaluate(draft, net, ev, tgt_map, sub_w)
        log(f"{name}: {metrics[name]}")
    return {"draft": draft, "used": used, "metrics": metrics, "losses": result.losses}


# ----------------------------------------------------------------------------------------------- tree simulation


@torch.no_grad()
def simulate_tau(draft, net, seqs: list[dict], top_k: int, depth: int, total_tokens: int, max_new: int = 128) -> dict:
    """Mean accepted tokens per step (tau, bonus included) of greedy EAGLE-2 dynamic-tree decoding, simulated with
    the engine's own `expand_dynamic` on known greedy continuations (`seqs` need whole-prompt features).

    Greedy verification is lossless, so the accepted length of a step is the longest tree path that matches the
    base model's greedy continuation; the draft cache holds the step-0 (true-feature) KV of the prefix."""
    from types import SimpleNamespace

    from specbuild.plugins.eagle.draft_net import expand_dynamic

    draft.eval()
    steps = tokens = 0
    for s in seqs:
        bt = collate([s])
        n = bt["token"].shape[1]
        full_len = n + 1
        prompt_len = full_len - int(s["valid"].sum())
        f0 = draft.fc(bt["feat"]) if draft.version == 3 else bt["feat"]
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
            out = expand_dynamic(
                draft, ctx, h[:, a : a + 1], kv[..., :a, :], kv[..., a : a + 1, :], top_k, depth, total_tokens
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


# ----------------------------------------------------------------------------------------------- export


def _draft_config_json(version: int, hf_dir, draft, base_model_name: str, defaults: dict, metrics: dict | None) -> dict:
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
        "bias": version == 1,
        "base_model": base_model_name,
        "specbuild_defaults": dict(defaults),
    }
    if version == 3:
        cfg["draft_vocab_size"] = int(draft.lm_head.weight.shape[0])
    if metrics:
        cfg["specbuild_training"] = metrics
    return cfg


def _write(out_dir: str | Path, tensors: dict[str, torch.Tensor], cfg: dict) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def save_eagle3(out_dir, draft, used: np.ndarray, hf_dir, base_model_name: str, defaults: dict, metrics=None):
    """SafeAILab EAGLE-3 layout: fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t [Vd] int64, t2d [V] bool
    (no embed_tokens: the base embedding is used), fp16 weights."""
    sd = draft.state_dict()
    tensors = {k: v.detach().to(torch.float16) for k, v in sd.items() if k != "d2t"}
    vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    used_t = torch.from_numpy(np.asarray(used)).long()
    tensors["d2t"] = used_t - torch.arange(len(used_t))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used_t] = True
    tensors["t2d"] = t2d
    _write(out_dir, tensors, _draft_config_json(3, hf_dir, draft, base_model_name, defaults, metrics))


def save_eagle1(out_dir, draft, hf_dir, base_model_name: str, defaults: dict, metrics=None, used=None):
    """SafeAILab EAGLE-1 layout: fc.weight/bias, layers.0.* without input_layernorm, no embed_tokens.

    With `used` (the training draft vocabulary, sorted target ids) the head also carries `lm_head.weight` =
    those rows of the base lm_head and `d2t`, so the engine drafts over the vocabulary it was trained on
    (EAGLE-3's reduced-vocabulary layout); without it the base lm_head is shared."""
    sd = draft.state_dict()
    tensors = {k: v.detach().to(torch.float16) for k, v in sd.items() if k != "d2t"}
    cfg = _draft_config_json(1, hf_dir, draft, base_model_name, defaults, metrics)
    if used is not None:
        used_t = torch.from_numpy(np.asarray(used)).long()
        tensors["lm_head.weight"] = load_base_weights(hf_dir).lm_head[used_t].to(torch.float16)
        tensors["d2t"] = used_t - torch.arange(len(used_t))
        cfg["draft_vocab_size"] = len(used_t)
    _write(out_dir, tensors, cfg)


# ----------------------------------------------------------------------------------------------- recipes


def run_eagle_recipe(cfg: dict, log=print) -> dict:
    """Run an EAGLE recipe (`load_recipe`'s dict, `kind: eagle` or `eagle3`): features, training, evaluation,
    export.

    Sequences come from the Medusa recipe's data stage (`distill_dir`: train.jsonl, humaneval.jsonl and, for
    EAGLE-1, its final-hidden shards feat_train / feat_humaneval); EAGLE-3 layer features go to `feature_dir`."""
    version = 3 if cfg.get("kind", "eagle3") == "eagle3" else 1
    hf, dd = cfg["base_model"], Path(cfg["distill_dir"])
    t = cfg.get("train", {})
    device = cfg["device"]
    distill.setup_torch()
    if version == 3:
        fd = Path(cfg["feature_dir"])
        f = cfg.get("features", {})
        extract_features(hf, dd / "humaneval.jsonl", fd / "humaneval", log=log, device=device)
        budget = float(f.get("time_budget_s", 1e9))
        extract_features(hf, dd / "train.jsonl", fd / "train", time_budget_s=budget, log=log, device=device)
        train_dir, he_dir = fd / "train", fd / "humaneval"
    else:
        train_dir, he_dir = dd / "feat_train", dd / "feat_humaneval"
    res = train_eagle(
        version,
        hf,
        train_dir,
        dd / "train.jsonl",
        eval_sets={"humaneval": (he_dir, dd / "humaneval.jsonl")},
        intermediate_size=int(t.get("intermediate_size", 768)),
        draft_vocab_size=int(t.get("draft_vocab_size", 8192)),
        steps=int(t.get("ttt_steps", 3)),
        step_decay=float(t.get("step_decay", 0.8)),
        l1_weight=float(t.get("l1_weight", 0.1)),
        chunk_len=int(t.get("chunk_len", 256)),
        batch=int(t.get("batch", 16)),
        lr=float(t.get("lr", 1e-3)),
        warmup=int(t.get("warmup", 50)),
        epochs=float(t.get("epochs", 4)),
        time_budget_s=float(t.get("time_budget_s", 1200)),
        heldout_frac=float(t.get("heldout_frac", 0.05)),
        feature_noise=float(t.get("feature_noise", 0.0)),
        init_from=t.get("init_from"),
        log=log,
        device=device,
    )
    defaults = cfg.get("specbuild_defaults", {"eagle_top_k": 6, "eagle_depth": 5, "eagle_total_tokens": 24})
    name = cfg.get("base_model_name", str(hf))
    if version == 3:
        save_eagle3(cfg["output_dir"], res["draft"], res["used"], hf, name, defaults, res["metrics"])
    else:
        used = res["used"] if t.get("ship_draft_vocab", False) else None
        save_eagle1(cfg["output_dir"], res["draft"], hf, name, defaults, res["metrics"], used=used)
    work = Path(cfg.get("work_dir", cfg.get("feature_dir", dd)))
    work.mkdir(parents=True, exist_ok=True)
    (work / f"metrics-eagle{version}.json").write_text(json.dumps(res["metrics"], indent=1) + "\n")
    return res["metrics"]
