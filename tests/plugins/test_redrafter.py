"""ReDrafter mode: the converter (Apple's layout and TensorRT-LLM's spellings, broken checkpoints refused by name),
beam search and prefix merging against plain references, exact greedy ids on tiny models of every shape (drafters
with and without input_proj, with and without the RNN), the base distribution when sampling."""

import itertools
import json

import numpy as np
import pytest
import torch

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.errors import SpecbuildError
from specbuild.plugins.redrafter.drafter_net import LOG_0, RecurrentDrafter, beam_search, beams_to_tree
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, Lazy, hf_greedy, quiet
from tests.plugins.distribution_check import check_sampled_distribution, exact_distribution
from tests.plugins.medusa_helpers import toy_model
from tests.plugins.redrafter_fixtures import write_redrafter
from tests.shapes import TINY_SHAPES
from tests.tiers import fast_first, full

pytestmark = pytest.mark.xdist_group("redrafter")

PROMPTS = [[1, 5, 9, 3, 7, 5, 9, 3], [1, 4], [1, 11, 10, 6, 2, 8, 3, 11, 10]]
# per shape: drafter layout (exit_dim factor of H, ResBlocks, RNN, file, name variants, draft vocabulary)
DRAFTERS = {
    "llama_gqa_llama3rope": dict(exit=2.0, layers=2, rnn=True, file="model.safetensors", kw={}),
    "llama_tied_linear": dict(exit=1.0, layers=1, rnn=False, file="model.pt", kw=dict(head_prefix="lm_heads.")),
    "qwen2_bias": dict(
        exit=0.5,
        layers=2,
        rnn=True,
        file="pytorch_model.bin",
        kw=dict(head_prefix="0.", proj_prefix="input_projs.", draft_vocab=[0, 2, 3, 5, 6, 7, 8, 9, 11]),
    ),
}


def _write(shape, root, model, seed):
    d = DRAFTERS[shape]
    h = model.config.hidden_size
    write_redrafter(root, h, model.config.vocab_size, int(d["exit"] * 2 * h), d["layers"], d["rnn"], d["file"],
                    seed=seed, **d["kw"])  # fmt: skip


@pytest.fixture(scope="module")
def toy_redrafter(tmp_path_factory):
    root = tmp_path_factory.mktemp("redrafter_toy")

    def make(shape):
        i = list(TINY_SHAPES).index(shape)  # the seed
        model = toy_model(shape, root / shape / "hf", seed=i)
        _write(shape, root / shape / "drafter", model, seed=i)
        ckpt = convert_checkpoint(
            root / shape / "hf", root / shape / "ckpt", heads={"redrafter": root / shape / "drafter"}, progress=False
        )
        options = BuildOptions(backends=ORT_ONLY, speculative_mode="redrafter")
        return (model, build_engine(ckpt, root / shape / "engine", options, log=quiet), ckpt)

    return Lazy(make)


# ----------------------------------------------------------------------------------------------- graph pieces


def reference_beams(drafter, context, root, embed, m, length):
    """Apple's beam_search_candidates step by step, in plain torch per beam (no batching)."""
    log_p = [0.0] + [LOG_0] * (m - 1)
    beams = [[int(root)] for _ in range(m)]
    states = [torch.zeros(drafter.hidden) for _ in range(m)]
    for _ in range(length):
        cands = []
        new_states = []
        for i in range(m):
            emb = embed(torch.tensor(beams[i][-1]))
            s = drafter.next_state(emb, states[i])
            new_states.append(s)
            lp = drafter.log_probs(context, s)
            for t in range(lp.shape[-1]):
                cands.append((float(lp[t]) + log_p[i], i, t))
        cands.sort(key=lambda c: -c[0])
        top = cands[:m]
        beams = [beams[i] + [int(drafter.to_target(torch.tensor(t)))] for _, i, t in top]
        states = [new_states[i] for _, i, _ in top]
        log_p = [c[0] for c in top]
    return beams


