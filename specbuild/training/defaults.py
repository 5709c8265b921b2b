"""Choosing a mode's default build settings by measurement: acceptance and per-step cost together.

A larger tree (more beams, a deeper draft, more EAGLE nodes) raises tau but costs more per engine call; which one
is fastest depends on the device. `measure_settings` builds one engine per candidate setting (ONNX Runtime graph)
for the trained heads and generates greedily on fresh prompts (none in the training data), interleaved per prompt
like `specbuild bench`, recording tau, engine ms per step and tokens/s; `best` picks the fastest. The recipe
records the winner as the heads' `specbuild_defaults` (what `build` uses when no option is given) with the whole
table as lineage.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from specbuild import engine_format as ef


def measure_settings(
    checkpoint_dir: str | Path,
    mode: str,
    candidates: list[dict],
    prompts: list[list[int]],
    max_new_tokens: int = 96,
    threads: int | None = None,
    max_seq_len: int = 1024,
    log=print,
) -> list[dict]:
    """One row per candidate: {settings, tau, engine_ms_per_step, tokens_per_s} (medians over prompts) and
    same_as_none (prompts whose output equals the `none` engine's), plus a `none` row (the same checkpoint without
    speculation) for the speed-up."""
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.modes.registry import baseline_mode, get_mode
    from specbuild.modes.spec import ENGINE_DRAFTED
    from specbuild.runtime.engine import Engine

    if get_mode(mode).family == ENGINE_DRAFTED:  # a candidate says its heads' weights (else a recorded one would apply)
        candidates = [{"head_weights": ef.FLOAT_HEADS, **c} for c in candidates]
    rows = []
    with tempfile.TemporaryDirectory(prefix="specbuild-choose-") as tmp:
        engines = []
        for i, settings in enumerate([None, *candidates]):
            name = baseline_mode() if settings is None else mode
            options = BuildOptions(backends=("onnxruntime",), speculative_mode=name, max_seq_len=max_seq_len,
                                   **(settings or {}))  # fmt: skip
            t0 = time.time()
            engine_dir = build_engine(checkpoint_dir, Path(tmp) / f"e{i}", options, log=lambda *a: None)
            log(f"built {name} {settings or ''} in {time.time() - t0:.0f}s")
            engines.append((settings, Engine(engine_dir, threads=threads)))
        stats = {i: {"tau": [], "ms": [], "tps": [], "same": 0} for i in range(len(engines))}
        for ids in prompts:
            want = None
            for i, (_, engine) in enumerate(engines):
                r = engine.generate(input_ids=ids, max_new_tokens=max_new_tokens)
                want = r.output_ids if want is None else want
                stats[i]["same"] += r.output_ids == want
                if r.steps:
                    stats[i]["tau"].append(r.mean_accepted_tokens)
                    stats[i]["ms"].append((r.engine_s - r.prefill_engine_s) / r.steps * 1e3)
                    stats[i]["tps"].append(r.decode_tokens_per_s)
        base = statistics.median(stats[0]["tps"])
        for i, (settings, _) in enumerate(engines):
            s = stats[i]
            row = {
                "settings": settings or baseline_mode(),
                "tau": round(statistics.mean(s["tau"]), 3),
                "engine_ms_per_step": round(statistics.median(s["ms"]), 2),
                "tokens_per_s": round(statistics.median(s["tps"]), 1),
            }
            row["speedup"] = round(row["tokens_per_s"] / base, 3)
            row["same_as_none"] = f"{s['same']}/{len(prompts)}"
            rows.append(row)
            log(f"{row}")
    return rows


def best(rows: list[dict]) -> dict | None:
    """The fastest candidate (rows from measure_settings; the `none` row is not a candidate, nor is one whose output
    differed from `none`'s)."""

    def exact(row: dict) -> bool:
        same, _, total = row.get("same_as_none", "1/1").partition("/")
        return same == total

    candidates = [r for r in rows if isinstance(r["settings"], dict) and exact(r)]
    return max(candidates, key=lambda r: r["tokens_per_s"]) if candidates else None


def fresh_prompts(
    base_model: str | Path, work_dir: str | Path, count: int, seed: int = 99, corpus_dir: str | Path | None = None
) -> list:
    """`count` prompt ids no trainer has seen: fresh code, stub and chat prompts (seed `seed`) minus every prompt of
    the recipe's training data (`work_dir`/train.jsonl, and the corpus a corpus recipe trains on), kinds
    interleaved."""
    from transformers import AutoTokenizer

    from specbuild.training import distill
    from specbuild.training.corpus import iter_sequences

    tok = AutoTokenizer.from_pretrained(str(base_model))
    seen = {tuple(r["prompt_ids"]) for r in distill.read_sequences(Path(work_dir) / "train.jsonl")}
    if corpus_dir is not None:
        seen |= {tuple(r["prompt_ids"]) for r in iter_sequences(corpus_dir)}
    fresh = distill.build_prompts(tok, 4 * count, 4 * count, seed=seed, n_stub=4 * count)
    by_kind: dict[str, list] = {}
    for p in fresh:
        if tuple(p["ids"]) not in seen:
            by_kind.setdefault(p["kind"], []).append(p["ids"])
    out: list = []
    while len(out) < count and any(by_kind.values()):
        for kind in sorted(by_kind):
            if by_kind[kind] and len(out) < count:
                out.append(by_kind[kind].pop(0))
    return out


def choose_for_recipe(cfg: dict, mode: str, head_dir: str | Path, log=print) -> dict | None:
    """The recipe's `choose` stage: measure `choose.candidates` (build options of `mode`) with the heads just written
    on fresh prompts, and record the fastest as the heads' `specbuild_defaults` (config.json), with the table."""
    choice = cfg.get("choose")
    if not choice:  # before the builder's imports: a training host may lack them (corpus recipes have no choose)
        return None
    import json

    from specbuild.builder.checkpoint.convert import convert_checkpoint

    data_dir = cfg.get("distill_dir") or cfg["work_dir"]  # where the recipe's training sequences are
    count = int(choice.get("prompts", 12))
    prompts = fresh_prompts(cfg["base_model"], data_dir, count, corpus_dir=cfg.get("corpus_dir"))
    with tempfile.TemporaryDirectory(prefix="specbuild-choose-ckpt-") as tmp:
        ckpt = convert_checkpoint(cfg["base_model"], Path(tmp) / "ckpt", heads={mode: Path(head_dir)}, progress=False)
        rows = measure_settings(
            ckpt, mode, [dict(c) for c in choice["candidates"]], prompts, int(choice.get("max_new_tokens", 96)),
            threads=choice.get("threads"), log=log,
        )  # fmt: skip
    win = best(rows)
    config_file = Path(head_dir) / "config.json"
    head_cfg = json.loads(config_file.read_text())
    by_weights = (head_cfg.get("specbuild_defaults") or {}).get("by_weights")  # choices for other --weights: kept
    head_cfg["specbuild_defaults"] = {**win["settings"], **({"by_weights": by_weights} if by_weights else {})}
    head_cfg["specbuild_choice"] = {
        "how": f"fastest measured setting: {len(prompts)} prompts absent from the training data, "
        f"{choice.get('max_new_tokens', 96)} new "
        "tokens, greedy, ONNX Runtime CPU graph, engines interleaved per prompt",
        "rows": rows,
    }
    config_file.write_text(json.dumps(head_cfg, indent=2) + "\n")
    log(f"chosen defaults: {win['settings']} ({win['tokens_per_s']} tok/s, tau {win['tau']})")
    return {"rows": rows, "chosen": win["settings"]}
