"""`specbuild serve`: an engine behind an OpenAI-compatible HTTP API (extra specbuild[serve]), or with --triton
through Triton Inference Server (extra specbuild[triton])."""

from __future__ import annotations

from pathlib import Path

import click

from specbuild.cli.extras import require_extra
from specbuild.cli.handling import handle_errors
from specbuild.cli.options import ALLOW_LOSSY_HELP
from specbuild.errors import SpecbuildError


@click.command()
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
    "--api-key",
    "api_keys",
    multiple=True,
    envvar="SPECBUILD_API_KEY",
    help="A key clients must send as 'Authorization: Bearer KEY' (repeat for several; or SPECBUILD_API_KEY, keys "
    "separated by spaces). /health stays open.",
)
@click.option(
    "--api-key-file",
    type=click.Path(path_type=Path),
    help="A file of API keys, one per line (# comments), e.g. one per client; added to --api-key.",
)
@click.option("--protect-metrics", is_flag=True, help="/metrics needs an API key too (default: open, like /health).")
@click.option("--ssl-certfile", type=click.Path(path_type=Path), help="Serve HTTPS with this PEM certificate (chain).")
@click.option("--ssl-keyfile", type=click.Path(path_type=Path), help="The certificate's private key (PEM).")
@click.option(
    "--triton",
    is_flag=True,
    help="Serve through Triton Inference Server instead (PyTriton, extra specbuild[triton]): a decoupled streaming "
    "model on Triton's HTTP port (--port; /v2/models/NAME/generate_stream) and gRPC port (--grpc-port).",
)
@click.option(
    "--draft-pool",
    type=click.Path(path_type=Path, file_okay=False),
    help="Keep what drafters that learn from traffic (suffix decoding) learnt in this directory, across restarts.",
)
@click.option(
    "--shared-draft-pool",
    is_flag=True,
    help="With API keys: one pool of earlier responses for every key (default: one per key; a shared pool lets "
    "one client's outputs speed up, and so be timed by, another's requests).",
)
@click.option("--grpc-port", type=int, default=8001, show_default=True, help="With --triton: Triton's gRPC port.")
@click.option("--metrics-port", type=int, default=8002, show_default=True, help="With --triton: Triton's metrics.")
@handle_errors
def serve(
    engine_dir, host, port, threads, max_queue, max_batch_size, model_name, allow_lossy, api_keys, api_key_file,
    protect_metrics, ssl_certfile, ssl_keyfile, triton, draft_pool, shared_draft_pool, grpc_port, metrics_port,
):  # fmt: skip
    """Serve an engine over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, streaming),
    with /health and Prometheus /metrics; SIGINT/SIGTERM stop it within seconds. With --triton, through Triton
    Inference Server (gRPC streaming and the generate extension)."""
    if not triton:
        require_extra("serve", "serve")
        from specbuild.serve.access import load_keys
        from specbuild.serve.server import Exposure, run_server

        keys = load_keys(api_keys, api_key_file)
        exposure = Exposure(keys, protect_metrics, ssl_certfile, ssl_keyfile, shared_draft_pool)
        run_server(
            engine_dir, host, port, threads, max_queue, max_batch_size, model_name, allow_lossy, exposure, draft_pool
        )
        return
    if api_keys or api_key_file or protect_metrics or ssl_certfile or ssl_keyfile:
        raise SpecbuildError(
            "--api-key, --api-key-file, --protect-metrics and --ssl-* are the HTTP server's; with --triton use "
            "Triton's own controls (docs/serving.md: restricting Triton)"
        )
    if draft_pool or shared_draft_pool:
        raise SpecbuildError("--draft-pool and --shared-draft-pool are the HTTP server's (not with --triton)")
    require_extra("triton", "serve --triton")
    from specbuild.serve.triton_pytriton import run_triton

    run_triton(
        engine_dir, host, port, grpc_port, metrics_port, threads, max_queue, max_batch_size, model_name, allow_lossy
    )
