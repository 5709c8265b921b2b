"""Training of the draft-target mode's draft model (`specbuild train --recipe`, `kind: draft-target`): a shallow
Llama cut from the base model, self-distilled on a corpus of the base model's own greedy continuations.

The draft is the base model's configuration with `train.num_layers` decoder layers, initialised from the base
layers `train.init_layers` and the base final norm; the token embedding is the base model's, frozen and tied to the
lm_head, and is left out of the written checkpoint (config.json: `"specbuild": {"embeddings": "target"}`), so
convert takes it from the target. Loss: next-token cross-entropy on the generated positions only (hard labels: the
base model's greedy tokens), with the softmax over the first `train.vocab_size` ids of the draft vocabulary (the
training targets, most frequent first, written as draft_vocab.json) and a few random ids outside them (so that a
draft projecting onto more ids stays sound); targets outside the subset are left out of the loss.

Evaluation on a fixed held-out split of sequences (`heldout.heldout_mask`, never trained on): loss and top-1
accuracy before and after training, and the chain estimate: from held-out positions, how many of the draft's own
greedy tokens (fed back autoregressively) match the base model's, for chains of k = 1..chain_len tokens, which
predicts the tokens accepted per step of a k-token draft chain (greedy).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from specbuild.errors import SpecbuildError
from specbuild.fsutil import OutputTarget, atomic_output_dir, prepare_output_dir
from specbuild.plugins.draft_target import DRAFT_VOCAB_FILE, EMBEDDINGS_FROM_TARGET
from specbuild.training import corpus, distill
from specbuild.training.heldout import heldout_mask
from specbuild.training.loop import ProgressCosine, train_loop
from specbuild.training.settings import TrainSettings, read_train
from specbuild.training.vocab import frequent_targets

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")  # fmt: skip
# The draft model's defaults of what every trainer shares (the other trainers' differ); its batch is in padded tokens
# (`train.batch_tokens`), its draft vocabulary's cap is the loss's softmax (`train.vocab_size`: the first that many ids
# of draft_vocab.json), and it logs by time (log_every_s), not by steps.
SETTINGS = TrainSettings(epochs=1.0, lr=2e-3, batch=4096, warmup=30, time_budget_s=1800.0, log_every=10**9,
                         draft_vocab_size=8192)  # fmt: skip
RECIPE_KEYS = {"batch": "batch_tokens", "draft_vocab_size": "vocab_size"}


@dataclasses.dataclass(frozen=True)
class DraftModelKnobs:
    """The draft model's own training knobs (`train:` keys of the same names)."""

    num_layers: int = 2
    init_layers: tuple[int, ...] = (0, 1)  # the base layers the draft's layers start from
    negatives: int = 1024  # ids from outside the subset added to each step's softmax (0: the subset alone)
    seq_len: int = 384  # tokens per sequence: the generated ones and the prompt's tail
    eval_sequences: int = 300  # held-out sequences for loss, accuracy and the chain estimate
    chain_len: int = 5
    cpu_dtype: str = "float32"  # float32 or bfloat16 (autocast) on the CPU; cuda always runs bf16 autocast
    log_every_s: float = 30.0  # a progress line at most this often


# ----------------------------------------------------------------------------------------------- data


def read_corpus(corpus_dir, seq_len: int, max_sequences: int | None = None) -> list[dict]:
    """The corpus's sequences with >= 2 generated ids as {seq (sequence number), ids int32 [n], gen_start}: cut to
    `seq_len` tokens by dropping the head of the prompt (at least one prompt token stays), then the end of the
    generation; ids[gen_start:] are the generated ones."""
    out = []
    for r in corpus.iter_sequences(corpus_dir):
        plen, gen = len(r["prompt_ids"]), r["gen_ids"]
        if len(gen) < 2 or plen < 1:
            continue
        start = min(max(0, plen + len(gen) - seq_len), plen - 1)
        ids = np.asarray((r["prompt_ids"] + gen)[start : start + seq_len], dtype=np.int32)
        out.append({"seq": distill._seq_no(r["id"]), "ids": ids, "gen_start": plen - start})
        if max_sequences is not None and len(out) >= max_sequences:
            break
    return out


