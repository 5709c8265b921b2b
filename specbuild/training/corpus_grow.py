"""Growing a corpus (`corpus`) from a prompt pool (`prompt_pool`) with the base model's own continuations.

`grow` takes the pool's prompts whose key the corpus does not hold yet (a prompt is never repeated), in a random
order from the seed (sources interleaved in proportion), decodes them with `batched_decode.decode_batch` in
length-sorted batches and writes a chunk every `chunk_minutes` and at the end: an interrupted run keeps every
finished chunk, and a second run continues where the corpus stands. `probe_batch_size` times a few decoding steps
at several batch sizes and returns the cheapest per token.
"""

from __future__ import annotations

import datetime
import platform
import random
import subprocess
import time

import torch

from specbuild.errors import SpecbuildError
from specbuild.training import corpus
from specbuild.training.batched_decode import decode_batch

SORT_WINDOW = 8  # batches whose prompts are sorted by length together


def hardware(device: str) -> str:
    """The GPU's name on cuda, else the CPU's model name."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def special_ids(tok) -> tuple[set[int], int]:
    """(end-of-sequence ids, padding id) of a tokenizer."""
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")} - {None}  # as distill's
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return eos, pad


def order_todo(pool: list[dict], done: set[str], batch_size: int, seed: int) -> list[list[dict]]:
    """Batches of the prompts not done: shuffled by `seed`, then sorted by length within windows of batches."""
    todo = [p for p in pool if p["key"] not in done]
    random.Random(seed).shuffle(todo)
    window = batch_size * SORT_WINDOW
    ordered = [p for i in range(0, len(todo), window) for p in sorted(todo[i : i + window], key=_plen)]
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def _plen(p: dict) -> int:
    return len(p["prompt_ids"])


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def grow(
    corpus_dir,
    model,
    tok,
    pool: list[dict],
    minutes: float,
    batch_size: int,
    max_new_tokens: int,
    device: str,
    dtype: str,
    chunk_minutes: float,
    base: dict,
    seed: int = 0,
    temperature: float = 0.0,
    log=print,
) -> dict:
    """Decode unseen pool prompts for `minutes` (no new batch starts once the budget would be passed); returns the
    corpus totals. `base`: {name, sha256} of the model, checked against an existing corpus."""
    if minutes <= 0 or batch_size <= 0 or max_new_tokens <= 0 or chunk_minutes <= 0:
        raise SpecbuildError("minutes, batch size, max new tokens and chunk minutes must be > 0")
    vocab = int(model.config.vocab_size)
    corpus.open_corpus(corpus_dir, base, vocab)
    too_big = [p["key"] for p in pool if p["prompt_ids"] and max(p["prompt_ids"]) >= vocab]
    if too_big:
        raise SpecbuildError(f"{len(too_big)} pool prompts hold ids outside this model's vocabulary ({vocab})")
    batches = order_todo(pool, corpus.corpus_keys(corpus_dir), batch_size, seed)
    log(f"{sum(len(b) for b in batches)} prompts not yet in the corpus, {len(batches)} batches of <= {batch_size}")
    eos, pad = special_ids(tok)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    settings = {
        "dtype": dtype, "greedy": temperature <= 0, "temperature": temperature, "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max((_plen(p) for p in pool), default=0), "seed": seed, "batch_size": batch_size,
    }  # fmt: skip
    info = {"settings": settings, "hardware": hardware(device)}
    t_start = time.time()
    pending: list[dict] = []
    t_chunk, last_batch_s, done_tokens = time.time(), 0.0, 0
    for n, batch in enumerate(batches):
        if time.time() - t_start + last_batch_s > minutes * 60:
            log(f"time budget reached after {n} of {len(batches)} batches")
            break
        tb = time.time()
        prompts = [p["prompt_ids"] for p in batch]
        gens = decode_batch(model, prompts, max_new_tokens, eos, pad, (), 1, temperature, generator, False).gens
        _sync(device)
        last_batch_s = time.time() - tb
        new = sum(len(g) for g in gens)
        done_tokens += new
        pending += [{**p, "gen_ids": g} for p, g in zip(batch, gens)]
        log(f"batch {n + 1}/{len(batches)}: {len(batch)} prompts, {new} tokens in {last_batch_s:.1f}s "
            f"({new / last_batch_s:.0f} tok/s; run {done_tokens / (time.time() - t_start):.0f} tok/s)")  # fmt: skip
        if time.time() - t_chunk >= chunk_minutes * 60:
            _flush(corpus_dir, pending, info, t_chunk, log)
            pending, t_chunk = [], time.time()
    if pending:
        _flush(corpus_dir, pending, info, t_chunk, log)
    return corpus.totals(corpus_dir)


def _flush(corpus_dir, records: list[dict], info: dict, t_chunk: float, log) -> None:
    seconds = time.time() - t_chunk
    gen = sum(len(r["gen_ids"]) for r in records)
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    extra = {"seconds": round(seconds, 1), "tokens_per_s": round(gen / max(seconds, 1e-9), 1), "created": created}
    entry = corpus.append_chunk(corpus_dir, records, {**info, **extra})
    log(f"wrote {entry['file']}: {entry['sequences']} sequences, {gen} generated tokens, {extra['tokens_per_s']} tok/s")


def probe_batch_size(model, tok, pool: list[dict], device: str, sizes=(256, 512, 1024), steps: int = 3, log=print):
    """The batch size of `sizes` with the cheapest decoding step per sequence: each is timed as the difference of
    decoding 1 + `steps` and 1 token for prompts of the pool's median length (the prefill cancels out)."""
    eos, pad = special_ids(tok)
    lens = sorted(_plen(p) for p in pool)
    median = lens[len(lens) // 2]
    prompts = [p["prompt_ids"] for p in pool if _plen(p) == median]
    best, best_cost = sizes[0], float("inf")
    for size in sizes:
        batch = [prompts[i % len(prompts)] for i in range(size)]
        try:
            times = []
            for new in (1, 1, 1 + steps):  # the first call warms up
                _sync(device)
                t = time.time()
                decode_batch(model, batch, new, set(), pad, keep_features=False)
                _sync(device)
                times.append(time.time() - t)
        except torch.OutOfMemoryError:
            log(f"probe: batch {size} does not fit")
            break
        cost = max(times[2] - times[1], 1e-9) / steps / size
        log(f"probe: batch {size}: {1 / cost:.0f} tok/s per step ({median}-token prompts)")
        if cost < best_cost:
            best, best_cost = size, cost
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return best
