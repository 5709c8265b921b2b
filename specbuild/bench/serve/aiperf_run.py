"""One `aiperf profile` run against a served engine: the exact command (chat endpoint, streaming, greedy, server token
counts, a warm-up of one request per client), run offline, and the profile_export_aiperf.json it wrote."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

from specbuild.errors import SpecbuildError

# Offline by construction: every Hugging Face Hub request goes to a closed local port. (HF_HUB_OFFLINE=1 would be the
# usual way, but AIPerf 0.13.0 then looks a local --tokenizer directory up in the hub cache and fails on it.)
OFFLINE_ENV = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
SUMMARY_FILE = "profile_export_aiperf.json"
REQUEST_TIMEOUT_S = 900


def aiperf_command(
    aiperf: str,
    url: str,
    model_name: str,
    tokenizer_dir: Path,
    concurrency: int,
    requests: int,
    output_tokens: int,
    dataset_args: list[str],
    artifact_dir: Path,
) -> list[str]:
    return [
        aiperf, "profile",
        "--model", model_name,
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(tokenizer_dir),
        "--use-server-token-count",  # the server's usage counts: exact, and what a speculative step emitted
        "--extra-inputs", "temperature:0",
        "--output-tokens-mean", str(output_tokens),
        "--concurrency", str(concurrency),
        "--request-count", str(requests),
        "--warmup-request-count", str(concurrency),
        "--request-timeout-seconds", str(REQUEST_TIMEOUT_S),
        "--random-seed", "0",
        *dataset_args,
        "--output-artifact-dir", str(artifact_dir),
        "--ui-type=none",  # no progress display
        "--no-server-metrics",  # read once per run by the driver instead (spec-decode counters)
        "--no-gpu-telemetry",
    ]  # fmt: skip


def shell_line(command: list[str]) -> str:
    """The command as one copy-pasteable shell line, the offline environment in front."""
    env = " ".join(f"{k}={v}" for k, v in OFFLINE_ENV.items())
    return f"{env} {shlex.join(command)}"


def run_aiperf(command: list[str], artifact_dir: Path) -> dict:
    """Run it (output in artifact_dir/aiperf-console.log) and return its summary JSON."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    console = artifact_dir / "aiperf-console.log"
    with open(console, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE_ENV})
    tail = "\n".join(console.read_text(errors="replace").splitlines()[-25:])
    if done.returncode != 0:
        raise SpecbuildError(f"aiperf exited {done.returncode}; {console} ends:\n{tail}")
    summary = artifact_dir / SUMMARY_FILE  # the profiling phase (phases/ holds warm-up and profiling apart)
    if not summary.is_file():
        raise SpecbuildError(f"aiperf wrote no {summary}; {console} ends:\n{tail}")
    return json.loads(summary.read_text())