def draft_vocabulary(seqs: list[dict], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, counts) of the training targets (generated ids) seen at least twice, most frequent first, ties
    by id."""
    targets = np.concatenate([s["ids"][s["gen_start"] :] for s in seqs]) if seqs else np.zeros(0, np.int32)
    return frequent_targets(targets, vocab)


def make_batch(seqs: list[dict]) -> dict[str, torch.Tensor]:
    """`ids` [B, L] (right-padded with 0: attention is causal, padding never reaches a real position) and `labels`
    [B, L]: the generated id that position predicts, -1 where there is none."""
    length = max(len(s["ids"]) for s in seqs)
    ids = torch.zeros((len(seqs), length), dtype=torch.long)
    labels = torch.full((len(seqs), length), -1, dtype=torch.long)
    for b, s in enumerate(seqs):
        t = torch.from_numpy(s["ids"].astype(np.int64))
        ids[b, : len(t)] = t
        labels[b, s["gen_start"] - 1 : len(t) - 1] = t[s["gen_start"] :]
    return {"ids": ids, "labels": labels, "tokens": sum(len(s["ids"]) for s in seqs)}


def length_batches(seqs: list[dict], batch_tokens: int, rng, window: int = 256):
    """Endless batches of whole sequences (epoch after epoch, reshuffled by numpy Generator `rng`): shuffled,
    sorted by length within windows of `window` sequences and cut so that a batch's padded size stays within
    `batch_tokens`; the batches of an epoch in random order."""
    while True:
        order = rng.permutation(len(seqs))
        groups, cur, width = [], [], 0
        for w in range(0, len(order), window):
            for i in sorted(order[w : w + window], key=lambda i: len(seqs[i]["ids"])):
                n = len(seqs[i]["ids"])
                if cur and (len(cur) + 1) * max(width, n) > batch_tokens:
                    groups.append(cur)
                    cur, width = [], 0
                cur.append(seqs[i])
                width = max(width, n)
        groups += [cur] if cur else []
        for g in rng.permutation(len(groups)):
            yield make_batch(groups[g])


# ----------------------------------------------------------------------------------------------- the model


def build_draft(hf_dir, num_layers: int, init_layers: list[int]):
    """The draft LlamaForCausalLM (float32, train mode): the base config with `num_layers` layers, layer i copied
    from base layer init_layers[i], the base final norm, the base embedding frozen (tied to the lm_head)."""
    from safetensors import safe_open
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(str(hf_dir))
    if config.model_type != "llama" or not config.tie_word_embeddings:
        raise SpecbuildError(f"{hf_dir}: draft-target training needs a Llama base model with tied embeddings")
    if len(init_layers) != num_layers or not all(0 <= i < config.num_hidden_layers for i in init_layers):
        raise SpecbuildError(f"train.init_layers {init_layers}: {num_layers} base layer indices expected")
    config.num_hidden_layers = num_layers
    model = LlamaForCausalLM(config)
    state = {}
    with safe_open(str(Path(hf_dir) / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            parts = name.split(".")
            if name in ("model.embed_tokens.weight", "model.norm.weight"):
                state[name] = f.get_tensor(name).float()
            elif name.startswith("model.layers.") and int(parts[2]) in init_layers:
                for i in (i for i, src in enumerate(init_layers) if src == int(parts[2])):
                    state[".".join([*parts[:2], str(i), *parts[3:]])] = f.get_tensor(name).float()
    missing, _ = model.load_state_dict(state, strict=False)
    if set(missing) - {"lm_head.weight"}:
        raise SpecbuildError(f"{hf_dir}: base tensors missing for the draft: {sorted(missing)[:3]}")
    model.tie_weights()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model.float().train()


def lm_rows(model, vocab_ids: torch.Tensor) -> torch.Tensor:
    """The tied lm_head's rows of the ids `vocab_ids` (frozen: the logits over those ids are hidden @ rows.T)."""
    return model.model.embed_tokens.weight[vocab_ids.to(model.device)].detach()


# ----------------------------------------------------------------------------------------------- training


