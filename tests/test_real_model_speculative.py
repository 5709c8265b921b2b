"""SmolLM2-135M-Instruct with the speculative heads shipped in the package: exact greedy ids and real acceptance."""

import json

import pytest

from specbuild.builder.checkpoint.default_model import shipped_heads
from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, options_key, quiet
from tests.tiers import full

pytestmark = [
    pytest.mark.xdist_group("real"),
    full("the real SmolLM2-135M model: a 135M engine per mode and precision"),
]

# What this release ships; a head directory that goes missing (or appears untested) fails here.
SHIPPED = {"medusa", "eagle", "eagle3", "redrafter", "draft-target"}
PROMPTS = [
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    "<|im_start|>user\nGive me three tips for staying healthy.<|im_end|>\n<|im_start|>assistant\n",
    "from typing import List\n\n\ndef below_zero(operations: List[int]) -> bool:\n",
]


def accepted_steps(engine, prompts, reference, max_new_tokens: int = 64) -> list[int]:
    """Tokens accepted per step by `engine` on `prompts`, each output checked against reference(ids, n)."""
    steps = []
    for prompt in prompts:
        ids = engine.codec.encode(prompt)
        result = engine.generate(input_ids=ids, max_new_tokens=max_new_tokens)
        assert result.output_ids == reference(ids, max_new_tokens), prompt
        steps += result.accepted_per_step
    return steps


def greedy_of(engine):
    """reference(ids, n) for accepted_steps: `engine`'s own output."""
    return lambda ids, n: engine.generate(input_ids=ids, max_new_tokens=n).output_ids


def test_the_package_ships_the_expected_heads():
    assert set(shipped_heads()) == SHIPPED


@pytest.mark.parametrize("mode", sorted(SHIPPED))
def test_greedy_equals_transformers_with_shipped_heads(mode, smollm2_hf, smollm2_greedy, tmp_path):
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.builder.checkpoint.convert import convert_checkpoint

    heads = shipped_heads()
    assert mode in heads, f"{mode} heads are not shipped"
    ckpt = convert_checkpoint(smollm2_hf, tmp_path / "ckpt", heads={mode: heads[mode]}, progress=False)
    engine_dir = build_engine(
        ckpt, tmp_path / "engine", BuildOptions(backends=ORT_ONLY, speculative_mode=mode, max_seq_len=512), log=quiet
    )
    engine = Engine(engine_dir)
    steps = accepted_steps(engine, PROMPTS, smollm2_greedy)
    assert sum(steps) / len(steps) > 1.15  # the shipped heads really draft accepted tokens (measured τ 1.25-1.8)
    # the head modes build with the heads' recorded weights (int8/int4 blocks), and the output above is still exact
    recorded = json.loads((heads[mode] / "config.json").read_text())["specbuild_defaults"].get("head_weights")
    assert engine.manifest["weights"]["mode_weights"] == (recorded or "float32")
    assert recorded is not None or mode == "draft-target"


def test_ngram_greedy_equals_transformers(smollm2_checkpoint, smollm2_greedy, tmp_path):
    """Prompt lookup decoding needs no heads: any base model, exact greedy ids, drafts accepted on code."""
    from specbuild.builder.build import BuildOptions, build_engine

    options = BuildOptions(backends=ORT_ONLY, speculative_mode="ngram", ngram_candidates=2, max_seq_len=512)
    engine = Engine(build_engine(smollm2_checkpoint, tmp_path / "engine", options, log=quiet))
    steps = accepted_steps(engine, PROMPTS, smollm2_greedy)
    assert sum(steps) / len(steps) > 1.1


