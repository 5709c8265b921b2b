"""The modes that draft in the graph build on random checkpoints of every tiny shape and several seeds: the export
validation never refuses a correct graph (a choice at a near-tie is counted, not an error), including ReDrafter's
drafter with an input_proj (exit_dim != 2 * hidden) on a GQA base with llama3 RoPE, the case that once failed on a
beam tie. (Every mode builds on every tiny shape in its own plugin tests.)"""

from __future__ import annotations

import pytest

from specbuild.builder.build import build_engine
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.builder.options import BuildOptions
from tests.helpers import ORT_ONLY, quiet
from tests.plugins.eagle_fixtures import write_eagle3_head
from tests.plugins.medusa_helpers import write_medusa_heads
from tests.plugins.redrafter_fixtures import write_redrafter
from tests.shapes import ARCH_SHAPES, SLIDING_SHAPES, TINY_SHAPES, tiny_hf_model
from tests.tiers import full

SEEDS = (0, 1, 2)
# the graphs whose drafting chooses among float scores (top-k expansion, beams, per-head top-k): every seed builds
# them; the other modes' in-graph choices are the acceptance's argmax, checked by every build of theirs in
# tests/plugins (each mode on every tiny shape)
DRAFTING_IN_GRAPH = ("eagle3", "medusa", "redrafter")


def write_checkpoint(shape: str, seed: int, root):
    """A random base of `shape` and random heads of the drafting modes for it, converted."""
    model = tiny_hf_model(shape, seed=seed)
    model.save_pretrained(root / "hf")
    cfg = model.config
    h, vocab = cfg.hidden_size, cfg.vocab_size
    write_eagle3_head(root / "eagle3", cfg, draft_vocab=vocab // 2, seed=seed)
    write_medusa_heads(root / "medusa", "v2", h, vocab, num_heads=3, seed=seed)
    write_redrafter(root / "redrafter", h, vocab, exit_dim=h, layers=2, seed=seed)  # input_proj: 2H -> H
    heads = {"eagle3": root / "eagle3", "medusa": root / "medusa", "redrafter": root / "redrafter"}
    return convert_checkpoint(root / "hf", root / "ckpt", heads=heads, progress=False)


# the Llama, Mistral and Qwen2 shapes on every seed; each later architecture on one (tests/builder/
# test_architectures.py builds its none engine on three seeds and every mode on another). Seed-major: a shape's later
# seeds come after every first build, so xdist's workers find its traces in the run's trace cache instead of
# exporting the same structure side by side
SHAPES = [*TINY_SHAPES, *SLIDING_SHAPES]
CASES = [(shape, SEEDS[0]) for shape in [*SHAPES, *ARCH_SHAPES]] + [
    (shape, seed) for seed in SEEDS[1:] for shape in SHAPES
]


@full("three modes on 5 shapes x 3 seeds and 6 more architectures: 63 builds")
@pytest.mark.parametrize("shape,seed", CASES)
def test_drafting_modes_build_without_a_refusal(shape, seed, tmp_path):
    ckpt = write_checkpoint(shape, seed, tmp_path)
    for mode in DRAFTING_IN_GRAPH:
        options = BuildOptions(backends=ORT_ONLY, speculative_mode=mode, max_seq_len=64)
        build_engine(ckpt, tmp_path / f"engine-{mode}", options, log=quiet)  # raises on a refusal
