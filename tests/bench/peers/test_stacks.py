"""The peer stacks behind one interface (bench/peers): each module's STACK gives its `specbuild bench` options (the
CLI is made from them, so a new stack's options appear without editing the command), its checks and its rows, and
the report records its options."""

import dataclasses

from click.testing import CliRunner

from specbuild.bench import peers
from specbuild.bench.peers.base import PeerOption, PeerStack
from specbuild.cli.main import cli


def test_every_stack_is_a_module_with_its_options_in_the_cli():
    names = {stack.name for stack in peers.STACKS}
    assert names == {"transformers", "ONNX Runtime GenAI", "OpenVINO GenAI", "llama.cpp"}
    flags = [option.flag for option in peers.options()]
    assert len(flags) == len(set(flags)) and "--llama-cpp-model" in flags
    help_text = CliRunner().invoke(cli, ["bench", "--help"]).output
    assert all(flag in help_text for flag in flags)


def test_a_stack_added_to_the_list_is_asked_for_its_rows_and_recorded(monkeypatch):
    class Echo(PeerStack):
        name = "echo"
        options = (PeerOption("--echo-model", "echo_dirs", "an echo"),)

        def sequential(self, args, threads, eos_ids):
            return [f"echo {d}" for d in args["echo_dirs"]]

    monkeypatch.setattr(peers, "STACKS", (*peers.STACKS, Echo()))
    args = {"echo_dirs": ["a", "b"], "hf_model_dir": None}
    assert [stack.name for stack in peers.given(args)] == ["echo"]
    assert peers.sequential_peers(args, 1, set()) == ["echo a", "echo b"]
    assert peers.load_peers(args, 1, 4, 8) == []  # a stack without a batching path has no rows under load
    assert peers.settings(args)["echo_dirs"] == ["a", "b"] and peers.settings(args)["hf_model_dir"] is None
    assert dataclasses.replace(peers.options()[-1]).flag == "--echo-model"
