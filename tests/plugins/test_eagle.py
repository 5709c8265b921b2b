"""EAGLE-1 (static tree), EAGLE-2 (dynamic tree) and EAGLE-3 (reduced draft vocabulary) engines on toy models:
exact greedy ids, lossless sampling, seeded determinism, build-time option checks."""

import numpy as np
import pytest
import torch

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine, SamplingParams
from tests.helpers import ORT_ONLY, hf_greedy, quiet
from tests.plugins.distribution_check import chi_square_pvalue, exact_distribution
from tests.plugins.eagle_fixtures import write_eagle1_head, write_eagle3_head
from tests.plugins.medusa_helpers import toy_model
from tests.shapes import TINY_SHAPES
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("eagle")

PROMPTS = [[1, 5, 9, 3, 7], [1, 4], [1, 11, 10, 6, 2, 8, 3]]
DYNAMIC = dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8)
STATIC_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def _checkpoint(root, shape, mode, vocab=12, seed=0, **head_kwargs):
    model = toy_model(shape, root / "hf", vocab=vocab, seed=seed)
    if mode == "eagle":
        write_eagle1_head(root / "head", model.config, seed=seed, **head_kwargs)
    else:
        write_eagle3_head(root / "head", model.config, seed=seed, **head_kwargs)
    ckpt = convert_checkpoint(root / "hf", root / "ckpt", heads={mode: root / "head"}, progress=False)
    return model, ckpt


def _check_greedy(model, engine_dir):
    engine = Engine(engine_dir, threads=1)
    steps = []
    for ids in PROMPTS:
        result = engine.generate(input_ids=ids, max_new_tokens=40)
        assert result.output_ids == hf_greedy(model, ids, 40)
        steps += result.accepted_per_step
    return steps


OTHER_CASE = "another shape or expansion: the fast tier checks EAGLE-2 and EAGLE-3 on one shape each"
CASES = [
    ("llama_gqa_llama3rope", "eagle", "dynamic"),
    ("llama_tied_linear", "eagle3", "dynamic"),
    *[pytest.param(shape, "eagle", "dynamic", marks=full(OTHER_CASE)) for shape in list(TINY_SHAPES)[1:]],
    pytest.param("llama_gqa_llama3rope", "eagle", "static", marks=full(OTHER_CASE)),
    pytest.param("qwen2_bias", "eagle3", "dynamic", marks=full(OTHER_CASE)),
]


@pytest.mark.parametrize("shape,mode,expansion", CASES)
def test_greedy_equals_base_model(tmp_path, shape, mode, expansion):
    kwargs = {"draft_vocab": 8} if mode == "eagle3" else {"qkv_bias": shape == "qwen2_bias"}
    model, ckpt = _checkpoint(tmp_path, shape, mode, **kwargs)
    opts = BuildOptions(
        backends=ORT_ONLY, speculative_mode=mode, **(DYNAMIC if expansion == "dynamic" else {"tree": STATIC_TREE})
    )
    engine_dir = build_engine(ckpt, tmp_path / "engine", opts, log=quiet)
    steps = _check_greedy(model, engine_dir)
    assert max(steps) > 1  # some drafts were accepted, so multi-token commits of base and draft KV are exercised
    tree = Engine(engine_dir).manifest["tree"]
    assert tree.get("dynamic") == (expansion == "dynamic") or (expansion == "static" and "choices" in tree)


