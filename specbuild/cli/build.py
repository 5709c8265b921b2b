"""`specbuild build`: an engine directory (the ONNX step graph with drafting and acceptance) from a canonical
checkpoint; every mode-specific option comes from the mode registry. `demo` builds its engines with run_build too."""

from __future__ import annotations

from pathlib import Path

import click

from specbuild import engine_format as ef
from specbuild.cli.extras import needs_extra
from specbuild.cli.handling import handle_errors
from specbuild.cli.options import OneLineChoice, mode_choice
from specbuild.cli.output import stderr_console
from specbuild.errors import SpecbuildError
from specbuild.modes.registry import mode_options


def parse_pair(flag: str, text: str | None, metavar: str | None = None) -> tuple[float, float] | None:
    """'A,B' -> (A, B) as floats; None stays None."""
    if text is None:
        return None
    try:
        first, second = (float(x) for x in text.split(","))
    except ValueError:
        raise SpecbuildError(f"{flag} {text!r}: expected two numbers {metavar or 'A,B'}") from None
    return first, second


def mode_option_flags(func):
    """`specbuild build` flags for every mode-specific build option (from the mode registry)."""
    for option in reversed(list(mode_options().values())):
        kind = {"int": int, "float": float}.get(option.kind, str)
        func = click.option(option.flag, option.name, type=kind, metavar=option.metavar, help=option.help)(func)
    return func


def _build_options(recipe, **overrides):
    """BuildOptions from the recipe (if any) with the flags given (not None) overriding it."""
    from specbuild.builder.options import BuildOptions

    overrides = {k: v for k, v in overrides.items() if v is not None}
    return BuildOptions.from_recipe(recipe, **overrides) if recipe else BuildOptions(**overrides)


def run_build(checkpoint_dir, output_dir, options) -> Path:
    """Resolve the plan (every check first), then build it with a spinner and the stages logged on stderr."""
    from specbuild.builder.build import build_plan
    from specbuild.builder.plan import resolve
    from specbuild.interrupts import check_interrupted

    console = stderr_console()

    def log(msg):
        check_interrupted()  # a stage boundary: an interrupt that library code swallowed ends the build here
        console.print(msg, markup=False)

    plan = resolve(checkpoint_dir, output_dir, options)  # every check, before any work
    with console.status(f"building {plan.mode} engine ...", spinner="dots"):
        return build_plan(plan, log=log)


@click.command()
@click.option("--checkpoint-dir", required=True, type=click.Path(path_type=Path), help="Canonical checkpoint.")
@click.option("--output-dir", required=True, type=click.Path(path_type=Path), help="Engine directory to write.")
@click.option("--speculative-mode", type=mode_choice(), help="Default: plain decoding.")
@click.option("--max-seq-len", type=int, help="Prompt + generated tokens limit (default: model's, at most 4096).")
@click.option(
    "--max-batch-size",
    type=int,
    help="Sequences one engine call advances: the runtime's KV slots (default 16; `inspect` shows the KV memory).",
)
@click.option("--recipe", type=click.Path(path_type=Path), help="YAML build recipe; flags given here override it.")
@mode_option_flags
@click.option(
    "--backends",
    metavar="LIST",
    help="Graphs to build, comma-separated (default both): onnxruntime (its fused CPU kernels), tensorrt (the "
    "portable standard-op graph TensorRT parses).",
)
@click.option(
    "--weights",
    type=OneLineChoice(ef.WEIGHTS),
    help="Weight precision: fp32, fp16, int8 (onnxruntime graph only) or int4 (default: the checkpoint's, fp32 "
    "for bfloat16). int4/int8 are weight-only, blockwise, symmetric; speculative engines stay exact relative to "
    "the none engine of the same --weights.",
)
@click.option("--weights-block-size", type=int, help="int4/int8: weights per quantization block (default 32).")
@click.option(
    "--int8-activations",
    is_flag=True,
    help="int4/int8 matmuls quantize activations to int8 (faster, what ONNX Runtime GenAI does). Output differs "
    "from the float-activation engine's; speculation stays exact against the none engine built the same way "
    "(attention is padded to two or more rows so that every op is batch-invariant).",
)
@click.option(
    "--kv-cache",
    type=OneLineChoice(ef.KV_CACHE_DTYPES),
    help="int8: the onnxruntime graph keeps its KV cache in 8 bits, one scale per layer calibrated at build "
    "(attention reads a quarter of the bytes: faster with many sequences in flight). Output differs from the float "
    "cache's (the build records by how much); speculation stays exact against the none engine built the same way. "
    "Needs --backends onnxruntime (default: float).",
)
@click.option(
    "--head-weights",
    type=OneLineChoice(ef.HEAD_WEIGHTS),
    help="Medusa/EAGLE/ReDrafter: the heads' and draft layers' own matmuls in int8 or int4 blocks with int8 "
    "activations (onnxruntime graph; the target's weights stay at --weights), or float. Drafts only propose: the "
    "output is the same, greedy or sampled, alone or batched; tau may move slightly (default: the heads' recorded "
    "choice, specbuild_defaults.head_weights, else float).",
)
@click.option("--output-logits", is_flag=True, help="Also output the logits of every new token.")
@click.option("--tensorrt", is_flag=True, help="Also compile a TensorRT plan (NVIDIA GPU host with tensorrt).")
@click.option("--fp16-plan", is_flag=True, help="Build the TensorRT plan with fp16 kernels.")
@click.option("--overwrite", is_flag=True, help="Replace a previous specbuild output there (nothing else).")
@handle_errors
@needs_extra("build")
def build(
    checkpoint_dir,
    output_dir,
    speculative_mode,
    max_seq_len,
    max_batch_size,
    recipe,
    backends,
    weights,
    weights_block_size,
    int8_activations,
    kv_cache,
    head_weights,
    output_logits,
    tensorrt,
    fp16_plan,
    overwrite,
    **mode_settings,
):
    """Build an engine directory (ONNX step graph with drafting and acceptance) from a canonical checkpoint.

    With $SPECBUILD_TRACE_CACHE set to a directory, exported graphs are kept there without their weights, and a
    later build of the same structure (other weights) reuses them."""
    from specbuild.fsutil import provisional_commits

    for option in mode_options().values():
        if option.kind == "pair":
            mode_settings[option.name] = parse_pair(option.flag, mode_settings[option.name], option.metavar)
    options = _build_options(
        recipe,
        speculative_mode=speculative_mode,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        **mode_settings,
        backends=backends,
        weights=weights,
        weights_block_size=weights_block_size,
        int8_activations=int8_activations or None,
        kv_cache=kv_cache,
        head_weights=head_weights,
        output_logits=output_logits or None,
        tensorrt=tensorrt or None,
        fp16_plan=fp16_plan or None,
        overwrite=overwrite or None,
    )
    with provisional_commits():  # an interrupt until the command ends still leaves nothing behind
        run_build(checkpoint_dir, output_dir, options)
