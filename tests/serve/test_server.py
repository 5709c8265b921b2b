"""The server process: SIGINT with requests in flight exits within 5 s (each stream ends with [DONE], those cut short
after an error event); an engine that fails to load leaves /health at 503 with the reason; the startup line names
the address, engine and limits."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from tests.serve.conftest import ServerProcess

pytestmark = pytest.mark.xdist_group("serve")


def _stream_to_end(server, model: str, index: int, outcomes: list, errors: list) -> None:
    body = {"model": model, "prompt": f"p{index}", "max_tokens": 3000, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=20) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        outcomes.append(lines[-1] if response.status_code == 200 else response.status_code)
        errors += [json.loads(line[len("data: ") :])["error"] for line in lines if '"error"' in line]
    except httpx.TransportError as exc:  # sent after the server closed its port
        outcomes.append(type(exc).__name__)


def test_sigint_with_requests_in_flight_exits_within_5_s(serve_engines, tmp_path):
    engine = serve_engines["none"]
    server = ServerProcess(engine, tmp_path / "log", "--max-batch-size", "2").wait_ready()
    try:
        assert f"ready on {server.url}: engine {engine}" in server.log
        assert "mode none" in server.log and "max_batch_size 2" in server.log and "max_seq_len 4096" in server.log
        outcomes: list = []
        errors: list = []
        args = (server, engine.name)
        clients = [threading.Thread(target=_stream_to_end, args=(*args, i, outcomes, errors)) for i in range(6)]
        for client in clients:
            client.start()
        while server.metric("specbuild:num_requests_running") < 2:
            pass
        assert server.interrupt(timeout=10) < 5
        for client in clients:
            client.join(5)
        assert not any(client.is_alive() for client in clients)
        # the streams begun end with [DONE] (finished, or cancelled with an error event before it); later ones are
        # refused (503) or find the port closed
        assert outcomes.count("data: [DONE]") >= 2, outcomes
        assert set(outcomes) <= {"data: [DONE]", 503, "ConnectError"}, outcomes
        # six requests of 3000 tokens on two slots outlast the grace period: those left were cancelled in-stream
        assert errors and all(e["code"] == 503 and "shutting down" in e["message"] for e in errors), errors
        assert server.process.returncode == 0
        assert "stopped" in server.log
    finally:
        server.close()


def test_an_engine_that_fails_to_load_answers_503(serve_engines, tmp_path):
    broken = shutil.copytree(serve_engines["none"], tmp_path / "broken")
    graph = next(broken.glob("*.onnx"))
    data = bytearray(graph.read_bytes())
    data[-100:] = bytes(100)  # same size, wrong content: the load's hash check refuses it
    graph.write_bytes(bytes(data))
    server = ServerProcess(broken, tmp_path / "log")
    try:
        server.wait_listening()
        while "failed to load" not in server.log:
            assert server.process.poll() is None
        for path in ("/health", "/v1/models"):
            response = httpx.get(server.url + path)
            assert response.status_code == 503
            assert "the engine failed to load" in response.json()["error"]["message"]
        assert server.interrupt() < 5
    finally:
        server.close()
