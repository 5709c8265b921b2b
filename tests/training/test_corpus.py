"""The self-distillation corpus on a tiny random Llama: chunks, index, atomic writes, resumable growth that never
repeats a prompt, greedy ids equal to transformers' generate, a stable prompt pool, one-line CLI errors."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specbuild.cli.main import cli
from specbuild.errors import SpecbuildError
from specbuild.training import corpus, corpus_grow, distill, prompt_pool
from tests.helpers import quiet, write_char_tokenizer
from tests.shapes import tiny_hf_model

VOCAB = 300
BASE = {"name": "tiny", "file": "model.safetensors", "sha256": "ab" * 32}
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _records(n: int, seed: int = 0, source: str = "code", gen: bool = True) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "key": corpus.prompt_key(source, f"{seed}-{i}"),
            "source": source,
            "prompt_ids": [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))],
            "gen_ids": [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 7))] if gen else [],
        }
        for i in range(n)
    ]


def _as_read(records: list[dict]) -> list[dict]:
    return [
        {"id": r["key"], "kind": r["source"], "prompt_ids": r["prompt_ids"], "gen_ids": r["gen_ids"]} for r in records
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer, HF directory) of a tiny random Llama (vocab 300) with a character tokenizer."""
    from transformers import AutoTokenizer

    hf = tmp_path_factory.mktemp("tiny_corpus") / "hf"
    model = tiny_hf_model("llama_gqa_llama3rope", vocab_size=VOCAB)
    model.save_pretrained(hf)
    write_char_tokenizer(hf)
    special = {"eos_token": "<unk>", "pad_token": "<unk>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}))
    return model, AutoTokenizer.from_pretrained(str(hf)), hf


def _pool(n: int, seed: int = 1) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "gen_ids"} for r in _records(n, seed, "chat", gen=False)]


def _grow(tmp_path, tiny, pool, **kw):
    model, tok, _ = tiny
    args = dict(minutes=10, batch_size=4, max_new_tokens=6, device="cpu", dtype="float32", chunk_minutes=10)
    return corpus_grow.grow(tmp_path / "c", model, tok, pool, base=BASE, log=quiet, **{**args, **kw})


def test_chunk_round_trip_and_index_totals(tmp_path):
    corpus.open_corpus(tmp_path, BASE, VOCAB)
    first, second = _records(5, 0, "code"), _records(3, 1, "stub")
    corpus.append_chunk(tmp_path, first, {"seconds": 1.5})
    corpus.append_chunk(tmp_path, second, {"seconds": 2.0})
    assert list(corpus.iter_sequences(tmp_path)) == _as_read(first + second)
    with np.load(tmp_path / "chunk-0000.npz", allow_pickle=False) as z:
        assert z["tokens"].dtype == np.uint16 and z["offsets"].dtype == np.int64 and z["prompt_lens"].dtype == np.int32
    assert corpus.totals(tmp_path) == {
        "chunks": 2,
        "sequences": 8,
        "prompt_tokens": sum(len(r["prompt_ids"]) for r in first + second),
        "generated_tokens": sum(len(r["gen_ids"]) for r in first + second),
        "seconds": 3.5,
        "sources": {"code": 5, "stub": 3},
    }
    index = corpus.load_index(tmp_path)
    assert index["base_model"] == BASE and [c["file"] for c in index["chunks"]] == ["chunk-0000.npz", "chunk-0001.npz"]
    assert corpus.pack(_records(2), 70000)["tokens"].dtype == np.uint32  # a vocabulary beyond uint16


