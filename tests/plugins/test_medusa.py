"""Medusa: every published head format converts; engines are exact at temperature 0 and lossless when sampling."""

import json

import numpy as np
import pytest
import torch

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine, SamplingParams
from tests.helpers import ORT_ONLY, Lazy, hf_greedy, quiet
from tests.plugins.distribution_check import chi_square_pvalue, exact_distribution
from tests.plugins.medusa_helpers import medusa_state, toy_model, write_medusa_heads
from tests.shapes import TINY_SHAPES
from tests.tiers import fast_first, full

pytestmark = pytest.mark.xdist_group("medusa")

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
PROMPTS = [[1, 5, 9, 3, 7], [1, 4], [1, 11, 10, 6, 2, 8, 3]]


def _hidden(model):
    return model.config.hidden_size


@pytest.fixture(scope="module")
def toy_medusa(tmp_path_factory):
    """shape -> (HF model, Medusa engine dir) on a 12-token vocabulary (drafts often get accepted)."""
    root = tmp_path_factory.mktemp("medusa_toy")

    def make(shape):
        i = list(TINY_SHAPES).index(shape)  # the seed
        model = toy_model(shape, root / shape / "hf", seed=i)
        write_medusa_heads(
            root / shape / "heads", "v2" if i % 2 else "v0.1-pt", _hidden(model), 12, num_heads=3, seed=i
        )
        ckpt = convert_checkpoint(
            root / shape / "hf", root / shape / "ckpt", heads={"medusa": root / shape / "heads"}, progress=False
        )
        eng = build_engine(
            ckpt,
            root / shape / "engine",
            BuildOptions(backends=ORT_ONLY, speculative_mode="medusa", tree=TREE),
            log=quiet,
        )
        return (model, eng, ckpt)

    return Lazy(make)


@pytest.mark.parametrize("fmt", ["v0.1-pt", "legacy-safetensors", "v2", "medusa2-full"])
def test_every_published_format_converts(tmp_path, fmt):
    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf")
    heads_dir = tmp_path / "heads" if fmt != "medusa2-full" else tmp_path / "full"
    # the v0.1 Vicuna config says 2 heads while the file holds 5: the count must come from the tensors
    state = write_medusa_heads(
        heads_dir, fmt, _hidden(model), 12, num_heads=4, config={"medusa_num_heads": 2}, base_dir=tmp_path / "hf"
    )
    model_dir = heads_dir if fmt == "medusa2-full" else tmp_path / "hf"
    ckpt = Checkpoint.load(
        convert_checkpoint(model_dir, tmp_path / "ckpt", heads={"medusa": heads_dir}, progress=False)
    )
    cfg = ckpt.heads["medusa"]
    assert cfg["num_heads"] == 4 and cfg["num_layers"] == 1
    assert cfg["own_lm_head"] == (fmt != "v2")
    tensors = ckpt.head_tensors("medusa")
    for h in range(4):
        torch.testing.assert_close(tensors[f"heads.{h}.blocks.0.weight"], state[f"{h}.0.linear.weight"])
        if fmt != "v2":
            torch.testing.assert_close(tensors[f"heads.{h}.lm_head.weight"], state[f"{h}.1.weight"])


@full("a second Medusa engine to compare trees")
def test_a_measured_default_tree_wins_over_medusa_choices(tmp_path):
    """A recipe's choose stage records the fastest tree as specbuild_defaults.tree: it becomes the engine default
    (and specbuild_defaults.by_weights.<weights>.tree at those --weights)."""
    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf")
    measured, measured_int4 = [[0], [0, 0], [0, 0, 0]], [[0], [1]]
    recorded = {"tree": measured, "by_weights": {"int4": {"tree": measured_int4}}}  # another choice at int4
    config = {"medusa_choices": [[0], [1], [0, 0]], "specbuild_defaults": recorded}
    write_medusa_heads(tmp_path / "heads", "v2", _hidden(model), 12, num_heads=3, config=config)
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"medusa": tmp_path / "heads"}, progress=False)
    assert Checkpoint.load(ckpt).heads["medusa"]["medusa_choices"] == measured
    engine = build_engine(ckpt, tmp_path / "e", BuildOptions(backends=ORT_ONLY, speculative_mode="medusa"), log=quiet)
    assert Engine(engine).manifest["tree"]["choices"] == measured
    options = BuildOptions(backends=ORT_ONLY, speculative_mode="medusa", weights="int4")
    engine = build_engine(ckpt, tmp_path / "e4", options, log=quiet)
    assert Engine(engine).manifest["tree"]["choices"] == measured_int4


def test_broken_heads_fail_naming_the_tensor(tmp_path):
    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf")
    state = medusa_state(_hidden(model), 13, 2, own_lm_head=True)  # vocab 13 != 12
    (tmp_path / "heads").mkdir()
    torch.save(state, tmp_path / "heads" / "medusa_lm_head.pt")
    with pytest.raises(SpecbuildError, match=r"h\.0\.1\.weight has shape \[13, 64\]"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"medusa": tmp_path / "heads"}, progress=False)
    assert not (tmp_path / "ckpt").exists()
    del state["1.0.linear.bias"]
    state = {k: v for k, v in state.items() if not k.endswith(".1.weight") or k.startswith("0.")}
    torch.save(state, tmp_path / "heads" / "medusa_lm_head.pt")
    with pytest.raises(SpecbuildError):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"medusa": tmp_path / "heads"}, progress=False)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("shape", fast_first(TINY_SHAPES, "another tiny shape: the fast tier checks the first"))
