"""`specbuild bench`: engines, and the peer stacks a user could run instead (their options come from
specbuild/bench/peers: transformers, ONNX Runtime GenAI, OpenVINO GenAI, llama.cpp), timed on the benchmark prompt
sets, one prompt at a time (specbuild/bench/sequential.py) or under load with --concurrency
(specbuild/bench/load.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specbuild.cli.extras import require_extra
from specbuild.cli.handling import handle_errors
from specbuild.cli.options import ALLOW_LOSSY_HELP, check_choice, sampling_options, sampling_params
from specbuild.cli.output import stderr_console
from specbuild.errors import SpecbuildError


def peer_options(command):
    """The peer stacks' options (bench/peers), each arriving as a keyword of the command."""
    from specbuild.bench.peers import options

    for option in reversed(options()):
        path = click.Path(path_type=Path)
        command = click.option(option.flag, option.dest, type=path, multiple=option.multiple, help=option.help)(command)
    return command


@click.command()
@click.option("--engine-dir", "engine_dirs", multiple=True, required=True, type=click.Path(path_type=Path))
@click.option(
    "--prompts",
    default="humaneval,mtbench",
    show_default=True,
    help="Comma-separated prompt sets: humaneval (code), mtbench (chat), summarize (chat, the text is in the prompt).",
)
@click.option("--num-prompts", type=int, default=8, show_default=True, help="Prompts per set.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--threads", type=int, help="Threads for ONNX Runtime (and torch with --hf-model-dir).")
@click.option("--context-sweep", is_flag=True, help="Host/engine ms per step at ~64 vs ~1024 context tokens.")
@click.option("--json-out", type=click.Path(path_type=Path), help="Write all numbers to this JSON file.")
@click.option("--allow-lossy", is_flag=True, help=ALLOW_LOSSY_HELP)
@click.option(
    "--stock-kernels",
    is_flag=True,
    help="Also run every engine that uses specbuild's own kernels (int4 weights, int8 activations or an int8 KV "
    "cache) on ONNX Runtime's stock kernels, as a row of its own beside it: what the kernels change on this machine.",
)
@click.option(
    "--concurrency",
    help="Comma-separated numbers of requests in flight (e.g. 1,4,16): instead of one prompt at a time, run every "
    "prompt through each engine's scheduler as a closed loop at each concurrency (aggregate tokens/s, TTFT and "
    "inter-token latency percentiles, τ, the engines' call cost curves); --openvino-model then runs OpenVINO GenAI's "
    "continuous batching, --ort-genai-model ONNX Runtime GenAI's static batch.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --concurrency: rounds of every engine and peer at each concurrency, in turns; each row is its "
    "median round (the machine's slow spells fall on all of them).",
)
@click.option(
    "--passes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run the prompt sets this many times in order through the same engines, each pass reported apart: "
    "traffic seen again (modes that learn from earlier responses, e.g. suffix, draft from the earlier passes).",
)
@sampling_options
@peer_options
@handle_errors
def bench(
    engine_dirs,
    prompts,
    num_prompts,
    max_new_tokens,
    threads,
    context_sweep,
    json_out,
    allow_lossy,
    stock_kernels,
    concurrency,
    repeats,
    passes,
    temperature,
    top_p,
    top_k,
    seed,
    **peer_args,
):
    """Benchmark engines (interleaved per prompt) on HumanEval / MT-Bench prompts, greedy or sampled (--temperature:
    every engine and peer with the same settings, prompt i seeded with --seed + i); with --concurrency, under load
    (closed loop, in-flight batching)."""
    from specbuild.bench import peers
    from specbuild.bench.sequential import render, run_benchmark

    sampling = sampling_params(temperature, top_p, top_k, seed)
    for stack in peers.given(peer_args):
        if stack.extra:
            require_extra(stack.extra, f"bench {stack.options[0].flag}")
    peers.check(peer_args, under_load=concurrency is not None)
    sets = _prompt_sets(prompts)
    if passes != 1 and concurrency is not None:
        raise SpecbuildError("--passes belongs to the one-at-a-time benchmark (without --concurrency)")
    if concurrency is not None:
        if context_sweep:
            raise SpecbuildError(
                "--concurrency runs the load benchmark: --context-sweep belongs to the one-at-a-time benchmark (run "
                "it without --concurrency)"
            )
        _bench_load(
            engine_dirs, sets, concurrency, num_prompts, max_new_tokens, threads, json_out, allow_lossy, repeats,
            peer_args, sampling, stock_kernels,
        )  # fmt: skip
        return
    if repeats != 1:
        raise SpecbuildError("--repeats belongs to the load benchmark (--concurrency)")
    console = stderr_console()
    with console.status("benchmarking ...", spinner="dots") as status:
        report = run_benchmark(
            list(engine_dirs),
            sets,
            num_prompts=num_prompts,
            max_new_tokens=max_new_tokens,
            threads=threads,
            sweep=context_sweep,
            log=lambda msg: status.update(f"benchmarking: {msg}"),
            allow_lossy=allow_lossy,
            peer_args=peer_args,
            sampling=sampling,
            stock_kernels=stock_kernels,
            passes=passes,
        )
    render(report)
    if json_out:
        _write_numbers(report, json_out)
        _write_plot(report, json_out)


def _prompt_sets(prompts: str) -> list[str]:
    """The prompt sets --prompts names (comma-separated), each one of specbuild.prompts.PROMPT_SETS."""
    from specbuild.prompts import PROMPT_SETS

    sets = [p.strip() for p in prompts.split(",") if p.strip()]
    if not sets:
        raise SpecbuildError("--prompts: give at least one prompt set")
    for name in sets:
        check_choice("--prompts", name, tuple(PROMPT_SETS))
    return sets


def _write_numbers(report: dict, json_out: Path) -> None:
    """--json-out: every number of the report as JSON."""
    Path(json_out).write_text(json.dumps(report, indent=2))
    click.echo(f"numbers written to {json_out}", err=True)


def _write_plot(report: dict, json_out: Path) -> None:
    """The one-at-a-time report's plot beside its --json-out (.png), when matplotlib is installed."""
    from specbuild.bench.plot import plot_available, write_plot

    if plot_available():
        click.echo(f"plot written to {write_plot(report, Path(json_out).with_suffix('.png'))}", err=True)
    else:
        click.echo("no plot: matplotlib is not installed (pip install specbuild[bench])", err=True)


def _bench_load(
    engine_dirs, sets, concurrency, num_prompts, max_new_tokens, threads, json_out, allow_lossy, repeats, peer_args,
    sampling, stock_kernels,
):  # fmt: skip
    """`bench --concurrency`: the closed-loop load benchmark (specbuild/bench/load.py)."""
    from specbuild.bench.load import parse_concurrency, run_load_benchmark
    from specbuild.bench.load_render import render_load

    levels = parse_concurrency(concurrency)
    with stderr_console().status("benchmarking under load ...", spinner="dots") as status:
        report = run_load_benchmark(
            list(engine_dirs),
            sets,
            levels,
            num_prompts=num_prompts,
            max_new_tokens=max_new_tokens,
            threads=threads,
            log=lambda msg: status.update(f"benchmarking: {msg}"),
            allow_lossy=allow_lossy,
            repeats=repeats,
            peer_args=peer_args,
            sampling=sampling,
            stock_kernels=stock_kernels,
        )
    render_load(report)
    if json_out:
        _write_numbers(report, json_out)
