"""The `specbuild` command line: the `cli` group and its commands, one module each in specbuild/cli (convert, build,
run, serve, triton-repo, inspect, prepare-default-model, demo, bench, train and corpus).

Every command turns a SpecbuildError into one line `error: <message>` on stderr and exit code 1 (handling.py). Heavy
imports happen inside commands, and a command that needs an extra (build, train) says which one to install when it
is missing (extras.py), so the base install runs and inspects engines without torch.
"""

from __future__ import annotations

import atexit
import gc

import click

from specbuild.cli.bench import bench
from specbuild.cli.build import build
from specbuild.cli.convert import convert
from specbuild.cli.corpus import corpus
from specbuild.cli.demo import demo
from specbuild.cli.inspect import inspect
from specbuild.cli.prepare_default_model import prepare_default_model
from specbuild.cli.run import run
from specbuild.cli.serve import serve
from specbuild.cli.train import train
from specbuild.cli.triton_repo import triton_repo


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(package_name="specbuild")
def cli():
    """specbuild: ahead-of-time compiler for speculative decoding (HF checkpoint -> ONNX engine -> generation)."""
    _freeze_at_exit()


def _freeze_at_exit() -> None:
    """At exit, gc.freeze: the cyclic collections the interpreter runs as it shuts down skip the objects a command
    made. They walked every one of them (a large build's trace included: seconds after a 1B build,
    docs/benchmarks/design-measurements.md). Every atexit handler still runs and the memory goes with the process; what
    a command writes, it closes itself before it reports."""
    if not getattr(_freeze_at_exit, "registered", False):
        atexit.register(gc.freeze)
        _freeze_at_exit.registered = True


cli.add_command(convert)
cli.add_command(build)
cli.add_command(run)
cli.add_command(serve)
cli.add_command(triton_repo)
cli.add_command(inspect)
cli.add_command(prepare_default_model)
cli.add_command(demo)
cli.add_command(bench)
cli.add_command(train)
cli.add_command(corpus)


if __name__ == "__main__":
    cli()