def test_int8_activation_ngram_equals_its_none_engine(smollm2_checkpoint, smollm2_engines, tmp_path):
    """int4 weights with int8 activations (what ONNX Runtime GenAI runs): prompt lookup reproduces the none engine
    of the same build token for token on this CPU, or is refused as lossless here. Without attention padding it did
    not (1/20 and 3/20 prompts on AVX-512, 2026-11-24); without step padding neither on AVX2 (2/10, 2026-11-25).
    Measured: an AVX-512 CPU needs no step padding, an AVX2-only one pads every call to two rows."""
    from specbuild.builder.build import BuildOptions, build_engine

    common = dict(backends=ORT_ONLY, weights="int4", int8_activations=True, max_seq_len=512)
    none = Engine(smollm2_engines[options_key(**common)])
    options = BuildOptions(speculative_mode="ngram", num_draft_tokens=3, **common)
    ngram_dir = build_engine(smollm2_checkpoint, tmp_path / "ngram", options, log=quiet)
    try:
        ngram = Engine(ngram_dir)
    except SpecbuildError as exc:  # no exact path on this CPU: refused in one line, runs only labelled lossy
        assert "--allow-lossy" in str(exc) and "\n" not in str(exc)
        assert not Engine(ngram_dir, allow_lossy=True).lossless
        return
    assert ngram.manifest["lossless"] is True and ngram.lossless
    assert ngram.min_rows == none.min_rows == ngram.exactness.probe.min_rows
    steps = accepted_steps(ngram, PROMPTS, greedy_of(none), max_new_tokens=96)
    assert max(steps) > 1


def test_int4_draft_target_equals_its_none_engine(smollm2_hf, smollm2_engines, tmp_path):
    """The shipped SmolLM2 draft at int4 (target and draft weights) reproduces the int4 none engine token for token,
    with drafts accepted (fp32 against transformers: test_greedy_equals_transformers_with_shipped_heads)."""
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.builder.checkpoint.convert import convert_checkpoint

    heads = {"draft-target": shipped_heads()["draft-target"]}
    ckpt = convert_checkpoint(smollm2_hf, tmp_path / "ckpt", heads=heads, progress=False)
    common = dict(backends=ORT_ONLY, weights="int4", max_seq_len=512)
    none = Engine(smollm2_engines[options_key(**common)])  # heads or not, the same none engine
    options = BuildOptions(speculative_mode="draft-target", **common)
    draft = Engine(build_engine(ckpt, tmp_path / "dt", options, log=quiet))
    assert draft.drafter_settings.engine.manifest["weights"]["precision"] == "int4"
    drafter = draft.manifest["mode"]["drafter"]
    assert (drafter["top_k"], drafter["num_draft_tokens"]) == (1, 3)  # the draft's recorded choice: a chain of 3
    steps = accepted_steps(draft, PROMPTS[:2], greedy_of(none))
    assert sum(steps) / len(steps) > 1.6  # the GPU-trained draft (tau 2.3 on HumanEval at int4; the CPU one 1.3)


def test_lookahead_equals_transformers_and_its_int4_none_engine(
    smollm2_checkpoint, smollm2_engines, smollm2_greedy, tmp_path
):
    """Lookahead needs no heads: exact greedy ids at fp32 (against transformers) and at int4 (against the int4 none
    engine), with guesses accepted."""
    from specbuild.builder.build import BuildOptions, build_engine

    options = BuildOptions(backends=ORT_ONLY, speculative_mode="lookahead", max_seq_len=512)
    engine = Engine(build_engine(smollm2_checkpoint, tmp_path / "fp32", options, log=quiet))
    steps = accepted_steps(engine, PROMPTS, smollm2_greedy)
    assert sum(steps) / len(steps) > 1.1
    common = dict(backends=ORT_ONLY, weights="int4", max_seq_len=512)
    none = Engine(smollm2_engines[options_key(**common)])
    options = BuildOptions(speculative_mode="lookahead", **common)
    lookahead = Engine(build_engine(smollm2_checkpoint, tmp_path / "lookahead4", options, log=quiet))
    steps = accepted_steps(lookahead, PROMPTS[:2], greedy_of(none))
    assert max(steps) > 1
