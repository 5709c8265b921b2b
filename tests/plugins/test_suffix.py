"""Suffix decoding: the trie's counts, removal and matches against a brute-force count, the pool's memory bound and
FIFO eviction, the drafter's choice between its own tokens and the pool (match length cap, min probability, trees),
exact greedy ids on tiny models of every shape while the pool learns from earlier responses, the base distribution
when sampling, and bad settings refused before any work."""

import collections
import random

import numpy as np
import pytest

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.errors import SpecbuildError
from specbuild.plugins.suffix.drafter import SuffixDrafter
from specbuild.plugins.suffix.pool import PoolSet, SuffixPool
from specbuild.plugins.suffix.trie import ROOT, SuffixTrie, most_new_nodes
from specbuild.runtime.drafter import StepResult
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, hf_greedy, quiet
from tests.plugins.host_mode_helpers import check_mode_sampling, toy_engines
from tests.shapes import TINY_SHAPES
from tests.tiers import fast_first

pytestmark = pytest.mark.xdist_group("suffix")

PROMPTS = [[1, 5, 9, 3, 7, 5, 9, 3], [1, 4], [1, 11, 10, 6, 2, 8, 3, 11, 10]]


def run_counts(sequences, depth):
    """Brute force: how often each run of at most `depth` tokens occurs in `sequences`."""
    counts = collections.Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + depth) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def trie_counts(trie):
    out, stack = {}, [(ROOT, ())]
    while stack:
        node, run = stack.pop()
        for child in trie.children(node):
            key = (*run, trie.token(child))
            out[key] = trie.count(child)
            stack.append((child, key))
    return out


def drafter(prompt=(), pool=None, num_draft=8, depth=8, min_prob=0.1, factor=1.0, shape="tree", pool_nodes=10_000):
    fields = {"num_draft_tokens": num_draft, "depth": depth, "min_prob": min_prob, "spec_factor": factor}
    fields |= {"shape": shape, "pool_nodes": pool_nodes}
    settings = SuffixDrafter.read_settings({"mode": {"drafter": fields}})
    if pool is not None:
        settings = type(settings)(**{**settings.__dict__, "pool": pool})
    return SuffixDrafter(settings, list(prompt))


def step(*tokens):
    return StepResult(list(tokens), None, {})


def test_the_trie_counts_every_run_and_forgets_removed_sequences():
    rng = random.Random(0)
    sequences = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    trie = SuffixTrie(4)
    for seq in sequences:
        trie.add(seq)
    assert trie_counts(trie) == run_counts(sequences, 4)
    for i in (3, 0, 7):  # in any order
        trie.remove(sequences[i])
    kept = [s for i, s in enumerate(sequences) if i not in (3, 0, 7)]
    assert trie_counts(trie) == run_counts(kept, 4)
    assert trie.nodes == len(run_counts(kept, 4))  # freed nodes are not counted ...
    trie.add(sequences[3])  # ... and are used again
    assert trie_counts(trie) == run_counts([*kept, sequences[3]], 4)
    for seq in [*kept, sequences[3]]:
        trie.remove(seq)
    assert trie.nodes == 0 and trie_counts(trie) == {}


def test_matches_carried_step_by_step_equal_matches_found_again():
    rng = random.Random(1)
    trie = SuffixTrie(6)
    for _ in range(8):
        trie.add([rng.randrange(4) for _ in range(30)])
    context = [rng.randrange(4) for _ in range(5)]
    matched = trie.matches(context)
    for _ in range(60):
        token = rng.randrange(5)  # 4 never occurs in the trie: the matches start again from nothing
        context.append(token)
        matched = trie.advance(matched, token)
        assert matched == trie.matches(context)
        runs = run_counts([context[-len(matched) :]], len(matched)) if matched else {}
        assert all(trie.count(node) > 0 for node in matched) and len(runs) >= len(matched)


