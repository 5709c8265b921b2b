"""Self-distillation data on the embedded model: the features written during generation equal a second pass."""

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from specbuild.plugins.eagle3.training import LAYER_FEATURES
from specbuild.training import distill
from tests.helpers import quiet
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("training")


def _rows(d: Path) -> dict[str, np.ndarray]:
    shards = [load_file(str(p)) for p in sorted(d.glob("*.safetensors"))]
    rows = {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}
    order = np.lexsort((rows["pos"], rows["seq"])) if "pos" in rows else np.lexsort((rows["gen_offset"], rows["seq"]))
    return {k: v[order] for k, v in rows.items()}


@full("the real SmolLM2-135M model")
def test_generation_writes_the_features_of_a_second_forward(smollm2_hf, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_hf))
    prompts = [
        {"id": "a", "kind": "code", "ids": tok('def add(a, b):\n    """Add two numbers."""\n')["input_ids"]},
        {"id": "b", "kind": "code", "ids": tok("import os\nprint(")["input_ids"]},
    ]
    seqs = distill.generate_sequences(
        smollm2_hf,
        prompts,
        10,
        2,
        tmp_path / "t.jsonl",
        1e9,
        tmp_path / "final",
        log=lambda *a: None,
        layer_features=LAYER_FEATURES,
        layer_features_dir=tmp_path / "layers",
    )
    assert sorted(r["id"] for r in seqs) == ["a", "b"] and all(len(r["gen_ids"]) >= 2 for r in seqs)
    assert set((tmp_path / "layers" / "done.txt").read_text().split()) == {"a", "b"}

    # EAGLE-3 layer inputs: the same rows as a separate forward pass (fp16 rounding apart)
    distill.extract_layer_features(LAYER_FEATURES, smollm2_hf, tmp_path / "t.jsonl", tmp_path / "second", log=quiet)
    gen, second = _rows(tmp_path / "layers"), _rows(tmp_path / "second")
    for key in ("token", "seq", "pos"):
        assert np.array_equal(gen[key], second[key]), key
    for key in LAYER_FEATURES.keys:
        a, b = gen[key].astype(np.float32), second[key].astype(np.float32)
        assert np.abs(a - b).max() <= 2e-3 * max(1.0, np.abs(b).max()), key

    # final normed hidden: the same rows as distill.compute_features' forward pass
    distill.compute_features(smollm2_hf, seqs, tmp_path / "final2", log=lambda *a: None)
    f1, f2 = _rows(tmp_path / "final"), _rows(tmp_path / "final2")
    assert np.array_equal(f1["next_token"], f2["next_token"]) and np.array_equal(f1["seq"], f2["seq"])
    h1, h2 = f1["hidden"].astype(np.float32), f2["hidden"].astype(np.float32)
    assert np.abs(h1 - h2).max() <= 2e-3 * max(1.0, np.abs(h2).max())
