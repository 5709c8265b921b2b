#!/usr/bin/env python
"""Measure lookahead settings on this machine: tau, verified rows per step and decode tokens/s of each (W, N, G, pool)
against `none` (and `ngram`, if given), greedy, on fresh prompts (code, chat, stubs; never HumanEval or MT-Bench),
interleaved per prompt. One lookahead engine built at the largest setting serves every smaller one (per-request
drafting options); every output is checked against `none`'s.

    scripts/sweep-lookahead.py --none e/none --lookahead e/la-max --ngram e/ngram --hf-dir hf \\
        --prompts 16 --seed 98 1,3,2,context,10 1,3,2,context,0 4,3,4,window,0

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--none", required=True, help="the none engine")
    parser.add_argument("--lookahead", required=True, help="a lookahead engine built as large as any setting")
    parser.add_argument("--ngram", help="an ngram engine to compare with")
    parser.add_argument("--hf-dir", required=True, help="the model's HF directory (its tokenizer makes the prompts)")
    parser.add_argument("--corpus-dir", help="a training corpus whose prompts are excluded")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--seed", type=int, default=99)
    parser.add_argument("--kind", help="only prompts of this kind (chat, chatcode, code, stub)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("settings", nargs="+", help="W,N,G,POOL[,L] (POOL: window, prompt or context; L: lookup)")
    args = parser.parse_args()
    settings = []
    for text in args.settings:
        w, n, g, pool, *lookup = text.split(",")
        settings.append(
            {"window": int(w), "ngram": int(n), "guesses": int(g), "pool": pool, "lookup": int(*lookup or [0])}
        )
    kinds = 4  # fresh_prompts interleaves chat, chatcode, code, stub
    count = args.prompts * (kinds if args.kind else 1)
    prompts = fresh_prompts(args.hf_dir, "/nonexistent", count, seed=args.seed, corpus_dir=args.corpus_dir)
    if args.kind:
        prompts = prompts[["chat", "chatcode", "code", "stub"].index(args.kind) :: kinds]
    none = Engine(args.none, threads=args.threads)
    lookahead = Engine(args.lookahead, threads=args.threads)
    ngram = Engine(args.ngram, threads=args.threads) if args.ngram else None
    run(none, prompts[0], 8)  # warm-up
    run(lookahead, prompts[0], 8, settings[0])
    results = {i: [] for i in range(len(settings))}
    base, ngram_rows = [], []
    for ids in prompts:
        want, tps, _, _ = run(none, ids, args.new_tokens)
        base.append(tps)
        if ngram is not None:
            out, *rest = run(ngram, ids, args.new_tokens)
            assert out == want, "ngram differs from none"
            ngram_rows.append(rest)
        for i, options in enumerate(settings):
            out, *rest = run(lookahead, ids, args.new_tokens, options)
            assert out == want, f"lookahead {options} differs from none"
            results[i].append(rest)
    print(f"none: {np.mean(base):.1f} tok/s over {len(prompts)} prompts")
    if ngram_rows:
        print(f"ngram: {summary(ngram_rows, base)}")
    for i, options in enumerate(settings):
        name = " ".join(f"{key} {value}" for key, value in options.items())
        print(f"{name}: {summary(results[i], base)}", flush=True)


if __name__ == "__main__":
    main()
