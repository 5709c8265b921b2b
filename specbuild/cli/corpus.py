"""`specbuild corpus`: the self-distillation corpus (specbuild.training.corpus) from the command line.

- `prompts --out POOL.npz [--max N]`: build the prompt pool (stdlib code, stubs, chat code, ShareGPT turns) and
  save it, so a host without the sources grows from the same keys;
- `grow --corpus-dir D [--prompt-pool POOL.npz] [--minutes M] ...`: add the base model's continuations of prompts
  the corpus does not hold yet, a chunk every --chunk-minutes;
- `show --corpus-dir D`: totals per source and per chunk;
- `merge --from D1 --into D2`: append a corpus grown elsewhere to another (renumbered, no key repeated);
- `compare-heads --corpus-dir D --mode M --head H1 --head H2`: heads of one mode on the same held-out sequences.
Errors are one line `error: ...` and exit 1, as for every specbuild command.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import click

from specbuild.cli.extras import needs_extra
from specbuild.cli.handling import handle_errors
from specbuild.errors import SpecbuildError

DEVICES = ("cuda", "cpu")
DTYPES = ("bfloat16", "float32")


@click.group()
def corpus():
    """A resumable self-distillation corpus of token ids: build prompts, grow it, show it."""


def _model_dir(model_dir: Path | None) -> Path:
    if model_dir is not None:
        if not (model_dir / "config.json").is_file():
            raise SpecbuildError(f"--model-dir {model_dir}: no config.json (a Hugging Face model directory)")
        return model_dir
    from specbuild.builder.checkpoint.default_model import prepare_smollm2

    return prepare_smollm2()


def _positive(**values) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise SpecbuildError(f"--{name.replace('_', '-')} {value}: must be > 0")


def _choice(flag: str, value: str, choices) -> None:
    if value not in choices:
        raise SpecbuildError(f"{flag} {value!r} is not one of {', '.join(choices)}")


MODEL_DIR = click.option(
    "--model-dir", type=click.Path(path_type=Path, file_okay=False), help="HF model directory (default: SmolLM2)."
)


@corpus.command()
@click.option("--out", "out", required=True, type=click.Path(path_type=Path, dir_okay=False), help="Pool .npz.")
@click.option("--max", "max_n", type=int, default=None, help="Keep a random subset of this many prompts.")
@click.option("--max-prompt-tokens", type=int, default=256, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--exclude-corpus",
    type=click.Path(path_type=Path, file_okay=False),
    help="Leave out the prompts this corpus already holds (for a run that grows a fresh corpus elsewhere).",
)
@MODEL_DIR
@handle_errors
@needs_extra("train")
def prompts(out, max_n, max_prompt_tokens, seed, exclude_corpus, model_dir):
    """Build the prompt pool and save it as a compressed npz of token ids."""
    _positive(max=max_n, max_prompt_tokens=max_prompt_tokens)
    from transformers import AutoTokenizer

    from specbuild.training import corpus as corpus_mod
    from specbuild.training import prompt_pool

    if exclude_corpus is not None and corpus_mod.load_index(exclude_corpus) is None:
        raise SpecbuildError(f"--exclude-corpus {exclude_corpus}: no corpus index ({corpus_mod.INDEX})")
    tok = AutoTokenizer.from_pretrained(str(_model_dir(model_dir)))
    pool = prompt_pool.build_pool(tok, max_prompt_tokens, seed, log=lambda m: click.echo(m, err=True))
    click.echo(f"pool: {len(pool)} prompts {json.dumps(prompt_pool.source_counts(pool))}")
    if exclude_corpus is not None:
        done = corpus_mod.corpus_keys(exclude_corpus)
        pool = [p for p in pool if p["key"] not in done]
        click.echo(f"{len(pool)} prompts not in {exclude_corpus}")
    counts = prompt_pool.save_pool(out, pool, len(tok), max_n, seed)
    click.echo(f"wrote {out}: {sum(counts.values())} prompts {json.dumps(counts)}, {out.stat().st_size} bytes")


@corpus.command()
@click.option("--corpus-dir", required=True, type=click.Path(path_type=Path), help="The corpus directory.")
@click.option("--prompt-pool", type=click.Path(path_type=Path, dir_okay=False), help="Pool .npz (default: build).")
@click.option("--minutes", type=float, default=30.0, show_default=True, help="Time budget.")
@click.option("--chunk-minutes", type=float, default=None, help="Write a chunk this often (default: --minutes / 4).")
@click.option("--batch-size", type=int, default=256, show_default=True)
@click.option("--probe", is_flag=True, help="Time batch sizes 256/512/1024 first and use the cheapest per token.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--device", default=None, help="cuda or cpu (default: cuda when torch sees a GPU).")
@click.option("--dtype", default="bfloat16", show_default=True, help="bfloat16 or float32.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True, help="CPU threads for torch.")
@MODEL_DIR
@handle_errors
@needs_extra("train")
def grow(corpus_dir, prompt_pool, minutes, chunk_minutes, batch_size, probe, max_new_tokens, device, dtype, seed,
         threads, model_dir):  # fmt: skip
    """Add the base model's greedy continuations of prompts the corpus does not hold yet."""
    _positive(minutes=minutes, chunk_minutes=chunk_minutes, batch_size=batch_size, max_new_tokens=max_new_tokens,
              threads=threads)  # fmt: skip
    _choice("--dtype", dtype, DTYPES)
    if prompt_pool is not None and not prompt_pool.is_file():
        raise SpecbuildError(f"--prompt-pool {prompt_pool}: no such file")
    from specbuild.training import corpus_grow, distill
    from specbuild.training import prompt_pool as pool_mod

    device = device or distill.default_device()
    _choice("--device", device, DEVICES)
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SpecbuildError("--device cuda: torch sees no CUDA GPU")
    from specbuild.builder.checkpoint.default_model import model_source

    hf = _model_dir(model_dir)
    pool = pool_mod.load_pool(prompt_pool) if prompt_pool is not None else None  # bad input fails before loading
    base = model_source(hf)
    distill.setup_torch(threads)
    model, tok = distill.load_model(hf, device, dtype)
    log = functools.partial(click.echo, err=True)
    if pool is None:
        pool = pool_mod.build_pool(tok, seed=seed, log=log)
    log(f"pool: {len(pool)} prompts {json.dumps(pool_mod.source_counts(pool))}; model {base['name']} on {device}")
    if probe:
        batch_size = corpus_grow.probe_batch_size(model, tok, pool, device, log=log)
        log(f"probe: batch size {batch_size}")
    totals = corpus_grow.grow(corpus_dir, model, tok, pool, minutes, batch_size, max_new_tokens, device, dtype,
                              chunk_minutes or minutes / 4, base, seed=seed, log=log)  # fmt: skip
    click.echo(json.dumps(totals, indent=1))