def make_loss_fn(model, subset: torch.Tensor, knobs: DraftModelKnobs, device: str, stats: dict):
    """Cross-entropy over the `subset` ids, plus knobs.negatives ids drawn from outside it per step (so that the
    logits of the ids the loss never targets stay low), at the batch's generated positions whose target is in the
    subset; counts tokens, targets and covered targets into `stats` and keeps the losses there."""
    remap = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    remap[subset] = torch.arange(len(subset))
    rows, rest = lm_rows(model, subset), torch.nonzero(remap < 0)[:, 0]
    n_neg, cpu_bf16 = min(knobs.negatives, len(rest)), knobs.cpu_dtype == "bfloat16"

    def loss_of(batch) -> torch.Tensor:
        labels = batch["labels"]
        sel = labels >= 0
        target = remap[labels[sel]]
        stats["tokens"] += batch["tokens"]
        stats["targets"] += int(sel.sum())
        stats["covered"] += int((target >= 0).sum())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_bf16 and device == "cpu"):
            hidden = model.model(input_ids=batch["ids"].to(device), use_cache=False).last_hidden_state
            negatives = lm_rows(model, rest[torch.randperm(len(rest))[:n_neg]])
            logits = hidden[sel.to(device)] @ torch.cat([rows, negatives]).T
        loss = torch.nn.functional.cross_entropy(logits.float(), target.to(device), ignore_index=-1)
        stats["losses"].append(loss.detach())
        return loss

    return loss_of


def progress_logger(stats: dict, every_s: float, log):
    """An `every` callback of train_loop: a line with step, mean loss and tokens/s at most every `every_s`."""
    t0 = last = time.time()
    seen = {"tokens": 0}

    def after(step: int) -> None:
        nonlocal last
        now = time.time()
        if now - last < every_s:
            return
        rate = (stats["tokens"] - seen["tokens"]) / (now - last)
        cover = stats["covered"] / max(1, stats["targets"])
        loss = float(torch.stack(stats["losses"][-20:]).mean())
        log(f"step {step}: {stats['tokens']} tokens, {stats['targets']} targets ({cover:.1%} in the subset), "
            f"{rate:.0f} tokens/s, loss {loss:.4f} (last 20 steps), {now - t0:.0f}s")  # fmt: skip
        seen["tokens"], last = stats["tokens"], now

    return after


