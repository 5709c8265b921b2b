"""The engines of a benchmark (bench/engines.py): loaded side by side only where they fit the machine together."""

import pytest

from specbuild.bench import engines
from specbuild.errors import SpecbuildError


def test_engines_that_do_not_fit_together_are_refused_before_any_loads(tmp_path, monkeypatch):
    small, large = tmp_path / "small", tmp_path / "large"
    for path, size in ((small, 1000), (large, 3000)):
        path.mkdir()
        (path / "weights.bin").write_bytes(b"\0" * size)
    engines.check_engines_fit([small, large], None)  # nothing known about the machine: no check
    engines.check_engines_fit([small, large], 4000)
    with pytest.raises(SpecbuildError, match=r"the 2 engines take .*\(the largest, .*large, takes"):
        engines.check_engines_fit([small, large], 3999)
    monkeypatch.setattr(engines, "available_bytes", lambda: 10)
    monkeypatch.setattr("specbuild.runtime.engine.Engine", lambda *a, **k: pytest.fail("an engine was loaded"))
    with pytest.raises(SpecbuildError, match="run fewer engines per benchmark"):
        engines.load_engines([small, large], 16, None, False)
