"""The kernel library built from the sources beside it (src/), once per machine and source: with the C++ compiler
found on PATH, against ONNX Runtime's C API headers, into the user cache.

The ONNX Runtime wheel ships no C headers. They come from, in order: $SPECBUILD_ORT_INCLUDE (a directory holding
onnxruntime_cxx_api.h); /usr/include/onnxruntime (Debian's and Ubuntu's libonnxruntime-dev); else Debian's
libonnxruntime-dev package itself, fetched once from deb.debian.org (its SHA-256 checked against the one pinned
here) and unpacked into the user cache. The library is built against that header version's API (ORT_API_VERSION 21)
and asks ONNX Runtime for it, which every runtime from 1.21 on provides. Every instruction set the library uses is
chosen per function at run time: one build serves AVX-512, AVX2 and older CPUs alike.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path

from specbuild import fsutil
from specbuild.errors import SpecbuildError
from specbuild.runtime import user_cache

SOURCES = Path(__file__).parent / "src"
LIBRARY = "libspecbuild_kernels.so"
HEADER = "onnxruntime_cxx_api.h"
DEB_URL = "http://deb.debian.org/debian/pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
DEB_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
DEB_INCLUDE = "usr/include/onnxruntime/"
# -ffp-contract=off: no a * b + c fused where the source does not say fma, so that every instruction-set path of a
# kernel rounds alike
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=off")


def compiler() -> str | None:
    """The C++ compiler: $CXX, else g++, else c++ (None: there is none)."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_root() -> Path:
    root = user_cache.cache_dir()
    if root is None:
        raise SpecbuildError("the kernel library is built into the user cache, which SPECBUILD_CACHE_DIR turns off")
    return root / "kernels"


def headers() -> Path:
    """A directory holding ONNX Runtime's C and C++ API headers (see the module docstring)."""
    explicit = os.environ.get("SPECBUILD_ORT_INCLUDE", "").strip()
    if explicit:
        if not (Path(explicit) / HEADER).is_file():
            raise SpecbuildError(f"SPECBUILD_ORT_INCLUDE={explicit}: no {HEADER} there")
        return Path(explicit)
    system = Path("/usr/include/onnxruntime")
    if (system / HEADER).is_file():
        return system
    target = _cache_root() / "onnxruntime-headers-1.21"
    if (target / HEADER).is_file():
        return target
    try:
        with urllib.request.urlopen(DEB_URL, timeout=60) as response:
            package = response.read()
    except OSError as exc:
        raise SpecbuildError(f"cannot fetch ONNX Runtime's headers from {DEB_URL} ({exc})") from None
    if hashlib.sha256(package).hexdigest() != DEB_SHA256:
        raise SpecbuildError(f"{DEB_URL}: not the package pinned here (its SHA-256 differs)")
    _unpack_headers(package, target)
    return target


def _unpack_headers(package: bytes, target: Path) -> None:
    """The headers of a .deb (an ar archive holding data.tar.xz) into `target`, written atomically."""
    if package[:8] != b"!<arch>\n":
        raise SpecbuildError(f"{DEB_URL}: not a Debian package")
    offset, data = 8, None
    while offset + 60 <= len(package):
        name = package[offset : offset + 16].decode().strip().rstrip("/")
        size = int(package[offset + 48 : offset + 58].decode().strip())
        if name.startswith("data.tar"):
            data = package[offset + 60 : offset + 60 + size]
        offset += 60 + size + (size % 2)
    if data is None:
        raise SpecbuildError(f"{DEB_URL}: no data archive in the package")
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in archive.getmembers():
            name = member.name.removeprefix("./")
            if member.isfile() and name.startswith(DEB_INCLUDE) and name.endswith(".h"):
                out = staging / name[len(DEB_INCLUDE) :]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(archive.extractfile(member).read())
    if not (staging / HEADER).is_file():
        raise SpecbuildError(f"{DEB_URL}: no {HEADER} in the package")
    try:
        staging.rename(target)
    except OSError:  # another process unpacked them first
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / HEADER).is_file():
            raise


def source_key(cxx: str) -> str:
    """What a build depends on: the sources, the flags and the compiler's version."""
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for path in sorted([*SOURCES.glob("*.cc"), *SOURCES.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest.update(version.encode())
    return digest.hexdigest()[:16]


def build() -> Path:
    """The library's path, built first if this machine has not built these sources yet (one process builds it while
    others wait for it: the test workers, the server's first engines)."""
    cxx = compiler()
    if cxx is None:
        raise SpecbuildError("no C++ compiler on PATH (g++ or c++, or $CXX)")
    out = _cache_root() / source_key(cxx) / LIBRARY
    if out.is_file():
        return out
    include = headers()
    out.parent.mkdir(parents=True, exist_ok=True)
    with fsutil.locked_dir(out.parent, timeout=600):
        if not out.is_file():
            _compile(cxx, include, out)
    return out


def _compile(cxx: str, include: Path, out: Path) -> None:
    """Each source into an object file, all at once (one compiler per source), then the objects into `out`."""
    work = out.with_name(f".build.{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        sources = sorted(SOURCES.glob("*.cc"))
        objects = [work / f"{source.stem}.o" for source in sources]
        jobs = [
            subprocess.Popen([cxx, *FLAGS, f"-I{include}", "-c", str(source), "-o", str(obj)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for source, obj in zip(sources, objects)
        ]  # fmt: skip
        errors = [job.communicate(timeout=600)[1] for job in jobs]
        failed = next((e for e, job in zip(errors, jobs) if job.returncode), None)
        if failed is None:
            link = subprocess.run([cxx, *FLAGS, *map(str, objects), "-o", str(work / LIBRARY)],
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
            failed = link.stderr if link.returncode else None
        if failed is not None:
            lines = failed.strip().splitlines()
            first = next((line for line in lines if ": error" in line), lines[0] if lines else "(no message)")
            raise SpecbuildError(f"the kernel library did not compile: {first}")
        (work / LIBRARY).rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
