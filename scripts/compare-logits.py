"""How far quantized engines are from a reference engine on text: every position of each prompt prefilled through
each engine (`Engine.prefill_logits`, so every engine must be built with `--output-logits`), then top-1 agreement
with the reference and the KL divergence KL(reference || engine) per token (mean and 90th percentile, nats).
The accuracy table of `--weights-block-size` in docs/engine-format.md.

    python scripts/compare-logits.py REFERENCE_ENGINE ENGINE [ENGINE ...] [--prompts humaneval,summarize]
        [--num-prompts 12] [--max-tokens 400]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specbuild.prompts import load_prompt_set  # noqa: E402
from specbuild.runtime.engine import Engine  # noqa: E402


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference")
    parser.add_argument("engines", nargs="+")
    parser.add_argument("--prompts", default="humaneval,summarize")
    parser.add_argument("--num-prompts", type=int, default=12, help="per prompt set")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens of each prompt kept")
    args = parser.parse_args()
    reference = Engine(args.reference)
    texts = [t for name in args.prompts.split(",") for t in load_prompt_set(name, args.num_prompts)]
    prompts = [reference.codec.prompt_ids(t, False)[: args.max_tokens] for t in texts]
    wanted = [log_softmax(reference.prefill_logits(ids)) for ids in prompts]
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} positions, reference {args.reference}")
    for directory in args.engines:
        engine = Engine(directory)
        agree, divergence = 0, []
        for ids, ref in zip(prompts, wanted):
            got = log_softmax(engine.prefill_logits(ids))
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            divergence.append((np.exp(ref) * (ref - got)).sum(-1))
        kl = np.concatenate(divergence)
        print(
            f"{directory}: top-1 agreement {100 * agree / len(kl):.1f} %, KL mean {kl.mean():.3f} "
            f"p90 {np.quantile(kl, 0.9):.3f} nats"
        )


if __name__ == "__main__":
    main()
