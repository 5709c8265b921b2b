"""Training a ReDrafter drafter by self-distillation, evaluating it by simulated beam-search acceptance, and writing it
in apple/ml-recurrent-drafter's layout.

Data: feature rows of the base model's own continuations (specbuild.training.distill: the final normed hidden state
at position p and the token at p+1). Row i drafts from context hidden[i] with g0 = next_token[i] (the token the base
emitted there): drafting step k feeds the token after step k-1 into the RNN state and predicts next_token[i+k],
teacher-forced, as the reference trains (a hard cross-entropy to the base's greedy token and a soft one to the base's
distribution over the draft vocabulary, weighted step_decay^(k-1)). The network is drafter_net.RecurrentDrafter,
the module the step graph exports, so what is evaluated here is what the engine runs.

Evaluation replays the engine's drafting: beam_search from each held-out row and greedy verification against the
base's continuation, giving the expected tokens per step (tau) for every beam count and draft length asked for.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specbuild.plugins.redrafter import TOP_K_WARP
from specbuild.plugins.redrafter.drafter_net import RecurrentDrafter, beam_search
from specbuild.training import distill, teacher_forced
from specbuild.training.base_weights import load_base_weights
from specbuild.training.heldout import heldout_mask
from specbuild.training.loop import FittedCosine, row_batches, train_loop
from specbuild.training.recipe import prepare_data
from specbuild.training.settings import TrainSettings, read_train
from specbuild.training.teacher_forced import loop_facts
from specbuild.training.vocab import draft_vocabulary

MODEL_TYPE = "recurrent_drafting_drafter"

# ReDrafter's defaults of what every trainer shares (the other trainers' lr, warm-up and logging differ); the draft
# vocabulary's cap is the recipe's `train.draft_vocab` (0, false or null: the whole vocabulary)
SETTINGS = TrainSettings(epochs=2.0, lr=2e-3, batch=512, warmup=100, time_budget_s=1200.0, log_every=100,
                         draft_vocab_size=8192)  # fmt: skip
RECIPE_KEYS = {"draft_vocab_size": "draft_vocab"}


@dataclasses.dataclass(frozen=True)
class DrafterKnobs:
    """ReDrafter's own training knobs (`train:` keys of the same names)."""

    exit_dim: int | None = None  # the ResBlocks' width; None: 2H (no input_proj)
    num_layers: int = 2  # ResBlocks
    rnn: bool = True
    draft_len: int = 5  # teacher-forced drafting steps
    soft_weight: float = 0.5  # the soft cross-entropy's share (to the base's distribution)
    step_decay: float = 0.8  # the loss weight of drafting step k: step_decay^(k-1)


def step_targets(feats: dict[str, np.ndarray], steps: int) -> np.ndarray:
    """valid[i, k-1] for k = 1..steps: rows i..i+k belong to one sequence and the token after row i+k is generated."""
    seq, goff = feats["seq"], feats["gen_offset"]
    n = len(seq)
    valid = np.zeros((n, steps), dtype=bool)
    for k in range(1, steps + 1):
        ok = np.zeros(n, dtype=bool)
        ok[: n - k] = (seq[k:] == seq[: n - k]) & (goff[k:] >= 0)
        valid[:, k - 1] = ok if k == 1 else ok & valid[:, k - 2]
    return valid


def init_drafter(hidden: int, exit_dim: int, num_layers: int, rnn: bool, lm_rows: torch.Tensor) -> RecurrentDrafter:
    """Start near the base model: ResBlocks at identity, the vocabulary projection from the base lm_head rows (when
    exit_dim == H), input_proj adding context and state, the RNN reading the token embedding."""
    drafter = RecurrentDrafter(hidden, exit_dim, num_layers, rnn, lm_rows.shape[0], TOP_K_WARP)
    with torch.no_grad():
        for block in drafter.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        if drafter.input_proj is not None and exit_dim == hidden:
            eye = torch.eye(hidden)
            drafter.input_proj.weight.copy_(torch.cat([eye, 0.5 * eye], dim=1))
            nn.init.zeros_(drafter.input_proj.bias)
        if lm_rows.shape[1] == exit_dim:
            drafter.lm_head.weight.copy_(lm_rows)
        if rnn:
            drafter.rnn_w.weight.copy_(torch.eye(hidden))
            nn.init.normal_(drafter.rnn_u.weight, std=0.02)
            nn.init.zeros_(drafter.rnn_u.bias)
    return drafter


