#!/usr/bin/env bash
# Trains every head family (EAGLE-3, EAGLE-1/2, Medusa, ReDrafter) on the repository's corpus (corpus/smollm2) with
# teacher-forced features (issue 32), and the draft model (MODES=draft: recipes/train-draft-corpus.yaml), on a CUDA
# GPU host that has torch and transformers but no internet and no `gguf`. See scripts/device/README.md for the two
# calls that carry the model there; run from the repository root.
#
#   scripts/device/train-heads.sh stash          # call 1: keep the carried .device/pNN/part, check the host, and a
#                                                #         ~20 s smoke test of corpus training on a tiny random model
#   scripts/device/train-heads.sh train [TOTAL]  # call 2: reassemble + check the GGUF, install .whl/*.whl, build the
#                                                #         HF directory, train the families in MODES concurrently
#                                                #         on the one GPU; every head is written within TOTAL
#                                                #         seconds of the call's start (default 470)
#   scripts/device/train-heads.sh smoke          # the smoke test alone
#
# Results: $OUT/smollm2-<mode>/ (config.json with the lineage and held-out metrics under specbuild_training, and the
# weights; the draft model's also draft_vocab.json, not the base's tokenizer files; a file over 16 MiB is sent as
# <file>.xz) -- 8 files at most; the logs stay in $LOGS, their summary goes to stdout.
# Environment: DEVICE (cuda), CORPUS (corpus/smollm2), MAX_SEQUENCES (all), BUDGET_<MODE> (loop seconds per family:
# EAGLE3 330, EAGLE 240, MEDUSA 200, REDRAFTER 200, DRAFT 235; each loop also ends in time for TOTAL), SETS (more
# recipe overrides KEY=VALUE, space-separated), LOGS (/tmp/train-heads), MODES ("eagle3 eagle medusa redrafter";
# also draft), and lib.sh's PYTHON, STASH, HF_DIR.
set -euo pipefail
T0=$(date +%s)
# shellcheck source=scripts/device/lib.sh
source "$(dirname "$0")/lib.sh"
DEVICE=${DEVICE:-cuda}
LOGS=${LOGS:-/tmp/train-heads}
MODES=${MODES:-eagle3 eagle medusa redrafter}
LIMIT=16777216  # bytes a file may have to come back from $OUT

smoke() {
  rm -rf "$LOGS/smoke"
  mkdir -p "$LOGS/smoke"
  PYTHONPATH=$PWD:${PYTHONPATH:-} "$py" scripts/device/smoke_train.py "$LOGS/smoke" "$DEVICE"
}

budget_of() {
  local var
  var="BUDGET_$(echo "$1" | tr '[:lower:]' '[:upper:]')"
  case "$1" in
    eagle3) echo "${!var:-330}" ;; eagle) echo "${!var:-240}" ;; draft) echo "${!var:-235}" ;; *) echo "${!var:-200}" ;;
  esac
}

launch() {  # launch MODE END_BY: one `specbuild train` in the background ($!), its log in $LOGS/MODE.log
  local mode=$1 end_by=$2 extra=() item
  [ -n "${MAX_SEQUENCES:-}" ] && extra=(--max-sequences "$MAX_SEQUENCES")
  for item in ${SETS:-}; do extra+=(--set "$item"); done
  "$py" -m specbuild.cli.main train --recipe "recipes/train-$mode-corpus.yaml" --device "$DEVICE" \
    --corpus-dir "${CORPUS:-corpus/smollm2}" "${extra[@]}" --set "base_model=$HF" \
    --set "output_dir=$OUT/smollm2-$mode" --set "work_dir=$LOGS/$mode" \
    --set "train.time_budget_s=$(budget_of "$mode")" --set "train.end_by=$end_by" > "$LOGS/$mode.log" 2>&1 &
}

summary() {  # the lines of a log worth reading in the call's output tail
  grep -E "teacher-forced|held-out|train rows|^epoch|heldout|time budget|schedule|Error|error" "$1" |
    grep -Ev '^[[:space:]]*[{}"]' |
    cut -c1-400 | tail -n 14 || true
  grep -E "^step " "$1" | tail -n 2 | cut -c1-300 || true
}

prune_outputs() {  # the base model's own tokenizer files (the draft model writes them) stay behind: 8 files come back
  rm -f "$OUT"/*/tokenizer.json "$OUT"/*/tokenizer_config.json "$OUT"/*/special_tokens_map.json \
    "$OUT"/*/chat_template.jinja "$OUT"/*/generation_config.json
}

shrink_outputs() {  # files over the limit travel as .xz (python's lzma: no xz binary needed)
  local f
  for f in "$OUT"/*/*; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt "$LIMIT" ] || continue
    "$py" -c "import lzma, pathlib, sys; p = pathlib.Path(sys.argv[1]); pathlib.Path(sys.argv[1] + '.xz').write_bytes(lzma.compress(p.read_bytes(), preset=9)); p.unlink()" "$f"
    echo "compressed $f -> $f.xz ($(stat -c %s "$f.xz") bytes)"
  done
}

train() {
  local total=${1:-470} pids=() mode
  stash
  prepare_model
  mkdir -p "$LOGS" "$OUT"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
  local end_by=$((T0 + total - 5))
  echo "start $(($(date +%s) - T0))s after the call began; heads due by +${total}s"
  for mode in $MODES; do launch "$mode" "$end_by"; pids+=($!); done
  local deadline=$((T0 + total + 60))  # a trainer still running then is stopped (its head is lost, the rest kept)
  while true; do
    local alive=0 pid
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    if [ "$(date +%s)" -gt $deadline ]; then
      echo "deadline: stopping ${pids[*]}"; for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; break
    fi
    sleep 5
  done
  local status=0 i=0
  for mode in $MODES; do
    wait "${pids[$i]}" || { echo "== $mode FAILED (exit $?)"; status=1; }
    i=$((i + 1))
    echo "== $mode"; summary "$LOGS/$mode.log"
  done
  prune_outputs
  shrink_outputs
  ls -l "$OUT"/* || true
  echo "done $(($(date +%s) - T0))s after the call began"
  return $status
}

case "${1:-}" in
  stash) stash; check_host; smoke ;;
  smoke) smoke ;;
  train) shift; train "$@" ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
