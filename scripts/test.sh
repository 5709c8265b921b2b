#!/usr/bin/env bash
# Run the test suite: set up the venv ($VENV, default .venv), then pytest on 2 workers (tests sharing a built
# engine are kept on one worker with xdist groups). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv}"
scripts/setup-venv.sh "$VENV"
exec "$VENV/bin/python" -m pytest -q -n 2 --dist loadgroup tests "$@"
