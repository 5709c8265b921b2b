"""A self-distillation corpus on disk: token ids in compressed chunks and an index, grown in resumable steps.

A corpus directory holds `index.json` and chunk files `chunk-NNNN.npz` (np.savez_compressed, read with
allow_pickle=False). A chunk holds, for its n sequences:
- `tokens`: prompt + generated ids of all sequences concatenated (uint16 when the vocabulary fits, else uint32);
- `offsets` int64 [n+1]: sequence i is tokens[offsets[i]:offsets[i+1]];
- `prompt_lens` int32 [n]: the first prompt_lens[i] ids of sequence i are its prompt;
- `keys` fixed-width unicode [n]: the prompt's stable key (`prompt_key`), never repeated within a corpus;
- `sources` unicode [n]: where the prompt came from (code, chatcode, chat, stub, sharegpt-turn, ...).
A prompt pool (`prompt_pool`) is the same layout without generations (prompt_lens == the lengths).

index.json: the format version, the base model (name and the sha256 of the file its weights came from) and one
entry per chunk (file, counts, settings, hardware, seconds, tokens/s, created). A chunk is written to a temporary
file and renamed, then the index is rewritten the same way: an interrupted write leaves the corpus as it was (at
worst an orphan chunk file the index does not list, which the next write replaces). `merge` appends the chunks
of a corpus grown elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specbuild.errors import SpecbuildError

FORMAT_VERSION = 1
INDEX = "index.json"
KEY_CHARS = 20


def prompt_key(source: str, text: str) -> str:
    """The stable key of a prompt: sha1 of its source and text, 20 hex characters."""
    return hashlib.sha1(f"{source}\n{text}".encode()).hexdigest()[:KEY_CHARS]


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size < 65536 else np.uint32


# ----------------------------------------------------------------------------------------------- arrays


def pack(records: list[dict], vocab_size: int) -> dict[str, np.ndarray]:
    """Chunk arrays of records {key, source, prompt_ids, gen_ids (optional)}."""
    if not records:
        raise SpecbuildError("a chunk needs at least one sequence")
    seqs = [list(r["prompt_ids"]) + list(r.get("gen_ids", ())) for r in records]
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lens.sum()))
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
        raise SpecbuildError(f"token ids outside the vocabulary [0, {vocab_size})")
    keys = [r["key"] for r in records]
    if len(set(keys)) != len(keys):
        raise SpecbuildError("duplicate prompt keys in one chunk")
    return {
        "tokens": flat.astype(token_dtype(vocab_size)),
        "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        "prompt_lens": np.array([len(r["prompt_ids"]) for r in records], dtype=np.int32),
        "keys": np.array(keys, dtype=f"<U{KEY_CHARS}"),
        "sources": np.array([r["source"] for r in records], dtype=np.str_),
    }


def unpack(arrays: dict[str, np.ndarray]) -> Iterator[dict]:
    """Records {key, source, prompt_ids, gen_ids} of chunk arrays, in order."""
    tokens, offsets, plens = arrays["tokens"], arrays["offsets"], arrays["prompt_lens"]
    for i, (key, source) in enumerate(zip(arrays["keys"].tolist(), arrays["sources"].tolist())):
        seq = tokens[offsets[i] : offsets[i + 1]].tolist()
        yield {"key": key, "source": source, "prompt_ids": seq[: plens[i]], "gen_ids": seq[plens[i] :]}


def read_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of a chunk or pool file, checked for the layout above."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError) as exc:
        raise SpecbuildError(f"{path}: not a readable token-id npz ({exc})") from None
    missing = {"tokens", "offsets", "prompt_lens", "keys", "sources"} - set(arrays)
    if missing:
        raise SpecbuildError(f"{path}: missing arrays {', '.join(sorted(missing))}")
    n = len(arrays["keys"])
    if len(arrays["offsets"]) != n + 1 or len(arrays["prompt_lens"]) != n or len(arrays["sources"]) != n:
        raise SpecbuildError(f"{path}: arrays of different lengths")
    if int(arrays["offsets"][-1]) != len(arrays["tokens"]):
        raise SpecbuildError(f"{path}: offsets do not cover the tokens")
    return arrays


def write_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed to a temporary file in the same directory, then renamed over `path`."""
    _write_atomic(path, "wb", lambda fh: np.savez_compressed(fh, **arrays))


def _write_text_atomic(path: Path, text: str) -> None:
    _write_atomic(path, "w", lambda fh: fh.write(text))


