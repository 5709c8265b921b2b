"""A tiny engine pair with a character tokenizer and a chat template (`none` and `ngram`, built once), and real
`specbuild serve` processes on free local ports, driven with the `openai` client and httpx."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import specbuild
from specbuild.ports import free_port
from tests.helpers import ORT_ONLY, quiet, write_char_tokenizer
from tests.shapes import tiny_hf_model

pytestmark = pytest.mark.xdist_group("serve")

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
MAX_SEQ_LEN = 4096  # long requests (seconds) for the queue, disconnect and shutdown tests
REPO = Path(specbuild.__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def serve_engines(tmp_path_factory) -> dict[str, Path]:
    """`none` and `ngram` engines of a tiny Llama with a character tokenizer and a chat template; no EOS token, so a
    request runs to its max_tokens."""
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.builder.checkpoint.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("serve")
    hf = root / "hf"
    tiny_hf_model("llama_gqa_llama3rope", eos_token_id=None, max_position_embeddings=MAX_SEQ_LEN).save_pretrained(hf)
    write_char_tokenizer(hf)
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    ckpt = convert_checkpoint(hf, root / "ckpt", progress=False)
    common = dict(backends=ORT_ONLY, max_seq_len=MAX_SEQ_LEN)
    return {
        "none": build_engine(ckpt, root / "none", BuildOptions(**common), log=quiet),
        "ngram": build_engine(
            ckpt, root / "ngram", BuildOptions(speculative_mode="ngram", num_draft_tokens=3, **common), log=quiet
        ),
    }


class ServerProcess:
    """`python -m specbuild.cli.main serve` in a subprocess (its output in a log file)."""

    def __init__(self, engine_dir: Path, log_file: Path, *args: str, ca_file: Path | None = None, key: str = "unused"):
        """ca_file: the CA that signed the server's certificate (the server runs with TLS); key: its API key."""
        self.model = engine_dir.name
        self.port = free_port()
        self.url = f"{'https' if ca_file else 'http'}://127.0.0.1:{self.port}"
        self.verify = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
        self.key = key
        self.log_file = log_file
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "specbuild.cli.main", "serve", "--engine-dir", str(engine_dir)]
        command += ["--port", str(self.port), "--threads", "1", *args]
        with open(log_file, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def log(self) -> str:
        return self.log_file.read_text()

    def health(self) -> httpx.Response | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=5, verify=self.verify)
        except httpx.TransportError:
            return None

    def wait_listening(self, timeout: float = 60) -> httpx.Response:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the server exited:\n{self.log}"
            response = self.health()
            if response is not None:
                return response
            time.sleep(0.05)
        raise AssertionError(f"the server did not listen within {timeout} s:\n{self.log}")

    def wait_ready(self, timeout: float = 60) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while self.wait_listening(timeout).status_code != 200:
            assert time.monotonic() < deadline, f"the server was not ready within {timeout} s:\n{self.log}"
            time.sleep(0.05)
        return self

    def client(self, **kwargs) -> openai.OpenAI:
        http = httpx.Client(verify=self.verify)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, http_client=http, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        """The sum of a metric's samples (all labels) in /metrics."""
        headers = {"Authorization": f"Bearer {self.key}"}
        text = httpx.get(f"{self.url}/metrics", timeout=5, verify=self.verify, headers=headers).text
        samples = [line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#")]
        return sum(float(value) for sample, value in samples if sample.split("{")[0] == name)

    def interrupt(self, timeout: float = 10) -> float:
        """SIGINT; the seconds until the process exited."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout)
        return time.monotonic() - start

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="session")
def none_server(serve_engines, tmp_path_factory):
    """The `none` engine served with its 16 slots."""
    server = ServerProcess(serve_engines["none"], tmp_path_factory.mktemp("none_server") / "log")
    yield server.wait_ready()
    server.close()


@pytest.fixture(scope="session")
def ngram_server(serve_engines, tmp_path_factory):
    """The `ngram` engine served with one slot and one waiting place (the queue fills at once)."""
    log = tmp_path_factory.mktemp("ngram_server") / "log"
    server = ServerProcess(serve_engines["ngram"], log, "--max-batch-size", "1", "--max-queue", "1")
    yield server.wait_ready()
    server.close()


@pytest.fixture(scope="session")
def reference_engine(serve_engines):
    """The `none` engine loaded in this process (what `specbuild run` gives)."""
    from specbuild.runtime.engine import Engine

    return Engine(serve_engines["none"], threads=1)
