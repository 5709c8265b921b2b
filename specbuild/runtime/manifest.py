"""Read and check an engine directory's engine.yaml."""

from __future__ import annotations

from pathlib import Path

import yaml

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError


def load_manifest(engine_dir) -> dict:
    engine_dir = Path(engine_dir)
    file = engine_dir / ef.ENGINE_MANIFEST
    if not file.is_file():
        raise SpecbuildError(f"{engine_dir}: not a specbuild engine directory (no {ef.ENGINE_MANIFEST})")
    try:
        manifest = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise SpecbuildError(f"{file}: invalid YAML ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ef.ENGINE_FORMAT:
        raise SpecbuildError(f"{file}: not a specbuild engine manifest")
    version = manifest.get("format_version")
    if version != ef.ENGINE_FORMAT_VERSION:
        raise SpecbuildError(
            f"{file}: engine format version {version} is not supported by this specbuild (reads version "
            f"{ef.ENGINE_FORMAT_VERSION}); rebuild the engine with `specbuild build`"
        )
    onnx_file = engine_dir / manifest["files"]["onnx"]
    if not onnx_file.is_file():
        raise SpecbuildError(f"{onnx_file}: missing from the engine directory")
    return manifest
