"""Teacher-forced features from a corpus (issue 32) on a tiny random Llama: they equal the features the data stage
captured during generation, and every head family trains from a tiny corpus end to end (`specbuild train` with the
corpus recipes).

Tolerance: float32 on the CPU, both sides stored as float16, so a value may differ by one float16 rounding step
(relative 2^-10) plus float32 noise: |a - b| <= 2e-3 * |b| + 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from specbuild.cli.main import cli
from specbuild.plugins.eagle3.training import LAYER_FEATURES
from specbuild.training import corpus, distill, teacher_forced
from specbuild.training.heldout import heldout_mask
from tests.helpers import quiet
from tests.training.tiny_distill import make_tiny_distill

pytestmark = pytest.mark.xdist_group("training")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tiny data stage's output, with its sequences also written as a corpus (root/corpus)."""
    root = make_tiny_distill(tmp_path_factory.mktemp("tiny_tf"))
    corpus.open_corpus(root / "corpus", {"name": "tiny", "sha256": "0"}, 97)
    records = [{"key": r["id"], "source": r["kind"], "prompt_ids": r["prompt_ids"], "gen_ids": r["gen_ids"]}
               for r in distill.read_sequences(root / "train.jsonl")]  # fmt: skip
    corpus.append_chunk(root / "corpus", records, {"settings": {"greedy": True}})
    return root


def _sorted_rows(rows: dict[str, np.ndarray], by: str, seqs: set[int]) -> dict[str, np.ndarray]:
    keep = np.isin(rows["seq"], list(seqs))
    rows = {k: v[keep] for k, v in rows.items()}
    order = np.lexsort((rows[by], rows["seq"]))
    return {k: v[order] for k, v in rows.items()}


def _shards(d: Path) -> dict[str, np.ndarray]:
    parts = [load_file(str(p)) for p in sorted(d.glob("*.safetensors"))]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _assert_close(a: np.ndarray, b: np.ndarray) -> None:
    a, b = a.astype(np.float32), b.astype(np.float32)
    assert a.shape == b.shape
    assert np.all(np.abs(a - b) <= 2e-3 * np.abs(b) + 1e-4), float(np.abs(a - b).max())


def test_teacher_forced_features_equal_the_captured_ones(data):
    records = teacher_forced.corpus_records(data / "corpus")
    assert len(records) >= 30
    seqs = {distill._seq_no(r["id"]) for r in records}

    model, layers = teacher_forced.load_base(data / "hf", "cpu", "float32")
    final = _sorted_rows(teacher_forced.teacher_forced_rows(model, records, batch_tokens=256, log=quiet), "pos", seqs)
    shard = _sorted_rows(_shards(data / "feat_train"), "gen_offset", seqs)
    assert layers is None and len(final["seq"]) == len(shard["seq"])
    assert np.array_equal(final["token"], shard["next_token"]) and np.array_equal(final["seq"], shard["seq"])
    assert np.array_equal(final["gen_offset"], shard["gen_offset"])
    _assert_close(final["feat"], shard["hidden"])

    model, layers = teacher_forced.load_base(data / "hf", "cpu", "float32", LAYER_FEATURES)
    tf = teacher_forced.teacher_forced_rows(model, records, layers, batch_tokens=256, log=quiet)
    tf = _sorted_rows(tf, "pos", seqs)
    shard = _sorted_rows(_shards(data / "feat_layers"), "pos", seqs)
    for key in ("token", "seq", "pos"):
        assert np.array_equal(tf[key], shard[key]), key
    _assert_close(tf["feat"], np.concatenate([shard[k] for k in LAYER_FEATURES.keys], axis=1))


def test_rows_keep_the_record_order_whatever_the_batching(data):
    records = teacher_forced.corpus_records(data / "corpus", max_sequences=12)
    model, _ = teacher_forced.load_base(data / "hf", "cpu", "float32")
    one = teacher_forced.teacher_forced_rows(model, records, batch_tokens=1, log=quiet)
    many = teacher_forced.teacher_forced_rows(model, records, batch_tokens=10_000, log=quiet)
    assert [int(s) for s in dict.fromkeys(one["seq"].tolist())] == [distill._seq_no(r["id"]) for r in records]
    for key in one:
        np.testing.assert_array_equal(one[key], many[key]) if key != "feat" else _assert_close(one[key], many[key])


def test_the_heldout_subset_is_the_trainers_split(data):
    held = teacher_forced.corpus_records(data / "corpus", heldout_only=True, heldout_frac=0.3)
    every = teacher_forced.corpus_records(data / "corpus")
    mask = heldout_mask(np.array([distill._seq_no(r["id"]) for r in every]), 0.3)
    assert [r["id"] for r in held] == [r["id"] for r, m in zip(every, mask) if m] and held


TINY = {
    "eagle": ["train.intermediate_size=32", "train.draft_vocab_size=64", "train.chunk_len=16", "train.batch=4",
              "train.warmup=2", "train.epochs=2", "train.epoch_eval_sequences=4", "train.log_every=5"],
    "medusa": ["train.batch=64", "train.n_negatives=8", "tree.max_nodes=4"],
    "redrafter": ["train.batch=64", "train.exit_dim=64", "train.num_layers=1", "train.draft_len=3",
                  "train.simulate=[[2, 3]]"],
}  # fmt: skip
TINY["eagle3"] = TINY["eagle"]


@pytest.mark.parametrize("mode", ["eagle3", "eagle", "medusa", "redrafter"])
def test_every_family_trains_from_a_corpus(data, tmp_path, mode):
    out = tmp_path / "head"
    args = ["train", "--recipe", str(RECIPES / f"train-{mode}-corpus.yaml"), "--device", "cpu",
            "--corpus-dir", str(data / "corpus"), "--max-sequences", "36"]  # fmt: skip
    for item in [f"base_model={data / 'hf'}", f"work_dir={tmp_path / 'work'}", f"output_dir={out}",
                 "train.time_budget_s=3", "train.heldout_frac=0.2", *TINY[mode]]:  # fmt: skip
        args += ["--set", item]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    cfg = json.loads((out / "config.json").read_text())
    lineage = cfg["specbuild_training"].get("training", cfg["specbuild_training"])
    assert lineage["corpus_sequences"] == 36 and lineage["optimizer_steps"] > 0 and lineage["hardware"]
    weights = "medusa_lm_head.safetensors" if mode == "medusa" else "model.safetensors"
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", weights])

    compare = ["corpus", "compare-heads", "--corpus-dir", str(data / "corpus"), "--mode", mode, "--head", str(out),
               "--max-sequences", "4", "--heldout-frac", "0.2", "--model-dir", str(data / "hf"),
               "--json", str(tmp_path / "compare.json")]  # fmt: skip
    result = CliRunner().invoke(cli, compare)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["heldout_sequences"] == 4 and list(report["heads"]) == [str(out)]
