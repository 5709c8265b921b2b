"""n-gram (prompt lookup) mode: the host drafter's lookups and trees, exact greedy ids on tiny models of every shape,
the base distribution when sampling, and bad settings refused before any work."""

import numpy as np
import pytest

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.errors import SpecbuildError
from specbuild.plugins.ngram.drafter import NgramDrafter
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, hf_greedy, quiet
from tests.plugins.host_mode_helpers import check_mode_sampling, toy_engines
from tests.shapes import TINY_SHAPES
from tests.tiers import fast_first

pytestmark = pytest.mark.xdist_group("ngram")

PROMPTS = [[1, 5, 9, 3, 7, 5, 9, 3], [1, 4], [1, 11, 10, 6, 2, 8, 3, 11, 10]]


def drafter(max_n=3, num_draft=4, candidates=1, draft_length=None):
    settings = {"max_ngram_size": max_n, "num_draft_tokens": num_draft, "candidates": candidates}
    if draft_length is not None:
        settings["draft_length"] = draft_length
    return NgramDrafter(NgramDrafter.read_settings({"mode": {"drafter": settings}}), [])


def observed(d, tokens):
    """The drafter after the sequence grew to `tokens` (a continuation of what it saw)."""
    d.index.observe(tokens[len(d.index.tokens) :])
    return d


def test_lookup_continues_the_longest_suffix_ngram():
    d = drafter(max_n=3, num_draft=3)
    # suffix (7, 8) occurs at 1 and 5; the 3-gram (6, 7, 8) only at 4 -> the longest match wins
    observed(d, [1, 7, 8, 2, 6, 7, 8, 9, 6, 7, 8])
    assert d.continuations() == [[9, 6, 7]]
    proposal = d.draft()
    assert proposal.tokens.tolist() == [[8, 9, 6, 7]]
    assert proposal.offsets.tolist() == [0, 1, 2, 3]
    assert proposal.paths.tolist() == [[[0, 1, 2, 3]]]
    assert proposal.mask[0].tolist() == np.tril(np.ones((4, 4), dtype=bool)).tolist()


def test_no_match_proposes_the_root_alone_and_partial_continuations_are_kept():
    d = drafter(max_n=2, num_draft=5)
    observed(d, [1, 2, 3])
    assert d.continuations() == []
    assert d.draft().tokens.tolist() == [[3]]
    observed(d, [1, 2, 3, 2])  # 2 occurred once before, followed by 3, 2 (two tokens only)
    assert d.continuations() == [[3, 2]]


def test_match_drafts_as_many_tokens_as_the_context_matched():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 5, 6, 7, 8, 2, 3, 4, 5]
    d = drafter(max_n=3, num_draft=6, draft_length="match")
    seq = observed(d, tokens)
    # (3, 4, 5) recurs: the match runs back over 2 -> 4 tokens (2, 3, 4, 5): four drafts after it
    assert seq.index.matches()[0] == (4, 5)
    assert d.continuations() == [[6, 7, 8, 9]]
    assert d.draft().tokens.tolist() == [[5, 6, 7, 8, 9]]
    fixed = drafter(max_n=3, num_draft=6, draft_length="fixed")
    assert observed(fixed, tokens).continuations() == [[6, 7, 8, 9, 0, 5]]
    short = drafter(max_n=3, num_draft=6, draft_length="match")
    seq = observed(short, [4, 9, 1, 4])  # a one-token match: one draft
    assert short.continuations() == [[9]]
    capped = drafter(max_n=3, num_draft=2, draft_length="match")
    assert observed(capped, tokens).continuations() == [[6, 7]]  # never more than num_draft_tokens


def test_engines_without_a_draft_length_draft_the_fixed_number_and_bad_values_are_refused():
    d = drafter(max_n=1, num_draft=3)  # an engine.yaml written before draft_length existed
    assert observed(d, [4, 9, 1, 4]).continuations() == [[9, 1, 4]]
    with pytest.raises(SpecbuildError, match="mode.drafter.draft_length must be one of match, fixed, got 'long'"):
        drafter(draft_length="long")
    with pytest.raises(SpecbuildError, match="field mode.drafter.max_ngram_size must be an integer >= 1, got 0"):
        drafter(max_n=0)
    with pytest.raises(SpecbuildError, match="field mode.drafter.candidates must be an integer >= 1, got '2'"):
        drafter(candidates="2")


