"""Self-distillation data of a tiny random Llama for the trainer tests: the real data stage (`distill.
generate_sequences`) on TINY_SHAPES' llama_gqa_llama3rope with a character tokenizer, giving train.jsonl, the
final-hidden shards (feat_train) and EAGLE-3's decoder-layer-input shards (feat_layers) of random prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

from specbuild.plugins.eagle3.training import LAYER_FEATURES
from specbuild.training import distill
from tests.helpers import quiet, write_char_tokenizer
from tests.shapes import save_tiny_model

SHAPE = "llama_gqa_llama3rope"  # vocab 97, hidden 64, 4 heads (2 KV heads of 16), 2 layers


def make_tiny_distill(root: Path, prompts: int = 40, new_tokens: int = 24) -> Path:
    """The tiny base model at root/hf (no tokenizer left: convert and build need none) and its data in root."""
    hf = save_tiny_model(SHAPE, root / "hf")
    write_char_tokenizer(hf)  # the data stage loads a tokenizer for its end-of-text and padding ids
    special = {"eos_token": "<unk>", "pad_token": "<unk>", "unk_token": "<unk>"}
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}))
    rng = random.Random(0)
    rows = [
        {"id": f"p{i}", "kind": "code", "ids": [rng.randrange(3, 90) for _ in range(rng.randrange(4, 12))]}
        for i in range(prompts)
    ]
    distill.generate_sequences(
        hf, rows, new_tokens, 16, root / "train.jsonl", 1e9, root / "feat_train", log=quiet,
        layer_features=LAYER_FEATURES, layer_features_dir=root / "feat_layers",
    )  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).unlink()
    return root
