"""`specbuild triton-repo`: a Triton model repository that serves an engine on Triton's Python backend, for a Triton
server of your own."""

from __future__ import annotations

from pathlib import Path

import click

from specbuild.cli.extras import needs_extra
from specbuild.cli.handling import handle_errors


@click.command("triton-repo")
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
