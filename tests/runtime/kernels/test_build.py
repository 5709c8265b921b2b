"""The kernel library's build (runtime/kernels/build.py) on stand-in sources: one library per source key, built once
by one process while others wait, a compile error as one line with nothing left behind."""

import threading

import pytest

from specbuild.errors import SpecbuildError
from specbuild.runtime.kernels import build

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler on this machine")


@pytest.fixture
def sources(tmp_path, monkeypatch):
    src, include = tmp_path / "src", tmp_path / "include"
    src.mkdir()
    include.mkdir()
    (include / build.HEADER).write_text("// stand-in\n")
    (src / "a.cc").write_text('extern "C" __attribute__((visibility("default"))) int SpecbuildA() { return 1; }\n')
    (src / "b.cc").write_text('extern "C" __attribute__((visibility("default"))) int SpecbuildB() { return 2; }\n')
    monkeypatch.setattr(build, "SOURCES", src)
    monkeypatch.setenv("SPECBUILD_ORT_INCLUDE", str(include))
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path / "cache"))
    return src


def test_every_source_is_compiled_into_one_library_once(sources, monkeypatch):
    import ctypes

    paths, calls = [], []
    real = build._compile
    monkeypatch.setattr(build, "_compile", lambda *a: (calls.append(a), real(*a)))
    threads = [threading.Thread(target=lambda: paths.append(build.build())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(paths)) == 1 and len(calls) == 1  # the others waited for the first build
    library = ctypes.CDLL(str(paths[0]))
    assert library.SpecbuildA() == 1 and library.SpecbuildB() == 2
    assert sorted(p.name for p in paths[0].parent.iterdir()) == [build.LIBRARY]  # no object files left


def test_a_compile_error_is_one_line_and_leaves_nothing(sources):
    (sources / "b.cc").write_text("int broken( {\n")
    with pytest.raises(SpecbuildError, match=r"^the kernel library did not compile: .*b\.cc:1:.*error") as info:
        build.build()
    assert "\n" not in str(info.value)
    key = build._cache_root() / build.source_key(build.compiler())
    assert not key.exists() or list(key.iterdir()) == []
