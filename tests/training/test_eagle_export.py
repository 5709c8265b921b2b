"""EAGLE-1 heads written by the trainer convert back to the same draft, with or without their draft vocabulary."""

import numpy as np
import pytest
import torch

from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.plugins.eagle import training as eagle
from specbuild.plugins.feature_draft.training import build_draft
from specbuild.training.base_weights import load_base_weights
from tests.tiers import full

pytestmark = [pytest.mark.xdist_group("training"), full("the real SmolLM2-135M model")]


@pytest.mark.parametrize("with_vocab", [False, True])
def test_save_eagle1_round_trip(smollm2_hf, tmp_path, with_vocab):
    draft = build_draft(eagle.EAGLE1, smollm2_hf, intermediate_size=64, draft_vocab_size=None)
    used = np.sort(np.random.default_rng(0).choice(49152, size=300, replace=False)) if with_vocab else None
    eagle.save_eagle1(tmp_path / "head", draft, smollm2_hf, "smollm2", {"eagle_top_k": 2}, used=used)
    out = convert_checkpoint(smollm2_hf, tmp_path / "ckpt", heads={"eagle": tmp_path / "head"}, progress=False)
    ckpt = Checkpoint.load(out)
    cfg, tensors = ckpt.heads["eagle"], ckpt.head_tensors("eagle")
    assert cfg["defaults"] == {"eagle_top_k": 2}
    for name, value in draft.state_dict().items():
        if name != "d2t":
            assert torch.equal(tensors[name].float(), value.half().float()), name
    if not with_vocab:
        assert cfg["draft_vocab_size"] is None and "lm_head.weight" not in tensors
        return
    base = load_base_weights(smollm2_hf).lm_head
    assert cfg["draft_vocab_size"] == 300
    assert torch.equal(tensors["lm_head.weight"].float(), base[torch.from_numpy(used)].half().float())
    assert torch.equal(torch.arange(300) + tensors["d2t"], torch.from_numpy(used))
