"""`specbuild build`: canonical checkpoint -> torch step module -> ONNX (validated) -> engine directory."""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from specbuild import __version__
from specbuild import engine_format as ef
from specbuild.builder.checkpoint import Checkpoint
from specbuild.errors import SpecbuildError
from specbuild.fsutil import atomic_output_dir, existing_paths, prepare_output_dir
from specbuild.plugins.registry import baseline_mode, get_mode, load_object, mode_options, modes_reading

# Largest --max-seq-len accepted whatever the model's max_position_embeddings (a 2**20-position KV cache of even a
# small model is tens of GB).
MAX_SEQ_LEN = 1 << 20
# What a quantized graph's greedy agreement is measured on (when the checkpoint has a tokenizer).
QUANTIZATION_CHECK_TEXT = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    "The capital of France is Paris. Speculative decoding drafts tokens and verifies them in one pass."
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclasses.dataclass
class _BuildOptions:
    """The options every build reads; BuildOptions adds one field per mode-specific option (plugins' ModeSpecs)."""

    speculative_mode: str | None = None  # default: the baseline (plain decoding)
    max_seq_len: int | None = None
    output_logits: bool = False
    backends: tuple[str, ...] = ef.BACKENDS  # one graph per backend: onnxruntime (fused kernels), tensorrt (portable)
    weights: str | None = None  # fp32, fp16, int8, int4 (default: fp16 for a float16 checkpoint, else fp32)
    weights_block_size: int = 32  # int4/int8: weights per quantization block along K
    int8_activations: bool = False  # int4/int8: quantize activations to int8 too (faster; calls padded, ort_kernels)
    tensorrt: bool = False
    fp16_plan: bool = False
    overwrite: bool = False
    validate_tolerance: float | None = None

    def __post_init__(self):
        if self.speculative_mode is None:
            self.speculative_mode = baseline_mode()

    @classmethod
    def from_recipe(cls, recipe_file, **overrides) -> BuildOptions:
        path = Path(recipe_file)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise SpecbuildError(f"recipe {path}: not found") from None
        except OSError as exc:
            raise SpecbuildError(f"recipe {path}: cannot read ({exc.strerror or exc})") from None
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise SpecbuildError(f"recipe {path}: invalid YAML ({exc})") from None
        data = data.get("build", data)
        if not isinstance(data, dict):
            raise SpecbuildError(f"recipe {path}: expected a mapping of build options")
        names = {f.name for f in dataclasses.fields(cls)}
        data = {k.replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SpecbuildError(f"recipe {path}: unknown build option(s) {unknown}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        typical = data.get("typical_acceptance")
        if isinstance(typical, (list, tuple)):
            data["typical_acceptance"] = tuple(typical)
        options = cls(**data)
        options.check(source=f"recipe {path}: ")
        return options

    def check(self, source: str = "") -> None:
        """Types and ranges of every option, checked before any work; the message names the option and its range.

        Limits that depend on the checkpoint (max_position_embeddings, vocabulary, heads) are checked by
        build_engine and the mode plugin, still before any weight is loaded."""

        def fail(name: str, want: str):
            raise SpecbuildError(f"{source}{_flag(name)} {getattr(self, name)!r} is invalid: expected {want}")

        def integer(name: str, lo: int, hi: int | None = None):
            value = getattr(self, name)
            if value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
                fail(name, f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")

        get_mode(self.speculative_mode, option=f"{source}--speculative-mode")
        integer("max_seq_len", 2, MAX_SEQ_LEN)
        for option in mode_options().values():
            if option.kind == "int":
                integer(option.name, option.minimum or 0)
            elif option.kind == "text":
                value = getattr(self, option.name)
                if value is not None and not isinstance(value, (str, list, tuple, Path)):
                    fail(option.name, "text, a list or a file path")
        for name in ("output_logits", "tensorrt", "fp16_plan", "overwrite", "int8_activations"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "true or false")
        if self.typical_acceptance is not None:
            typical = self.typical_acceptance
            numbers_ok = (
                isinstance(typical, tuple)
                and len(typical) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in typical)
            )
            if not numbers_ok or not (0 < typical[0] <= 1 and 0 <= typical[1] <= 1):  # NaN fails the comparisons
                fail("typical_acceptance", "EPS,ALPHA with 0 < EPS <= 1 and 0 <= ALPHA <= 1 (e.g. 0.09,0.3)")
        tol = self.validate_tolerance
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < math.inf):
            fail("validate_tolerance", "a finite number > 0")
        if self.fp16_plan and not self.tensorrt:
            raise SpecbuildError(f"{source}--fp16-plan applies to the TensorRT plan: add --tensorrt")
        backends = self.backends
        if isinstance(backends, str):
            backends = tuple(b.strip() for b in backends.split(",") if b.strip())
        if (
            not isinstance(backends, (list, tuple))
            or not backends
            or len(set(backends)) != len(backends)
            or any(b not in ef.BACKENDS for b in backends)
        ):
            fail("backends", f"a non-empty list of distinct backends among {', '.join(ef.BACKENDS)}")
        self.backends = tuple(backends)
        if self.weights is not None and self.weights not in ef.WEIGHTS:
            fail("weights", f"one of {', '.join(ef.WEIGHTS)}")
        bs = self.weights_block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs > 256 or bs & (bs - 1):
            fail("weights_block_size", "a power of two between 16 and 256")
        if self.int8_activations and self.weights not in ("int4", "int8"):
            raise SpecbuildError(f"{source}--int8-activations applies to --weights int4 or int8")
        if self.weights == "int8" and ef.BACKEND_TENSORRT in self.backends:
            raise SpecbuildError(
                f"{source}--weights int8 builds the onnxruntime graph only (TensorRT's ONNX parser takes blockwise "
                "quantized weights in int4 only): pass --backends onnxruntime, or use --weights int4 or fp16"
            )
        if self.tensorrt and ef.BACKEND_TENSORRT not in self.backends:
            raise SpecbuildError(f"{source}--tensorrt compiles the tensorrt graph: add tensorrt to --backends")


BuildOptions = dataclasses.make_dataclass(
    "BuildOptions",
    [(name, Any, dataclasses.field(default=None)) for name in mode_options()],
    bases=(_BuildOptions,),
)
BuildOptions.__doc__ = (
    """Build options: the common ones and every mode's own (None = the mode's default); see --help."""
)
BuildOptions.__module__ = __name__


def load_plugin_class(mode: str):
    """The torch graph plugin (ModePlugin subclass) of `mode`."""
    return load_object(get_mode(mode).graph_plugin)


def _check_mode_options(options) -> None:
    """A mode-specific option the chosen mode does not read is an error (it would be silently ignored)."""
    reads = {o.name for o in get_mode(options.speculative_mode).options}
    for name in mode_options():
        if getattr(options, name) is not None and name not in reads:
            raise SpecbuildError(
                f"{_flag(name)} does not apply to --speculative-mode {options.speculative_mode} "
                f"(it is an option of {', '.join(modes_reading(name))})"
            )


def _io_spec(onnx_path: Path) -> dict:
    """{"inputs": [...], "outputs": [...]}: name, dtype and shape (ints or symbolic names) as ONNX Runtime sees them."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])

    def describe(items):
        return [
            {"name": i.name, "dtype": i.type.removeprefix("tensor(").rstrip(")"), "shape": list(i.shape)} for i in items
        ]

    return {"inputs": describe(sess.get_inputs()), "outputs": describe(sess.get_outputs())}


def build_engine(checkpoint_dir, output_dir, options: BuildOptions, log=print) -> Path:
    """Build an engine directory. Nothing is left at output_dir if any step fails."""
    import torch

    from specbuild.builder.export import compare_quantized, export_step, validate_export
    from specbuild.builder.network import LlamaNetwork
    from specbuild.builder.quantize import ACCURACY_FP32, ACCURACY_INT8
    from specbuild.builder.step import FusedStepModule, StepModule
    from specbuild.builder.trt_compat import assert_tensorrt_clean
    from specbuild.builder.weights_file import WEIGHTS_FILE, share_weights

    options.check()
    started = time.perf_counter()
    sources = [checkpoint_dir, *existing_paths(options.tree)]  # checked before any work: never replaced
    target = prepare_output_dir(output_dir, overwrite=options.overwrite, inputs=sources)
    if options.tensorrt:
        from specbuild.builder.tensorrt_plan import tensorrt_available

        if not tensorrt_available():
            raise SpecbuildError(
                "--tensorrt needs the TensorRT Python package (pip install specbuild[trt]) on an "
                "NVIDIA GPU host; build without --tensorrt for the ONNX Runtime engine"
            )
    ckpt = Checkpoint.load(checkpoint_dir)
    cfg = ckpt.model
    max_seq_len = options.max_seq_len or min(cfg.max_position_embeddings, 4096)
    if max_seq_len < 2 or max_seq_len > cfg.max_position_embeddings:
        raise SpecbuildError(
            f"--max-seq-len {max_seq_len} must be between 2 and the model's max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    plugin_cls = load_plugin_class(options.speculative_mode)
    _check_mode_options(options)
    settings = plugin_cls.check_options(ckpt, options)  # mode bounds from the configs: before any weight loads
    if settings["tokens_per_step"] >= max_seq_len:
        raise SpecbuildError(
            f"--max-seq-len {max_seq_len} leaves no room for the prompt: one {options.speculative_mode} step verifies "
            f"{settings['tokens_per_step']} tokens; use a larger --max-seq-len or a smaller tree"
        )
    if ckpt.tokenizer_file is not None:  # the engine carries it: it must load, round-trip and render its template
        from specbuild.builder.tokenizer_io import validate_tokenizer

        config_file = ckpt.path / ef.CHECKPOINT_CONFIG
        validate_tokenizer(ckpt.tokenizer_file, ckpt.tokenizer_file, cfg.vocab_size, ckpt.chat_template, config_file)
    if options.typical_acceptance is not None:
        log("warning: typical acceptance is LOSSY (not distribution-preserving); the engine is marked lossless: false")
    torch.manual_seed(0)
    # ONNX Runtime's CPU kernels barely cover bfloat16: bf16 checkpoints become fp32 engines (exact upcast);
    # int4/int8 quantize the float32 graph
    weights = options.weights or ("fp16" if ckpt.dtype == "float16" else "fp32")
    engine_dtype = "float16" if weights == "fp16" else "float32"
    if ckpt.dtype == "bfloat16" and weights == "fp32":
        log("bfloat16 checkpoint: building a float32 engine (ONNX Runtime CPU has few bfloat16 kernels)")
    net = LlamaNetwork.from_tensors(cfg, ckpt.tensors(), engine_dtype)
    plugin = plugin_cls(ckpt, net, options).to(net.embed_tokens.weight.dtype).eval()
    tree = plugin.tree()
    chain_drafts = settings.get("chain_drafts", tree is not None and tree.is_chain)
    tolerance = options.validate_tolerance or (1e-3 if engine_dtype == "float32" else 5e-2)
    quantized = weights in ("int4", "int8")
    # int8 activations turn last-bit row differences into other tokens (ort_kernels: row padding): attention is
    # padded to >= 2 rows (it needs it on every CPU measured), and the graph takes a min_rows input with which the
    # runtime pads whole calls where the probe finds other kernels need it (runtime/row_invariance.py)
    pad_rows = 1 if options.int8_activations else 0
    prompt_ids = _sample_prompt(ckpt, cfg)
    graphs = []
    with atomic_output_dir(target) as tmp:
        unfused = fused_kernels_unsupported(cfg, engine_dtype)
        for backend in sorted(options.backends, key=ef.BACKENDS.index, reverse=True):  # portable graph first
            if backend == ef.BACKEND_TENSORRT or unfused:
                step_cls, file, kv_layout = StepModule, ef.ENGINE_ONNX, ef.KV_STACKED
                if backend == ef.BACKEND_ONNXRUNTIME:
                    log(f"onnxruntime graph: the portable form ({unfused})")
                    if graphs:  # the portable graph just built serves ONNX Runtime as well
                        graphs.append({**graphs[-1], "backend": backend})
                        continue
            else:
                net.use_fused_kernels(max_seq_len + pad_rows)
                step_cls, file, kv_layout = FusedStepModule, ef.ENGINE_ORT_ONNX, ef.KV_SHARED
            logits = options.output_logits or quantized  # the quantization check compares logits
            fused_graph = step_cls is FusedStepModule
            padded = fused_graph and pad_rows > 0  # padding is a fused-kernel (ONNX Runtime) matter
            # the fused kernels' own settings: attention padding, step padding chosen at load (a min_rows input), and
            # their causal mask for chain drafts
            fused = dict(attention_pad=pad_rows, row_padding=padded, chain_drafts=chain_drafts) if fused_graph else {}
            step = step_cls(net, plugin, output_logits=logits, typical=options.typical_acceptance, **fused).eval()
            onnx_path = tmp / file
            log(
                f"exporting {options.speculative_mode} step graph for {backend} ({cfg.num_layers} layers, "
                f"{engine_dtype}) ..."
            )
            export_step(step, onnx_path)
            diff = validate_export(step, onnx_path, tolerance)
            log(f"{backend} graph validated against torch: max abs diff {diff:.3g} (bound {tolerance:g})")
            entry = {"validation": {"max_abs_diff": diff, "tolerance": tolerance}}
            if quantized:
                bits = 4 if weights == "int4" else 8
                log(f"quantizing the {backend} graph's weights to {weights} (blocks of {options.weights_block_size})")
                level = ACCURACY_INT8 if options.int8_activations else ACCURACY_FP32
                _quantize_in_place(
                    onnx_path, bits, options.weights_block_size, backend == ef.BACKEND_ONNXRUNTIME, level
                )
                entry["quantization"] = {
                    "bits": bits,
                    "block_size": options.weights_block_size,
                    "symmetric": True,
                    "accuracy_level": level,
                    **compare_quantized(step, onnx_path, prompt_ids, accuracy_level=level),
                }
                q = entry["quantization"]
                log(
                    f"{weights} {backend} graph against torch: top-1 agreement {q['top1_agreement']:.1%} over "
                    f"{q['positions']} positions, logit error max {q['max_logit_error']:.3f} mean "
                    f"{q['mean_logit_error']:.4f} (relative)"
                )
                if not options.output_logits:
                    _drop_output(onnx_path, ef.LOGITS)
            if backend == ef.BACKEND_TENSORRT:
                import onnx

                assert_tensorrt_clean(onnx.load(str(onnx_path), load_external_data=False))
            # what the graph can address, kept inside the (hashed) graph file: the runtime checks engine.yaml against it
            positions = max_seq_len + pad_rows if fused_graph else cfg.max_position_embeddings
            _record_metadata(onnx_path, {ef.GRAPH_MAX_POSITIONS: positions})
            if padded:
                entry["attention_pad_rows"] = pad_rows
            graphs.append(
                {
                    "role": ef.ROLE_TARGET,
                    "backend": backend,
                    "file": file,
                    "kv_cache": kv_layout,
                    "weights": weights,
                    **entry,
                }
            )
        stats = share_weights(tmp, list(dict.fromkeys(g["file"] for g in graphs)))
        log(f"weights: {stats['bytes'] / 1e6:.1f} MB in {WEIGHTS_FILE} ({stats['shared']} tensors shared by graphs)")
        for graph in graphs:
            graph["io"] = _io_spec(tmp / graph["file"])
        for name in (ef.TOKENIZER_FILE, ef.TOKENIZER_CONFIG_FILE):
            if (ckpt.path / name).is_file():
                shutil.copy(ckpt.path / name, tmp / name)
        manifest = {
            "format": ef.ENGINE_FORMAT,
            "format_version": ef.ENGINE_FORMAT_VERSION,
            "specbuild_version": __version__,
            "speculative_mode": options.speculative_mode,
            "dtype": engine_dtype,
            "checkpoint_dtype": ckpt.dtype,
            "lossless": _lossy_reason(options, chain_drafts) is None,
            "lossy_reason": _lossy_reason(options, chain_drafts),
            # int8 activations: exact only where the kernels are row-invariant (with padding), checked at every load
            "lossless_condition": "row-invariant kernels on the running CPU, probed at load"
            if options.int8_activations and _lossy_reason(options, chain_drafts) is None
            else None,
            "typical_acceptance": list(options.typical_acceptance) if options.typical_acceptance else None,
            "model": {
                "architecture": cfg.architecture,
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "num_layers": cfg.num_layers,
                "num_kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "sliding_window": cfg.sliding_window if cfg.sliding_layers else None,
                "sliding_layers": cfg.sliding_layers,
                "bos_token_id": cfg.bos_token_id,
                "eos_token_ids": cfg.eos_token_ids,
            },
            "limits": {
                "max_seq_len": max_seq_len,
                "max_batch_size": 1,
                "max_new_tokens_per_step": plugin.max_new_tokens_per_step(),
            },
            "tree": {"choices": tree.to_list(), "size": tree.size, "depth": tree.depth}
            if tree is not None
            else {"dynamic": True},
            "mode": plugin.manifest(),
            "states": [dataclasses.asdict(s) for s in plugin.state_specs()],
            "graphs": graphs,
            "files": {
                "tokenizer": ef.TOKENIZER_FILE if (tmp / ef.TOKENIZER_FILE).is_file() else None,
                "plan": None,
            },
            "chat_template": ckpt.chat_template,
            "validation": {
                "max_abs_diff": max(g["validation"]["max_abs_diff"] for g in graphs),
                "tolerance": tolerance,
            },
            "weights": {
                "precision": weights,
                "activations": "int8" if options.int8_activations else "float",
                "file": WEIGHTS_FILE,
                "bytes": stats["bytes"],
            },
            "opset": 18,
        }
        if options.tensorrt:
            from specbuild.builder.tensorrt_plan import build_tensorrt_plan

            log("compiling TensorRT plan ...")
            build_tensorrt_plan(
                tmp / ef.ENGINE_ONNX,
                tmp / ef.ENGINE_PLAN,
                fp16=options.fp16_plan,
                profiles=_trt_profiles(cfg, plugin, max_seq_len),
            )
            manifest["files"]["plan"] = ef.ENGINE_PLAN
        manifest["build_seconds"] = round(time.perf_counter() - started, 1)
        from specbuild.runtime.integrity import record_files

        manifest["checksums"] = record_files(tmp)  # size + sha256 of every file written above (load checks sizes)
        (tmp / ef.ENGINE_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    log(f"engine written to {output_dir} in {manifest['build_seconds']} s")
    return Path(output_dir)


def fused_kernels_unsupported(cfg, dtype: str) -> str | None:
    """Why ONNX Runtime's fused kernels cannot run this model (the onnxruntime graph is then the portable one)."""
    if cfg.head_dim % 16:
        return f"its GroupQueryAttention kernel needs head_dim % 16 == 0, the model has head_dim {cfg.head_dim}"
    if dtype != "float32":
        return f"its fused CPU kernels are float32 (the engine is {dtype})"
    return None


def _sample_prompt(ckpt, cfg, length: int = 48) -> list[int]:
    """Token ids to check a quantized graph on: real text when the checkpoint has a tokenizer, else a fixed draw."""
    if ckpt.tokenizer_file is not None:
        from specbuild.runtime.text import TextCodec

        ids = TextCodec(ckpt.tokenizer_file).encode(QUANTIZATION_CHECK_TEXT)[:length]
        if len(ids) >= 8 and max(ids) < cfg.vocab_size:
            return ids
    rng = np.random.default_rng(0)
    return rng.integers(0, cfg.vocab_size, size=min(length, 32)).tolist()


def _quantize_in_place(onnx_path: Path, bits: int, block_size: int, fused: bool, accuracy_level: int) -> None:
    """Replace the graph at onnx_path by its weight-quantized form (which keeps its own data file until
    share_weights moves every graph's tensors into the engine's one weights file)."""
    from specbuild.builder.quantize import quantize_graph

    staged = onnx_path.with_name("quantized." + onnx_path.name)
    quantize_graph(onnx_path, staged, bits, block_size, fused_gather=fused, accuracy_level=accuracy_level)
    onnx_path.unlink()
    Path(str(onnx_path) + ".data").unlink(missing_ok=True)
    staged.rename(onnx_path)


def _lossy_reason(options: BuildOptions, chain_drafts: bool) -> str | None:
    if options.typical_acceptance is not None:
        return "typical acceptance (not distribution-preserving)"
    if options.int8_activations and not chain_drafts:
        return (
            "int8 activations with branching trees: a tree node's keys sit in other cache columns than in one-token "
            "decoding, attention sums them in another order, and the int8 roundings that follow can change greedy "
            "output against the none engine of the same --weights (chain drafts, e.g. ngram with one candidate, "
            "stay exact)"
        )
    return None


def _record_metadata(onnx_path: Path, entries: dict) -> None:
    """Add key/value entries to the graph file's metadata (ONNX Runtime reads them back without parsing the graph)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props} | {k: str(v) for k, v in entries.items()}
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(onnx_path))


def _drop_output(onnx_path: Path, name: str) -> None:
    """Remove graph output `name` (its value is still computed for the nodes that use it)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    keep = [o for o in model.graph.output if o.name != name]
    del model.graph.output[:]
    model.graph.output.extend(keep)
    onnx.save(model, str(onnx_path))


def _trt_profiles(cfg, plugin, max_seq_len: int) -> dict:
    """min/opt/max shapes per dynamic input for the TensorRT optimization profile (batch 1)."""
    n = plugin.max_new_tokens_per_step()
    kv = (cfg.num_layers, 2, 1, cfg.num_kv_heads)
    d = cfg.head_dim
    depth = max(1, plugin.tree().depth + 1 if plugin.tree() is not None else n)
    return {
        ef.INPUT_IDS: ((1, 1), (1, n), (1, max_seq_len)),
        ef.POSITION_IDS: ((1, 1), (1, n), (1, max_seq_len)),
        ef.TREE_MASK: ((1, 1, 1), (1, n, n), (1, max_seq_len, max_seq_len)),
        ef.KV_CACHE: ((*kv, 1, d), (*kv, 1024, d), (*kv, max_seq_len, d)),
        ef.PATHS: ((1, 1, 1), (1, n, depth), (1, n, depth)),
        ef.RAND_ACCEPT: ((1, 1), (1, n), (1, n)),
    }
