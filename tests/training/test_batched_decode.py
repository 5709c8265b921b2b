"""Batched self-distillation decoding against transformers: the same greedy ids and the same features, per row."""

import pytest
import torch

from specbuild.training.batched_decode import decode_batch
from tests.shapes import TINY_SHAPES, tiny_hf_model

PROMPTS = [[5, 17, 3, 44, 9, 58, 2], [12, 40], [33, 7, 7, 21, 50]]  # different lengths: left padding is exercised
NEW = 12


def _hf_greedy(model, prompt, new):
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


# Gemma 3 with its window over the whole sequence (batched decoding masks no window)
@pytest.mark.parametrize("name,overrides", [*((n, {}) for n in TINY_SHAPES), ("qwen3_qknorm", {}),
                                            ("gemma3_pattern", {"sliding_window": 64})])  # fmt: skip
def test_greedy_ids_and_features_equal_transformers(name, overrides):
    model = tiny_hf_model(name, **overrides)
    capture = (1,)
    res = decode_batch(model, PROMPTS, NEW, eos_ids=set(), pad_id=0, capture=capture, tail=3)
    h = model.config.hidden_size
    for row, prompt in enumerate(PROMPTS):
        assert res.gens[row] == _hf_greedy(model, prompt, NEW), f"row {row}"
        # features: positions len(prompt) - 3 (or 0) .. len(prompt) + NEW - 2 of the full sequence
        full = torch.tensor([prompt + res.gens[row]])
        with torch.no_grad():
            states = model(full, output_hidden_states=True).hidden_states
        start, stop = max(0, len(prompt) - 3), len(prompt) + NEW - 1
        feats = res.features[row].float()
        assert feats.shape == (stop - start, 2 * h)
        torch.testing.assert_close(feats[:, :h], states[-1][0, start:stop], atol=2e-3, rtol=2e-3)  # final, normed
        torch.testing.assert_close(feats[:, h:], states[1][0, start:stop], atol=2e-3, rtol=2e-3)  # layer 1's input


def test_stops_at_eos_per_row_and_pads_the_rest():
    model = tiny_hf_model("llama_tied_linear")
    free = decode_batch(model, PROMPTS, NEW, eos_ids=set(), pad_id=0)
    eos = free.gens[0][3]  # row 0 emits this at its 4th step
    res = decode_batch(model, PROMPTS, NEW, eos_ids={eos}, pad_id=0)
    assert res.gens[0] == free.gens[0][:4]
    for row in range(len(PROMPTS)):
        cut = free.gens[row].index(eos) + 1 if eos in free.gens[row] else NEW
        assert res.gens[row] == free.gens[row][:cut]


def test_sampling_is_seeded_and_differs_from_greedy():
    model = tiny_hf_model("llama_gqa_llama3rope")
    runs = [
        decode_batch(model, PROMPTS, NEW, set(), 0, temperature=1.0, generator=torch.Generator().manual_seed(s)).gens
        for s in (1, 1, 2)
    ]
    greedy = decode_batch(model, PROMPTS, NEW, set(), 0).gens
    assert runs[0] == runs[1]
    assert runs[0] != runs[2] and runs[0] != greedy


@pytest.mark.parametrize("name", ["mistral_window", "gemma3_pattern"])
def test_sliding_windows_shorter_than_the_sequences_are_refused(name):
    model = tiny_hf_model(name)
    with pytest.raises(ValueError, match="sliding-window"):
        decode_batch(model, PROMPTS, 4, set(), 0)
