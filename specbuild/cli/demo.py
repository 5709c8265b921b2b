"""`specbuild demo`: SmolLM2-135M-Instruct end to end (prepare -> convert -> build -> generate), plain decoding and
the registry's demo mode side by side; steps whose output already exists are reused."""

from __future__ import annotations

from pathlib import Path

import click

from specbuild import engine_format as ef
from specbuild.cli.build import run_build
from specbuild.cli.extras import needs_extra
from specbuild.cli.handling import handle_errors
from specbuild.cli.options import mode_choice
from specbuild.cli.output import generate_and_print, stderr_console
from specbuild.errors import SpecbuildError
from specbuild.modes.registry import baseline_mode, get_mode, modes

DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def _embedded_heads(mode: str) -> Path | None:
    """Heads for SmolLM2 shipped in specbuild/data/heads/smollm2-<mode>, if any."""
    from specbuild.builder.checkpoint.default_model import shipped_heads

    return shipped_heads().get(mode)


def demo_mode() -> str:
    """The mode the demo shows beside plain decoding (the registry's `demo` mode)."""
    return next((name for name, spec in modes().items() if spec.demo), baseline_mode())


def _demo_checkpoint(console, hf_dir: Path, work_dir: Path, mode: str) -> Path:
    """The SmolLM2 checkpoint, with `mode`'s shipped heads when it has any (reused when already there)."""
    from specbuild.builder.checkpoint.canonical import Checkpoint
    from specbuild.builder.checkpoint.convert import convert_checkpoint

    spec, heads = get_mode(mode), None
    if spec.converter:
        head_dir = _embedded_heads(mode)
        if head_dir is None:
            raise SpecbuildError(
                f"no {mode} heads are embedded for SmolLM2; run the demo with another --speculative-mode "
                f"or convert and build your own heads with `specbuild convert {spec.head_option} DIR`"
            )
        heads = {mode: head_dir}
    ckpt_dir = work_dir / ("checkpoint" if heads is None else f"checkpoint-{mode}")
    try:
        Checkpoint.load(ckpt_dir)
        console.print(f"[2/4] checkpoint: {ckpt_dir} (reused)", markup=False)
    except SpecbuildError:
        with console.status("[2/4] converting ...", spinner="dots"):
            convert_checkpoint(hf_dir, ckpt_dir, heads=heads, overwrite=True, progress=False)
        console.print(f"[2/4] checkpoint: {ckpt_dir}", markup=False)
    return ckpt_dir


def _demo_engine(console, ckpt_dir: Path, work_dir: Path, mode: str) -> Path:
    """The `mode` engine of the demo (reused when one of that mode is already there)."""
    from specbuild.builder.build import BuildOptions
    from specbuild.runtime.manifest import load_manifest

    engine_dir = work_dir / f"engine-{mode}"
    try:
        reuse = load_manifest(engine_dir).get("speculative_mode") == mode
    except SpecbuildError:
        reuse = False
    if reuse:
        console.print(f"[3/4] engine: {engine_dir} (reused)", markup=False)
    else:
        options = BuildOptions(
            speculative_mode=mode, max_seq_len=2048, backends=(ef.BACKEND_ONNXRUNTIME,), overwrite=True
        )  # the graph the demo runs: half the build time of both backends
        run_build(ckpt_dir, engine_dir, options)
        console.print(f"[3/4] engine: {engine_dir}", markup=False)
    return engine_dir


def _demo_summary(results: dict) -> list[str]:
    """One line per mode: tokens/s and τ, and for a speculative mode its speed-up and whether it equals `none`."""
    base = results.get(baseline_mode())
    lines = []
    for mode, result in results.items():
        line = f"{mode:>10}: {result.tokens_per_s:6.1f} tok/s, τ {result.mean_accepted_tokens:.2f}"
        if base is not None and result is not base:
            same = "yes" if result.output_ids == base.output_ids else "NO"
            line += f", {result.tokens_per_s / base.tokens_per_s:.2f}x, same tokens as {baseline_mode()}: {same}"
        lines.append(line)
    return lines


@click.command()
@click.option("--work-dir", type=click.Path(path_type=Path), default=Path("demo-out"), show_default=True)
@click.option("--prompt", default=DEMO_PROMPT, show_default=True)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option(
    "--speculative-mode",
    type=mode_choice(),
    help=f"The mode shown beside plain decoding (default: {demo_mode()}, with the heads shipped for SmolLM2).",
)
@click.option("--threads", type=int, help="Intra-op threads for ONNX Runtime.")
@handle_errors
@needs_extra("build")
def demo(work_dir, prompt, max_new_tokens, speculative_mode, threads):
    """End to end on SmolLM2-135M-Instruct: prepare -> convert -> build -> generate (chat template on), plain
    decoding and a speculative mode side by side (tokens/s, τ, same output).

    Steps whose output already exists in --work-dir are reused.
    """
    from specbuild.builder.checkpoint.default_model import prepare_smollm2
    from specbuild.runtime.engine import Engine, SamplingParams

    modes_shown = list(dict.fromkeys([baseline_mode(), speculative_mode or demo_mode()]))
    console = stderr_console()
    work_dir = Path(work_dir)
    hf_dir = work_dir / "smollm2-hf"
    with console.status("[1/4] preparing SmolLM2-135M-Instruct ...", spinner="dots"):
        prepare_smollm2(hf_dir)
    console.print(f"[1/4] model: {hf_dir}", markup=False)

    ckpt_dir = _demo_checkpoint(console, hf_dir, work_dir, modes_shown[-1])  # a checkpoint with heads builds none too
    engines = {mode: _demo_engine(console, ckpt_dir, work_dir, mode) for mode in modes_shown}

    results = {}
    for mode, engine_dir in engines.items():
        console.print(f"[4/4] {mode}: generating (chat template on): {prompt}", markup=False)
        engine = Engine(engine_dir, threads=threads)
        results[mode] = generate_and_print(engine, prompt, None, max_new_tokens, SamplingParams(), True, False)
    for line in _demo_summary(results):
        click.echo(line, err=True)
