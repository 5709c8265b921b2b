"""Shared test fixtures: tiny random HF models of three Llama-family shapes, SmolLM2-135M, and their checkpoints.

Tiny models get weights of std 0.3-0.5 (not HF's 0.02), random norm weights and biases, so logits are peaked and every
tensor matters: a loader or network bug changes the output instead of hiding in near-uniform noise.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from specbuild.builder.trace_cache import CACHE_ENV as TRACE_CACHE_ENV

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per xdist worker: two workers on two cores, no oversubscription (ORT reads SPECBUILD_THREADS)
    os.environ.setdefault("SPECBUILD_THREADS", "1")
    torch.set_num_threads(1)


# the user cache (row-invariance verdicts, verified file hashes) of this test process only: nothing is read from or
# left in the user's ~/.cache; tests that need a cold or warm cache set it themselves
# exactness tests must exercise drafting whatever the machine's measured costs: the policy is pinned (tests of the
# cost-driven policy pass theirs explicitly)
os.environ.setdefault("SPECBUILD_SPECULATION", "always")
if "SPECBUILD_CACHE_DIR" not in os.environ:
    os.environ["SPECBUILD_CACHE_DIR"] = tempfile.mkdtemp(prefix="specbuild-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SPECBUILD_CACHE_DIR"], True)


# Test tiers. `scripts/test.sh` runs the fast tier (unit tests, tiny random models, each mode's lossless and sampling
# tests on one tiny shape, the server and scheduler on tiny engines: under 5 minutes on 2 cores); `scripts/test.sh
# --full` (CI) adds what is marked `full`: the real model, every shape and precision, Triton, packaging, training.
FULL = "full"
REAL_MODEL_FIXTURES = ("smollm2_", "gemma3_")  # fixtures of the real models: only tests of the full tier use them


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="Also run the full tier (tests marked `full`).")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{FULL}(reason): in the full tier only (scripts/test.sh --full); says why")
    # one trace cache for the run (builder/trace_cache.py): the builds of a structure after its first, in any worker
    # or CLI subprocess, skip torch.export (tests/builder/test_trace_cache.py proves them byte-identical)
    if not hasattr(config, "workerinput") and TRACE_CACHE_ENV not in os.environ:
        config._trace_cache_dir = tempfile.mkdtemp(prefix="specbuild-trace-cache-")
        os.environ[TRACE_CACHE_ENV] = config._trace_cache_dir


def pytest_unconfigure(config):
    folder = getattr(config, "_trace_cache_dir", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(TRACE_CACHE_ENV, None)


def full(reason: str):
    """The `full` marker: this test runs in the full tier only, for `reason` (what makes it belong there)."""
    return getattr(pytest.mark, FULL)(reason)


def full_tier(config) -> bool:
    """Whether this run is the full tier (--full)."""
    return bool(config.getoption("--full"))


def fast_first(values, reason: str) -> list:
    """Parameter values for parametrize: the first runs in the fast tier, the others in the full tier (`reason`).
    A tuple is the values of several arguments (`parametrize("a,b", ...)`)."""
    values = list(values)
    rest = [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=full(reason)) for v in values[1:]]
    return values[:1] + rest


def _select_tier(config, items) -> None:
    """Without --full, leave out the tests marked `full`; every `full` marker must say why."""
    kept, left = [], []
    for item in items:
        marker = item.get_closest_marker(FULL)
        if marker is not None and not (marker.args and isinstance(marker.args[0], str) and marker.args[0].strip()):
            raise pytest.UsageError(f"{item.nodeid}: a `full` marker must say why the test is in the full tier")
        if marker is None and any(name.startswith(REAL_MODEL_FIXTURES) for name in getattr(item, "fixturenames", ())):
            raise pytest.UsageError(f"{item.nodeid}: a test of the real model belongs to the full tier (mark it full)")
        (left if marker is not None and not full_tier(config) else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


class Lazy(dict):
    """{key: value} built on first use by make(key): a fixture over many shapes or modes builds only what the selected
    tests read (the fast tier reads one)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        value = self[key] = self.make(key)
        return value


def pytest_collection_modifyitems(config, items):
    """Select the tier, then keep each `xdist_group` on one worker (its session fixtures are then built once).

    pytest-xdist 3.8 tags grouped items by assigning `item._nodeid`, which pytest >= 9.2 no longer reads (node ids
    live in `item._id`): the groups were silently spread over both workers and every expensive fixture was built
    twice. Tag them here the way xdist's scheduler reads them (`<nodeid>@<group>`), on any pytest version."""
    _select_tier(config, items)
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    for item in items:
        groups = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        if not groups or "@" in item.nodeid:
            continue
        tagged = f"{item.nodeid}@{'_'.join(groups)}"
        if hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(tagged)
        else:
            item._nodeid = tagged


