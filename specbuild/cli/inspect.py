"""`specbuild inspect`: describe a checkpoint or an engine directory (specbuild.inspect), as text or JSON; runs on
the base install."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specbuild.cli.handling import handle_errors


@click.command()
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
