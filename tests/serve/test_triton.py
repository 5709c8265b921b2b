"""Triton: a request's inputs (named like TensorRT-LLM's ensemble) checked into one scheduler request, a bad one a
line naming the input; `specbuild triton-repo` writes a model repository atomically; its Python-backend model streams
the same tokens and text as `specbuild run` (driven through a stand-in of triton_python_backend_utils); and, where
the Triton venv exists (scripts/test.sh makes it: SPECBUILD_TRITON_PYTHON), `serve --triton` and the repository on
the Triton server inside the PyTriton wheel answer gRPC streams and generate_stream with those same tokens."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from specbuild.cli.main import cli
from specbuild.errors import SpecbuildError
from specbuild.ports import free_ports
from specbuild.serve import triton_io
from specbuild.serve.errors import APIError
from specbuild.serve.triton_repo import write_repository
from tests.serve.conftest import MAX_SEQ_LEN, REPO
from tests.tiers import full

pytestmark = [pytest.mark.xdist_group("serve"), full("Triton: a real Triton server from the PyTriton venv")]

TRITON_PYTHON = os.environ.get("SPECBUILD_TRITON_PYTHON")
TOOLS = Path(__file__).with_name("triton_tools.py")
PROMPTS = ["def fib(n):", "hello world", "abcabcabc", "The quick brown fox"]


def _text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def test_inputs_become_one_scheduler_request(reference_engine):
    arrays = {"text_input": _text("hello"), "max_tokens": np.array([5], np.int32)}
    arrays["stop"] = np.array([b"xy", b"z"], dtype=np.object_)
    wanted = triton_io.parse_inputs(arrays, reference_engine, "m")
    assert wanted.ids == reference_engine.codec.encode("hello") and wanted.max_tokens == 5
    assert wanted.stop == ("xy", "z") and wanted.sampling.temperature == 0  # greedy unless asked
    arrays = {
        "text_input": _text("hi"),
        "temperature": np.array([0.5], np.float32),
        "top_p": np.array([0.9], np.float32),
    }
    arrays.update(top_k=np.array([5], np.int32), seed=np.array([7], np.int64))
    sampled = triton_io.parse_inputs(arrays, reference_engine, "m").sampling
    assert (sampled.temperature, sampled.top_k, sampled.seed) == (0.5, 5, 7) and sampled.top_p == pytest.approx(0.9)


@pytest.mark.parametrize(
    "arrays, param, words",
    [
        ({"text_input": None}, "text_input", "text_input must hold one string"),
        ({"text_input": np.array([b"\xff"], dtype=np.object_)}, "text_input", "not valid UTF-8"),
        ({"text_input": np.array([1], np.int32)}, "text_input", "must be a string"),
        ({"text_input": _text("")}, "text_input", "the text_input is empty"),
        ({"max_tokens": np.array([2, 3], np.int32)}, "max_tokens", "max_tokens must hold one value, got 2"),
        ({"max_tokens": np.array([0], np.int32)}, "max_tokens", "max_tokens must be an integer >= 1"),
        ({"temperature": np.array([-1.0], np.float32)}, "temperature", "temperature"),
        ({"top_p": np.array([1.5], np.float32)}, "top_p", "top_p"),
        ({"stop": np.array([3], np.int64)}, "stop", "stop must be a string"),
        ({"text_input": _text("x" * (MAX_SEQ_LEN + 10))}, "text_input", str(MAX_SEQ_LEN)),
    ],
)
def test_a_bad_input_is_one_line_naming_it(reference_engine, arrays, param, words):
    with pytest.raises(APIError) as err:
        triton_io.parse_inputs({"text_input": _text("hi"), **arrays}, reference_engine, "m")
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert words in err.value.message and "\n" not in err.value.message


def test_triton_repo_writes_a_decoupled_python_model(serve_engines, tmp_path):
    repo = tmp_path / "repo"
    (repo / "other").mkdir(parents=True)  # another model of the repository stays
    path = write_repository(serve_engines["none"], repo, "tiny-none", threads=1, max_batch_size=4)
    assert path == repo / "tiny-none" and (repo / "other").is_dir()
    config = (path / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "model_transaction_policy { decoupled: true }" in config
    assert "max_batch_size: 0" in config and 'name: "tiny-none"' in config
    for spec in (*triton_io.INPUTS, *triton_io.OUTPUTS):
        assert f'name: "{spec.name}" data_type: {spec.triton_type}' in config, spec.name
    assert f'key: "engine_dir" value: {{ string_value: "{serve_engines["none"].resolve()}" }}' in config
    assert 'key: "threads" value: { string_value: "1" }' in config
    spec = importlib.util.spec_from_file_location("model", path / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports without Triton
    assert module.TritonPythonModel.__module__ == "specbuild.serve.triton_backend"
    with pytest.raises(SpecbuildError, match="already exists"):  # nothing replaced without --overwrite
        write_repository(serve_engines["none"], repo, "tiny-none")
    write_repository(serve_engines["none"], repo, "tiny-none", overwrite=True)
    assert "threads" not in (path / "config.pbtxt").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-name", "a b"], "--model-name 'a b': Triton model names hold only letters, digits"),
        (["--max-batch-size", "999"], "--max-batch-size 999 is outside [1, 16]"),
        (["--threads", "0"], "--threads must be an integer >= 1, got 0"),
    ],
)
def test_triton_repo_refuses_bad_options_in_one_line(serve_engines, tmp_path, args, message):
    command = ["triton-repo", "--engine-dir", str(serve_engines["none"]), "--output-dir", str(tmp_path / "r"), *args]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 1 and result.output.startswith(f"error: {message}"), result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_triton_repo_of_a_missing_engine_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["triton-repo", "--engine-dir", str(tmp_path / "no"), "--output-dir", "r"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1 and "no" in result.output


# ---------------------------------------------------------------- the Python-backend model, without Triton
class FakeBackendUtils:
    """The parts of triton_python_backend_utils the model uses."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonModelException(Exception):
        pass

    class TritonError:
        def __init__(self, message):
            self.message = message

    class Tensor:
        def __init__(self, name, value):
            self.name, self.value = name, value

        def as_numpy(self):
            return self.value

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.outputs = {t.name: t.value for t in output_tensors}
            self.error = error

    @staticmethod
    def using_decoupled_model_transaction_policy(config):
        return config.get("model_transaction_policy", {}).get("decoupled", False)

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.inputs.get(name)


