#!/usr/bin/env python
"""Measure drafting settings on this machine: tau, verified rows per step and decode tokens/s of each engine and
per-request drafting options against `none`, greedy, on fresh prompts (code, chat, stubs; never HumanEval or
MT-Bench), interleaved per prompt. One engine built at the largest setting serves every smaller one (per-request
drafting options, Drafter.narrowed); every output is checked against `none`'s.

    scripts/sweep-drafting.py --none e/none --hf-dir hf --prompts 16 --seed 98 e/ngram \\
        e/la-max@window=1,ngram=3,guesses=1,pool=context,lookup=10 e/dt-tree@depth=2,top_k=1 e/dt-tree@top_k=2

Needs `specbuild[build]` (the fresh prompts come from the training prompt builders)."""

import argparse

import numpy as np

from specbuild.runtime.engine import Engine, SamplingParams
from specbuild.runtime.scheduler import Request
from specbuild.training.defaults import fresh_prompts


def run(engine, ids, new_tokens, options=None):
    """(output ids, decode tok/s, accepted per step, verified rows per step) of one greedy request."""
    handle = engine.scheduler.submit(Request(list(ids), new_tokens, SamplingParams(), draft_options=options))
    handle.wait()
    result = engine.result(handle, decode_text=False)
    tps = (len(result.output_ids) - 1) / (result.total_s - result.ttft_s)
    return result.output_ids, tps, result.accepted_per_step, [d + 1 for d in handle.drafted_per_step]


def summary(rows, base) -> str:
    accepted = [a for r in rows for a in r[1]]
    verified = [x for r in rows for x in r[2]]
    tps = float(np.mean([r[0] for r in rows]))
    return (
        f"tau {np.mean(accepted):.3f}  rows/step {np.mean(verified):.1f} (max {max(verified)})  {tps:.1f} tok/s  "
        f"{tps / np.mean(base):.3f}x none"
    )


def parse_setting(text: str) -> tuple[str, dict]:
    """ "DIR" or "DIR@key=value,key=value" -> (DIR, drafting options; integer values as ints)."""
    path, _, rest = text.partition("@")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return path, options


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--none", required=True, help="the none engine")
    parser.add_argument("--hf-dir", required=True, help="the model's HF directory (its tokenizer makes the prompts)")
    parser.add_argument("--corpus-dir", help="a training corpus whose prompts are excluded")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--seed", type=int, default=99)
    parser.add_argument("--kind", help="only prompts of this kind (chat, chatcode, code, stub)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("settings", nargs="+", help="ENGINE_DIR[@key=value,...] (the request's drafting options)")
    args = parser.parse_args()
    settings = [parse_setting(text) for text in args.settings]
    kinds = 4  # fresh_prompts interleaves chat, chatcode, code, stub
    count = args.prompts * (kinds if args.kind else 1)
    prompts = fresh_prompts(args.hf_dir, "/nonexistent", count, seed=args.seed, corpus_dir=args.corpus_dir)
    if args.kind:
        prompts = prompts[["chat", "chatcode", "code", "stub"].index(args.kind) :: kinds]
    none = Engine(args.none, threads=args.threads)
    engines = {path: Engine(path, threads=args.threads) for path, _ in settings}
    run(none, prompts[0], 8)  # warm-up
    for path, options in settings:
        run(engines[path], prompts[0], 8, options or None)
    results = {i: [] for i in range(len(settings))}
    base = []
    for ids in prompts:
        want, tps, _, _ = run(none, ids, args.new_tokens)
        base.append(tps)
        for i, (path, options) in enumerate(settings):
            out, *rest = run(engines[path], ids, args.new_tokens, options or None)
            assert out == want, f"{args.settings[i]} differs from none"
            results[i].append(rest)
    print(f"none: {np.mean(base):.1f} tok/s over {len(prompts)} prompts")
    for i, text in enumerate(args.settings):
        print(f"{text}: {summary(results[i], base)}", flush=True)


if __name__ == "__main__":
    main()
