"""`BuildOptions`: what `specbuild build` is asked (flags or a recipe), with the checks that need no checkpoint."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.modes.registry import baseline_mode, mode_options

# Largest --max-seq-len accepted whatever the model's max_position_embeddings (a 2**20-position KV cache of even a
# small model is tens of GB).
MAX_SEQ_LEN = 1 << 20
FLAGS = ("output_logits", "tensorrt", "fp16_plan", "overwrite", "int8_activations")  # the true/false options


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclasses.dataclass
class _BuildOptions:
    """The options every build reads; BuildOptions adds one field per mode-specific option (plugins' ModeSpecs)."""

    speculative_mode: str | None = None  # default: the baseline (plain decoding)
    max_seq_len: int | None = None
    max_batch_size: int = 16  # sequences one engine call advances (the runtime's KV slots; limits.max_batch_size)
    output_logits: bool = False
    backends: tuple[str, ...] = ef.BACKENDS  # one graph per backend: onnxruntime (fused kernels), tensorrt (portable)
    weights: str | None = None  # fp32, fp16, int8, int4 (default: fp16 for a float16 checkpoint, else fp32)
    weights_block_size: int = 32  # int4/int8: weights per quantization block along K
    int8_activations: bool = False  # int4/int8: quantize activations to int8 too (faster; calls padded, ort_kernels)
    kv_cache: str = ef.KV_CACHE_FLOAT  # int8: the onnxruntime graph's KV cache in 8 bits (builder/quantize/kv_int8.py)
    # int8/int4: the mode's own matmuls (heads, draft layers) in the onnxruntime graph; float: keep them float;
    # None: the heads' recorded default (plan.resolve_head_weights)
    head_weights: str | None = None
    tensorrt: bool = False
    fp16_plan: bool = False
    overwrite: bool = False
    validate_tolerance: float | None = None
    recipe: Path | None = None  # the recipe the options came from (named in errors; never overwritten)

    def __post_init__(self):
        if self.speculative_mode is None:
            self.speculative_mode = baseline_mode()

    @classmethod
    def from_recipe(cls, recipe_file, **overrides) -> BuildOptions:
        """The recipe's `build:` mapping (or the whole file), then `overrides` (None values ignored); unchecked."""
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
        names = {f.name for f in dataclasses.fields(cls)} - {"recipe"}
        data = {k.replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SpecbuildError(f"recipe {path}: unknown build option(s) {unknown}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        for option in mode_options().values():
            if option.kind == "pair" and isinstance(data.get(option.name), list):
                data[option.name] = tuple(data[option.name])
        return cls(**data, recipe=path)

    def check(self) -> None:
        """Types and ranges of every option; the message names the option, its range and the recipe if any.

        Limits that depend on the checkpoint (max_position_embeddings, vocabulary, heads) are checked by
        plan.resolve and the mode plugin, still before any weight is loaded."""
        source = f"recipe {self.recipe}: " if self.recipe else ""

        def fail(name: str, want: str):
            raise SpecbuildError(f"{source}{flag(name)} {getattr(self, name)!r} is invalid: expected {want}")

        def integer(name: str, lo: int, hi: int | None = None):
            value = getattr(self, name)
            if value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
                fail(name, f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")

        def number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not isinstance(self.speculative_mode, str):
            fail("speculative_mode", "the name of a mode")
        integer("max_seq_len", 2, MAX_SEQ_LEN)
        integer("max_batch_size", 1, ef.MAX_BATCH_SIZE)
        if self.max_batch_size is None:
            fail("max_batch_size", f"an integer in [1, {ef.MAX_BATCH_SIZE}]")
        for option in mode_options().values():
            value = getattr(self, option.name)
            if option.kind == "int":
                integer(option.name, option.minimum or 0)
            elif option.kind == "text" and value is not None and not isinstance(value, (str, list, tuple, Path)):
                fail(option.name, "text, a list or a file path")
            elif option.kind == "pair" and value is not None:
                if not (isinstance(value, tuple) and len(value) == 2 and all(map(number, value))):
                    fail(option.name, f"two finite numbers {option.metavar or 'A,B'}")
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                fail(name, "true or false")
        tol = self.validate_tolerance
        if tol is not None and not (number(tol) and tol > 0):
            fail("validate_tolerance", "a finite number > 0")
        self._check_precision_and_backends(source, fail)

    def _check_precision_and_backends(self, source: str, fail) -> None:
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
        if self.int8_activations and self.weights not in ef.BLOCKWISE_WEIGHTS:
            raise SpecbuildError(f"{source}--int8-activations applies to --weights int4 or int8")
        if self.kv_cache not in ef.KV_CACHE_DTYPES:
            fail("kv_cache", f"one of {', '.join(ef.KV_CACHE_DTYPES)}")
        if self.kv_cache == ef.KV_CACHE_INT8 and self.backends != (ef.BACKEND_ONNXRUNTIME,):
            raise SpecbuildError(
                f"{source}--kv-cache int8 is ONNX Runtime's GroupQueryAttention reading an 8-bit cache (the portable "
                "graph's attention keeps a float one): pass --backends onnxruntime"
            )
        if self.head_weights is not None and self.head_weights not in ef.HEAD_WEIGHTS:
            fail("head_weights", f"one of {', '.join(ef.HEAD_WEIGHTS)}")
        if self.head_weights in ef.BLOCKWISE_WEIGHTS and ef.BACKEND_ONNXRUNTIME not in self.backends:
            raise SpecbuildError(
                f"{source}--head-weights quantizes the onnxruntime graph's heads: add onnxruntime to --backends"
            )
        if self.weights in ef.ONNXRUNTIME_ONLY_WEIGHTS and ef.BACKEND_TENSORRT in self.backends:
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