def test_an_interrupted_write_leaves_the_corpus_as_it_was(tmp_path, monkeypatch):
    corpus.open_corpus(tmp_path, BASE, VOCAB)
    corpus.append_chunk(tmp_path, _records(4), {})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def half_written(fh, **arrays):
        fh.write(b"PK\x03\x04 partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", half_written)
    with pytest.raises(OSError, match="disk full"):
        corpus.append_chunk(tmp_path, _records(3, 1), {})
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    # the chunk is in place but the index rewrite fails: the index (and what is read) stays as it was
    real_replace = os.replace

    def killed_at_the_index(src, dst):
        if str(dst).endswith(corpus.INDEX):
            raise OSError("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_index)
    with pytest.raises(OSError, match="killed"):
        corpus.append_chunk(tmp_path, _records(3, 1), {})
    monkeypatch.undo()
    assert (tmp_path / corpus.INDEX).read_bytes() == before[corpus.INDEX]
    assert list(corpus.iter_sequences(tmp_path)) == _as_read(_records(4))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    corpus.append_chunk(tmp_path, _records(3, 1), {})  # the orphan chunk file is replaced
    assert corpus.totals(tmp_path)["sequences"] == 7


def test_resumed_growth_adds_to_the_corpus_and_never_repeats_a_prompt(tmp_path, tiny):
    pool = _pool(20)
    first = _grow(tmp_path, tiny, pool[:9], chunk_minutes=1e-9)  # a chunk after every batch
    assert first["sequences"] == 9 and first["chunks"] == 3
    second = _grow(tmp_path, tiny, pool)
    assert second["sequences"] == 20 and second["chunks"] == 4
    keys = [r["id"] for r in corpus.iter_sequences(tmp_path / "c")]
    assert sorted(keys) == sorted(p["key"] for p in pool)
    assert _grow(tmp_path, tiny, pool)["chunks"] == 4  # nothing left: nothing written
    entry = corpus.load_index(tmp_path / "c")["chunks"][0]
    assert entry["settings"]["greedy"] and entry["settings"]["max_new_tokens"] == 6 and entry["hardware"]
    assert entry["tokens_per_s"] > 0 and entry["created"].endswith("Z")


def test_corpus_sequences_are_transformers_greedy(tmp_path, tiny):
    model, tok, _ = tiny
    pool = _pool(6, seed=3)
    _grow(tmp_path, tiny, pool, max_new_tokens=8)
    eos, pad = corpus_grow.special_ids(tok)
    by_key = {r["id"]: r for r in corpus.iter_sequences(tmp_path / "c")}
    for p in pool[:3]:
        ids = torch.tensor([p["prompt_ids"]])
        out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=sorted(eos), pad_token_id=pad)
        want = out[0, ids.shape[1] :].tolist()
        got = by_key[p["key"]]
        assert got["prompt_ids"] == p["prompt_ids"] and got["gen_ids"] == want[: len(got["gen_ids"])]
        assert len(got["gen_ids"]) == 8 or got["gen_ids"][-1] in eos


def _stdlib(root: Path) -> Path:
    root.mkdir()
    body = "\n".join(f"    x{i} = value + {i}\n    value = x{i} * 2" for i in range(6))
    for m in range(3):
        funcs = [
            f'def f{m}_{j}(value):\n    """Return a number computed from the value, step {j}."""\n'
            f"{body}\n    return value\n"
            for j in range(4)
        ]
        (root / f"mod{m}.py").write_text("import os\n\n\n" + "\n\n".join(funcs))
    return root


def _sharegpt(path: Path) -> Path:
    convs = [
        {"conversations": [
            {"from": "human", "value": f"Question number {i}: how do I sort a list?"},
            {"from": "gpt", "value": f"Use sorted(), answer {i}."},
            {"from": "human", "value": f"And in reverse order, case {i}?"},
        ]}
        for i in range(4)
    ]  # fmt: skip
    path.write_text(json.dumps(convs))
    return path


