"""Feature shards keep what the base model computed: float16 where it holds the values, float32 beyond its range."""

import torch

from specbuild.training.features import FLOAT16_MAX, stored


def test_rows_within_float16_are_stored_in_float16():
    x = torch.randn(5, 8) * 1000
    out = stored(x)
    assert out.dtype == torch.float16 and torch.allclose(out.float(), x, rtol=1e-3)


def test_rows_beyond_float16_keep_float32_and_stay_finite():
    x = torch.randn(5, 8)
    x[2, 3] = 2 * FLOAT16_MAX  # Gemma's residual stream reaches such values; float16 would store inf
    out = stored(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and torch.equal(out, x)
