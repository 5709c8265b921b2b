"""What the tests of the host-drafted modes (ngram, lookahead, suffix) share: an engine of the mode on a toy model of
each tiny shape, and the check that sampling through the mode keeps the base model's distribution."""

from __future__ import annotations

from pathlib import Path

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, Lazy, quiet
from tests.plugins.distribution_check import check_sampled_distribution, exact_distribution
from tests.plugins.medusa_helpers import toy_model
from tests.shapes import TINY_SHAPES


def toy_engines(root: Path, **options) -> Lazy:
    """shape -> (toy model, engine built with `options`, checkpoint), made on first use (the shape's index seeds it)."""
    from specbuild.builder.checkpoint.convert import convert_checkpoint

    def make(shape):
        model = toy_model(shape, root / shape / "hf", seed=list(TINY_SHAPES).index(shape))
        ckpt = convert_checkpoint(root / shape / "hf", root / shape / "ckpt", progress=False)
        engine = build_engine(ckpt, root / shape / "engine", BuildOptions(backends=ORT_ONLY, **options), log=quiet)
        return (model, engine, ckpt)

    return Lazy(make)


def check_mode_sampling(tmp_path: Path, temperature, top_k, top_p, **options) -> None:
    """Seeded samples of an engine built with `options` on an 8-token toy model follow the base distribution."""
    from specbuild.builder.checkpoint.convert import convert_checkpoint

    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf", vocab=8, seed=3)
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    built = build_engine(ckpt, tmp_path / "engine", BuildOptions(backends=ORT_ONLY, **options), log=quiet)
    engine = Engine(built, threads=1)
    prompt, n, samples = [1, 5, 3, 1, 5, 3, 1], 3, 3000
    exact = exact_distribution(model, prompt, n, temperature, top_k, top_p)
    check_sampled_distribution(engine, prompt, n, samples, exact, temperature, top_k, top_p)
