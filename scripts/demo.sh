#!/usr/bin/env bash
# End to end on the embedded SmolLM2-135M-Instruct: set up .venv, then prepare -> convert -> build -> generate,
# plain decoding beside a speculative mode with the heads shipped for the model (tokens/s, τ, same output);
# --speculative-mode picks another.
# Arguments go to `specbuild demo` (e.g. --prompt "..." --max-new-tokens 64 --work-dir DIR).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv}"
scripts/setup-venv.sh "$VENV"
exec "$VENV/bin/specbuild" demo "$@"