def test_draft_probabilities_come_from_what_followed_the_run():
    trie = SuffixTrie(8)
    for seq in ([7, 1, 2, 3, 4], [7, 1, 2, 3, 4], [7, 1, 2, 5, 6], [9, 1, 2, 3, 8]):
        trie.add(seq)
    node = trie.matches([0, 1, 2])[-1]  # "1 2": followed by 3 (3 times) and 5 (once)
    draft, score = trie.draft(node, budget=3, min_prob=0.1)
    # best first: 3 (0.75), then 3's child 4 (0.75 * 2/3 = 0.5), then 5 (0.25)
    assert draft == [(3, -1), (4, 0), (5, -1)] and score == pytest.approx(1.5)
    chain, _ = trie.draft(node, budget=3, min_prob=0.1, chain=True)
    assert chain == [(3, -1), (4, 0)]  # 4 ends its runs: nothing follows it
    assert trie.draft(node, budget=5, min_prob=0.3)[0] == [(3, -1), (4, 0)]  # 5 (0.25) is below 0.3


def test_the_pool_stays_under_its_bound_and_evicts_the_oldest_first():
    rng = random.Random(2)
    pool = SuffixPool(depth=8, max_nodes=600)
    responses = [[rng.randrange(50) for _ in range(40)] for _ in range(10)]
    for i, response in enumerate(responses):
        pool.add(response)
        assert pool.nodes <= 600
        held = [r.tolist() for r in pool.responses]
        assert held == responses[i - len(held) + 1 : i + 1]  # the newest, in order
        assert trie_counts(pool.trie) == run_counts(held, 8)
    assert pool.evicted == 10 - len(pool.responses) > 0
    huge = SuffixPool(depth=8, max_nodes=50)
    huge.add(list(range(100)))  # alone over the bound: never kept
    assert huge.nodes == 0 and not huge.responses and huge.evicted == 1
    same = SuffixPool(depth=4, max_nodes=100)
    for _ in range(30):  # repeats add no node, but their tokens count
        same.add(list(range(10)))
    assert len(same.responses) == 10 and same.tokens == 100 and same.nodes == len(run_counts([range(10)], 4))


@pytest.mark.parametrize("depth, bound, vocab", [(8, 600, 50), (24, 20_000, 500), (24, 20_000, None)])
def test_the_pools_memory_never_passes_its_bound_in_bytes(depth, bound, vocab):
    """Nodes and tokens stay under the bound at every moment (the oldest leave before a response joins, as many as
    its runs could add), and so the bytes, measured from the arrays, stay under bound_bytes: long responses, 1-token
    ones (the most lengths), repeats, a vocabulary larger than the bound."""
    rng = random.Random(depth + bound)
    pool = SuffixPool(depth, bound, vocab_size=vocab)
    assert pool.trie.memory_bytes() <= pool.memory_bytes() <= pool.bound_bytes()
    for _ in range(300):
        length = rng.choice([1, 1, 2, rng.randrange(1, 300)])
        tokens = [rng.randrange(vocab or 100_000) for _ in range(length)]
        for _repeat in range(rng.choice([1, 1, 3])):
            before = pool.trie.nodes
            pool.add(tokens)
            assert pool.nodes <= bound and pool.tokens <= bound and pool.memory_bytes() <= pool.bound_bytes()
            assert pool.nodes - before <= most_new_nodes(length, depth)
    held = [r.tolist() for r in pool.responses]
    assert trie_counts(pool.trie) == run_counts(held, depth) and pool.tokens == sum(map(len, held))
    pools = PoolSet(depth, bound, vocab_size=vocab)
    pools.get("a1").add([1, 2, 3])
    pools.get(None)
    memory, most = pools.memory()
    assert memory == pools.get("a1").memory_bytes() + pools.get(None).memory_bytes() and most == 2 * pool.bound_bytes()


def test_most_new_nodes_counts_every_run_a_sequence_has():
    for length in range(12):
        for depth in (1, 3, 8):
            runs = {(start, end) for start in range(length) for end in range(start + 1, min(length, start + depth) + 1)}
            assert most_new_nodes(length, depth) == len(runs)


