"""Every mode built on one toy model (12-token vocabulary, heads and a draft from the fixtures), as chains and trees:
the engines the scheduler's and the seed tests share (each built on first use, on the worker of the xdist group
"batching")."""

import numpy as np
import pytest
import torch

from tests.helpers import ORT_ONLY, Lazy, quiet

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
DYNAMIC = dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8)
LOOKAHEAD = dict(lookahead_window=3, lookahead_ngram=3, lookahead_guesses=2)
# variant -> (mode, build options): each mode with its drafting, a chain and a tree where the mode has both
VARIANTS = {
    "none": ("none", {}),
    "ngram": ("ngram", {}),  # a chain (one candidate)
    "ngram-tree": ("ngram", dict(ngram_candidates=2, num_draft_tokens=3)),
    "medusa": ("medusa", dict(tree=TREE)),
    "eagle": ("eagle", DYNAMIC),
    "eagle3": ("eagle3", DYNAMIC),
    "eagle3-chain": ("eagle3", dict(eagle_top_k=1, eagle_depth=3, eagle_total_tokens=4)),
    "redrafter": ("redrafter", {}),
    "lookahead": ("lookahead", LOOKAHEAD),
    "draft-target": ("draft-target", dict(num_draft_tokens=3)),  # a chain
    "draft-target-tree": ("draft-target", dict(draft_top_k=2, draft_depth=2)),
    "suffix": ("suffix", dict(num_draft_tokens=4, suffix_depth=8)),
    "recycle": ("recycle", dict(num_draft_tokens=6, recycle_top_k=3, recycle_depth=3, recycle_context="token")),
}
# the variants test_scheduler parametrizes over: each mode once
MODES = ("none", "ngram", "medusa", "eagle", "eagle3", "redrafter", "lookahead", "draft-target", "suffix", "recycle")

_rng = np.random.default_rng(0)
# 16 prompts of mixed lengths; repeats in them give prompt lookup something to copy
PROMPTS = [[int(x) for x in _rng.integers(1, 12, size=int(_rng.integers(2, 30)))] for _ in range(16)]


@pytest.fixture(scope="session")
def mode_engines(tmp_path_factory):
    """(variant, weights) -> engine dir: every variant on one toy model (12-token vocabulary, heads from the
    fixtures, a draft model that is the target with its last MLP damped)."""
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.builder.checkpoint.convert import convert_checkpoint
    from tests.plugins.eagle_fixtures import write_eagle1_head, write_eagle3_head
    from tests.plugins.medusa_helpers import toy_model, write_medusa_heads
    from tests.plugins.redrafter_fixtures import write_redrafter

    root = tmp_path_factory.mktemp("batching")
    model = toy_model("llama_gqa_llama3rope", root / "hf", seed=0)
    h = model.config.hidden_size
    write_medusa_heads(root / "medusa", "v2", h, 12, num_heads=3, seed=0)
    write_eagle1_head(root / "eagle", model.config, seed=0)
    write_eagle3_head(root / "eagle3", model.config, seed=0, draft_vocab=8)
    write_redrafter(root / "redrafter", h, 12, 4 * h, 2, True, "model.safetensors", seed=0)
    draft = toy_model("llama_gqa_llama3rope", root / "draft", seed=0)
    with torch.no_grad():  # drafts accepted often, not always
        draft.model.layers[-1].mlp.down_proj.weight.mul_(0.6)
    draft.save_pretrained(root / "draft")
    heads = {m: root / m for m in ("medusa", "eagle", "eagle3", "redrafter")} | {"draft-target": root / "draft"}
    ckpt = convert_checkpoint(root / "hf", root / "ckpt", heads=heads, progress=False)

    def make(key):
        variant, weights = key
        mode, options = VARIANTS[variant]
        extra = {} if mode == "none" else {"speculative_mode": mode}
        opts = BuildOptions(backends=ORT_ONLY, weights=weights, max_seq_len=96, **extra, **options)
        return build_engine(ckpt, root / f"{variant}-{weights}", opts, log=quiet)

    return Lazy(make)  # each engine built when a selected test first reads it
