#!/usr/bin/env bash
# Soak `specbuild serve`: scripts/soak-serve.sh ENGINE_DIR [--duration 600] [--report soak.md] [--max-batch-size N]
#   Starts a server on the engine, sends it twice its KV slots in flight for --duration seconds (default 10 minutes):
#   greedy (checked against the same request sent alone first), seeded sampling (checked against its first answer),
#   stop strings, streams, clients that leave mid-stream and bad requests (checked for their 4xx). Fails on any
#   difference, any 5xx, RSS setting new highs after the warm-up (the first half of the load), /metrics not adding up
#   to the requests sent, or an unhealthy server at the end; prints the report (and writes it with --report).
#   specbuild/serve/soak.py has the details.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENGINE="${1:?usage: scripts/soak-serve.sh ENGINE_DIR [--duration SECONDS] [--report FILE] [--max-batch-size N]}"
shift
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
exec "$PYTHON" -m specbuild.serve.soak --engine-dir "$ENGINE" "$@"