@full("sampling with point-mass drafts: the fast tier checks n-gram's (one acceptance rule in every graph)")
@pytest.mark.parametrize("mode", ["eagle", "eagle3"])
def test_sampling_preserves_the_base_distribution(tmp_path, mode):
    vocab = 8
    kwargs = {"draft_vocab": 6} if mode == "eagle3" else {}
    model, ckpt = _checkpoint(tmp_path, "llama_gqa_llama3rope", mode, vocab=vocab, seed=3, **kwargs)
    engine_dir = build_engine(
        ckpt,
        tmp_path / "engine",
        BuildOptions(backends=ORT_ONLY, speculative_mode=mode, eagle_top_k=2, eagle_depth=2, eagle_total_tokens=5),
        log=quiet,
    )
    engine = Engine(engine_dir, threads=1)
    prompt, n, samples = [1, 5, 3], 3, 2500
    params = dict(temperature=0.9, top_k=0, top_p=1.0)
    exact = exact_distribution(model, prompt, n, **params)
    counts: dict = {}
    steps = []
    for seed in range(samples):
        r = engine.generate(input_ids=prompt, max_new_tokens=n, sampling=SamplingParams(seed=seed, **params))
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
        steps += r.accepted_per_step
    assert chi_square_pvalue(counts, exact, samples) > 1e-3
    assert max(steps) > 1
    a = engine.generate(input_ids=prompt, max_new_tokens=20, sampling=SamplingParams(seed=11, **params))
    b = engine.generate(input_ids=prompt, max_new_tokens=20, sampling=SamplingParams(seed=11, **params))
    assert a.output_ids == b.output_ids


def test_bad_expansion_options_fail_at_build(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "qwen2_bias", "eagle3", draft_vocab=8)
    for opts, message in [
        (dict(eagle_top_k=9, eagle_depth=2, eagle_total_tokens=5), "--eagle-top-k 9"),
        (dict(eagle_top_k=2, eagle_depth=2, eagle_total_tokens=40), "--eagle-total-tokens 40"),
        (dict(eagle_top_k=2, eagle_depth=0, eagle_total_tokens=3), "--eagle-depth 0"),
        (dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=12, max_draft_len=8), "--max-draft-len"),
    ]:
        with pytest.raises(SpecbuildError, match=message):
            build_engine(ckpt, tmp_path / "engine", BuildOptions(speculative_mode="eagle3", **opts), log=quiet)
        assert not (tmp_path / "engine").exists()
    with pytest.raises(SpecbuildError, match="no medusa heads|holds no Medusa heads"):
        build_engine(ckpt, tmp_path / "engine", BuildOptions(speculative_mode="medusa"), log=quiet)


@full("a third EAGLE engine (the greedy tests commit the draft state too)")
def test_draft_state_is_committed_like_the_base_cache(tmp_path, monkeypatch):
    """Decoding with the engine equals decoding the draft by hand: the draft cache after generation holds one
    entry per committed position (prompt + accepted tokens), so nothing is dropped or duplicated."""
    model, ckpt = _checkpoint(tmp_path, "llama_gqa_llama3rope", "eagle")
    engine = Engine(
        build_engine(
            ckpt, tmp_path / "engine", BuildOptions(backends=ORT_ONLY, speculative_mode="eagle", **DYNAMIC), log=quiet
        ),
        threads=1,
    )
    from specbuild.runtime.slots import StateSlots

    seen = {}
    real_commit = StateSlots.commit

    def spy(states, row, out, nodes, count):
        real_commit(states, row, out, nodes, count)
        seen["draft_len"] = states.arrays["draft_kv"].lengths[row]

    monkeypatch.setattr(StateSlots, "commit", spy)
    ids = PROMPTS[0]
    result = engine.generate(input_ids=ids, max_new_tokens=25)
    # every generated token except the last (the pending root) is committed, plus the whole prompt
    assert seen["draft_len"] == len(ids) + len(result.output_ids) - 1
    assert np.isfinite(torch.tensor(0.0).item())


# speculators (vLLM) EAGLE-3 heads: norm_before_residual

SMALL_DYNAMIC = dict(eagle_top_k=2, eagle_depth=2, eagle_total_tokens=4)


@full("a head in the speculators format: its own engine")
def test_speculators_head_reproduces_greedy_ids(tmp_path):
    """A speculators-layout head (layers.0.*, transformer_layer_config, norm_before_residual true, the verifier's
    embedding copy) converts, builds and reproduces the base model's greedy ids."""
    model = toy_model("llama_tied_linear", tmp_path / "hf", vocab=12)
    embed = model.get_input_embeddings().weight.detach()
    write_eagle3_head(
        tmp_path / "head", model.config, layout="speculators", draft_vocab=8, norm_before_residual=True, embed=embed
    )
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"eagle3": tmp_path / "head"}, progress=False)
    opts = BuildOptions(backends=ORT_ONLY, speculative_mode="eagle3", **SMALL_DYNAMIC)
    engine_dir = build_engine(ckpt, tmp_path / "engine", opts, log=quiet)
    mode = Engine(engine_dir).manifest["mode"]
    assert mode["draft_norm_before_residual"] is True and mode["draft_vocab_size"] == 8
    steps = _check_greedy(model, engine_dir)
    assert max(steps) > 1