def train_drafter(
    feats: dict[str, np.ndarray],
    hf_dir: str | Path,
    settings: TrainSettings = SETTINGS,
    knobs: DrafterKnobs = DrafterKnobs(),
    log=print,
) -> tuple[RecurrentDrafter, dict]:
    """Train on `settings.device`, from the drafter at `settings.init_from` if given; returns (the drafter on the
    CPU in float32, training facts with the per-step `losses`)."""
    s, device, steps = settings, settings.device, knobs.draft_len
    init = load_saved(s.init_from)[0].state_dict() if s.init_from else None  # before seeding, as the RNG runs
    torch.manual_seed(s.seed)
    base = load_base_weights(hf_dir)
    embed, lm_head = base.embed.to(device), base.lm_head
    vocab, hidden = lm_head.shape
    valid = step_targets(feats, steps)
    held = heldout_mask(feats["seq"], s.heldout_frac, s.seed)
    rows = np.nonzero(valid[:, 0] & ~held)[0]
    size = s.draft_vocab_size
    if size:  # at least TOP_K_WARP ids: every drafting step keeps its top 50 and the build allows as many beams
        draft_ids = draft_vocabulary(feats["next_token"][~held], vocab=vocab, max_size=size, min_size=TOP_K_WARP)
    else:
        draft_ids = np.arange(vocab)
    remap = torch.full((vocab,), -1, dtype=torch.long)
    remap[torch.from_numpy(draft_ids)] = torch.arange(len(draft_ids))
    rows_w = lm_head[torch.from_numpy(draft_ids)]
    drafter = init_drafter(hidden, knobs.exit_dim or 2 * hidden, knobs.num_layers, knobs.rnn, rows_w)
    if init is not None:
        drafter.load_state_dict(init)
        log(f"continuing from {s.init_from}")
    drafter.draft_ids = torch.from_numpy(draft_ids).long()
    drafter.to(device).train()
    covered = float(np.isin(feats["next_token"][held], draft_ids).mean()) if held.any() else 1.0
    log(
        f"train rows {len(rows)}, held-out rows {int(held.sum())}, draft vocabulary {len(draft_ids)} (covers "
        f"{covered:.1%} of held-out targets), {steps} steps, device {device}"
    )
    data = (torch.from_numpy(feats["hidden"]), torch.from_numpy(feats["next_token"].astype(np.int64)),
            torch.from_numpy(valid))  # fmt: skip
    weights = [knobs.step_decay**k for k in range(steps)]
    teacher_w, remap = rows_w.to(device), remap.to(device)

    def loss_of(idx):
        return _batch_loss(drafter, *data, idx, embed, teacher_w, remap, weights, knobs.soft_weight, device)

    total = max(1, int(max(1, len(rows) // s.batch) * s.epochs))
    schedule = FittedCosine(s.lr, total, min(s.warmup, total // 10), s.loop_budget())
    result = train_loop(drafter, row_batches(rows, s.batch, np.random.default_rng(s.seed)), loss_of, schedule, device,
                        log_every=s.log_every, log=log)  # fmt: skip
    drafter.eval().float().cpu()
    facts = {**loop_facts(result.steps, result.seconds, s.batch, len(rows), device),
             "draft_vocab_coverage": round(covered, 4)}  # fmt: skip
    return drafter, {**facts, "losses": result.losses}


def _batch_loss(drafter, hidden_all, tokens_all, valid_t, idx, embed, teacher_w, remap, weights, soft_weight,
                device):  # fmt: skip
    n = len(tokens_all)
    context = hidden_all[idx].float().to(device)
    vmask = valid_t[idx].to(device)
    state = torch.zeros_like(context)
    loss = torch.zeros((), device=device)
    for k in range(1, len(weights) + 1):
        m = vmask[:, k - 1]
        if not bool(m.any()):
            break
        inputs = tokens_all[torch.clamp(idx + k - 1, max=n - 1)].to(device)
        target_rows = torch.clamp(idx + k, max=n - 1)
        targets = remap[tokens_all[target_rows].to(device)]
        state = drafter.next_state(embed[inputs], state)
        logp = torch.log_softmax(drafter.logits(context, state), dim=-1)
        with torch.no_grad():
            teacher = torch.softmax(hidden_all[target_rows].float().to(device) @ teacher_w.T, dim=-1)
        soft = -(teacher * logp).sum(-1)
        hard_ok = m & (targets >= 0)
        hard = nn.functional.nll_loss(logp[hard_ok], targets[hard_ok], reduction="sum") / max(1, int(m.sum()))
        loss = loss + weights[k - 1] * ((1 - soft_weight) * hard + soft_weight * soft[m].mean())
    return loss


@torch.no_grad()
def simulate_tau(
    drafter: RecurrentDrafter,
    feats: dict[str, np.ndarray],
    hf_dir: str | Path,
    settings: list[tuple[int, int]],
    rows: np.ndarray | None = None,
    max_rows: int = 2000,
    seed: int = 0,
    chunk: int = 128,
) -> dict[str, float]:
    """Expected tokens per engine step (greedy) of beam search with (beams, draft length) for each setting: from each
    row's context and emitted token, the longest beam prefix that equals the base's continuation, plus the bonus."""
    embed = nn.Embedding.from_pretrained(load_base_weights(hf_dir).embed)
    longest = max(length for _, length in settings)
    valid = step_targets(feats, longest)
    if rows is None:
        rows = np.arange(len(feats["seq"]))
    rows = rows[valid[rows, 0]]
    if len(rows) > max_rows:
        rows = np.sort(np.random.default_rng(seed).choice(rows, max_rows, replace=False))
    tokens = feats["next_token"].astype(np.int64)
    n = len(tokens)
    out = {}
    for beams, length in settings:
        accepted = []
        for s in range(0, len(rows), chunk):
            r = rows[s : s + chunk]
            context = torch.from_numpy(feats["hidden"][r]).float()
            root = torch.from_numpy(tokens[r])
            drafted = beam_search(drafter, context, root, embed, beams, length)[:, :, 1:].numpy()  # [R,M,L]
            truth = tokens[np.minimum(r[:, None] + np.arange(1, length + 1), n - 1)]  # [R,L]
            ok = (drafted == truth[:, None, :]) & valid[r, None, :length]
            accepted.append(np.cumprod(ok, axis=-1).sum(-1).max(-1))
        out[f"{beams}x{length}"] = round(1.0 + float(np.concatenate(accepted).mean()), 4)
    return out


@torch.no_grad()
def step_accuracy(drafter, feats, hf_dir, steps: int, rows=None, max_rows: int = 4000, seed: int = 0) -> list[float]:
    """Teacher-forced top-1 accuracy (full vocabulary) of each drafting step."""
    embed = load_base_weights(hf_dir).embed
    valid = step_targets(feats, steps)
    rows = np.arange(len(feats["seq"])) if rows is None else rows
    rows = rows[valid[rows, 0]]
    if len(rows) > max_rows:
        rows = np.sort(np.random.default_rng(seed).choice(rows, max_rows, replace=False))
    tokens = torch.from_numpy(feats["next_token"].astype(np.int64))
    n = len(tokens)
    idx = torch.from_numpy(rows)
    context = torch.from_numpy(feats["hidden"][rows]).float()
    state = torch.zeros_like(context)
    acc = []
    for k in range(1, steps + 1):
        m = torch.from_numpy(valid[rows, k - 1])
        state = drafter.next_state(embed[tokens[torch.clamp(idx + k - 1, max=n - 1)]], state)
        pred = drafter.to_target(drafter.logits(context, state).argmax(-1))
        hit = pred == tokens[torch.clamp(idx + k, max=n - 1)]
        acc.append(round(float(hit[m].float().mean()) if bool(m.any()) else float("nan"), 4))
    return acc


def save_redrafter(out_dir: str | Path, drafter: RecurrentDrafter, vocab_size: int, extra: dict | None = None) -> Path:
    """apple/ml-recurrent-drafter's layout: config.json (DrafterConfig) + model.safetensors (float16; `draft_vocab`,
    the specbuild extension, when the vocabulary projection covers a draft vocabulary)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = len(drafter.blocks)
    tensors = {}
    if drafter.input_proj is not None:
        tensors["input_proj.weight"] = drafter.input_proj.weight
        tensors["input_proj.bias"] = drafter.input_proj.bias
    for i, block in enumerate(drafter.blocks):
        tensors[f"lm_head.{i}.linear.weight"] = block.weight
        tensors[f"lm_head.{i}.linear.bias"] = block.bias
    tensors[f"lm_head.{n}.weight"] = drafter.lm_head.weight
    if drafter.rnn_u is not None:
        tensors["rnn_u.weight"] = drafter.rnn_u.weight
        tensors["rnn_u.bias"] = drafter.rnn_u.bias
        tensors["rnn_w.weight"] = drafter.rnn_w.weight
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}
    if drafter.draft_ids.numel() and drafter.draft_ids.numel() < vocab_size:
        tensors["draft_vocab"] = drafter.draft_ids.to(torch.int64).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["Drafter"],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab_size,
        "hidden_size": drafter.hidden,
        "exit_dim": drafter.exit_dim,
        "num_draft_layers": n,
        "num_lookback_tokens": -1,
        "rnn": drafter.rnn_u is not None,
        **(extra or {}),
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return out


def load_saved(head_dir: str | Path) -> tuple[RecurrentDrafter, dict]:
    """A drafter written by save_redrafter (for continued training and evaluation)."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(head_dir) / "config.json").read_text())
    raw = load_file(str(Path(head_dir) / "model.safetensors"))
    n = int(cfg["num_draft_layers"])
    rows = int(raw[f"lm_head.{n}.weight"].shape[0])
    drafter = RecurrentDrafter(cfg["hidden_size"], cfg["exit_dim"], n, bool(cfg["rnn"]), rows, TOP_K_WARP)
    state = {}
    for key, value in raw.items():
        if key.startswith("lm_head."):
            parts = key.split(".")
            state["lm_head.weight" if int(parts[1]) == n else f"blocks.{parts[1]}.{parts[3]}"] = value.float()
        elif key != "draft_vocab":
            state[key] = value.float()
    drafter.load_state_dict(state)
    if "draft_vocab" in raw:
        drafter.draft_ids = raw["draft_vocab"].long()
    return drafter, cfg


def train_and_export(cfg: dict, log=print) -> dict:
    t, work, hf = cfg.get("train", {}), Path(cfg["work_dir"]), cfg["base_model"]
    settings = TrainSettings.from_recipe(cfg, SETTINGS, RECIPE_KEYS)
    knobs = read_train(cfg, DrafterKnobs())
    generated, lineage = teacher_forced.recipe_hidden_rows(cfg, log=log)
    feats = generated
    if t.get("mix_text") and (work / "feat_text").is_dir():  # teacher-forced rows over recorded answers
        text = distill.load_features(work / "feat_text")
        feats = {k: np.concatenate([generated[k], text[k]]) for k in generated}
        log(f"mixing in {len(text['seq'])} teacher-forced rows")
    steps = knobs.draft_len
    drafter, facts = train_drafter(feats, hf, settings, knobs, log=log)
    facts.pop("losses")
    # evaluated on held-out generated sequences only (the split by sequence number is the one training used)
    held = np.nonzero(heldout_mask(generated["seq"], settings.heldout_frac, settings.seed))[0]
    shapes = [tuple(int(v) for v in s) for s in (t.get("simulate") or [[5, 5], [4, 4], [3, 4], [2, 3], [1, 4]])]
    metrics = {"training": {**facts, **lineage}, "heldout": {}, "humaneval": {}}
    he = distill.load_features(work / "feat_humaneval") if (work / "feat_humaneval").is_dir() else None
    for name, f, rows in (("heldout", generated, held), ("humaneval", he, None)):
        if f is None:
            continue
        metrics[name]["step_accuracy"] = step_accuracy(drafter, f, hf, steps, rows=rows)
        metrics[name]["tau"] = simulate_tau(drafter, f, hf, shapes, rows=rows)
        log(f"{name}: {json.dumps(metrics[name])}")
    extra = {"base_model": cfg.get("base_model_name", str(hf)), "specbuild_training": metrics}
    if t.get("defaults"):  # the build defaults chosen by measurement (`specbuild bench`), recorded with the drafter
        extra["specbuild_defaults"] = dict(t["defaults"])
    if t.get("note"):
        extra["specbuild_note"] = t["note"]
    save_redrafter(cfg["output_dir"], drafter, int(load_base_weights(hf).lm_head.shape[0]), extra)
    work.mkdir(parents=True, exist_ok=True)
    (work / "redrafter_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def evaluate_heads(heads: list, hf_dir, records: list[dict], device: str = "cpu", log=print) -> list[dict]:
    """Teacher-forced step accuracy and simulated tau (5x5, 4x4, 2x3) of each drafter directory on the final
    hidden states of corpus `records` (held-out ones)."""
    feats = teacher_forced.as_shard_rows(teacher_forced.rows_for(hf_dir, records, None, device, log=log))
    out = []
    for head in heads:
        drafter = load_saved(head)[0]
        out.append({"step_accuracy": step_accuracy(drafter, feats, hf_dir, 5),
                    "tau": simulate_tau(drafter, feats, hf_dir, [(5, 5), (4, 4), (2, 3)])})  # fmt: skip
    return out


def run_redrafter_recipe(cfg: dict, log=print) -> dict:
    """A ReDrafter recipe (`load_recipe`'s dict): data generation (shared with the other heads) or a `corpus_dir`,
    training, evaluation, export."""
    distill.setup_torch()
    if not cfg.get("corpus_dir"):  # a corpus recipe trains on teacher-forced features of its corpus instead
        prepare_data(cfg, log=log)
    return train_and_export(cfg, log=log)