def test_greedy_equals_base_model(toy_medusa, shape):
    model, eng, _ = toy_medusa[shape]
    engine = Engine(eng, threads=1)
    accepted = []
    for ids in PROMPTS:
        result = engine.generate(input_ids=ids, max_new_tokens=40)
        assert result.output_ids == hf_greedy(model, ids, 40)
        accepted += result.accepted_per_step
    assert np.mean(accepted) > 1.2  # drafts really get accepted, so multi-token acceptance is exercised


def test_bad_trees_are_rejected_at_build(toy_medusa, tmp_path):
    _, _, ckpt = toy_medusa["llama_gqa_llama3rope"]
    cases = [
        ([[0], [0, 1, 2]], "lacks its prefix"),
        ([[0], [10]], "top-k index 10"),
        ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "3 Medusa heads"),
        ("cpu24", "--max-draft-len"),
    ]
    for tree, message in cases:
        opts = BuildOptions(
            backends=ORT_ONLY,
            speculative_mode="medusa",
            tree=json.dumps(tree) if isinstance(tree, list) else tree,
            medusa_top_k=10,
            max_draft_len=20,
        )
        with pytest.raises(SpecbuildError, match=message):
            build_engine(ckpt, tmp_path / "engine", opts, log=quiet)
        assert not (tmp_path / "engine").exists()


@full("sampling with point-mass drafts: the fast tier checks n-gram's (one acceptance rule in every graph)")
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_sampling_preserves_the_base_distribution(tmp_path, temperature, top_k, top_p):
    vocab = 8
    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf", vocab=vocab, seed=3)
    write_medusa_heads(tmp_path / "heads", "v2", _hidden(model), vocab, num_heads=2, seed=5)
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"medusa": tmp_path / "heads"}, progress=False)
    eng = build_engine(
        ckpt,
        tmp_path / "engine",
        BuildOptions(backends=ORT_ONLY, speculative_mode="medusa", tree=[[0], [1], [0, 0], [0, 1], [1, 0]]),
        log=quiet,
    )
    engine = Engine(eng, threads=1)
    prompt, n, samples = [1, 5, 3], 3, 3000
    exact = exact_distribution(model, prompt, n, temperature, top_k, top_p)
    counts: dict = {}
    steps = []
    for seed in range(samples):
        r = engine.generate(
            input_ids=prompt,
            max_new_tokens=n,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
        )
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
        steps += r.accepted_per_step
    assert set(counts) <= set(exact)
    assert chi_square_pvalue(counts, exact, samples) > 1e-3
    assert max(steps) > 1  # speculative steps accepted drafts
    again = engine.generate(input_ids=prompt, max_new_tokens=n, sampling=SamplingParams(temperature, top_k, top_p, 7))
    first = engine.generate(input_ids=prompt, max_new_tokens=n, sampling=SamplingParams(temperature, top_k, top_p, 7))
    assert again.output_ids == first.output_ids


@full("another tiny shape's Medusa engine and a lossy one beside it")
def test_typical_acceptance_is_opt_in_and_labelled(toy_medusa, tmp_path):
    model, _, ckpt = toy_medusa["qwen2_bias"]
    eng = build_engine(
        ckpt,
        tmp_path / "typical",
        BuildOptions(backends=ORT_ONLY, speculative_mode="medusa", tree=TREE, typical_acceptance=(0.09, 0.3)),
        log=quiet,
    )
    engine = Engine(eng, threads=1)
    assert engine.manifest["lossless"] is False
    ids = PROMPTS[0]
    assert engine.generate(input_ids=ids, max_new_tokens=30).output_ids == hf_greedy(model, ids, 30)


@full("two more Medusa engines (draft vocabulary)")
def test_draft_vocabulary_extension_is_exact_and_validated(tmp_path):
    from safetensors.torch import load_file, save_file

    model = toy_model("llama_tied_linear", tmp_path / "hf", seed=4)
    write_medusa_heads(tmp_path / "heads", "v2", _hidden(model), 12, num_heads=3, seed=4)
    file = tmp_path / "heads" / "medusa_lm_head.safetensors"
    state = load_file(str(file))
    save_file({**state, "draft_vocab": torch.tensor([0, 2, 3, 5, 7, 8, 9, 11])}, str(file))
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"medusa": tmp_path / "heads"}, progress=False)
    engine = Engine(
        build_engine(
            ckpt, tmp_path / "engine", BuildOptions(backends=ORT_ONLY, speculative_mode="medusa", tree=TREE), log=quiet
        ),
        threads=1,
    )
    assert engine.manifest["mode"]["draft_vocab_size"] == 8
    drafted = set()
    real_run = engine.backend.run

    def spy(feeds, aliases=None, buffers=None):
        out = real_run(feeds, aliases, buffers)
        drafted.update(out["next_input_ids"][0, 1:].tolist())
        return out

    engine.backend.run = spy
    for ids in PROMPTS:
        assert engine.generate(input_ids=ids, max_new_tokens=30).output_ids == hf_greedy(model, ids, 30)
    assert drafted and drafted <= {0, 2, 3, 5, 7, 8, 9, 11}  # proposals come from the draft vocabulary only
    save_file({**state, "draft_vocab": torch.tensor([3, 2, 5])}, str(file))
    with pytest.raises(SpecbuildError, match="draft_vocab must hold strictly increasing"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt2", heads={"medusa": tmp_path / "heads"}, progress=False)
    assert not (tmp_path / "ckpt2").exists()