def _write_atomic(path: Path, mode: str, write) -> None:
    """write(fh) into a temporary file beside `path`, synced, then renamed over it (nothing left on failure)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------- the corpus


def load_index(corpus_dir: str | Path) -> dict | None:
    """The corpus index, or None where the directory holds none."""
    path = Path(corpus_dir) / INDEX
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecbuildError(f"{path}: not a readable corpus index ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_VERSION:
        raise SpecbuildError(f"{path}: not a corpus index of format {FORMAT_VERSION}")
    return index


def open_corpus(corpus_dir: str | Path, base: dict, vocab_size: int) -> dict:
    """The index of the corpus at `corpus_dir`, created empty where there is none.

    base: {name, sha256, ...} of the model; an existing corpus of another model (sha256) is refused."""
    corpus_dir = Path(corpus_dir)
    if corpus_dir.exists() and not corpus_dir.is_dir():
        raise SpecbuildError(f"{corpus_dir}: not a directory")
    index = load_index(corpus_dir)
    if index is None:
        corpus_dir.mkdir(parents=True, exist_ok=True)
        index = {"format": FORMAT_VERSION, "base_model": dict(base), "vocab_size": vocab_size, "chunks": []}
        _write_text_atomic(corpus_dir / INDEX, json.dumps(index, indent=1) + "\n")
    elif index["base_model"].get("sha256") != base.get("sha256"):
        raise SpecbuildError(
            f"{corpus_dir}: corpus of {index['base_model'].get('name')} ({index['base_model'].get('sha256')}), "
            f"not of this model ({base.get('sha256')})"
        )
    return index


def append_chunk(corpus_dir: str | Path, records: list[dict], info: dict) -> dict:
    """Write `records` as the next chunk and list it in the index with `info` (settings, hardware, seconds, ...).

    Returns the chunk's index entry. Keys already in the corpus are refused."""
    corpus_dir = Path(corpus_dir)
    index = load_index(corpus_dir)
    if index is None:
        raise SpecbuildError(f"{corpus_dir}: no corpus (open_corpus creates one)")
    seen = corpus_keys(corpus_dir)
    repeated = [r["key"] for r in records if r["key"] in seen]
    if repeated:
        raise SpecbuildError(f"{corpus_dir}: {len(repeated)} prompt(s) already in the corpus, e.g. {repeated[0]}")
    name = f"chunk-{len(index['chunks']):04d}.npz"
    write_npz_atomic(corpus_dir / name, pack(records, index["vocab_size"]))
    entry = {
        "file": name,
        "sequences": len(records),
        "prompt_tokens": sum(len(r["prompt_ids"]) for r in records),
        "generated_tokens": sum(len(r["gen_ids"]) for r in records),
        "sources": dict(sorted(Counter(r["source"] for r in records).items())),
        **info,
    }
    index["chunks"].append(entry)
    _write_text_atomic(corpus_dir / INDEX, json.dumps(index, indent=1) + "\n")
    return entry


def iter_chunks(corpus_dir: str | Path) -> Iterator[tuple[dict, dict[str, np.ndarray]]]:
    """(index entry, arrays) of every chunk the index lists, in order."""
    corpus_dir = Path(corpus_dir)
    index = load_index(corpus_dir)
    if index is None:
        raise SpecbuildError(f"{corpus_dir}: no corpus index ({INDEX})")
    for entry in index["chunks"]:
        yield entry, read_arrays(corpus_dir / entry["file"])


def corpus_keys(corpus_dir: str | Path) -> set[str]:
    """The prompt keys of every sequence in the corpus (empty where there is no corpus yet)."""
    if load_index(corpus_dir) is None:
        return set()
    return {k for _, arrays in iter_chunks(corpus_dir) for k in arrays["keys"].tolist()}


def iter_sequences(corpus_dir: str | Path) -> Iterator[dict]:
    """Every sequence as the records `distill.read_sequences` gives: {id, kind, prompt_ids, gen_ids}."""
    for _, arrays in iter_chunks(corpus_dir):
        for r in unpack(arrays):
            yield {"id": r["key"], "kind": r["source"], "prompt_ids": r["prompt_ids"], "gen_ids": r["gen_ids"]}


def totals(corpus_dir: str | Path) -> dict:
    """Sums over the index: chunks, sequences, prompt and generated tokens, seconds, sequences per source."""
    index = load_index(corpus_dir)
    if index is None:
        raise SpecbuildError(f"{corpus_dir}: no corpus index ({INDEX})")
    chunks = index["chunks"]
    sources: Counter = Counter()
    for c in chunks:
        sources.update(c["sources"])
    return {
        "chunks": len(chunks),
        "sequences": sum(c["sequences"] for c in chunks),
        "prompt_tokens": sum(c["prompt_tokens"] for c in chunks),
        "generated_tokens": sum(c["generated_tokens"] for c in chunks),
        "seconds": round(sum(c.get("seconds", 0.0) for c in chunks), 1),
        "sources": dict(sorted(sources.items())),
    }


COUNT_FIELDS = ("file", "sequences", "prompt_tokens", "generated_tokens", "sources")


def merge(src_dir: str | Path, dst_dir: str | Path) -> list[dict]:
    """Append every chunk of the corpus at `src_dir` (grown elsewhere, e.g. on a GPU host) to the corpus at
    `dst_dir` (created where there is none), renumbered, with its settings and lineage; sequences whose key
    `dst_dir` already holds are left out. Returns the new index entries."""
    src = load_index(src_dir)
    if src is None:
        raise SpecbuildError(f"{src_dir}: no corpus index ({INDEX})")
    open_corpus(dst_dir, src["base_model"], src["vocab_size"])
    added = []
    for entry, arrays in iter_chunks(src_dir):
        seen = corpus_keys(dst_dir)
        records = [r for r in unpack(arrays) if r["key"] not in seen]
        if records:
            info = {k: v for k, v in entry.items() if k not in COUNT_FIELDS}
            added.append(append_chunk(dst_dir, records, {**info, "merged_from": entry["file"]}))
    return added