def _speculators_layer_reference(w: dict, x, emb, norm_before_residual: bool, c: dict):
    """speculators' EAGLE-3 first decoder layer (Eagle3FirstLayerMixin over LlamaDecoderLayer), written out for one
    causal sequence at positions 0..T-1 with no cache: hidden_norm(x) always feeds attention; the attention residual
    is hidden_norm(x) with norm_before_residual, else x."""
    heads, kv_heads, d, eps = c["num_heads"], c["num_kv_heads"], c["head_dim"], c["rms_norm_eps"]
    t = x.shape[1]

    def rms(v, weight):
        return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))

    def heads_of(v, n):
        return v.view(1, t, n, d).transpose(1, 2)

    angles = torch.arange(t).float()[:, None] / (c["rope_theta"] ** (torch.arange(0, d, 2).float() / d))[None]
    cos, sin = angles.cos(), angles.sin()

    def rope(v):  # HF convention: dimension i pairs with i + d/2
        a, b = v[..., : d // 2], v[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    hidden = rms(x, w["midlayer.hidden_norm.weight"])
    residual = hidden if norm_before_residual else x
    inp = torch.cat([rms(emb, w["midlayer.input_layernorm.weight"]), hidden], dim=-1)
    proj = {p: inp @ w[f"midlayer.self_attn.{p}_proj.weight"].T for p in "qkv"}
    q = rope(heads_of(proj["q"], heads))
    k = rope(heads_of(proj["k"], kv_heads)).repeat_interleave(heads // kv_heads, dim=1)
    v = heads_of(proj["v"], kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = residual + att.transpose(1, 2).reshape(1, t, heads * d) @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(h, w["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
    return h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T


def test_norm_before_residual_draft_layer_matches_speculators_math():
    from types import SimpleNamespace

    from specbuild.plugins.eagle3.draft_net import Eagle3Net
    from tests.plugins.eagle_fixtures import eagle3_state
    from tests.shapes import tiny_hf_config

    hf = tiny_hf_config("llama_gqa_llama3rope")  # H 64, 4 heads / 2 kv heads of 16, intermediate 96, V 97
    base = SimpleNamespace(
        hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6,
        rope_theta=10000.0, vocab_size=97,
    )  # fmt: skip
    state = eagle3_state(hf, draft_vocab=40)
    state.pop("t2d")
    g = torch.Generator().manual_seed(5)
    state["embed_tokens.weight"] = torch.randn(97, 64, generator=g)
    t = 6
    tokens = torch.randint(0, 97, (1, t), generator=g)
    feats = 3.0 * torch.randn(1, t, 64, generator=g)  # far from unit RMS, so hidden_norm(x) != x
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool)).unsqueeze(0)
    out = {}
    for flag in (False, True):
        head_cfg = {
            "draft_vocab_size": 40, "target_hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "intermediate_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "has_embed": True,
            "norm_before_residual": flag,
        }  # fmt: skip
        draft = Eagle3Net(head_cfg, base)
        draft.load(state)
        with torch.no_grad():
            h, _, _ = draft.run(tokens, feats, torch.arange(t).view(1, t), None, [[]], [[]], [], causal)
            ref = _speculators_layer_reference(state, feats, state["embed_tokens.weight"][tokens], flag, head_cfg)
            out[flag] = (h, draft.logprobs(h, None))
        assert draft.midlayer.norm_before_residual is flag
        torch.testing.assert_close(h, ref, rtol=1e-4, atol=1e-4)
    assert (out[True][0] - out[False][0]).abs().max() > 0.1  # the flag changes the draft's hidden state ...
    assert not torch.equal(out[True][1].argmax(-1), out[False][1].argmax(-1))  # ... and its proposals