@pytest.mark.parametrize("rnn,exit_factor,draft_vocab", [(True, 2, None), (False, 1, [1, 3, 4, 6, 8, 9, 10])])
def test_beam_search_matches_the_reference_algorithm(rnn, exit_factor, draft_vocab):
    torch.manual_seed(0)
    h, v = 8, 12
    rows = len(draft_vocab) if draft_vocab else v
    drafter = RecurrentDrafter(h, exit_factor * h, 2, rnn, rows, top_k_warp=5)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 0.7)
    if draft_vocab:
        drafter.draft_ids = torch.tensor(draft_vocab)
    embed = torch.nn.Embedding(v, h)
    context = torch.randn(h)
    with torch.no_grad():
        got = beam_search(drafter, context[None], torch.tensor([3]), embed, 4, 3)[0].tolist()
        want = reference_beams(drafter, context, 3, embed, 4, 3)
    assert got == want
    assert all(b[0] == 3 for b in got)
    if draft_vocab:
        assert {t for b in got for t in b[1:]} <= set(draft_vocab)


def test_beams_merge_by_shared_prefix():
    beams = torch.tensor([[[7, 1, 2, 3], [7, 1, 2, 4], [7, 5, 6, 8], [7, 1, 2, 3], [7, 1, 9, 3]]])
    tree = beams_to_tree(beams)
    n = int(tree["count"][0])
    assert n == 10  # root + 1,2,3 + 4 + 5,6,8 + 9,3 (beam 3 repeats beam 0)
    tokens = tree["tokens"][0, :n].tolist()
    mask = tree["mask"][0, :n, :n].numpy()
    paths = tree["paths"][0].tolist()
    for beam, path in zip(beams[0].tolist(), paths):
        assert [tokens[i] for i in path] == beam  # every beam is a path of the tree
        for depth, node in enumerate(path):  # a node sees exactly its path's prefix
            assert set(np.nonzero(mask[node])[0]) == set(path[: depth + 1])
    assert tree["offsets"][0, :n].tolist() == [int(mask[i].sum()) - 1 for i in range(n)]
    assert len({tuple(p[: d + 1]) for p in paths for d in range(4)}) == n  # prefixes are merged, not repeated
    # a parent precedes its children
    assert all(p[d] < p[d + 1] for p in paths for d in range(3))


def test_random_beams_give_valid_trees():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        m, length = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        beams = torch.randint(0, 3, (2, m, length + 1), generator=g)
        beams[:, :, 0] = 9
        tree = beams_to_tree(beams)
        for b in range(2):
            n = int(tree["count"][b])
            prefixes = {tuple(beams[b, i, : d + 1].tolist()) for i in range(m) for d in range(length + 1)}
            assert n == len(prefixes)
            tokens = tree["tokens"][b, :n].tolist()
            for i, path in enumerate(tree["paths"][b].tolist()):
                assert [tokens[j] for j in path] == beams[b, i].tolist()
                assert all(j < n for j in path)


# ----------------------------------------------------------------------------------------------- engines


@pytest.mark.parametrize("shape", fast_first(TINY_SHAPES, "another tiny shape: the fast tier checks the first"))
def test_greedy_equals_base_model(toy_redrafter, shape):
    model, eng, _ = toy_redrafter[shape]
    engine = Engine(eng, threads=1)
    assert engine.manifest["lossless"] is True
    assert engine.manifest["limits"]["max_new_tokens_per_step"] == 26
    accepted = []
    for ids in PROMPTS:
        result = engine.generate(input_ids=ids, max_new_tokens=40)
        assert result.output_ids == hf_greedy(model, ids, 40)
        accepted += result.accepted_per_step
    print(shape, np.mean(accepted), sum(a > 1 for a in accepted))
    assert sum(a > 1 for a in accepted) >= 5  # drafts really get accepted (random drafters: often not)


