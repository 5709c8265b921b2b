"""One `specbuild serve` process on a free local port: started, waited for (/health 200), read (/metrics) and
stopped with SIGINT (the server's clean shutdown); its output goes to a log file."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from specbuild.errors import SpecbuildError
from specbuild.ports import free_port

READY_TIMEOUT_S = 600  # an engine's first load may check file hashes and warm up
STOP_TIMEOUT_S = 20


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text -> the sum of each metric's samples over all label values."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, value = line.rsplit(" ", 1)
        name = sample.split("{", 1)[0]
        sums[name] = sums.get(name, 0.0) + float(value)
    return sums


class ServedEngine:
    """`with ServedEngine(...) as server:` a ready server at `server.url`, stopped on exit."""

    def __init__(self, engine_dir: Path, model_name: str, log_file: Path, serve_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = Path(log_file)
        self.command = [sys.executable, "-m", "specbuild.cli.main", "serve", "--engine-dir", str(engine_dir)]
        self.command += ["--port", str(self.port), "--model-name", model_name, *serve_args]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServedEngine:
        with open(self.log_file, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _get(self, path: str) -> tuple[int, str] | None:
        """(status, body) of GET path, or None while nothing listens."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except OSError:
            return None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecbuildError(
                    f"specbuild serve exited ({self.process.returncode}) before it was ready:\n{self.log_tail()}"
                )
            answer = self._get("/health")
            if answer is not None and answer[0] == 200:
                return
            time.sleep(0.2)
        raise SpecbuildError(f"specbuild serve was not ready within {READY_TIMEOUT_S} s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        answer = self._get("/metrics")
        if answer is None or answer[0] != 200:
            raise SpecbuildError(f"{self.url}/metrics did not answer 200")
        return metric_sums(answer[1])

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGINT and wait; killed only if it has not exited after STOP_TIMEOUT_S."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            print(f"warning: specbuild serve outlived SIGINT by {STOP_TIMEOUT_S} s: killed", file=sys.stderr)