# Builds that only need the graph ONNX Runtime runs (tests/builder/test_graphs.py covers the portable one per mode)
ORT_ONLY = ("onnxruntime",)

TINY_SEED = 0
TINY_STD = 0.3
TINY_VOCAB_STD = 0.5  # embeddings / lm_head: peaked logits

# name -> (transformers config class name, model class name, config kwargs)
TINY_SHAPES: dict[str, tuple[str, str, dict]] = {
    "llama_gqa_llama3rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "llama_tied_linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=61,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=24,
            max_position_embeddings=128,
            rms_norm_eps=1e-6,
            rope_theta=500.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen2_bias": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=89,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}

TINY_ENGINE = "qwen2_bias"  # the tiny `none` engine of the fast tier (its Llama shapes run in every mode's tests)
# the tiny shapes, TINY_ENGINE first: parameter values of the tests over tiny_engines
TINY_ENGINE_SHAPES = fast_first(
    [TINY_ENGINE, *(name for name in TINY_SHAPES if name != TINY_ENGINE)], "another tiny shape's `none` engine"
)

# Sliding-window shapes (kept out of TINY_SHAPES so the suites parametrized over it do not grow): windows far
# shorter than prompt + output. Mistral slides on every layer; this Qwen2 only on layers >= max_window_layers.
SLIDING_SHAPES: dict[str, tuple[str, str, dict]] = {
    "mistral_window": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen2_window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=89,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}
# The architectures beyond the Llama family's core (tests/builder/test_architectures.py): each proved against
# transformers at several seeds, every mode on them. head_dim differs from hidden / heads where the config allows it.
ARCH_SHAPES: dict[str, tuple[str, str, dict]] = {
    "qwen3_qknorm": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=83,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen3_window": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=89,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "phi3_longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            vocab_size=91,
            hidden_size=64,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            # the long factors from here: a 64-token generation crosses it (ModelConfig.rope_switch)
            original_max_position_embeddings=40,
            partial_rotary_factor=0.5,  # 16 of the 32 dims of a head rotate (ONNX Runtime: 16 is its least)
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 1.9, 2.4, 3.0, 3.6, 4.0],
                "long_factor": [1.5, 2.3, 3.4, 5.0, 7.1, 9.8, 13.0, 16.0],
            },
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            sliding_window=None,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
    "phi3_window": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            vocab_size=77,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            original_max_position_embeddings=128,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=6,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
    "gemma3_pattern": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            query_pre_attn_scalar=20,  # scores scaled by 20 ** -0.5, not head_dim ** -0.5
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
    "gemma3_untied": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=83,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            hidden_activation="gelu",
            # logit soft-capping (no Gemma 3 release sets it), small enough to change sampling; attention's is set
            # but transformers' Gemma 3 never applies it (config_fields)
            attn_logit_softcapping=2.0,
            final_logit_softcapping=4.0,
            tie_word_embeddings=False,  # a peaked lm_head of its own
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
}
ALL_SHAPES = {**TINY_SHAPES, **SLIDING_SHAPES, **ARCH_SHAPES}


def tiny_hf_config(name: str, **overrides):
    """A fresh transformers config object for TINY_SHAPES / SLIDING_SHAPES[name] (optional overrides, e.g. vocab)."""
    import transformers

    config_cls, _, kwargs = ALL_SHAPES[name]
    return getattr(transformers, config_cls)(**{**kwargs, **overrides})


def tiny_hf_model(name: str, seed: int = TINY_SEED, **overrides):
    """A TINY_SHAPES / SLIDING_SHAPES[name] transformers model with seeded, non-tiny random weights, in eval mode."""
    import transformers

    _, model_cls, _ = ALL_SHAPES[name]
    model = getattr(transformers, model_cls)(tiny_hf_config(name, **overrides))
    gen = torch.Generator().manual_seed(seed)
    # Gemma's norms scale by 1 + weight (weights around 0) and its embeddings by sqrt(hidden) (rows scaled down)
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for pname, param in model.named_parameters():  # tied parameters are yielded once
            noise = torch.randn(param.shape, generator=gen)
            if pname.endswith("norm.weight"):
                param.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            elif gemma and pname == "model.embed_tokens.weight":
                param.copy_(TINY_VOCAB_STD * noise / model.config.hidden_size**0.5)

            elif pname.endswith(".bias"):
                param.copy_(0.2 * noise)
            elif pname in ("model.embed_tokens.weight", "lm_head.weight"):
                param.copy_(TINY_VOCAB_STD * noise)
            else:
                param.copy_(TINY_STD * noise)
    return model.eval()