def test_candidates_merge_by_shared_prefix_into_one_tree():
    d = drafter(max_n=1, num_draft=3, candidates=3)
    observed(d, [5, 1, 2, 5, 1, 3, 5, 4, 4, 5])
    assert d.continuations() == [[4, 4, 5], [1, 3, 5], [1, 2, 5]]  # equal matches: most recent first
    p = d.draft()
    tokens = p.tokens[0].tolist()
    assert tokens[0] == 5 and sorted(tokens[1:]) == sorted([1, 2, 5, 3, 5, 4, 4, 5])  # (1) shared: 8 drafts
    assert p.size == 9
    for path in p.paths[0]:  # every root-to-leaf path spells one continuation
        nodes = [n for n in path.tolist() if n >= 0]
        assert [tokens[n] for n in nodes[1:]] in d.continuations()
        assert p.offsets[nodes].tolist() == list(range(len(nodes)))


@pytest.fixture(scope="module")
def toy_ngram(tmp_path_factory):
    root = tmp_path_factory.mktemp("ngram_toy")
    return toy_engines(root, speculative_mode="ngram", num_draft_tokens=4, ngram_candidates=2)


@pytest.mark.parametrize("shape", fast_first(TINY_SHAPES, "another tiny shape: the fast tier checks the first"))
def test_greedy_equals_base_model(toy_ngram, shape):
    model, eng, _ = toy_ngram[shape]
    engine = Engine(eng, threads=1)
    assert engine.manifest["lossless"] is True
    accepted = []
    for ids in PROMPTS:
        chunks = []
        result = engine.generate(input_ids=ids, max_new_tokens=40, stream=chunks.append)
        assert result.output_ids == hf_greedy(model, ids, 40)
        # streaming hands over each call's new tokens only: the first token, then each step's accepted tokens
        assert sum(chunks, []) == result.output_ids
        assert [len(c) for c in chunks[1:-1]] == result.accepted_per_step[:-1]
        assert 1 <= len(chunks[-1]) <= result.accepted_per_step[-1]  # the last step is cut at max_new_tokens
        accepted += result.accepted_per_step
    assert np.mean(accepted) > 1.2  # drafts really get accepted


def test_bad_settings_are_refused_before_any_work(toy_ngram, tmp_path):
    _, _, ckpt = toy_ngram["llama_gqa_llama3rope"]
    cases = [
        (dict(num_draft_tokens=0), "--num-draft-tokens 0 is invalid"),
        (dict(max_ngram_size=0), "--max-ngram-size 0 is invalid"),
        (dict(num_draft_tokens=5, ngram_candidates=2, max_draft_len=8), "10 draft tokens but --max-draft-len is 8"),
        (dict(num_draft_tokens=300, ngram_candidates=2), "at most 511 per step"),
        (dict(ngram_draft_length="long"), "--ngram-draft-length must be one of match, fixed, got 'long'"),
        (dict(eagle_top_k=2), "--eagle-top-k does not apply to --speculative-mode ngram"),
    ]
    for settings, message in cases:
        with pytest.raises(SpecbuildError, match=message):
            build_engine(
                ckpt, tmp_path / "e", BuildOptions(backends=ORT_ONLY, speculative_mode="ngram", **settings), log=quiet
            )
        assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    fast_first([(1.0, 0, 1.0), (1.5, 4, 0.9)], "another sampling setting: the fast tier checks the first"),
)
def test_sampling_preserves_the_base_distribution(tmp_path, temperature, top_k, top_p):
    options = dict(speculative_mode="ngram", num_draft_tokens=3, ngram_candidates=2)
    check_mode_sampling(tmp_path, temperature, top_k, top_p, **options)