def train_draft(model, train_seqs: list[dict], subset: torch.Tensor, settings: TrainSettings, knobs: DraftModelKnobs,
                log=print):  # fmt: skip
    """Train the draft's layers and final norm on `settings.device` (AdamW, warm-up + cosine over the time budget);
    returns the loop's result and the token counts."""
    s, device = settings, settings.device
    stats = {"tokens": 0, "targets": 0, "covered": 0, "losses": []}
    loss_fn = make_loss_fn(model, subset, knobs, device, stats)
    per_epoch = max(1, sum(len(q["ids"]) for q in train_seqs) // s.batch)
    total = max(1, int(per_epoch * s.epochs))
    schedule = ProgressCosine(s.lr, total, min(s.warmup, total // 10), s.loop_budget())
    batches = length_batches(train_seqs, s.batch, np.random.default_rng(s.seed))
    log(f"training {total} steps at most, time budget {schedule.time_budget_s:.0f}s, on {device}")
    result = train_loop(model, batches, loss_fn, schedule, device, grad_clip=1.0, log_every=s.log_every, log=log,
                        every=(1, progress_logger(stats, knobs.log_every_s, log)))  # fmt: skip
    return result, {k: v for k, v in stats.items() if k != "losses"}


# ----------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, seqs: list[dict], subset: torch.Tensor, device: str, chain_len: int, batch_tokens: int = 2048):
    """Held-out loss and top-1 accuracy at every generated position of `seqs`, over the whole vocabulary and
    restricted to `subset` (a target outside it is a miss; the subset loss averages the targets inside it), and
    the chain estimates of both (`chain_estimate`)."""
    model.eval()
    sums = {"targets": 0, "covered": 0, "loss_full": 0.0, "loss_subset": 0.0}
    hits: dict[str, list[np.ndarray]] = {"full": [], "subset": []}
    in_subset = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=device)
    in_subset[subset.to(device)] = True
    subset_sorted = torch.sort(subset).values.to(device)
    remap = torch.cumsum(in_subset.long(), 0) - 1  # id -> its index in subset_sorted
    for group in _groups(seqs, batch_tokens):
        batch = make_batch(group)
        sel = batch["labels"] >= 0
        target = batch["labels"][sel].to(device)
        hidden = model.model(input_ids=batch["ids"].to(device), use_cache=False).last_hidden_state[sel.to(device)]
        logits = (hidden @ model.model.embed_tokens.weight.T).float()
        sub, inside = logits[:, subset_sorted], in_subset[target]
        sums["loss_full"] += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        if inside.any():
            tgt = remap[target[inside]]
            sums["loss_subset"] += float(torch.nn.functional.cross_entropy(sub[inside], tgt, reduction="sum"))
        sums["targets"], sums["covered"] = sums["targets"] + len(target), sums["covered"] + int(inside.sum())
        per_seq = sel.sum(1).tolist()
        hits["full"] += np.split((logits.argmax(-1) == target).cpu().numpy(), np.cumsum(per_seq)[:-1])
        hits["subset"] += np.split((subset_sorted[sub.argmax(-1)] == target).cpu().numpy(), np.cumsum(per_seq)[:-1])
    model.train()
    n = max(sums["targets"], 1)
    return {"targets": sums["targets"], "subset_coverage": round(sums["covered"] / n, 4),
            "loss_full": round(sums["loss_full"] / n, 4),
            "loss_subset": round(sums["loss_subset"] / max(sums["covered"], 1), 4),
            **{f"top1_{k}": round(float(np.concatenate(h).mean()), 4) if h else 0.0 for k, h in hits.items()},
            **{f"chain_{k}": chain_estimate(h, chain_len) for k, h in hits.items()}}  # fmt: skip


def _groups(seqs: list[dict], batch_tokens: int) -> list[list[dict]]:
    """`seqs` in order, cut so that a group's padded size stays within `batch_tokens`."""
    out, cur, width = [], [], 0
    for s in seqs:
        if cur and (len(cur) + 1) * max(width, len(s["ids"])) > batch_tokens:
            out.append(cur)
            cur, width = [], 0
        cur.append(s)
        width = max(width, len(s["ids"]))
    return out + [cur] if cur else out


def chain_estimate(hits: list[np.ndarray], chain_len: int) -> dict[str, float]:
    """For k = 1..chain_len, the mean number of leading tokens of a k-token greedy draft chain that equal the
    corpus's (the base model's greedy) tokens, from every generated position with chain_len targets left.

    `hits` holds per sequence whether the teacher-forced top-1 prediction at each generated position is right. A
    chain fed its own predictions sees the corpus tokens for as long as they match, so its leading matches from
    position j are exactly the run of consecutive hits starting at j (no autoregressive decoding needed)."""
    runs = []
    for h in hits:
        run = np.zeros(len(h) + 1, dtype=np.int64)
        for j in range(len(h) - 1, -1, -1):
            run[j] = (run[j + 1] + 1) if h[j] else 0
        runs.append(run[: max(0, len(h) - chain_len + 1)])
    lead = np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)
    if not len(lead):
        return {}
    return {str(k): round(float(np.minimum(lead, k).mean()), 4) for k in range(1, chain_len + 1)}


# ----------------------------------------------------------------------------------------------- export


def write_draft(out_dir: str | Path | OutputTarget, model, hf_dir, vocab: tuple, lineage: dict) -> Path:
    """The draft directory, atomically: config.json (the base's with the draft's layer count and a `specbuild`
    key), model.safetensors (bfloat16, no embedding and no lm_head), draft_vocab.json and the base's tokenizer."""
    from safetensors.torch import save_file

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    config["num_hidden_layers"] = model.config.num_hidden_layers
    config["dtype"] = "bfloat16"
    config["specbuild"] = {"embeddings": EMBEDDINGS_FROM_TARGET, "draft_vocab": DRAFT_VOCAB_FILE, "lineage": lineage}
    tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()
               if k not in ("model.embed_tokens.weight", "lm_head.weight")}  # fmt: skip
    with atomic_output_dir(out_dir, overwrite=True, mark=True) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors creates it 0600
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        ids, counts = vocab
        text = json.dumps({"token_ids": ids.tolist(), "counts": counts.tolist()}, separators=(",", ":"))
        (tmp / DRAFT_VOCAB_FILE).write_text(text + "\n")
        for name in TOKENIZER_FILES:
            if (Path(hf_dir) / name).is_file():
                shutil.copyfile(Path(hf_dir) / name, tmp / name)
    return out_dir.path if isinstance(out_dir, OutputTarget) else Path(out_dir)


