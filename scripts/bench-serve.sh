#!/usr/bin/env bash
# `specbuild serve` under load, measured with AIPerf: each --engine-dir is served on a free local port in turn and
# driven at each concurrency (chat endpoint, streaming, greedy, fully offline, the engine directory's tokenizer);
# summary.md / summary.json / summary.png and the exact commands (commands.sh) land in --out-dir.
#   scripts/bench-serve.sh --engine-dir engines/none --engine-dir engines/eagle3 [--concurrency 1,4,16]
#       [--requests 32] [--output-tokens 128] [--prompts mtbench|humaneval,mtbench|synthetic:N]
#       [--out-dir bench-serve-out] [--threads N]
# AIPerf is installed (pinned) into its own environment, $AIPERF_VENV (default .aiperf-venv, scripts/setup-aiperf.sh),
# reused when present. specbuild runs from $PYTHON when set, else from the project venv $VENV (default .venv, set up by
# scripts/setup-venv.sh); the plot needs matplotlib there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # paths in the arguments stay relative to the caller's cwd
AIPERF_VENV="${AIPERF_VENV:-$ROOT/.aiperf-venv}"

if [ -z "${PYTHON:-}" ]; then
    VENV="${VENV:-$ROOT/.venv}"
    "$ROOT/scripts/setup-venv.sh" "$VENV"
    PYTHON="$VENV/bin/python"
fi

"$ROOT/scripts/setup-aiperf.sh" "$AIPERF_VENV"

exec "$PYTHON" -m specbuild.bench.serve --aiperf "$AIPERF_VENV/bin/aiperf" "$@"