class FakeRequest:
    def __init__(self, **arrays):
        self.inputs = {name: FakeBackendUtils.Tensor(name, value) for name, value in arrays.items()}
        self.sender = FakeSender()

    def get_response_sender(self):
        return self.sender


class FakeSender:
    def __init__(self):
        self.responses, self.done = [], threading.Event()

    def send(self, response=None, flags=0):
        assert not self.done.is_set(), "a response after the final one"
        self.responses.append(response)
        if flags & FakeBackendUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.done.set()


@pytest.fixture
def backend_model(serve_engines, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", FakeBackendUtils)
    from specbuild.serve.triton_backend import TritonPythonModel

    model = TritonPythonModel()
    config = {"model_transaction_policy": {"decoupled": True}}
    config["parameters"] = {
        "engine_dir": {"string_value": str(serve_engines["none"])},
        "threads": {"string_value": "1"},
    }
    model.initialize({"model_config": json.dumps(config), "model_name": "tiny"})
    yield model
    model.finalize()


def test_the_backend_model_streams_what_run_gives_and_refuses_bad_requests(backend_model, reference_engine):
    good = [FakeRequest(text_input=_text(p), max_tokens=np.array([12], np.int32)) for p in PROMPTS]
    bad = FakeRequest(text_input=_text("hi"), temperature=np.array([-1.0], np.float32))
    backend_model.execute([*good, bad])  # returns at once: decoupled
    for request in [*good, bad]:
        assert request.sender.done.wait(60)
    for prompt, request in zip(PROMPTS, good):
        want = reference_engine.generate(prompt, max_new_tokens=12)
        responses = request.sender.responses
        assert all(r.error is None for r in responses) and len(responses) >= 2
        ids = [int(i) for r in responses for i in r.outputs["output_ids"]]
        text = "".join(r.outputs["text_output"][0].decode() for r in responses)
        reasons = [r.outputs["finish_reason"][0].decode() for r in responses]
        assert ids == want.output_ids and text == want.text and reasons == [""] * (len(responses) - 1) + ["length"]
    [refused] = bad.sender.responses
    assert refused.error is not None and "temperature" in refused.error.message


def test_the_backend_model_needs_a_decoupled_config(serve_engines, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", FakeBackendUtils)
    from specbuild.serve.triton_backend import TritonPythonModel

    config = {"parameters": {"engine_dir": {"string_value": str(serve_engines["none"])}}}
    with pytest.raises(FakeBackendUtils.TritonModelException, match="decoupled"):
        TritonPythonModel().initialize({"model_config": json.dumps(config), "model_name": "tiny"})


# ---------------------------------------------------------------- a real Triton (the PyTriton wheel's)
needs_triton = pytest.mark.skipif(
    not TRITON_PYTHON, reason="no Triton venv: scripts/test.sh sets SPECBUILD_TRITON_PYTHON (specbuild[triton])"
)


class TritonProcess:
    """A Triton server in the Triton venv: `specbuild serve --triton` or the wheel's tritonserver on a repository."""

    def __init__(self, command: list[str], log_file: Path):
        self.http, self.grpc, self.metrics = free_ports(3)
        self.url = f"http://127.0.0.1:{self.http}"
        self.log_file = log_file
        ports = ["--port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(log_file, "w") as log:
            self.process = subprocess.Popen([TRITON_PYTHON, *command, *ports], stdout=log, stderr=subprocess.STDOUT,
                                            env=env)  # fmt: skip

    def wait_ready(self, model: str, timeout: float = 120) -> TritonProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"Triton exited:\n{self.log_file.read_text()}"
            try:
                if httpx.get(f"{self.url}/v2/models/{model}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"Triton was not ready within {timeout} s:\n{self.log_file.read_text()}")

    def generate_stream(self, model: str, body: dict) -> list[dict]:
        """The generate extension's SSE events, parsed."""
        events = []
        with httpx.stream("POST", f"{self.url}/v2/models/{model}/generate_stream", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: ") :]))
        return events

    def grpc_streams(self, model: str, max_tokens: int) -> list[dict]:
        """PROMPTS as concurrent gRPC streams (tritonclient, in the Triton venv): ids, text, errors per prompt."""
        args = [TRITON_PYTHON, str(TOOLS), "grpc", f"127.0.0.1:{self.grpc}", model, str(max_tokens), *PROMPTS]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 20) -> float:
        """Send `signum`; the seconds until the process exited (killed after `timeout`)."""
        start = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        return time.monotonic() - start


def _ids(events: list[dict]) -> list[int]:
    """The output_ids of generate_stream events (Triton writes a one-element tensor as a scalar)."""
    return [i for e in events for i in (e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]])]


def _check_same_as_run(triton: TritonProcess, model: str, reference_engine) -> None:
    streams = triton.grpc_streams(model, 10)
    for prompt, got in zip(PROMPTS, streams):
        want = reference_engine.generate(prompt, max_new_tokens=10)
        assert got["error"] is None and got["ids"] == want.output_ids and got["text"] == want.text, prompt
        assert got["finish_reason"] == "length"
    events = triton.generate_stream(model, {"text_input": PROMPTS[0], "max_tokens": 10})
    assert _ids(events) == streams[0]["ids"]
    assert "".join(e["text_output"] for e in events) == streams[0]["text"]
    bad = triton.generate_stream(model, {"text_input": PROMPTS[0], "temperature": -1.0})
    assert len(bad) == 1 and "temperature" in bad[0]["error"] and "\n" not in bad[0]["error"].strip()
    again = triton.generate_stream(model, {"text_input": PROMPTS[1], "max_tokens": 4})  # still serving
    assert _ids(again) == streams[1]["ids"][:4]


@needs_triton
def test_serve_triton_streams_over_grpc_and_generate_stream(serve_engines, reference_engine, tmp_path):
    command = ["-m", "specbuild.cli.main", "serve", "--triton", "--engine-dir", str(serve_engines["none"])]
    triton = TritonProcess([*command, "--threads", "1", "--model-name", "tiny"], tmp_path / "log")
    try:
        _check_same_as_run(triton.wait_ready("tiny"), "tiny", reference_engine)
        assert triton.stop(signal.SIGINT) < 10 and triton.process.returncode == 0  # as `specbuild serve` stops
        assert "specbuild serve --triton: stopped" in triton.log_file.read_text()
    finally:
        triton.stop()


@needs_triton
def test_triton_repo_on_the_triton_server_of_the_pytriton_wheel(serve_engines, reference_engine, tmp_path):
    write_repository(serve_engines["none"], tmp_path / "repo", "tiny", threads=1)
    triton = TritonProcess([str(TOOLS), "server", str(tmp_path / "repo")], tmp_path / "log")
    try:
        _check_same_as_run(triton.wait_ready("tiny"), "tiny", reference_engine)
    finally:
        triton.stop()