@corpus.command()
@click.option("--corpus-dir", required=True, type=click.Path(path_type=Path), help="The corpus directory.")
@click.option("--json", "as_json", is_flag=True, help="The totals and the index as JSON.")
@handle_errors
def show(corpus_dir, as_json):
    """Totals per source and per chunk."""
    from specbuild.training import corpus as corpus_mod

    index = corpus_mod.load_index(corpus_dir)
    if index is None:
        raise SpecbuildError(f"--corpus-dir {corpus_dir}: no corpus index ({corpus_mod.INDEX})")
    totals = corpus_mod.totals(corpus_dir)
    if as_json:
        click.echo(json.dumps({"totals": totals, "index": index}, indent=1))
        return
    base = index["base_model"]
    click.echo(f"corpus {corpus_dir}: base {base.get('name')} ({base.get('file')}, sha256 {base.get('sha256')})")
    click.echo(f"{totals['chunks']} chunks, {totals['sequences']} sequences, {totals['prompt_tokens']} prompt tokens, "
               f"{totals['generated_tokens']} generated tokens, {totals['seconds']} s")  # fmt: skip
    for source, n in totals["sources"].items():
        click.echo(f"  {source:14s} {n:8d} sequences")
    for c in index["chunks"]:
        click.echo(f"  {c['file']}: {c['sequences']} seqs, {c['generated_tokens']} gen tokens, "
                   f"{c.get('tokens_per_s')} tok/s, {c.get('hardware')}, {c.get('created')}")  # fmt: skip


