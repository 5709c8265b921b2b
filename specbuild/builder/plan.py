"""Resolve a build: options + checkpoint -> one `BuildPlan`. Every check runs here, once, before any work."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from specbuild import engine_format as ef
from specbuild.builder.checkpoint.canonical import Checkpoint, build_weights
from specbuild.builder.options import BuildOptions, flag
from specbuild.errors import SpecbuildError
from specbuild.fsutil import OutputTarget, existing_paths, prepare_output_dir
from specbuild.modes.registry import get_mode, load_object, mode_options, modes, modes_reading
from specbuild.modes.spec import ENGINE_DRAFTED, ModeSpec


@dataclasses.dataclass
class BuildPlan:
    """Everything a build needs, resolved and checked: what the graph builders, the manifest and the plan read."""

    options: BuildOptions
    checkpoint: Checkpoint
    target: OutputTarget
    spec: ModeSpec  # the mode, looked up once (resolve)
    plugin_cls: type  # the mode's ModePlugin
    settings: dict[str, Any]  # the mode's resolved options (plugin_cls.check_options)
    typical: tuple[float, float] | None  # typical acceptance (lossy), or None: rejection sampling
    max_seq_len: int
    weights: str  # fp32, fp16, int8, int4
    engine_dtype: str  # float32, float16
    tolerance: float  # of the export validation
    pad_rows: int  # int8 activations: rows the fused attention pads a one-token call to (ort_kernels)
    unfused: str | None  # why the ONNX Runtime graph is the portable one (None: it is the fused one)
    head_weights: str | None = None  # int8/int4: the heads' matmuls in the onnxruntime graph (None: float)
    head_weights_source: str = ""  # where a recorded head_weights came from, in words (the build log says it)

    @property
    def mode(self) -> str:
        return self.spec.name

    @property
    def model(self):
        return self.checkpoint.model

    @property
    def rope_switch(self) -> int | None:
        """LongRoPE's switch length (ModelConfig.rope_switch) where the engine's sequences can grow past it: its
        graphs then take ef.ROPE_LONG; None otherwise."""
        switch = self.model.rope_switch()
        return switch if switch is not None and self.max_seq_len > switch else None

    @property
    def quantized_bits(self) -> int | None:
        return ef.BLOCKWISE_BITS.get(self.weights)

    def companion(self, checkpoint: Checkpoint, weights: str, **options) -> BuildPlan:
        """The plan of an engine built beside this one from `checkpoint` (draft-target: the draft model's), in plain
        decoding at `weights`, with these build options changed; the mode's own options are dropped and the
        precision-derived settings recomputed as resolve does."""
        baseline = next(spec for spec in modes().values() if spec.baseline)
        dtype = engine_dtype(weights)
        options = dataclasses.replace(
            self.options,
            speculative_mode=baseline.name,
            weights=weights,
            tensorrt=False,
            **{o.name: None for o in self.spec.options},
            **options,
        )
        return dataclasses.replace(
            self,
            options=options,
            checkpoint=checkpoint,
            spec=baseline,
            plugin_cls=load_object(baseline.graph_plugin),
            settings={"tokens_per_step": 1},
            typical=None,
            # a companion that addresses fewer positions works within them
            max_seq_len=min(self.max_seq_len, checkpoint.model.max_position_embeddings),
            weights=weights,
            engine_dtype=dtype,
            tolerance=validation_tolerance(options, dtype),
            unfused=fused_kernels_unsupported(checkpoint.model, dtype),
            head_weights=None,
            head_weights_source="",
        )


def engine_dtype(weights: str) -> str:
    """The float type of an engine built at `weights` (int4/int8 quantize a float32 graph)."""
    return "float16" if weights == "fp16" else "float32"


def validation_tolerance(options: BuildOptions, dtype: str) -> float:
    """How far the ONNX graph's float outputs may stray from torch's in the export validation."""
    return options.validate_tolerance or (1e-3 if dtype == "float32" else 5e-2)


def resolve(checkpoint_dir, output_dir, options: BuildOptions) -> BuildPlan:
    """Check the options, the output directory, the checkpoint's configs and tokenizer and the mode's bounds."""
    options.check()
    source = f"recipe {options.recipe}: " if options.recipe else ""
    spec = get_mode(options.speculative_mode, option=f"{source}--speculative-mode")  # the one lookup of the mode
    if not Path(checkpoint_dir).is_dir():
        raise SpecbuildError(f"{checkpoint_dir}: checkpoint directory does not exist")
    # the inputs (checkpoint, recipe, files the mode's text options name) are checked before any work: never replaced
    texts = [getattr(options, o.name) for o in spec.options if o.kind == "text"]
    inputs = [checkpoint_dir, *existing_paths(options.recipe, *texts)]
    target = prepare_output_dir(output_dir, overwrite=options.overwrite, inputs=inputs)
    if options.tensorrt:
        _require_tensorrt()
    ckpt = Checkpoint.load(checkpoint_dir)
    limit = ckpt.model.max_position_embeddings
    max_seq_len = options.max_seq_len or min(limit, 4096)
    if max_seq_len < 2 or max_seq_len > limit:
        raise SpecbuildError(
            f"--max-seq-len {max_seq_len} must be between 2 and the model's max_position_embeddings ({limit})"
        )
    plugin_cls = load_object(spec.graph_plugin)
    _check_mode_options(options, spec)
    settings = plugin_cls.check_options(ckpt, options)  # mode bounds from the configs: before any weight loads
    if settings["tokens_per_step"] >= max_seq_len:
        raise SpecbuildError(
            f"--max-seq-len {max_seq_len} leaves no room for the prompt: one {spec.name} step verifies "
            f"{settings['tokens_per_step']} tokens; use a larger --max-seq-len or a smaller tree"
        )
    _check_tokenizer(ckpt)
    # ONNX Runtime's CPU kernels barely cover bfloat16: bf16 checkpoints become fp32 engines (exact upcast);
    # int4/int8 quantize the float32 graph
    weights = build_weights(ckpt, options)
    dtype = engine_dtype(weights)
    unfused = fused_kernels_unsupported(ckpt.model, dtype)
    head_weights, head_source = resolve_head_weights(options, plugin_cls, ckpt, unfused)
    if options.kv_cache == ef.KV_CACHE_INT8 and unfused:
        raise SpecbuildError(
            f"--kv-cache int8: this model's onnxruntime graph is the portable one ({unfused}), whose attention keeps "
            "a float cache"
        )
    _check_memory(ckpt, weights, options.weights_block_size)
    return BuildPlan(
        options=options,
        checkpoint=ckpt,
        target=target,
        spec=spec,
        plugin_cls=plugin_cls,
        settings=settings,
        typical=plugin_cls.typical_acceptance(options),
        max_seq_len=max_seq_len,
        weights=weights,
        engine_dtype=dtype,
        tolerance=validation_tolerance(options, dtype),
        # int8 activations turn last-bit row differences into other tokens (ort_kernels: row padding): attention is
        # padded to >= 2 rows (it needs it on every CPU measured), and the graph takes a min_rows input with which
        # the runtime pads whole calls where the probe finds other kernels need it (runtime/row_invariance.py)
        # an int8 KV cache turns them into other cached bits (a rounding at a half step): padded the same way
        pad_rows=1 if options.int8_activations or options.kv_cache == ef.KV_CACHE_INT8 else 0,
        unfused=unfused,
        head_weights=head_weights,
        head_weights_source=head_source,
    )


def _check_memory(ckpt: Checkpoint, weights: str, block_size: int) -> None:
    """The engine and the build's working set fit in the memory available now (builder/memory_budget.py)."""
    from specbuild.builder import memory_budget
    from specbuild.builder.checkpoint.weights_io import spec_of

    tensors = ckpt.tensors()
    memory_budget.check_fits(
        tensors,
        lambda name: spec_of(tensors, name)[0],
        weights,
        block_size,
        ckpt.model.tie_word_embeddings,
        memory_budget.available_bytes(),
    )


def resolve_head_weights(options: BuildOptions, plugin_cls, ckpt: Checkpoint, unfused: str | None):
    """(int8/int4, or None for float heads; why, where the build log should say it): --head-weights, else the heads'
    recorded default (specbuild_defaults.head_weights, or its by_weights entry for the build's weights; a recipe's
    choose stage measures it), applied where a graph serving ONNX Runtime alone can hold quantized heads. Heads only
    propose: either way the output is the same."""
    given = options.head_weights
    portable_shared = unfused is not None and ef.BACKEND_TENSORRT in options.backends
    if given is not None:
        if given in ef.BLOCKWISE_WEIGHTS and portable_shared:
            raise SpecbuildError(
                f"--head-weights: this model's onnxruntime graph is the portable one ({unfused}), which the tensorrt "
                "backend reads too and whose heads must stay float there: build it with --backends onnxruntime"
            )
        return (None if given == ef.FLOAT_HEADS else given), ""
    recorded = plugin_cls.recorded_defaults(ckpt, options).get("head_weights")
    if recorded is None or recorded == ef.FLOAT_HEADS:
        return None, ""
    skipped = f"float: the heads' recorded head_weights {recorded} skipped"
    if ef.BACKEND_ONNXRUNTIME not in options.backends:
        return None, f"{skipped} (no onnxruntime graph)"
    if portable_shared:
        return None, f"{skipped} (the portable onnxruntime graph ({unfused}) serves the tensorrt backend too)"
    return recorded, "the heads' recorded choice (specbuild_defaults.head_weights; --head-weights float keeps float)"


def fused_kernels_unsupported(cfg, dtype: str) -> str | None:
    """Why ONNX Runtime's fused kernels cannot run this model (the onnxruntime graph is then the portable one)."""
    if cfg.head_dim % 16:
        return f"its GroupQueryAttention kernel needs head_dim % 16 == 0, the model has head_dim {cfg.head_dim}"
    if dtype != "float32":
        return f"its fused CPU kernels are float32 (the engine is {dtype})"
    return None


def _require_tensorrt() -> None:
    from specbuild.builder.export.tensorrt_plan import tensorrt_available

    if not tensorrt_available():
        raise SpecbuildError(
            "--tensorrt needs the TensorRT Python package (pip install specbuild[trt]) on an "
            "NVIDIA GPU host; build without --tensorrt for the ONNX Runtime engine"
        )


def _check_mode_options(options: BuildOptions, spec: ModeSpec) -> None:
    """A mode-specific option the chosen mode does not read is an error (it would be silently ignored)."""
    if options.head_weights is not None and spec.family != ENGINE_DRAFTED:
        raise SpecbuildError(
            f"--head-weights applies to modes whose step graph drafts with heads "
            f"({', '.join(name for name, other in modes().items() if other.family == ENGINE_DRAFTED)}), not "
            f"--speculative-mode {spec.name}"
        )
    reads = {o.name for o in spec.options}
    for name in mode_options():
        if getattr(options, name) is not None and name not in reads:
            raise SpecbuildError(
                f"{flag(name)} does not apply to --speculative-mode {spec.name} "
                f"(it is an option of {', '.join(modes_reading(name))})"
            )


def _check_tokenizer(ckpt: Checkpoint) -> None:
    """The engine carries the checkpoint's tokenizer: it must load, round-trip and render its chat template."""
    if ckpt.tokenizer_file is not None:
        from specbuild.builder.checkpoint.tokenizer_io import validate_tokenizer

        config_file = ckpt.path / ef.CHECKPOINT_CONFIG
        validate_tokenizer(
            ckpt.tokenizer_file, ckpt.tokenizer_file, ckpt.model.vocab_size, ckpt.chat_template, config_file
        )
