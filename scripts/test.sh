#!/usr/bin/env bash
# Run the tests: scripts/test.sh [--full] [PYTEST ARGS...]
#   (default)  the fast tier: unit tests, tiny random models, each mode's lossless and sampling tests on one tiny
#              shape, the server and scheduler on tiny engines; under 5 minutes on 2 cores.
#   --full     every test (what .ci/run runs): adds the tests marked `full` -- the real model, every tiny shape and
#              precision, Triton, packaging, training; under 40 minutes on 2 cores.
# Sets up the venv ($VENV, default .venv) first; with --full also the Triton venv ($VENV-triton: PyTriton pins
# numpy < 2; without it the tests against a real Triton server skip, saying why). pytest runs on 2 workers (tests
# sharing a built engine stay on one worker: xdist groups) and lists its 25 slowest tests. Other arguments go to
# pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv}"
TIER=()
if [ "${1:-}" = "--full" ]; then
    TIER=(--full)
    shift
fi
scripts/setup-venv.sh "$VENV"
if [ ${#TIER[@]} -gt 0 ]; then
    if scripts/setup-venv.sh "$VENV-triton" triton; then
        export SPECBUILD_TRITON_PYTHON="$(cd "$VENV-triton/bin" && pwd)/python"
    else
        echo "warning: the Triton venv $VENV-triton could not be set up: the tests against a real Triton server skip" >&2
    fi
fi
exec "$VENV/bin/python" -m pytest -q -n 2 --dist loadgroup --durations=25 "${TIER[@]}" tests "$@"