@full("another ReDrafter engine (fewer beams)")
def test_settings_are_recorded_and_honoured(toy_redrafter, tmp_path):
    model, _, ckpt = toy_redrafter["llama_gqa_llama3rope"]
    options = BuildOptions(backends=ORT_ONLY, speculative_mode="redrafter", redrafter_num_beams=2,
                           redrafter_draft_len_per_beam=3)  # fmt: skip
    engine = Engine(build_engine(ckpt, tmp_path / "small", options, log=quiet), threads=1)
    mode = engine.manifest["mode"]
    assert (mode["num_beams"], mode["draft_len_per_beam"], mode["top_k_warp"]) == (2, 3, 50)
    assert engine.manifest["limits"]["max_new_tokens_per_step"] == 7
    for ids in PROMPTS[:2]:
        assert engine.generate(input_ids=ids, max_new_tokens=20).output_ids == hf_greedy(model, ids, 20)


def test_bad_options_are_refused_before_any_work(toy_redrafter, tmp_path):
    _, _, ckpt = toy_redrafter["llama_gqa_llama3rope"]
    cases = [
        (dict(redrafter_num_beams=0), "--redrafter-num-beams 0 is invalid"),
        (dict(redrafter_num_beams=13), "--redrafter-num-beams 13 must be between 1 and 12"),
        (dict(redrafter_draft_len_per_beam=17), "--redrafter-draft-len-per-beam 17 must be between 1 and 16"),
        (dict(max_draft_len=10), "25 draft tokens but --max-draft-len is 10"),
        (dict(eagle_top_k=2), "--eagle-top-k does not apply to --speculative-mode redrafter"),
    ]
    for settings, message in cases:
        with pytest.raises(SpecbuildError, match=message):
            build_engine(ckpt, tmp_path / "e", BuildOptions(backends=ORT_ONLY, speculative_mode="redrafter",
                                                            **settings), log=quiet)  # fmt: skip
        assert not (tmp_path / "e").exists()


def test_no_drafter_in_the_checkpoint(tmp_path):
    toy_model("llama_gqa_llama3rope", tmp_path / "hf")
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    with pytest.raises(SpecbuildError, match="no ReDrafter drafter; convert with `--redrafter-dir DIR`"):
        build_engine(ckpt, tmp_path / "e", BuildOptions(backends=ORT_ONLY, speculative_mode="redrafter"), log=quiet)


@full("sampling with point-mass drafts: the fast tier checks n-gram's (one acceptance rule in every graph)")
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.5, 4, 0.9)])
def test_sampling_preserves_the_base_distribution(tmp_path, temperature, top_k, top_p):
    vocab = 8
    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf", vocab=vocab, seed=3)
    write_redrafter(tmp_path / "drafter", model.config.hidden_size, vocab, layers=1, seed=3)
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"redrafter": tmp_path / "drafter"},
                              progress=False)  # fmt: skip
    options = BuildOptions(backends=ORT_ONLY, speculative_mode="redrafter", redrafter_num_beams=3,
                           redrafter_draft_len_per_beam=2)  # fmt: skip
    engine = Engine(build_engine(ckpt, tmp_path / "engine", options, log=quiet), threads=1)
    prompt, n, samples = [1, 5, 3, 1, 5, 3, 1], 3, 3000
    exact = exact_distribution(model, prompt, n, temperature, top_k, top_p)
    check_sampled_distribution(engine, prompt, n, samples, exact, temperature, top_k, top_p)


# ----------------------------------------------------------------------------------------------- converter


def _broken(tmp_path, mutate, **write_kwargs):
    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf")
    h, v = model.config.hidden_size, model.config.vocab_size
    kwargs = dict(exit_dim=h, layers=2, rnn=True)
    kwargs.update(write_kwargs)
    state = write_redrafter(tmp_path / "drafter", h, v, **kwargs)
    mutate(tmp_path / "drafter", state, h, v)
    return tmp_path / "hf", tmp_path / "drafter"


def _resave(d, state):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))


def _set_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


