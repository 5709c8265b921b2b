"""Smoke test of corpus training on a tiny random Llama (scripts/device/train-heads.sh stash|smoke): a random corpus,
then every corpus recipe (recipes/train-*-corpus.yaml: the heads and the draft model) for a few seconds on DEVICE, so
that a device-only bug shows before the real run. Usage: python scripts/device/smoke_train.py WORK_DIR [cuda|cpu];
exit status 1 on a failure."""

from __future__ import annotations

import random
import sys
import time
import traceback
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = {
    "eagle": ["train.intermediate_size=64", "train.draft_vocab_size=128", "train.chunk_len=32", "train.batch=8",
              "train.warmup=2", "train.epoch_eval_sequences=8", "train.log_every=10"],
    "medusa": ["train.batch=256", "tree.max_nodes=4"],
    "redrafter": ["train.batch=256", "train.exit_dim=64", "train.draft_len=3", "train.simulate=[[2, 3]]"],
    "draft": ["train.vocab_size=128", "train.negatives=16", "train.seq_len=64", "train.batch_tokens=512",
              "train.eval_sequences=8", "train.log_every_s=1"],
}  # fmt: skip
TINY["eagle3"] = TINY["eagle"]


def tiny_model(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    cfg = LlamaConfig(
        **shape, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def tiny_corpus(out: Path, n: int = 96) -> Path:
    from specbuild.training import corpus

    rng = random.Random(0)
    corpus.open_corpus(out, {"name": "tiny", "sha256": "0"}, 256)

    def ids(lo: int, hi: int) -> list[int]:
        return [rng.randrange(256) for _ in range(rng.randrange(lo, hi))]

    records = [{"key": f"s{i}", "source": "code", "prompt_ids": ids(4, 20), "gen_ids": ids(20, 80)} for i in range(n)]
    corpus.append_chunk(out, records, {"settings": {"greedy": True}})
    return out


def main(work: Path, device: str) -> int:
    from specbuild.training.recipe import run_recipe

    hf, data = tiny_model(work / "hf"), tiny_corpus(work / "corpus")
    failed = []
    for mode, extra in TINY.items():
        t0 = time.time()
        dirs = [f"work_dir={work / mode}", f"output_dir={work / mode / 'out'}"]
        overrides = [f"base_model={hf}", f"corpus_dir={data}", *dirs, "train.time_budget_s=3", "train.heldout_frac=0.2"]
        overrides += extra
        try:
            run_recipe(RECIPES / f"train-{mode}-corpus.yaml", log=lambda *a: None, device=device, overrides=overrides)
            print(f"smoke {mode} on {device}: ok ({time.time() - t0:.1f}s)", flush=True)
        except Exception:  # every family is tried; the failures are reported together
            failed.append(mode)
            print(f"smoke {mode} on {device}: FAILED\n{traceback.format_exc(limit=-6)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cuda"))
