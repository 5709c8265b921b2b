#!/usr/bin/env bash
# Run the tests: scripts/test.sh [--full] [PYTEST ARGS...]
#   (default)  the fast tier: unit tests, tiny random models, each mode's lossless and sampling tests on one tiny
#              shape, the server and scheduler on tiny engines; under 5 minutes on 2 cores.
#   --full     every test (what .ci/run runs): adds the tests marked `full` -- the real model, every tiny shape and
#              precision, Triton, AIPerf, packaging, training; under 40 minutes on 2 cores.
# Sets up the venv ($VENV, default .venv) first; with --full also the two environments of their own some tests drive:
# the Triton venv ($VENV-triton: PyTriton pins numpy < 2) and the AIPerf venv ($VENV-aiperf: scripts/setup-aiperf.sh).
# A companion that cannot be set up on a machine where it was set up before fails the run (a broken install must not
# pass as a skip); on a machine where it never could, its tests skip, saying why. pytest runs on 2 workers (tests
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

# companion NAME COMMAND...: set it up; the machine remembers it could (a marker per Python and platform in the user
# cache), so that a later failure there is an error rather than a skip. Returns 1 when it was never set up here.
companion() {
    local name="$1"
    shift
    local cache="${SPECBUILD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specbuild}"
    local marker="$cache/companion-$name-$(uname -m)-$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    if "$@"; then
        mkdir -p "$cache" 2>/dev/null && touch "$marker" 2>/dev/null || true
        return 0
    fi
    if [ -f "$marker" ]; then
        echo "error: the $name environment could be set up on this machine before and now cannot (see above)" >&2
        exit 1
    fi
    echo "warning: the $name environment could not be set up (never on this machine): its tests skip" >&2
    return 1
}

if [ ${#TIER[@]} -gt 0 ]; then
    if companion triton scripts/setup-venv.sh "$VENV-triton" triton; then
        export SPECBUILD_TRITON_PYTHON="$(cd "$VENV-triton/bin" && pwd)/python"
    fi
    if companion aiperf scripts/setup-aiperf.sh "$VENV-aiperf"; then
        export SPECBUILD_AIPERF="$(cd "$VENV-aiperf/bin" && pwd)/aiperf"
    fi
fi
exec "$VENV/bin/python" -m pytest -q -n 2 --dist loadgroup --durations=25 "${TIER[@]}" tests "$@"
