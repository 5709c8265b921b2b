"""Choosing build defaults by measurement: every candidate is built and timed, the fastest wins; the prompts are
never training prompts."""

from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.training.defaults import best, measure_settings
from tests.plugins.medusa_helpers import toy_model
from tests.plugins.redrafter_fixtures import write_redrafter
from tests.tiers import full


@full("builds and benchmarks candidate engines")
def test_candidates_are_measured_against_none_and_the_fastest_is_chosen(tmp_path):
    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf")
    write_redrafter(tmp_path / "d", model.config.hidden_size, 12, seed=1)
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"redrafter": tmp_path / "d"}, progress=False)
    candidates = [
        {"redrafter_num_beams": 1, "redrafter_draft_len_per_beam": 2},
        {"redrafter_num_beams": 3, "redrafter_draft_len_per_beam": 3},
        {"redrafter_num_beams": 3, "redrafter_draft_len_per_beam": 3, "head_weights": "int8"},
    ]
    rows = measure_settings(ckpt, "redrafter", candidates, [[1, 5, 9, 3, 7], [1, 4, 4]], 16, threads=1,
                            max_seq_len=64, log=lambda *a: None)  # fmt: skip
    # a candidate that names no head weights is measured (and recorded) with float heads, whatever the heads recorded
    assert [r["settings"] for r in rows] == ["none", *({"head_weights": "float", **c} for c in candidates)]
    assert rows[0]["tau"] == 1.0 and rows[0]["speedup"] == 1.0
    assert all(r["tau"] >= 1.0 and r["engine_ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["same_as_none"] == "2/2" for r in rows)  # greedy speculation is exact, with int8 heads too
    chosen = best(rows)
    assert chosen in rows[1:] and chosen["tokens_per_s"] == max(r["tokens_per_s"] for r in rows[1:])


@full("the real SmolLM2-135M model")
def test_choice_prompts_are_fresh_and_never_training_prompts(smollm2_hf, tmp_path):
    import json

    from specbuild.training.defaults import fresh_prompts

    first = fresh_prompts(smollm2_hf, tmp_path, 6)
    assert len(first) == 6 and len({tuple(p) for p in first}) == 6
    (tmp_path / "train.jsonl").write_text(json.dumps({"id": "x", "prompt_ids": first[0], "gen_ids": [1]}) + "\n")
    again = fresh_prompts(smollm2_hf, tmp_path, 6)
    assert first[0] not in again and len(again) == 6 and sum(p in again for p in first[1:]) >= 4


def test_a_candidate_whose_output_differed_from_none_never_wins():
    rows = [
        {"settings": "none", "tokens_per_s": 10.0, "same_as_none": "4/4"},
        {"settings": {"a": 1}, "tokens_per_s": 30.0, "same_as_none": "3/4"},
        {"settings": {"a": 2}, "tokens_per_s": 20.0, "same_as_none": "4/4"},
    ]
    assert best(rows)["settings"] == {"a": 2}
    assert best(rows[:2]) is None


def test_the_choose_stage_records_the_winner_and_keeps_the_choices_for_other_weights(tmp_path, monkeypatch):
    """The winner (its head weights included) becomes specbuild_defaults; a by_weights entry (another --weights'
    choice, which the stage does not measure) stays."""
    import json

    from specbuild.builder.checkpoint import convert
    from specbuild.training import defaults

    heads = tmp_path / "heads"
    heads.mkdir()
    by_weights = {"int4": {"eagle_top_k": 1, "eagle_depth": 3, "eagle_total_tokens": 4}}
    (heads / "config.json").write_text(json.dumps({"specbuild_defaults": {"eagle_depth": 3, "by_weights": by_weights}}))
    exact = {"tau": 2.0, "same_as_none": "1/1"}
    rows = [
        {"settings": "none", "tokens_per_s": 1.0, **exact},
        {"settings": {"head_weights": "float", "eagle_depth": 4}, "tokens_per_s": 2.0, **exact},
        {"settings": {"head_weights": "int8", "eagle_depth": 4}, "tokens_per_s": 3.0, **exact},
    ]
    monkeypatch.setattr(defaults, "fresh_prompts", lambda *a, **k: [[1, 2]])
    monkeypatch.setattr(defaults, "measure_settings", lambda *a, **k: rows)
    monkeypatch.setattr(convert, "convert_checkpoint", lambda *a, **k: tmp_path / "ckpt")
    cfg = {"base_model": "m", "work_dir": str(tmp_path), "choose": {"candidates": [{"eagle_depth": 4}]}}
    assert defaults.choose_for_recipe(cfg, "eagle", heads, log=lambda *a: None)["chosen"] == rows[2]["settings"]
    recorded = json.loads((heads / "config.json").read_text())
    assert recorded["specbuild_defaults"] == {"head_weights": "int8", "eagle_depth": 4, "by_weights": by_weights}
    assert recorded["specbuild_choice"]["rows"] == rows
