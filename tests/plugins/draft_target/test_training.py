"""The draft-target trainer (`specbuild train`, kind draft-target) on a tiny random Llama and a tiny corpus whose
continuations follow a rule of the previous token: the written draft directory (config, tensors, draft vocabulary,
lineage), that training learns the rule, that a draft equal to the base model predicts its greedy tokens exactly,
and that the chain estimate equals autoregressive decoding with the draft."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

from specbuild.plugins.draft_target import training as dt
from specbuild.training import corpus, distill
from specbuild.training.heldout import heldout_mask
from specbuild.training.recipe import run_recipe
from tests.helpers import hf_greedy, quiet, write_char_tokenizer
from tests.shapes import save_tiny_model, tiny_hf_model

pytestmark = pytest.mark.xdist_group("training")

SHAPE = "llama_tied_linear"  # vocab 61, hidden 48, 2 layers, tied embeddings
SEQ_LEN = 32
HELDOUT_FRAC = 0.25


def rule(token: int) -> int:
    """The next token of the tiny corpus's continuations: 13 possible targets, reached unevenly."""
    return 3 + (token * 7) % 13


def records(n: int = 80, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, 61, int(rng.integers(4, 11))).tolist()
        gen = [rule(prompt[-1]) if i % 20 else 40 + i // 20]  # 40..43: targets seen once (not in draft_vocab)
        while len(gen) < int(rng.integers(20, 31)):
            gen.append(rule(gen[-1]))
        out.append({"key": f"k{i:03d}", "source": "code", "prompt_ids": prompt, "gen_ids": gen})
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(base dir, corpus records, output dir, metrics) of `specbuild train` with a draft-target recipe."""
    root = tmp_path_factory.mktemp("draft_target")
    hf = save_tiny_model(SHAPE, root / "hf")
    write_char_tokenizer(hf)
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    recs = records()
    corpus.open_corpus(root / "corpus", {"name": "tiny", "sha256": "0"}, 61)
    corpus.append_chunk(root / "corpus", recs, {"settings": {"greedy": True}})
    recipe = {
        "kind": "draft-target", "base_model": str(hf), "corpus_dir": str(root / "corpus"),
        "work_dir": str(root / "work"), "output_dir": str(root / "draft"),
        "train": {"num_layers": 1, "init_layers": [1], "vocab_size": 8, "negatives": 4, "seq_len": SEQ_LEN,
                  "batch_tokens": 256, "lr": 0.01, "warmup": 5, "epochs": 40, "time_budget_s": 20,
                  "heldout_frac": HELDOUT_FRAC, "eval_sequences": 100, "chain_len": 3, "log_every_s": 5},
    }  # fmt: skip
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    metrics = run_recipe(root / "recipe.yaml", log=quiet, device="cpu")
    return hf, recs, root / "draft", metrics


def test_draft_directory(trained):
    hf, recs, out, metrics = trained
    base, cfg = json.loads((hf / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert cfg.pop("num_hidden_layers") == 1 and cfg.pop("dtype") == "bfloat16"
    special = cfg.pop("specbuild")
    assert cfg == {k: v for k, v in base.items() if k not in ("num_hidden_layers", "dtype")}
    assert special["embeddings"] == "target" and special["draft_vocab"] == "draft_vocab.json"
    assert special["lineage"] == metrics and metrics["corpus"].endswith("corpus") and metrics["hardware"]
    for key in ("train_tokens_seen", "optimizer_steps", "train_s", "torch", "date", "init", "heldout_final"):
        assert metrics[key], key
    with safe_open(str(hf / "model.safetensors"), "pt") as b, safe_open(str(out / "model.safetensors"), "pt") as d:
        expected = {"model.norm.weight": b.get_slice("model.norm.weight").get_shape()}
        for name in b.keys():  # the draft's layer 0 started from base layer 1
            if name.startswith("model.layers.1."):
                expected[name.replace("layers.1.", "layers.0.")] = b.get_slice(name).get_shape()
        assert set(d.keys()) == set(expected)  # no embedding, no lm_head
        for name, shape in expected.items():
            assert d.get_slice(name).get_shape() == shape and d.get_tensor(name).dtype == torch.bfloat16, name
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()

    held = heldout_mask(np.array([distill._seq_no(r["key"]) for r in recs]), HELDOUT_FRAC)
    counts = Counter(t for r, h in zip(recs, held) if not h for t in r["gen_ids"])
    want = sorted(((c, t) for t, c in counts.items() if c >= 2), key=lambda ct: (-ct[0], ct[1]))
    vocab = json.loads((out / "draft_vocab.json").read_text())
    assert vocab == {"token_ids": [t for _, t in want], "counts": [c for c, _ in want]}
    assert 8 < len(vocab["token_ids"]) <= 13 and max(vocab["token_ids"]) < 61
    assert metrics["train_sequences"] == int((~held).sum()) and metrics["heldout_sequences"] == int(held.sum())


def test_training_learns_the_rule(trained):
    _, _, _, m = trained
    initial, final = m["heldout_initial"], m["heldout_final"]
    assert m["last_loss"] < 0.5 * m["first_loss"]
    assert 0.5 < m["train_subset_coverage"] < 1.0  # 8 of the 13 targets
    assert final["top1_subset"] <= final["subset_coverage"] == initial["subset_coverage"] < 1.0
    assert final["top1_subset"] > 0.8 * final["subset_coverage"] and final["top1_subset"] > initial["top1_subset"] + 0.3
    assert final["loss_subset"] < initial["loss_subset"]
    chain = final["chain_subset"]
    assert chain["1"] <= chain["2"] <= chain["3"] <= 3 and chain["3"] > 1.0


def load_draft(out: Path, hf: Path):
    """The written draft as a float LlamaForCausalLM, its embedding taken from the base (as convert does)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig.from_pretrained(str(out)))
    state = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    state["model.embed_tokens.weight"] = load_file(str(hf / "model.safetensors"))["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model.float().eval()


def autoregressive_chain(model, seqs: list[dict], chain_len: int) -> dict[str, float]:
    """The chain estimate by decoding: from every start the draft feeds back its own greedy tokens."""
    lead = []
    with torch.no_grad():
        for s in seqs:
            ids = s["ids"].tolist()
            for t in range(s["gen_start"] - 1, len(ids) - chain_len):
                ctx, n = ids[: t + 1], 0
                while n < chain_len:
                    tok = int(model(torch.tensor([ctx])).logits[0, -1].argmax())
                    if tok != ids[t + 1 + n]:
                        break
                    ctx, n = ctx + [tok], n + 1
                lead.append(n)
    return {str(k): round(float(np.minimum(lead, k).mean()), 4) for k in range(1, chain_len + 1)}


def test_chain_estimate_equals_autoregressive_decoding(trained, tmp_path):
    hf, _, out, _ = trained
    corpus.open_corpus(tmp_path, {"name": "tiny", "sha256": "0"}, 61)
    corpus.append_chunk(tmp_path, records(12, seed=1), {})
    seqs = dt.read_corpus(tmp_path, SEQ_LEN)
    draft = load_draft(out, hf)
    ev = dt.evaluate(draft, seqs, torch.arange(61), "cpu", 3)
    assert ev["chain_full"] == autoregressive_chain(draft, seqs, 3)
    assert 0.3 < ev["chain_full"]["1"] < ev["chain_full"]["3"]


def test_a_draft_equal_to_the_base_predicts_its_greedy_tokens(trained, tmp_path):
    hf = trained[0]
    base = tiny_hf_model(SHAPE)
    rng = np.random.default_rng(2)
    recs = []
    for i in range(6):
        prompt = rng.integers(3, 61, 6).tolist()
        recs.append({"key": f"g{i}", "source": "code", "prompt_ids": prompt, "gen_ids": hf_greedy(base, prompt, 12)})
    corpus.open_corpus(tmp_path, {"name": "tiny", "sha256": "0"}, 61)
    corpus.append_chunk(tmp_path, recs, {})
    draft = dt.build_draft(hf, 2, [0, 1])  # every base layer: the base model itself
    ev = dt.evaluate(draft, dt.read_corpus(tmp_path, SEQ_LEN), torch.arange(61), "cpu", 3)
    assert ev["top1_full"] == 1.0 and ev["chain_full"] == {"1": 1.0, "2": 2.0, "3": 3.0}
    assert sum(len(r["gen_ids"]) for r in recs) == ev["targets"]
