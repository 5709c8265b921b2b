"""Training-time-test training of a feature-conditioned draft network, shared by the modes that specialise it.

Data: feature rows of the base model's greedy sequences (`specbuild.training.distill`), cut per sequence; the mode's
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

import json
import random
from pathlib import Path

import numpy as np
import torch

from specbuild import engine_format as ef
from specbuild.plugins.feature_draft.draft_net import DraftNet
from specbuild.training import distill
from specbuild.training.base_weights import BaseParts, load_base_weights
from specbuild.training.heldout import heldout_mask
from specbuild.training.loop import ProgressCosine, epoch_batches, train_loop


class DraftFamily:
    """What a mode tells the shared trainer about its draft network; subclassed in the mode's training module."""

    net_class: type[DraftNet]
    feature_loss = False  # add SmoothL1(h_t, f_{t+1}): the draft output regresses the true next feature

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
    d = family.read_rows(features_dir, prompt_len)
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


def base_config(hf_dir: str | Path):
    from specbuild.builder.model_config import ModelConfig

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
    family, draft, net, seqs: list[dict], tgt_map, sub_w, steps: int = 4, length: int = 256, batch: int = 16
) -> dict:
    """Per-step top-1 accuracy (training-time-test unroll) over `seqs`; positions whose target is
    outside the draft vocab count as misses (acc_all) and are excluded (acc_in_vocab)."""
    draft.eval()
    items = chunks(seqs, length)
    corr, cnt, total = np.zeros(steps), np.zeros(steps), np.zeros(steps)
    for i in range(0, len(items), batch):
        bt = collate(items[i : i + batch])
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
    """Train the family's draft with training-time test on `device` (bf16 autocast on cuda). Returns
    {draft, used, metrics, losses} (the draft on the CPU, float32; losses: one per optimizer step).

    eval_sets: {name: (features_dir, sequences_jsonl)} evaluated after training (never trained on).
    init_from: a head directory this function wrote before (model.safetensors); training continues from its
    weights (and a head with its own vocabulary keeps it, see DraftFamily.vocabulary)."""
    distill.setup_torch()
    base = base_config(hf_dir)
    net = BaseParts(load_base_weights(hf_dir))
    seqs = load_sequences(family, features_dir, sequences_jsonl)
    train, held = split_heldout(seqs, heldout_frac)
    init = _load_head(init_from) if init_from else None
    used = family.vocabulary(train, init, draft_vocab_size, base.vocab_size)
    tgt_map = _target_map(used, base.vocab_size)
    sub_w = family.subset_rows(net, used)
    draft = build_draft(family, hf_dir, intermediate_size, len(used), seed)
    with torch.no_grad():
        family.start_from_base(draft, net, used)
    if init is not None:
        own = draft.state_dict()
        state = {k: v.to(own[k].dtype) for k, v in init.items() if k in own and k != "d2t"}
        draft.load_state_dict({**own, **state})
        log(f"continuing from {init_from} ({len(state)} tensors)")
    items = chunks(train, chunk_len)
    n_tok = sum(int(it["valid"].sum()) for it in items)
    total_steps = max(1, int(epochs * len(items) / batch))
    log(
        f"{family.net_class.__name__}: {len(train)} train / {len(held)} held-out sequences, {len(items)} chunks, "
        f"{n_tok} targets, "
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
        res = step_losses(family, draft, net, ttt_forward(draft, net, bt, steps), bt, tgt_map, sub_w, l1_weight)
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
    metrics = {"version": draft.version, "train_s": round(result.seconds, 1), "optimizer_steps": result.steps}
    metrics["train_sequences"] = len(train)
    metrics["device"] = device
    metrics["heldout"] = evaluate(family, draft, net, held, tgt_map, sub_w)
    log(f"held-out: {metrics['heldout']}")
    for name, (fd, js) in (eval_sets or {}).items():
        try:
            ev = load_sequences(family, fd, js)
        except FileNotFoundError as e:
            log(f"eval set {name} skipped: {e}")
            continue
        metrics[name] = evaluate(family, draft, net, ev, tgt_map, sub_w)
        log(f"{name}: {metrics[name]}")
    return {"draft": draft, "used": used, "metrics": metrics, "losses": result.losses}


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


def train_from_recipe(cfg: dict, family: DraftFamily, train_dir: Path, humaneval_dir: Path, log=print) -> dict:
    """The training stage of a draft recipe (`load_recipe`'s dict): train on `train_dir`'s features and
    `distill_dir`/train.jsonl, evaluate on the HumanEval ones; returns train_draft's result. The metrics go to
    `work_dir`/metrics-<mode>.json."""
    t, hf, dd = cfg.get("train", {}), cfg["base_model"], Path(cfg["distill_dir"])
    res = train_draft(
        family,
        hf,
        train_dir,
        dd / "train.jsonl",
        eval_sets={"humaneval": (humaneval_dir, dd / "humaneval.jsonl")},
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
        device=cfg["device"],
    )
    work = Path(cfg["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    (work / f"metrics-{cfg['kind']}.json").write_text(json.dumps(res["metrics"], indent=1) + "\n")
    return res


def recipe_defaults(cfg: dict) -> dict:
    """The build defaults a recipe records with the head (replaced by its `choose` stage's measurement)."""
    return cfg.get("specbuild_defaults", {"eagle_top_k": 6, "eagle_depth": 5, "eagle_total_tokens": 24})
