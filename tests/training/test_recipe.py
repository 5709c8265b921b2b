"""Recipes: the data stage (several generation rounds append to one data set without id collisions), overrides, the
settings a `train:` mapping fills, and the `choose` stage alone."""

from dataclasses import replace

import pytest

from specbuild.training import distill, recipe
from specbuild.training.settings import TrainSettings, read_train
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("training")


@full("the real SmolLM2-135M model")
def test_rounds_append_with_prefixed_ids(smollm2_hf, tmp_path):
    base = {"code_prompts": 2, "chat_prompts": 0, "chat_code_frac": 0.0, "max_new_tokens": 4, "batch_size": 4}
    cfg = {
        "base_model": str(smollm2_hf),
        "work_dir": str(tmp_path / "work"),
        "data": {
            **base,
            "seed": 0,
            "eval_humaneval_prompts": 0,
            "layer_features": {"eagle3": str(tmp_path / "layers")},
            "rounds": [
                {"seed": 1, "id_prefix": "s1-", "code_prompts": 3},
                {"seed": 3, "id_prefix": "s3-", "code_prompts": 0, "stub_prompts": 2},
            ],
        },
    }
    recipe.prepare_data(cfg, log=lambda *a: None)
    seqs = distill.read_sequences(tmp_path / "work" / "train.jsonl")
    ids = [s["id"] for s in seqs]
    assert len(ids) == len(set(ids))
    first = [i for i in ids if not i.startswith(("s1-", "s3-"))]
    later = [i for i in ids if i.startswith("s1-")]
    assert sorted(first) == ["code-00000", "code-00001"] and later
    assert sorted(i for i in ids if i.startswith("s3-")) == ["s3-stub-00000", "s3-stub-00001"]
    prompts = [tuple(s["prompt_ids"]) for s in seqs]
    assert len(prompts) == len(set(prompts))  # a later round skips prompts an earlier one has
    assert all(1 <= len(s["gen_ids"]) <= 4 for s in seqs)
    assert set((tmp_path / "layers" / "done.txt").read_text().split()) == set(ids)
    feats = distill.load_features(tmp_path / "work" / "feat_train")
    assert set(feats["seq"].tolist()) == {distill._seq_no(i) for i in ids}

    recipe.prepare_data(cfg, log=lambda *a: None)  # resumes: nothing new
    assert len(distill.read_sequences(tmp_path / "work" / "train.jsonl")) == len(seqs)


def test_overrides_set_dotted_keys_with_yaml_values_and_end_by_shortens_the_budget():
    import time

    from specbuild.errors import SpecbuildError

    cfg = {"train": {"batch": 8, "lr": 0.1}, "kind": "x"}
    out = recipe.apply_override(recipe.apply_override(cfg, "train.batch=64"), "corpus.max_sequences=10")
    out = recipe.apply_override(out, "train.lr=null")
    assert out == {"train": {"batch": 64}, "kind": "x", "corpus": {"max_sequences": 10}}
    assert cfg == {"train": {"batch": 8, "lr": 0.1}, "kind": "x"}  # a copy
    assert recipe.apply_override({}, "train.simulate=[[2, 3]]") == {"train": {"simulate": [[2, 3]]}}
    with pytest.raises(SpecbuildError, match="KEY=VALUE"):
        recipe.apply_override(cfg, "train.batch")
    settings = TrainSettings(epochs=1, lr=0.1, batch=8, warmup=0, time_budget_s=300)
    assert settings.loop_budget() == 300
    budget = replace(settings, end_by=time.time() + 100, end_reserve_s=20).loop_budget()
    assert 79 <= budget <= 80


def test_a_recipe_fills_the_shared_settings_and_a_trainers_own_knobs_with_typed_values():
    import dataclasses

    from specbuild.errors import SpecbuildError

    @dataclasses.dataclass(frozen=True)
    class Knobs:
        layers: tuple[int, ...] = (0, 1)
        rnn: bool = True
        exit_dim: int | None = None

    defaults = TrainSettings(epochs=2.0, lr=1e-3, batch=512, warmup=50, time_budget_s=1200.0, draft_vocab_size=8192)
    train = {"lr": "0.002", "batch_tokens": 64, "draft_vocab": None, "epochs": 3, "other": "left to the trainer"}
    cfg = {"recipe_path": "r.yaml", "device": "cpu", "train": train}
    settings = TrainSettings.from_recipe(cfg, defaults, {"batch": "batch_tokens", "draft_vocab_size": "draft_vocab"})
    assert settings == replace(defaults, lr=0.002, batch=64, draft_vocab_size=None, epochs=3.0)
    assert isinstance(settings.epochs, float) and settings.time_budget_s == 1200.0  # defaults stay
    cfg["train"] = {"layers": [2], "exit_dim": "64"}
    assert read_train(cfg, Knobs()) == Knobs(layers=(2,), exit_dim=64)
    cfg["train"] = {"lr": "fast"}
    with pytest.raises(SpecbuildError, match=r"recipe r.yaml: train.lr 'fast' is not a valid float"):
        TrainSettings.from_recipe(cfg, defaults)
    cfg["train"] = {"layers": 3}
    with pytest.raises(SpecbuildError, match=r"train.layers 3 is not a valid tuple"):
        read_train(cfg, Knobs())


def test_choose_only_measures_the_installed_heads_without_training(tmp_path, monkeypatch):
    import json

    from specbuild.errors import SpecbuildError
    from specbuild.modes import registry
    from specbuild.training import defaults

    heads = tmp_path / "heads"
    text = f"kind: eagle3\nbase_model: {tmp_path}\nwork_dir: {tmp_path / 'w'}\noutput_dir: {heads}\n"
    (tmp_path / "plain.yaml").write_text(text)
    (tmp_path / "r.yaml").write_text(text + "choose:\n  candidates:\n    - {eagle_depth: 3}\n")
    calls = []
    monkeypatch.setattr(registry, "load_object", lambda name: pytest.fail("the trainer ran"))
    monkeypatch.setattr(defaults, "choose_for_recipe", lambda cfg, kind, d, log: calls.append((kind, d)) or {"x": 1})
    with pytest.raises(SpecbuildError, match="needs a `choose` stage"):
        recipe.run_recipe(tmp_path / "plain.yaml", device="cpu", choose_only=True)
    with pytest.raises(SpecbuildError, match="no heads in output_dir"):
        recipe.run_recipe(tmp_path / "r.yaml", device="cpu", choose_only=True)
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({}))
    assert recipe.run_recipe(tmp_path / "r.yaml", device="cpu", choose_only=True) == {"choice": {"x": 1}}
    assert calls == [("eagle3", str(heads))]
    # a recipe trained where it will not serve (choose.after_training: false) trains without choosing
    (tmp_path / "gpu.yaml").write_text(text + "choose:\n  after_training: false\n  candidates: [{eagle_depth: 3}]\n")
    monkeypatch.setattr(registry, "load_object", lambda name: lambda cfg, log: {"trained": 1})
    assert recipe.run_recipe(tmp_path / "gpu.yaml", device="cpu") == {"trained": 1} and len(calls) == 1
    assert recipe.run_recipe(tmp_path / "gpu.yaml", device="cpu", choose_only=True)["choice"] == {"x": 1}
