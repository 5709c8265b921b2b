"""Teacher-forced features from a corpus (`corpus`): the frozen base model's forward over each sequence (prompt +
generated ids) gives, in memory and on the training device, the rows the data stage captures during generation --
the final normed hidden state (EAGLE-1/2, Medusa, ReDrafter) or the decoder-layer inputs a mode declares (EAGLE-3's
`features.LayerFeatures`) -- so that every head trains from token ids alone.

Rows of a sequence are those of distill's shards: positions p = P - min(PROMPT_TAIL, P) .. n - 2 of its n ids
(prompt length P), with `token` x_{p+1}, `seq` (the sequence number of its corpus key, `distill._seq_no`), `pos` p
and `gen_offset` p - (P - 1). Sequences are padded on the right: attention is causal, so padding never reaches a
real position and no mask is needed.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from specbuild.training import corpus, distill
from specbuild.training.features import LayerFeatures
from specbuild.training.heldout import heldout_mask


def corpus_records(
    corpus_dir: str | Path, max_sequences: int | None = None, heldout_only: bool = False, heldout_frac: float = 0.05
) -> list[dict]:
    """Sequences {id, kind, prompt_ids, gen_ids} with >= 2 generated ids, in corpus order: the first
    `max_sequences`, or the first `max_sequences` of the held-out split every trainer uses (`heldout_only`)."""
    out = []
    for r in corpus.iter_sequences(corpus_dir):
        if len(r["gen_ids"]) < 2:
            continue
        if heldout_only and not heldout_mask(np.array([distill._seq_no(r["id"])]), heldout_frac)[0]:
            continue
        out.append(r)
        if max_sequences is not None and len(out) >= max_sequences:
            break
    return out


def load_base(hf_dir: str | Path, device: str, dtype: str, decl: LayerFeatures | None = None):
    """(the base model in eval mode, the captured layer indices or None) for `teacher_forced_rows`: with the layer
    features a mode declares, the model is cut after the last captured layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=distill.DTYPES[dtype]).to(device).eval()
    if decl is None:
        return model, None
    layers = tuple(decl.layers(model.config.num_hidden_layers))
    model.model.layers = model.model.layers[: max(layers) + 1]
    model.model.norm = torch.nn.Identity()
    return model, layers


def _row_index(records: list[dict]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(first row of each record [n+1], the token / seq / pos / gen_offset columns of all rows)."""
    starts, cols = [0], {"token": [], "seq": [], "pos": [], "gen_offset": []}
    for r in records:
        full, plen = r["prompt_ids"] + r["gen_ids"], len(r["prompt_ids"])
        p = np.arange(plen - min(distill.PROMPT_TAIL, plen), len(full) - 1)
        cols["token"].append(np.asarray(full[p[0] + 1 :], dtype=np.int32))
        cols["seq"].append(np.full(len(p), distill._seq_no(r["id"]), dtype=np.int32))
        cols["pos"].append(p.astype(np.int32))
        cols["gen_offset"].append((p - (plen - 1)).astype(np.int32))
        starts.append(starts[-1] + len(p))
    return np.asarray(starts, dtype=np.int64), {k: np.concatenate(v) for k, v in cols.items()}


def _batches(records: list[dict], batch_tokens: int) -> list[list[int]]:
    """Record indices sorted by length, cut so that a batch's padded size stays within `batch_tokens`."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt_ids"]) + len(records[i]["gen_ids"]))
    out, cur = [], []
    for i in order:
        n = len(records[i]["prompt_ids"]) + len(records[i]["gen_ids"])
        if cur and (len(cur) + 1) * n > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + [cur] if cur else out


@torch.inference_mode()
def teacher_forced_rows(
    model, records: list[dict], layers: tuple[int, ...] | None = None, batch_tokens: int = 4096, log=print
) -> dict[str, np.ndarray]:
    """`feat` [N, F] float16 -- the final normed hidden state (`layers` None) or the inputs of decoder layers
    `layers` (HF hidden_states[i]) side by side -- and `token`, `seq`, `pos`, `gen_offset` [N] of every row of
    `records` (grouped by record, in their order). `model` comes from `load_base` (the same `layers`)."""
    starts, cols = _row_index(records)
    device = model.model.embed_tokens.weight.device
    captured: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_pre_hook(_capture(captured, i), with_kwargs=True)
             for i in sorted(set(layers or ()))]  # fmt: skip
    width = model.config.hidden_size * (len(layers) if layers else 1)
    feat = np.empty((int(starts[-1]), width), dtype=np.float16)
    t0, done = time.time(), 0
    try:
        for batch in _batches(records, batch_tokens):
            fulls = [records[i]["prompt_ids"] + records[i]["gen_ids"] for i in batch]
            length = max(len(f) for f in fulls)
            ids = torch.zeros((len(batch), length), dtype=torch.long)
            for b, f in enumerate(fulls):
                ids[b, : len(f)] = torch.tensor(f)
            captured.clear()
            out = model.model(input_ids=ids.to(device), use_cache=False).last_hidden_state
            x = torch.cat([captured[i] for i in layers], dim=-1) if layers else out
            src, dst = _gather_index(records, batch, starts, length)
            feat[dst] = x.reshape(-1, width)[torch.from_numpy(src).to(device)].to(torch.float16).cpu().numpy()
            done += len(dst)
    finally:
        for h in hooks:
            h.remove()
    seconds = time.time() - t0
    rate = done / max(seconds, 1e-9)
    log(f"teacher-forced features: {len(records)} sequences, {done} rows, {seconds:.1f}s, {rate:.0f} rows/s")
    return {"feat": feat, **cols}


