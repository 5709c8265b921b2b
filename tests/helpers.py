"""What many tests share besides fixtures: a quiet build log, the lazy table of engines, transformers' greedy ids, a
`none` engine checked against transformers, graph walks, a character tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Builds that only need the graph ONNX Runtime runs (tests/builder/test_graphs.py covers the portable one per mode)
ORT_ONLY = ("onnxruntime",)


class Lazy(dict):
    """{key: value} built on first use by make(key): a fixture over many shapes or modes builds only what the selected
    tests read (the fast tier reads one)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        value = self[key] = self.make(key)
        return value


def quiet(*_args, **_kwargs):
    pass


def options_key(**options) -> tuple:
    """The key of smollm2_engines for these build options."""
    return tuple(sorted(options.items()))


def graph_nodes(graph) -> list:
    """Every node of an onnx GraphProto, those of its If branches included (an engine-drafted mode drafts in one)."""
    out = []
    for node in graph.node:
        out.append(node)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                out += graph_nodes(sub)
    return out


def assert_drafting_behind_an_if(onnx_path: Path) -> None:
    """A graph that takes draft_rows drafts behind one If (a call that drafts for no row skips it): each of its draft
    outputs (next tree, new states) comes out of the same If node."""
    import onnx

    from specbuild import engine_format as ef

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    assert ef.DRAFT_ROWS in [i.name for i in graph.input], onnx_path
    made_by = {out: node for node in graph.node for out in node.output}
    drafted = [o.name for o in graph.output if o.name.startswith(("next_", ef.NEW_STATE_PREFIX))]
    assert drafted, onnx_path
    makers = {made_by[name].name for name in drafted}
    assert len(makers) == 1 and made_by[drafted[0]].op_type == "If", (onnx_path, makers)


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate, generated ids only (stops at the config's EOS like the engine)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def check_none_engine(model, ckpt: Path, engine_dir: Path, prompts: list[list[int]], new_tokens: int) -> None:
    """A `none` engine of `ckpt` (built with logits into engine_dir) against transformers' `model`: its portable graph
    passes the TensorRT operator check, its prefill logits are within 1e-4 and its greedy ids equal transformers' for
    `new_tokens` on every prompt."""
    import numpy as np
    import onnx

    from specbuild import engine_format as ef
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.builder.export.trt_compat import lint_onnx_for_tensorrt
    from specbuild.runtime.engine import Engine

    engine_dir = build_engine(ckpt, engine_dir, BuildOptions(output_logits=True), log=quiet)
    assert lint_onnx_for_tensorrt(onnx.load(str(engine_dir / ef.ENGINE_ONNX), load_external_data=False)) == []
    engine = Engine(engine_dir, threads=1)
    ids = [1, 5, 9, 13, 7, 22, 3, 30, 11, 2, 4, 17, 19]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(engine.prefill_logits(ids) - want).max() < 1e-4
    for prompt in prompts:
        assert engine.generate(input_ids=prompt, max_new_tokens=new_tokens).output_ids == hf_greedy(
            model, prompt, new_tokens
        )


def write_char_tokenizer(hf: Path, vocab_offset: int = 0, decoder: bool = True) -> None:
    """A character-level tokenizer.json (Metaspace, no merges) covering printable ASCII in ids offset.. offset+96."""
    chars = ["<unk>", "▁"] + [chr(c) for c in range(33, 127) if chr(c) not in '"\\']
    vocab = {tok: i + vocab_offset for i, tok in enumerate(chars)}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        "post_processor": None,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
        if decoder
        else None,
        "model": {
            "type": "BPE",
            "vocab": vocab,
            "merges": [],
            "unk_token": "<unk>",
            "dropout": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
        },
    }
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer))