def test_the_drafter_continues_an_earlier_response_from_the_pool():
    pool = SuffixPool(depth=8, max_nodes=10_000)
    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    pool.add(answer)
    d = drafter(prompt=[1, 2, 3], pool=pool)
    assert d.propose(step(40)).tokens.tolist() == [[40, 41]]  # a match of 1 token: at most 1 draft (factor 1)
    d.propose(step(41, 42))
    proposal = d.propose(step(43))  # a match of 4: 4 drafts
    assert proposal.tokens.tolist() == [[43, 44, 45, 46, 47]]
    assert d.propose(step(44, 45, 46, 47, 48)).tokens.tolist() == [[48, 49]]  # what is left of the answer


def test_the_drafter_continues_its_own_tokens_and_drafts_trees():
    prompt = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6, 7, 3]
    one = drafter(prompt=prompt, num_draft=1, pool_nodes=0)
    assert one.propose(step(5, 6)).tokens.tolist() == [[6, 7]]  # "5 6" was followed by 7 twice, by 9 once
    two = drafter(prompt=prompt, num_draft=2, pool_nodes=0)
    two.propose(step(5, 6))
    tree = two.propose(step(7))  # "5 6 7" was followed by 8 and by 3 (1/2 each): a tree of two leaves
    assert sorted(tree.tokens[0, 1:].tolist()) == [3, 8] and tree.paths.shape[1] == 2
    chain = drafter(prompt=[5, 6, 7, 8, 1, 5, 6, 7, 3, 5, 6], shape="chain", pool_nodes=0).propose(step(7))
    assert chain.tokens.tolist() == [[7, 8, 1, 5]] and chain.paths.shape[1] == 1  # 3 drafts: a match of 3


def test_a_finished_request_joins_the_pool_and_a_failed_one_does_not():
    pool = SuffixPool(depth=8, max_nodes=10_000)
    drafter(pool=pool).finish([1, 2, 3], "eos")
    drafter(pool=pool).finish([4, 5, 6], "error")
    drafter(pool=pool).finish([7, 8], "cancelled")
    assert [r.tolist() for r in pool.responses] == [[1, 2, 3]] and pool.version == 1


def test_a_kept_pool_is_read_back_within_its_bound_and_bad_files_are_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    pool = SuffixPool(depth=8, max_nodes=600, path=path, vocab_size=100)
    rng = random.Random(3)
    for _ in range(6):
        pool.add([rng.randrange(50) for _ in range(40)])
    assert len(path.read_text().splitlines()) == 6  # appended as they joined
    back = SuffixPool(depth=8, max_nodes=600, path=path, vocab_size=100)
    assert back.responses == pool.responses and back.nodes == pool.nodes <= 600
    assert len(path.read_text().splitlines()) == len(pool.responses)  # rewritten with what the bound keeps
    with open(path, "a") as f:
        f.write("[1, 2")  # a line cut short by a crash: dropped
    assert SuffixPool(8, 600, path, 100).responses == pool.responses
    for bad, why in (("[1, 200]", "below 100"), ("{}", "JSON list"), ("[1.5]", "JSON list"), ("[-1]", "JSON list")):
        path.write_text(f"[1, 2]\n{bad}\n")
        with pytest.raises(SpecbuildError, match=f"p.jsonl:2: not a draft pool line .*{why}"):
            SuffixPool(8, 600, path, 100)


def test_each_tenant_learns_in_its_own_pool():
    settings = drafter().settings
    a, b = SuffixDrafter.for_tenant(settings, "a1"), SuffixDrafter.for_tenant(settings, "b2")
    a.pool.add([1, 2, 3])
    assert [r.tolist() for r in a.pool.responses] == [[1, 2, 3]]
    assert not b.pool.responses and not settings.pool.responses
    assert SuffixDrafter.for_tenant(settings, "a1").pool is a.pool
    assert SuffixDrafter.for_tenant(settings, None) is settings  # no tenant: the shared pool
    with pytest.raises(SpecbuildError, match="letters, digits"):
        SuffixDrafter.for_tenant(settings, "../x")