def save_tiny_model(name: str, out_dir: Path, **save_kwargs) -> Path:
    """Save TINY_SHAPES[name] (seeded weights) with save_pretrained into out_dir and return it."""
    tiny_hf_model(name).save_pretrained(out_dir, **save_kwargs)
    return Path(out_dir)


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory) -> dict[str, Path]:
    """TINY_SHAPES name -> HF model directory (config.json + model.safetensors, no tokenizer)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: save_tiny_model(name, root / name) for name in TINY_SHAPES}


@pytest.fixture(scope="session")
def tiny_checkpoints(tiny_hf_models, tmp_path_factory) -> dict[str, Path]:
    """TINY_SHAPES name -> canonical float32 checkpoint directory."""
    from specbuild.builder.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("tiny_ckpt")
    return {name: convert_checkpoint(hf, root / name, progress=False) for name, hf in tiny_hf_models.items()}


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A directory `make(path)` writes once per test run, shared by every xdist worker (a file lock orders them; a
    marker beside it says it is complete)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    path, done = root / "shared" / name, root / "shared" / f"{name}.done"
    path.parent.mkdir(exist_ok=True)
    with FileLock(str(root / "shared" / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(path, ignore_errors=True)
            make(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a HF directory, made once per test run; reused from the cache directory SPECBUILD_CACHE
    names, if set."""
    from specbuild.builder.default_model import prepare_smollm2

    if os.environ.get("SPECBUILD_CACHE"):
        return prepare_smollm2()
    return made_once(tmp_path_factory, "smollm2-hf", prepare_smollm2)


@pytest.fixture(scope="session")
def gemma3_hf(tmp_path_factory) -> Path:
    """Gemma 3 270M as a HF directory, from the PyPI package the user installs under the Gemma terms (skipped
    without it: scripts/setup-venv.sh installs it only with SPECBUILD_GEMMA_TERMS=accept)."""
    import importlib.util

    from specbuild.builder.default_model import GEMMA3_MODULE, GEMMA3_PACKAGE, prepare_gemma3

    if importlib.util.find_spec(GEMMA3_MODULE) is None:
        pytest.skip(
            f"{GEMMA3_PACKAGE} is not installed (Gemma terms: SPECBUILD_GEMMA_TERMS=accept scripts/setup-venv.sh)"
        )
    if os.environ.get("SPECBUILD_CACHE"):
        return prepare_gemma3()
    return made_once(tmp_path_factory, "gemma3-hf", prepare_gemma3)


