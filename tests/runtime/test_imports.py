"""The runtime loads and runs engines without the build side: importing it -- every runtime module, and every mode's
drafter -- pulls in neither torch, the builder nor training (tests/test_shape.py checks the import statements)."""

import subprocess
import sys


def test_runtime_and_drafters_import_neither_torch_nor_the_builder_nor_training():
    code = (
        "import sys, pkgutil, importlib, specbuild.runtime as r\n"
        "from specbuild.modes.registry import load_object, modes\n"
        "for m in pkgutil.walk_packages(r.__path__, 'specbuild.runtime.'): importlib.import_module(m.name)\n"
        "drafters = [load_object(spec.drafter) for spec in modes().values()]\n"
        "bad = sorted(n for n in sys.modules if n == 'torch' or n.startswith(('torch.', 'specbuild.builder', "
        "'specbuild.training')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "", out