@pytest.fixture(scope="module")
def toy_suffix(tmp_path_factory):
    root = tmp_path_factory.mktemp("suffix_toy")
    return toy_engines(root, speculative_mode="suffix", num_draft_tokens=6, suffix_depth=12)


@pytest.mark.parametrize("shape", fast_first(TINY_SHAPES, "another tiny shape: the fast tier checks the first"))
def test_greedy_equals_base_model_while_the_pool_learns(toy_suffix, shape):
    model, eng, _ = toy_suffix[shape]
    engine = Engine(eng, threads=1)
    assert engine.manifest["lossless"] is True
    first, again = [], []
    for ids in PROMPTS:
        result = engine.generate(input_ids=ids, max_new_tokens=30)
        assert result.output_ids == hf_greedy(model, ids, 30)
        first += result.accepted_per_step
    pool = engine.drafter_settings.pool
    assert len(pool.responses) == len(PROMPTS)  # every response joined the pool
    for ids in PROMPTS:  # the same requests again: their answers are in the pool now
        result = engine.generate(input_ids=ids, max_new_tokens=30)
        assert result.output_ids == hf_greedy(model, ids, 30)
        again += result.accepted_per_step
    assert np.mean(again) > max(1.5, np.mean(first))  # the pool's drafts are accepted
    engine.forget_traffic()  # a benchmark's next measurement: nothing learnt
    assert not engine.drafter_settings.pool.responses
    result = engine.generate(input_ids=PROMPTS[0], max_new_tokens=30)
    assert result.accepted_per_step == first[: len(result.accepted_per_step)]  # as on the first pass


def test_a_draft_pool_directory_carries_what_was_learnt_to_the_next_run(toy_suffix, tmp_path):
    _, eng, _ = toy_suffix["llama_gqa_llama3rope"]
    runs = [Engine(eng, threads=1, draft_pool=tmp_path / "pool").generate(input_ids=PROMPTS[2], max_new_tokens=30)]
    runs.append(Engine(eng, threads=1, draft_pool=tmp_path / "pool").generate(input_ids=PROMPTS[2], max_new_tokens=30))
    assert runs[1].output_ids == runs[0].output_ids
    assert runs[1].mean_accepted_tokens > runs[0].mean_accepted_tokens + 0.5
    assert len((tmp_path / "pool" / "suffix-shared.jsonl").read_text().splitlines()) == 2


def test_bad_settings_are_refused_before_any_work(toy_suffix, tmp_path):
    _, _, ckpt = toy_suffix["llama_gqa_llama3rope"]
    cases = [
        (dict(num_draft_tokens=0), "--num-draft-tokens 0 is invalid"),
        (dict(suffix_depth=1), "--suffix-depth 1 is invalid"),
        (dict(suffix_min_prob=0.0), r"--suffix-min-prob must be in \(0, 1\], got 0.0"),
        (dict(suffix_spec_factor=-1.0), "--suffix-spec-factor must be > 0, got -1.0"),
        (dict(suffix_shape="bush"), "--suffix-shape must be one of tree, chain, got 'bush'"),
        (dict(num_draft_tokens=9, max_draft_len=8), "--num-draft-tokens 9 but --max-draft-len is 8"),
        (dict(num_draft_tokens=600), "at most 511 per step"),
        (dict(ngram_candidates=2), "--ngram-candidates does not apply to --speculative-mode suffix"),
    ]
    for settings, message in cases:
        with pytest.raises(SpecbuildError, match=message):
            options = BuildOptions(backends=ORT_ONLY, speculative_mode="suffix", **settings)
            build_engine(ckpt, tmp_path / "e", options, log=quiet)
        assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    fast_first([(1.0, 0, 1.0), (1.5, 4, 0.9)], "another sampling setting: the fast tier checks the first"),
)
def test_sampling_preserves_the_base_distribution(tmp_path, temperature, top_k, top_p):
    options = dict(speculative_mode="suffix", num_draft_tokens=3, suffix_depth=6)
    check_mode_sampling(tmp_path, temperature, top_k, top_p, **options)
