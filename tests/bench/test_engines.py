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


@pytest.mark.xdist_group("quantize")
def test_stock_kernels_add_each_engine_on_onnx_runtimes_own_kernels(int8_engines):
    """`bench --stock-kernels`: every engine on specbuild's kernels comes again on the stock ones, a row of its own
    whose own `none` is the stock-kernel `none` (the two kernels round differently)."""
    from specbuild.runtime import kernels

    if kernels.library() is None:
        pytest.skip(kernels.description())
    dirs = [int8_engines["none"], int8_engines["ngram"]]
    loaded, labels = engines.load_engines(dirs, 16, 1, False, stock_kernels=True)
    assert labels == ["none (none)", "ngram (ngram)", "none (none, stock kernels)", "ngram (ngram, stock kernels)"]
    assert [e.exactness.kernels.startswith("specbuild kernels") for e in loaded] == [True, True, False, False]
    assert loaded[2].kernels_tag == loaded[3].kernels_tag == "stock" != loaded[0].kernels_tag
    assert engines.own_none(loaded, labels) == [labels[0], labels[0], labels[2], labels[2]]
    ids = [1, 5, 9, 3, 7, 5, 9, 3, 7]
    outputs = [e.generate(input_ids=ids, max_new_tokens=12, decode_text=False).output_ids for e in loaded]
    assert outputs[1] == outputs[0] and outputs[3] == outputs[2]
