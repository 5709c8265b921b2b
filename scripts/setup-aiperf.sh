#!/usr/bin/env bash
# Create (or reuse) the AIPerf environment: setup-aiperf.sh VENV_DIR
# AIPerf (pinned) lives in an environment of its own: its dependencies (transformers, pandas, ...) stay out of the
# project's. Used by scripts/bench-serve.sh and by scripts/test.sh --full (the AIPerf test). Idempotent: skipped when
# the marker records the same pin.
set -euo pipefail
AIPERF_PIN="aiperf==0.13.0"
AIPERF_VENV="${1:?usage: scripts/setup-aiperf.sh VENV_DIR}"
MARKER="$AIPERF_VENV/.aiperf-pin"
if [ ! -x "$AIPERF_VENV/bin/aiperf" ] || [ "$(cat "$MARKER" 2>/dev/null)" != "$AIPERF_PIN" ]; then
    echo "installing $AIPERF_PIN into $AIPERF_VENV ..." >&2
    [ -x "$AIPERF_VENV/bin/python" ] || python3 -m venv "$AIPERF_VENV"
    "$AIPERF_VENV/bin/python" -m pip install -q --disable-pip-version-check "$AIPERF_PIN"
    echo "$AIPERF_PIN" > "$MARKER"
fi