@pytest.fixture(scope="session")
def gemma3_checkpoint(gemma3_hf, tmp_path_factory) -> Path:
    """Gemma 3 270M as a canonical float32 checkpoint, converted once per test run."""
    from specbuild.builder.convert import convert_checkpoint

    return made_once(tmp_path_factory, "gemma3-ckpt", lambda path: convert_checkpoint(gemma3_hf, path, progress=False))


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_hf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a canonical float32 checkpoint, converted once per test run."""
    from specbuild.builder.convert import convert_checkpoint

    return made_once(
        tmp_path_factory, "smollm2-ckpt", lambda path: convert_checkpoint(smollm2_hf, path, progress=False)
    )


@pytest.fixture(scope="session")
def smollm2_engines(smollm2_checkpoint, tmp_path_factory) -> Lazy:
    """{build options as sorted (name, value) pairs: SmolLM2 `none` engine}, each built once per test run and shared
    by the real-model tests that compare a speculative engine with the `none` engine of the same precision."""
    from specbuild.builder.build import BuildOptions, build_engine

    def make(options: tuple) -> Path:
        def build(path: Path) -> None:
            build_engine(smollm2_checkpoint, path, BuildOptions(**dict(options)), log=quiet)

        name = hashlib.sha256(repr(options).encode()).hexdigest()[:16]
        return made_once(tmp_path_factory, f"smollm2-engine-{name}", build)

    return Lazy(make)


def options_key(**options) -> tuple:
    """The key of smollm2_engines for these build options."""
    return tuple(sorted(options.items()))


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_hf):
    """SmolLM2-135M-Instruct in transformers (float32, eval), loaded once per worker."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_hf_model):
    """greedy(ids, n): transformers' greedy continuation on SmolLM2, generated once per (ids, n) and shared by every
    engine the real-model tests compare with it (each costs seconds on this CPU)."""
    cache: dict[tuple, list[int]] = {}

    def greedy(ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(smollm2_hf_model, ids, max_new_tokens)
        return list(cache[key])

    return greedy


def quiet(*_args, **_kwargs):
    pass


def graph_nodes(graph) -> list:
    """Every node of an onnx GraphProto, those of its If branches included (an engine-drafted mode drafts in one)."""
    out = []
    for node in graph.node:
        out.append(node)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                out += graph_nodes(sub)
    return out


def assert_drafting_behind_an_if(onnx_path: Path) -> None:
    """A graph that takes draft_rows drafts behind one If (a call that drafts for no row skips it): each of its draft
    outputs (next tree, new states) comes out of the same If node."""
    import onnx

    from specbuild import engine_format as ef

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    assert ef.DRAFT_ROWS in [i.name for i in graph.input], onnx_path
    made_by = {out: node for node in graph.node for out in node.output}
    drafted = [o.name for o in graph.output if o.name.startswith(("next_", ef.NEW_STATE_PREFIX))]
    assert drafted, onnx_path
    makers = {made_by[name].name for name in drafted}
    assert len(makers) == 1 and made_by[drafted[0]].op_type == "If", (onnx_path, makers)


@pytest.fixture(scope="session")
def tiny_engines(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """TINY_SHAPES name -> `none` engine built with --output-logits (each when a selected test first reads it: the
    fast tier reads TINY_ENGINE's alone)."""
    from specbuild.builder.build import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("tiny_engines")
    options = BuildOptions(output_logits=True)
    return Lazy(lambda name: build_engine(tiny_checkpoints[name], root / name, options, log=quiet))


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate, generated ids only (stops at the config's EOS like the engine)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def check_none_engine(model, ckpt: Path, engine_dir: Path, prompts: list[list[int]], new_tokens: int) -> None:
    """A `none` engine of `ckpt` (built with logits into engine_dir) against transformers' `model`: its portable graph
    passes the TensorRT operator check, its prefill logits are within 1e-4 and its greedy ids equal transformers' for
    `new_tokens` on every prompt."""
    import numpy as np
    import onnx

    from specbuild import engine_format as ef
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.builder.trt_compat import lint_onnx_for_tensorrt
    from specbuild.runtime.engine import Engine

    engine_dir = build_engine(ckpt, engine_dir, BuildOptions(output_logits=True), log=quiet)
    assert lint_onnx_for_tensorrt(onnx.load(str(engine_dir / ef.ENGINE_ONNX), load_external_data=False)) == []
    engine = Engine(engine_dir, threads=1)
    ids = [1, 5, 9, 13, 7, 22, 3, 30, 11, 2, 4, 17, 19]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(engine.prefill_logits(ids) - want).max() < 1e-4
    for prompt in prompts:
        assert engine.generate(input_ids=prompt, max_new_tokens=new_tokens).output_ids == hf_greedy(
            model, prompt, new_tokens
        )


def write_char_tokenizer(hf: Path, vocab_offset: int = 0, decoder: bool = True) -> None:
    """A character-level tokenizer.json (Metaspace, no merges) covering printable ASCII in ids offset.. offset+96."""
    chars = ["<unk>", "▁"] + [chr(c) for c in range(33, 127) if chr(c) not in '"\\']
    vocab = {tok: i + vocab_offset for i, tok in enumerate(chars)}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        "post_processor": None,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
        if decoder
        else None,
        "model": {
            "type": "BPE",
            "vocab": vocab,
            "merges": [],
            "unk_token": "<unk>",
            "dropout": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
        },
    }
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.fixture(scope="session")
def int8_engines(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """int4 weights with int8 activations on a tiny model: `none` (with logits) and `ngram` (chains of <= 3 drafts).
    Tests using it run in xdist_group("quantize")."""
    from specbuild.builder.build import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("int8_engines")
    ckpt = tiny_checkpoints["llama_gqa_llama3rope"]
    common = dict(backends=ORT_ONLY, weights="int4", int8_activations=True, max_seq_len=128)
    return {
        "none": build_engine(ckpt, root / "none", BuildOptions(output_logits=True, **common), log=quiet),
        "ngram": build_engine(
            ckpt, root / "ngram", BuildOptions(speculative_mode="ngram", num_draft_tokens=3, **common), log=quiet
        ),
    }