def _capture(captured: dict, index: int):
    def hook(module, args, kwargs):
        captured[index] = args[0] if args else kwargs["hidden_states"]

    return hook


def _gather_index(records, batch, starts, length) -> tuple[np.ndarray, np.ndarray]:
    """(flat [b * length + p] positions in the padded batch, their output rows) of the batch's rows."""
    src, dst = [], []
    for b, i in enumerate(batch):
        plen = len(records[i]["prompt_ids"])
        n = plen + len(records[i]["gen_ids"])
        p = np.arange(plen - min(distill.PROMPT_TAIL, plen), n - 1)
        src.append(b * length + p)
        dst.append(np.arange(starts[i], starts[i + 1]))
    return np.concatenate(src), np.concatenate(dst)


def as_shard_rows(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rows under distill's final-hidden shard keys (hidden, next_token, seq, gen_offset), as Medusa and
    ReDrafter read them (no copy)."""
    return {"hidden": rows["feat"], "next_token": rows["token"], "seq": rows["seq"], "gen_offset": rows["gen_offset"]}


def prompt_lengths(records: list[dict]) -> dict[int, int]:
    """Sequence number -> prompt length."""
    return {distill._seq_no(r["id"]): len(r["prompt_ids"]) for r in records}


def rows_for(
    hf_dir, records: list[dict], decl: LayerFeatures | None, device: str, dtype: str | None = None,
    batch_tokens: int | None = None, log=print,
) -> dict[str, np.ndarray]:  # fmt: skip
    """`teacher_forced_rows` of `records` with the base model at `hf_dir` on `device`, loaded for this call only;
    dtype defaults to bfloat16 on cuda (the corpus's decoding precision) and float32 on cpu, batch_tokens (per
    forward) to 65536 on cuda and 4096 on cpu."""
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    model, layers = load_base(hf_dir, device, dtype, decl)
    rows = teacher_forced_rows(model, records, layers, batch_tokens or (65536 if device == "cuda" else 4096), log=log)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def from_recipe(cfg: dict, decl: LayerFeatures | None = None, log=print) -> tuple[dict, list[dict], dict]:
    """(rows, records, lineage) of a recipe's `corpus_dir` on its device, for the final normed hidden state (`decl`
    None) or the layer features `decl`. Options under `corpus`: max_sequences (default all), batch_tokens and
    dtype (see `rows_for`)."""
    c, device = cfg.get("corpus") or {}, cfg["device"]
    dtype = c.get("dtype") or ("bfloat16" if device == "cuda" else "float32")
    records = corpus_records(cfg["corpus_dir"], c.get("max_sequences"))
    t0 = time.time()
    rows = rows_for(cfg["base_model"], records, decl, device, dtype, c.get("batch_tokens"), log=log)
    lineage = {
        "corpus": Path(cfg["corpus_dir"]).name,
        "corpus_sequences": len(records),
        "corpus_generated_tokens": sum(len(r["gen_ids"]) for r in records),
        "feature_rows": len(rows["seq"]),
        "features": f"teacher-forced, {dtype} on {device}, {time.time() - t0:.0f}s",
    }
    return rows, records, lineage


def recipe_hidden_rows(cfg: dict, log=print) -> tuple[dict[str, np.ndarray], dict]:
    """(final-hidden rows under distill's shard keys, lineage) of a Medusa or ReDrafter recipe: teacher-forced from
    its `corpus_dir`, or the data stage's shards (`work_dir`/feat_train)."""
    if cfg.get("corpus_dir"):
        rows, _, lineage = from_recipe(cfg, None, log=log)
        return as_shard_rows(rows), lineage
    return distill.load_features(Path(cfg["work_dir"]) / "feat_train"), {}


def loop_facts(steps: int, seconds: float, rows_per_step: int, train_rows: int, device: str) -> dict:
    """What a row-batch trainer (Medusa, ReDrafter) records about its loop: steps, time, epochs, rows/s, hardware."""
    from specbuild.training.corpus_grow import hardware

    return {
        "optimizer_steps": steps,
        "train_s": round(seconds, 1),
        "epochs": round(steps * min(rows_per_step, train_rows) / max(train_rows, 1), 2),
        "train_rows": int(train_rows),
        "rows_per_s": round(steps * min(rows_per_step, train_rows) / max(seconds, 1e-9)),
        "device": device,
        "hardware": hardware(device),
    }
