"""The runtime loads and runs engines without the build side: importing it pulls in neither torch nor the builder."""

import subprocess
import sys


def test_runtime_imports_neither_torch_nor_the_builder():
    code = (
        "import sys, pkgutil, importlib, specbuild.runtime as r\n"
        "for m in pkgutil.walk_packages(r.__path__, 'specbuild.runtime.'): importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n == 'torch' or n.startswith('specbuild.builder'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "", out


def test_no_runtime_module_imports_the_builder_even_lazily():
    from pathlib import Path

    import specbuild.runtime as runtime

    offenders = [
        str(path)
        for path in Path(runtime.__path__[0]).rglob("*.py")
        if "specbuild.builder" in path.read_text() or "import torch" in path.read_text()
    ]
    assert offenders == []
