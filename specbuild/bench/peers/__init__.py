"""The peer stacks the benchmarks measure beside our engines, one module each behind `base.PeerStack`: transformers,
ONNX Runtime GenAI, OpenVINO GenAI, llama.cpp. A new peer is one module with a `STACK`, listed here; the `specbuild
bench` options, their checks and both harnesses' rows come from it."""

from __future__ import annotations

from specbuild.bench.peers import llama_cpp, openvino, ort_genai, transformers
from specbuild.bench.peers.base import PeerOption, PeerStack

STACKS: tuple[PeerStack, ...] = (transformers.STACK, ort_genai.STACK, openvino.STACK, llama_cpp.STACK)


def options() -> list[PeerOption]:
    """Every stack's `specbuild bench` options, in order."""
    return [option for stack in STACKS for option in stack.options]


def given(args: dict) -> list[PeerStack]:
    """The stacks some of whose options `args` gives."""
    return [stack for stack in STACKS if stack.given(args)]


def check(args: dict, under_load: bool) -> None:
    """A one-line SpecbuildError for options no stack can run together."""
    for stack in STACKS:
        stack.check(args, under_load)


def sequential_peers(args: dict, threads: int | None, eos_ids: set[int]) -> list:
    """The rows of the one-at-a-time benchmark, stack by stack."""
    return [peer for stack in given(args) for peer in stack.sequential(args, threads, eos_ids)]


def load_peers(args: dict, threads: int | None, max_num_seqs: int, max_new_tokens: int) -> list:
    """The closed-loop targets under load, stack by stack."""
    return [peer for stack in given(args) for peer in stack.load(args, threads, max_num_seqs, max_new_tokens)]


def settings(args: dict) -> dict:
    """The report's record of every stack's options."""
    return {key: value for stack in STACKS for key, value in stack.settings(args).items()}