BROKEN = {
    "missing ResBlock": (
        lambda d, s, h, v: _resave(d, {k: t for k, t in s.items() if not k.startswith("lm_head.1.")}),
        r"num_draft_layers is 2 but ResBlock lm_head\.1\.linear\.weight is missing \(expected shape \[64, 64\]\)",
    ),
    "wrong exit_dim": (
        lambda d, s, h, v: _set_config(d, exit_dim=2 * h),
        r"holds input_proj but exit_dim 128 == 2 \* hidden_size \(128\)",
    ),
    "exit_dim too small for the weights": (
        lambda d, s, h, v: _set_config(d, exit_dim=h // 2),
        r"tensor input_proj\.weight has shape \[64, 128\], expected \[32, 128\]",
    ),
    "vocab mismatch in config": (
        lambda d, s, h, v: _set_config(d, vocab_size=v + 1),
        r"vocab_size 13 differs from the base model's 12",
    ),
    "vocab mismatch in tensors": (
        lambda d, s, h, v: _resave(d, {**s, "lm_head.2.weight": torch.zeros(v + 3, h)}),
        r"tensor lm_head\.2\.weight has shape \[15, 64\], expected \[12, 64\]",
    ),
    "rnn without its tensors": (
        lambda d, s, h, v: _resave(d, {k: t for k, t in s.items() if not k.startswith("rnn_")}),
        r"tensor rnn_u\.weight is missing \(expected shape \[64, 64\]\)",
    ),
    "rnn tensors but rnn false": (
        lambda d, s, h, v: _set_config(d, rnn=False),
        r"holds rnn_u/rnn_w tensors but config\.json .* says rnn is false",
    ),
    "unexpected tensor": (
        lambda d, s, h, v: _resave(d, {**s, "medusa.0.weight": torch.zeros(2)}),
        r"unexpected tensor medusa\.0\.weight in a ReDrafter checkpoint",
    ),
    "not a drafter": (
        lambda d, s, h, v: _set_config(d, model_type="llama"),
        r"model_type 'llama' is not a ReDrafter drafter",
    ),
    "no weights": (
        lambda d, s, h, v: (d / "model.safetensors").unlink(),
        r"no drafter weights \(expected one of model\.safetensors, model\.pt, pytorch_model\.bin\)",
    ),
    "NaN weight": (
        lambda d, s, h, v: _resave(d, {**s, "rnn_w.weight": torch.full((h, h), float("nan"))}),
        r"tensor rnn_w\.weight holds 4096 non-finite values",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_drafters_are_refused_by_name(tmp_path, case):
    mutate, message = BROKEN[case]
    hf, drafter = _broken(tmp_path, mutate)
    with pytest.raises(SpecbuildError, match=message):
        convert_checkpoint(hf, tmp_path / "ckpt", heads={"redrafter": drafter}, progress=False)
    assert not (tmp_path / "ckpt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "hf"]  # no temporary left behind


def test_pickled_code_is_never_run(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf")
    state = write_redrafter(tmp_path / "d", model.config.hidden_size, 12, file="model.pt")
    torch.save({**state, "x": Evil()}, tmp_path / "d" / "model.pt")
    with pytest.raises(SpecbuildError, match="it was not executed"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"redrafter": tmp_path / "d"}, progress=False)


def test_all_name_spellings_convert_to_the_same_drafter(tmp_path):
    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf")
    h = model.config.hidden_size
    out = {}
    for head, proj in itertools.product(("lm_head.", "lm_heads.", "0."), ("input_proj.", "input_projs.")):
        d = tmp_path / f"{head}{proj}"
        write_redrafter(d, h, 12, exit_dim=h, head_prefix=head, proj_prefix=proj, seed=5)
        ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / f"ckpt{len(out)}", heads={"redrafter": d},
                                  progress=False)  # fmt: skip
        from specbuild.builder.checkpoint.canonical import Checkpoint

        out[(head, proj)] = Checkpoint.load(ckpt).head_tensors("redrafter")
    first = next(iter(out.values()))
    for tensors in out.values():
        assert sorted(tensors) == sorted(first)
        assert all(torch.equal(tensors[k], first[k]) for k in first)