def lineage_of(cfg: dict, settings: TrainSettings, knobs: DraftModelKnobs, counts: dict, result, initial: dict,
               final: dict) -> dict:  # fmt: skip
    """What the draft records about its training (config.json's specbuild.lineage)."""
    from specbuild.training.corpus_grow import hardware

    device = settings.device
    return {
        "base_model": cfg.get("base_model_name", str(cfg["base_model"])),
        "corpus": str(cfg["corpus_dir"]),
        **counts,
        "optimizer_steps": result.steps,
        "train_s": round(result.seconds, 1),
        "tokens_per_s": round(counts["train_tokens_seen"] / max(result.seconds, 1e-9)),
        "targets_per_s": round(counts["train_targets_seen"] / max(result.seconds, 1e-9)),
        "epochs": round(counts["train_tokens_seen"] / max(counts["train_split_tokens"], 1), 3),
        "device": device,
        "hardware": hardware(device),
        "precision": "bf16 autocast" if device == "cuda" or knobs.cpu_dtype == "bfloat16" else "float32",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "init": f"base layers {list(knobs.init_layers)} and final norm; embedding frozen, tied (the target's)",
        "settings": {
            "num_layers": knobs.num_layers,
            "vocab_size": settings.draft_vocab_size,
            "negatives": knobs.negatives,
            "seq_len": knobs.seq_len,
            "batch_tokens": settings.batch,
            "lr": settings.lr,
            "heldout_frac": settings.heldout_frac,
        },
        "heldout_initial": initial,
        "heldout_final": final,
    }


def run_draft_recipe(cfg: dict, log=print) -> dict:
    """A draft-target recipe (`load_recipe`'s dict): read the corpus, split off the held-out sequences, train the
    draft, evaluate it before and after, write the draft directory to `output_dir` and the metrics to
    `work_dir`/metrics-draft-target.json; returns the metrics (the lineage the config records)."""
    if not cfg.get("corpus_dir"):
        raise SpecbuildError("a draft-target recipe trains on a corpus: it needs `corpus_dir` (or --corpus-dir)")
    settings = TrainSettings.from_recipe(cfg, SETTINGS, RECIPE_KEYS)
    knobs, device, hf = read_train(cfg, DraftModelKnobs()), settings.device, cfg["base_model"]
    target = prepare_output_dir(cfg["output_dir"], overwrite=True, inputs=[hf, cfg["corpus_dir"]])  # before training
    distill.setup_torch()
    torch.manual_seed(settings.seed)
    seqs = read_corpus(cfg["corpus_dir"], knobs.seq_len, (cfg.get("corpus") or {}).get("max_sequences"))
    held_mask = heldout_mask(np.array([s["seq"] for s in seqs]), settings.heldout_frac)
    train = [s for s, h in zip(seqs, held_mask) if not h]
    held = [s for s, h in zip(seqs, held_mask) if h]
    model = build_draft(hf, knobs.num_layers, list(knobs.init_layers)).to(device)
    vocab = draft_vocabulary(train, model.config.vocab_size)
    subset = torch.from_numpy(vocab[0][: settings.draft_vocab_size].astype(np.int64))
    log(f"{len(train)} training and {len(held)} held-out sequences; draft vocabulary {len(vocab[0])}, "
        f"trained on its first {len(subset)}")  # fmt: skip
    evaluation = held[: knobs.eval_sequences]
    initial = evaluate(model, evaluation, subset, device, knobs.chain_len) if held else {}
    log(f"held-out before training: {json.dumps(initial)}")
    result, stats = train_draft(model, train, subset, settings, knobs, log=log)
    final = evaluate(model, evaluation, subset, device, knobs.chain_len) if held else {}
    log(f"held-out after training: {json.dumps(final)}")
    counts = {
        "corpus_sequences": len(seqs),
        "train_sequences": len(train),
        "train_split_tokens": sum(len(s["ids"]) for s in train),
        "heldout_sequences": len(held),
        "eval_sequences": len(evaluation),
        "train_tokens_seen": stats["tokens"],
        "train_targets_seen": stats["targets"],
        "train_subset_coverage": round(stats["covered"] / max(stats["targets"], 1), 4),
        "draft_vocab_len": int(len(vocab[0])),
        "first_loss": round(result.losses[0], 4) if result.losses else None,
        "last_loss": round(float(np.mean(result.losses[-20:])), 4) if result.losses else None,
    }
    metrics = lineage_of(cfg, settings, knobs, counts, result, initial, final)
    write_draft(target, model, hf, vocab, metrics)
    work = Path(cfg["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    (work / "metrics-draft-target.json").write_text(json.dumps(metrics, indent=1) + "\n")
    log(f"draft written to {cfg['output_dir']}")
    return metrics
