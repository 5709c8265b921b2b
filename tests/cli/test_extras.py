"""The extras check and the deferred import of an extra's compiled modules."""

from __future__ import annotations

import os
import signal

import pytest

from specbuild.cli import extras
from specbuild.errors import SpecbuildError
from specbuild.interrupts import handling_interrupts


def test_a_sigint_inside_the_native_import_is_raised_only_once_the_import_is_done(monkeypatch):
    imported = []

    def import_module(name):  # the signal lands in the middle of the import, as a Ctrl-C inside torch's C++ start-up
        os.kill(os.getpid(), signal.SIGINT)
        imported.append(name)

    monkeypatch.setattr(extras.importlib, "import_module", import_module)
    with handling_interrupts(), pytest.raises(KeyboardInterrupt):
        extras.import_native("build")
    assert imported == list(extras.EXTRA_NATIVE_IMPORTS["build"])


def test_no_signal_no_exception_and_extras_without_native_modules_import_nothing(monkeypatch):
    imported = []
    monkeypatch.setattr(extras.importlib, "import_module", imported.append)
    with handling_interrupts():
        extras.import_native("serve")
        extras.import_native("train")
    assert imported == list(extras.EXTRA_NATIVE_IMPORTS["train"])


def test_a_missing_module_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(extras.EXTRA_MODULES, "build", ("torch", "no_such_module_xyz"))
    with pytest.raises(SpecbuildError, match=r"needs the build extra \(no_such_module_xyz not installed\)"):
        extras.require_extra("build", "build")