def test_the_pool_is_the_same_on_every_build_and_round_trips(tmp_path, tiny):
    _, tok, _ = tiny
    root, share = _stdlib(tmp_path / "lib"), _sharegpt(tmp_path / "sg.json")
    a = prompt_pool.build_pool(tok, 256, stdlib_root=root, sharegpt=share, log=quiet)
    b = prompt_pool.build_pool(tok, 256, stdlib_root=root, sharegpt=share, log=quiet)
    assert a == b and len({p["key"] for p in a}) == len(a)
    counts = prompt_pool.source_counts(a)
    assert counts["chat"] == 4 and counts["sharegpt-turn"] == 4 and counts["code"] >= 12 and counts["stub"] == 12
    context = [
        {"role": "user", "content": "Question number 0: how do I sort a list?"},
        {"role": "assistant", "content": "Use sorted(), answer 0."},
        {"role": "user", "content": "And in reverse order, case 0?"},
    ]
    assert distill.chat_wrap_messages(tok, context) in [p["prompt_ids"] for p in a if p["source"] == "sharegpt-turn"]
    saved = prompt_pool.save_pool(tmp_path / "pool.npz", a, len(tok), max_n=10)
    loaded = prompt_pool.load_pool(tmp_path / "pool.npz")
    assert len(loaded) == 10 == sum(saved.values()) and all(p in a for p in loaded)
    limit = sorted(len(p["prompt_ids"]) for p in a)[len(a) // 2]
    short = prompt_pool.build_pool(tok, limit, stdlib_root=root, sharegpt=share, log=quiet)
    assert short and all(len(p["prompt_ids"]) <= limit for p in short) and len(short) < len(a)


def test_bad_inputs_are_one_clear_error(tmp_path, tiny):
    _, _, hf = tiny
    corpus.open_corpus(tmp_path / "c", BASE, VOCAB)
    corpus.append_chunk(tmp_path / "c", _records(2), {})
    with pytest.raises(SpecbuildError, match="already in the corpus"):
        corpus.append_chunk(tmp_path / "c", _records(2), {})
    with pytest.raises(SpecbuildError, match="not of this model"):
        corpus.open_corpus(tmp_path / "c", {**BASE, "sha256": "cd" * 32}, VOCAB)
    with pytest.raises(SpecbuildError, match="outside the vocabulary"):
        corpus.pack([{"key": "k", "source": "code", "prompt_ids": [VOCAB]}], VOCAB)
    with pytest.raises(SpecbuildError, match="outside this model's vocabulary"):
        _grow(tmp_path, tiny, [{"key": "k", "source": "code", "prompt_ids": [VOCAB + 5]}])
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(SpecbuildError, match="not a readable token-id npz"):
        prompt_pool.load_pool(tmp_path / "bad.npz")
    with pytest.raises(SpecbuildError, match="not a prompt pool"):
        prompt_pool.load_pool(tmp_path / "c" / "chunk-0000.npz")

    runner = CliRunner()
    grow = ["corpus", "grow", "--corpus-dir", str(tmp_path / "g"), "--model-dir", str(hf), "--device", "cpu"]
    for args, message in [
        (["corpus", "show", "--corpus-dir", str(tmp_path / "none")], "no corpus index"),
        ([*grow, "--minutes", "0"], "--minutes 0.0: must be > 0"),
        ([*grow, "--dtype", "int3"], "--dtype 'int3' is not one of"),
        ([*grow, "--prompt-pool", str(tmp_path / "missing.npz")], "no such file"),
        ([*grow, "--prompt-pool", str(tmp_path / "bad.npz")], "not a readable token-id npz"),
        (["corpus", "grow", "--corpus-dir", str(tmp_path / "g"), "--model-dir", str(tmp_path)], "no config.json"),
    ]:
        result = runner.invoke(cli, args)
        assert result.exit_code == 1, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, result.output)


def test_cli_grows_from_a_saved_pool_and_shows_it(tmp_path, tiny):
    _, tok, hf = tiny
    prompt_pool.save_pool(tmp_path / "pool.npz", _pool(5, seed=4), VOCAB)
    runner = CliRunner()
    args = ["corpus", "grow", "--corpus-dir", str(tmp_path / "c"), "--prompt-pool", str(tmp_path / "pool.npz"),
            "--model-dir", str(hf), "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "4"]  # fmt: skip
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    shown = runner.invoke(cli, ["corpus", "show", "--corpus-dir", str(tmp_path / "c")])
    assert shown.exit_code == 0 and "5 sequences" in shown.output and "chunk-0000.npz" in shown.output
    index = corpus.load_index(tmp_path / "c")
    assert index["base_model"]["file"] == "model.safetensors" and len(index["base_model"]["sha256"]) == 64


def test_a_corpus_grown_elsewhere_merges_renumbered_without_repeats(tmp_path):
    for name, seeds in (("here", (0,)), ("gpu", (1, 0, 2))):
        corpus.open_corpus(tmp_path / name, BASE, VOCAB)
        for seed in seeds:
            corpus.append_chunk(tmp_path / name, _records(3, seed), {"hardware": name, "seconds": 1.0})
    result = CliRunner().invoke(
        cli, ["corpus", "merge", "--from", str(tmp_path / "gpu"), "--into", str(tmp_path / "here")]
    )
    assert result.exit_code == 0, result.output
    index = corpus.load_index(tmp_path / "here")
    assert [c["file"] for c in index["chunks"]] == ["chunk-0000.npz", "chunk-0001.npz", "chunk-0002.npz"]
    assert [c.get("merged_from") for c in index["chunks"]] == [None, "chunk-0000.npz", "chunk-0002.npz"]
    assert index["chunks"][1]["hardware"] == "gpu"
    got = list(corpus.iter_sequences(tmp_path / "here"))
    assert got == _as_read(_records(3, 0) + _records(3, 1) + _records(3, 2))


def test_dropping_ended_rows_from_the_batch_keeps_every_row_s_ids(tiny):
    from collections import Counter

    from specbuild.training.batched_decode import decode_batch

    model = tiny[0]
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(24)]
    free = decode_batch(model, prompts, 12, set(), 0).gens
    eos = {t for t, _ in Counter(t for g in free for t in g[:6]).most_common(3)}  # rows end at different steps
    full = decode_batch(model, prompts, 12, eos, 0)  # features kept: no row is dropped
    slim = decode_batch(model, prompts, 12, eos, 0, keep_features=False)
    assert slim.gens == full.gens and slim.features == []
    assert len({len(g) for g in full.gens}) > 3  # several end steps, so the batch shrank several times