@corpus.command()
@click.option("--from", "src", required=True, type=click.Path(path_type=Path, file_okay=False), help="Grown corpus.")
@click.option(
    "--into", "dst", required=True, type=click.Path(path_type=Path, file_okay=False), help="Corpus to extend."
)
@handle_errors
def merge(src, dst):
    """Append the chunks of a corpus grown elsewhere (e.g. on a GPU host) to another, renumbered."""
    from specbuild.training import corpus as corpus_mod

    for entry in corpus_mod.merge(src, dst):
        click.echo(f"{entry['merged_from']} -> {entry['file']}: {entry['sequences']} sequences")
    click.echo(json.dumps(corpus_mod.totals(dst), indent=1))


@corpus.command("compare-heads")
@click.option("--corpus-dir", required=True, type=click.Path(path_type=Path, file_okay=False), help="The corpus.")
@click.option("--mode", required=True, help="The heads' speculative mode (one that trains heads).")
@click.option("--head", "heads", required=True, multiple=True, type=click.Path(path_type=Path, file_okay=False),
              help="A head directory of that mode; repeat to compare several.")  # fmt: skip
@click.option("--max-sequences", type=int, default=300, show_default=True, help="The first N held-out sequences.")
@click.option("--heldout-frac", type=float, default=0.05, show_default=True, help="The trainers' held-out split.")
@click.option("--device", default="cpu", show_default=True, help="cuda or cpu.")
@click.option("--threads", type=int, default=2, show_default=True, help="CPU threads for torch.")
@click.option("--json", "json_out", type=click.Path(path_type=Path, dir_okay=False), help="Also write the numbers.")
@MODEL_DIR
@handle_errors
@needs_extra("train")
def compare_heads(corpus_dir, mode, heads, max_sequences, heldout_frac, device, threads, json_out, model_dir):
    """Evaluate head directories of one mode on the same held-out corpus sequences (the split every trainer holds
    out, teacher-forced features): EAGLE per-step accuracy, Medusa per-head top-k and tree tau, ReDrafter step
    accuracy and simulated tau."""
    _positive(max_sequences=max_sequences, threads=threads)
    _choice("--device", device, DEVICES)
    from specbuild.modes.registry import get_mode, load_object
    from specbuild.training import distill, teacher_forced

    spec = get_mode(mode, "--mode")
    if spec.head_evaluator is None:
        raise SpecbuildError(f"--mode {mode}: its heads have no evaluator")
    records = teacher_forced.corpus_records(corpus_dir, max_sequences, heldout_only=True, heldout_frac=heldout_frac)
    if not records:
        raise SpecbuildError(f"--corpus-dir {corpus_dir}: no held-out sequences")
    distill.setup_torch(threads)
    log = functools.partial(click.echo, err=True)
    log(f"{len(records)} held-out sequences, {sum(len(r['gen_ids']) for r in records)} generated tokens")
    results = load_object(spec.head_evaluator)([str(h) for h in heads], _model_dir(model_dir), records, device, log)
    by_head = dict(zip(map(str, heads), results))
    report = {"corpus": str(corpus_dir), "heldout_sequences": len(records), "heads": by_head}
    click.echo(json.dumps(report, indent=1))
    if json_out:
        json_out.write_text(json.dumps(report, indent=1) + "\n")
