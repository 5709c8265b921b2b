#!/usr/bin/env bash
# Run the test suite: set up the venv ($VENV, default .venv) and the Triton venv ($VENV-triton: PyTriton pins
# numpy < 2; without it the tests against a real Triton server skip, saying why), then pytest on 2 workers (tests
# sharing a built engine are kept on one worker with xdist groups). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv}"
scripts/setup-venv.sh "$VENV"
if scripts/setup-venv.sh "$VENV-triton" triton; then
    export SPECBUILD_TRITON_PYTHON="$(cd "$VENV-triton/bin" && pwd)/python"
else
    echo "warning: the Triton venv $VENV-triton could not be set up: the tests against a real Triton server skip" >&2
fi
exec "$VENV/bin/python" -m pytest -q -n 2 --dist loadgroup tests "$@"
