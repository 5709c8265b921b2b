"""Every head family trains on a tiny random model: a few optimizer steps lower the loss, and the written head
converts (`specbuild convert --<mode>-dir`) and builds into an engine that reproduces the base model's greedy tokens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import AutoModelForCausalLM

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.runtime.engine import Engine
from specbuild.training import distill
from specbuild.training.vocab import draft_vocabulary
from tests.helpers import ORT_ONLY, hf_greedy, quiet
from tests.tiers import full
from tests.training.tiny_distill import make_tiny_distill

pytestmark = pytest.mark.xdist_group("training")

PROMPTS = ([1, 5, 9, 3, 7, 5, 9, 3], [40, 41, 12])
EAGLE_DEFAULTS = {"eagle_top_k": 2, "eagle_depth": 3, "eagle_total_tokens": 6}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_distill(tmp_path_factory.mktemp("tiny_distill"))


def assert_learns(losses: list[float]) -> None:
    assert len(losses) >= 8
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, losses


def assert_builds_exact(data, mode: str, head_dir, tmp_path) -> None:
    """The head converts and builds; the engine's greedy tokens are the base model's."""
    ckpt = convert_checkpoint(data / "hf", tmp_path / "ckpt", heads={mode: head_dir}, progress=False)
    engine = Engine(build_engine(ckpt, tmp_path / "engine", BuildOptions(backends=ORT_ONLY, speculative_mode=mode),
                                 log=quiet))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(data / "hf").eval()
    for ids in PROMPTS:
        assert engine.generate(input_ids=ids, max_new_tokens=16).output_ids == hf_greedy(model, ids, 16)


@full("trains a head, converts and builds it")
def test_medusa(data, tmp_path):
    from specbuild.plugins.medusa import training as medusa

    feats = distill.load_features(data / "feat_train")
    settings = replace(medusa.SETTINGS, epochs=2, lr=3e-2, batch=64, heldout_frac=0.0)
    state, result = medusa.train_medusa(feats, data / "hf", settings, medusa.MedusaKnobs(num_heads=2, n_negatives=8),
                                        log=quiet)  # fmt: skip
    assert_learns(result.losses)
    vocab = draft_vocabulary(feats["next_token"], max_size=40)  # a capped draft vocabulary stays exact
    assert len(vocab) == 40
    head = medusa.save_medusa_v2(
        tmp_path / "head", state, 2, 1, 64, "tiny", [[0], [1], [0, 0]], vocab_size=97, draft_vocab=vocab
    )
    assert_builds_exact(data, "medusa", head, tmp_path)


@full("trains a head, converts and builds it")
def test_redrafter(data, tmp_path):
    from specbuild.plugins.redrafter import training as redrafter

    feats = distill.load_features(data / "feat_train")
    settings = replace(redrafter.SETTINGS, draft_vocab_size=None, epochs=1, lr=1e-2, batch=64, heldout_frac=0.0)
    knobs = redrafter.DrafterKnobs(exit_dim=64, num_layers=1, draft_len=3)
    drafter, facts = redrafter.train_drafter(feats, data / "hf", settings, knobs, log=quiet)
    assert_learns(facts["losses"])
    head = redrafter.save_redrafter(tmp_path / "head", drafter, 97, {"specbuild_defaults": {"redrafter_num_beams": 2}})
    assert_builds_exact(data, "redrafter", head, tmp_path)


@full("trains a head, converts and builds it")
@pytest.mark.parametrize("mode", ["eagle", "eagle3"])
def test_eagle(data, tmp_path, mode):
    from specbuild.plugins.eagle import training as eagle
    from specbuild.plugins.eagle3 import training as eagle3
    from specbuild.plugins.feature_draft.training import SETTINGS, TTTKnobs, load_sequences, train_draft

    family, features = (eagle.EAGLE1, "feat_train") if mode == "eagle" else (eagle3.EAGLE3, "feat_layers")
    settings = replace(SETTINGS, draft_vocab_size=64, batch=8, lr=3e-3, warmup=2, epochs=2, heldout_frac=0.0)
    seqs = load_sequences(family, data / features, data / "train.jsonl")
    res = train_draft(family, data / "hf", seqs, settings, TTTKnobs(intermediate_size=32, ttt_steps=2, chunk_len=16),
                      log=quiet)  # fmt: skip
    assert_learns(res["losses"])
    if mode == "eagle":
        eagle.save_eagle1(tmp_path / "head", res["draft"], data / "hf", "tiny", EAGLE_DEFAULTS, res["metrics"])
    else:
        eagle3.save_eagle3(tmp_path / "head", res["draft"], res["used"], data / "hf", "tiny", EAGLE_DEFAULTS)
    assert_builds_exact(data, mode, tmp_path / "head", tmp_path)


def test_a_small_training_set_keeps_the_vocabulary_each_head_drafts_from(data):
    """With few targets seen twice, EAGLE's draft vocabulary keeps the published top-k (10) ids and ReDrafter's its
    top-50 warp: the most frequent targets first, then those seen once, then ids never seen."""
    from specbuild.plugins.eagle.training import EAGLE1
    from specbuild.plugins.feature_draft.training import draft_vocab, load_sequences
    from specbuild.plugins.redrafter import training as redrafter

    seqs = load_sequences(EAGLE1, data / "feat_train", data / "train.jsonl")[:1]
    targets = seqs[0]["token"][1:][seqs[0]["valid"][:-1]]
    assert list(draft_vocab(seqs, 8192, 97)) == sorted(draft_vocabulary(targets, vocab=97, min_size=10))
    assert len(draft_vocab(seqs, 8192, 97)) == 10 and len(draft_vocab(seqs, 4, 97)) == 4  # 3 targets seen twice
    feats = {k: v[:40] for k, v in distill.load_features(data / "feat_train").items()}
    settings = replace(redrafter.SETTINGS, epochs=1, batch=8, heldout_frac=0.0)
    drafter, _ = redrafter.train_drafter(feats, data / "hf", settings, redrafter.DrafterKnobs(exit_dim=64), log=quiet)
    assert drafter.draft_ids.numel() == 50 and set(feats["next_token"].tolist()) <= set(drafter.draft_ids.tolist())
