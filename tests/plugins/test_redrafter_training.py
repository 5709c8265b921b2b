"""ReDrafter training on the embedded model: a short run on self-generated data, the export in Apple's layout that
`convert --redrafter-dir` reads back to the same drafter, and the acceptance simulation."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.plugins.redrafter import training as rt
from specbuild.plugins.redrafter.convert import convert_redrafter
from specbuild.plugins.redrafter.drafter_net import beam_search
from specbuild.training import distill
from specbuild.training.base_weights import load_base_weights
from tests.tiers import full

pytestmark = [pytest.mark.xdist_group("training"), full("the real SmolLM2-135M model")]


@pytest.fixture(scope="module")
def features(smollm2_hf, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("redrafter_train")
    tok = AutoTokenizer.from_pretrained(str(smollm2_hf))
    prompts = [
        {"id": f"p{i}", "kind": "code", "ids": tok(text)["input_ids"]}
        for i, text in enumerate(
            ['def add(a, b):\n    """Add two numbers."""\n', "import os\nprint(", "for i in range(10):\n   "]
        )
    ]
    distill.generate_sequences(smollm2_hf, prompts, 24, 3, root / "t.jsonl", 1e9, root / "feat", log=lambda *a: None)
    return distill.load_features(root / "feat")


def test_train_export_convert_round_trip(smollm2_hf, features, tmp_path):
    settings = replace(rt.SETTINGS, draft_vocab_size=64, epochs=2, batch=32, heldout_frac=0.0)
    knobs = rt.DrafterKnobs(exit_dim=576, num_layers=2, rnn=True, draft_len=3)
    drafter, facts = rt.train_drafter(features, smollm2_hf, settings, knobs, log=lambda *a: None)
    assert facts["optimizer_steps"] >= 2 and 50 <= drafter.draft_ids.numel() <= 64
    out = rt.save_redrafter(tmp_path / "d", drafter, 49152, {"specbuild_defaults": {"redrafter_num_beams": 3}})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "recurrent_drafting_drafter" and cfg["exit_dim"] == 576 and cfg["rnn"] is True
    model = ModelConfig.from_hf(json.loads((smollm2_hf / "config.json").read_text()))
    head_cfg, tensors = convert_redrafter(out, model, {})
    assert head_cfg["defaults"] == {"redrafter_num_beams": 3}
    assert head_cfg["draft_vocab_size"] == drafter.draft_ids.numel() and head_cfg["num_layers"] == 2
    assert torch.equal(tensors["draft_vocab"], drafter.draft_ids)
    assert torch.equal(tensors["blocks.1.weight"], drafter.blocks[1].weight.half())
    loaded, _ = rt.load_saved(out)  # the float16 file drafts what the float16-rounded drafter drafts
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.half().float())
        embed = torch.nn.Embedding.from_pretrained(load_base_weights(smollm2_hf).embed)
        context = torch.from_numpy(features["hidden"][:4]).float()
        root = torch.from_numpy(features["next_token"][:4].astype(np.int64))
        assert torch.equal(
            beam_search(drafter, context, root, embed, 3, 3), beam_search(loaded, context, root, embed, 3, 3)
        )


def test_acceptance_simulation_counts_matching_prefixes(smollm2_hf, features):
    settings = replace(rt.SETTINGS, draft_vocab_size=None, epochs=1, batch=32, heldout_frac=0.0)
    knobs = rt.DrafterKnobs(exit_dim=576, num_layers=1, rnn=False, draft_len=2)
    drafter, _ = rt.train_drafter(features, smollm2_hf, settings, knobs, log=lambda *a: None)
    tau = rt.simulate_tau(drafter, features, smollm2_hf, [(1, 2), (4, 2)])
    assert 1.0 <= tau["1x2"] <= tau["4x2"] <= 3.0  # more beams never accept less
    acc = rt.step_accuracy(drafter, features, smollm2_hf, 2)
    assert all(0.0 <= a <= 1.0 for a in acc)
