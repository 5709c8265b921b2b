"""runtime/batch.py: a row's call (a prompt chunk or a tree) and its random numbers, and one engine call for several
rows: rows padded to the longest with copies that see only themselves, each row's numbers those of its own
positions, each row's result what the same call alone gives, the committed lengths O(accepted tokens), rows that
join from a staged prefill and leave."""

import dataclasses

import numpy as np
import pytest

from specbuild import engine_format as ef
from specbuild.runtime.batch import Batch, Call, RowOutputs, Sequence
from specbuild.runtime.drafter import Proposal
from specbuild.runtime.engine import Engine
from specbuild.runtime.sampling import SamplingParams, position_uniforms

pytestmark = pytest.mark.xdist_group("batching")


def test_a_prompt_call_is_a_causal_chain_read_at_its_last_token():
    call = Call.prompt([5, 6, 7])
    assert call.size == 3 and call.window == 1 and call.every_node
    assert call.mask.tolist() == np.tril(np.ones((3, 3), bool)).tolist()
    assert call.offsets.tolist() == [0, 1, 2] and call.paths.tolist() == [[2]]
    tree = Call.tree(Proposal.from_continuations(4, [[1, 2], [3]]))
    assert tree.window == tree.size == 4 and not tree.every_node and tree.paths.shape == (2, 3)


def test_a_sequence_draws_the_numbers_of_its_positions(mode_engines):
    layout = Engine(mode_engines["none", "fp32"], threads=1).layout
    seq = Sequence(layout, SamplingParams(temperature=1.0, seed=9))
    table = position_uniforms(9, layout.max_seq_len + 1)
    assert seq.uniforms(np.array([7, 3])).tolist() == table[[7, 3]].tolist()
    assert seq.uniforms(np.array([3])).tolist() == table[[3]].tolist()  # whatever was asked before
    assert seq.uniforms(np.array([layout.max_seq_len + 40])).tolist() == table[-1:].tolist()  # past the end: the last
    assert Sequence(layout, SamplingParams()).uniforms(np.array([1, 2])).tolist() == [0.0, 0.0]  # greedy
    older = dataclasses.replace(layout, per_position_uniforms=False)  # graphs before per-position numbers
    sequential = Sequence(older, SamplingParams(temperature=1.0, seed=9))
    assert sequential.uniforms(np.array([3])).tolist() != sequential.uniforms(np.array([3])).tolist()  # next draws


def test_rows_are_padded_and_numbered_by_their_own_positions(mode_engines):
    engine = Engine(mode_engines["ngram", "fp32"], threads=1)
    batch = Batch(engine.layout, engine.backend, slots=2, capacity=64)
    for sampling, ids in ((SamplingParams(temperature=0.8, seed=3), [1, 2, 3, 4]), (SamplingParams(), [5, 6])):
        staged = Batch(engine.layout, engine.backend, slots=1, capacity=64)
        staged.add(Sequence(engine.layout, sampling))
        staged.run([Call.prompt(ids)])  # a prompt is prefilled alone, in a slot of its own
        batch.add(staged.sequences[0], staged=staged)
    assert batch.lengths() == [4, 2]
    with pytest.raises(ValueError, match="verify whole trees"):
        batch.run([Call.prompt([1, 2]), Call.prompt([3, 4])])
    chain = Call.tree(Proposal.chain([4, 7, 8]))  # root + 2 drafts
    root = Call.tree(Proposal.root(6))
    feeds = batch._feeds([chain, root], 3, 3, batch.lengths())
    assert feeds[ef.INPUT_IDS].tolist() == [[4, 7, 8], [6, 6, 6]]  # the short row padded with its last token
    assert feeds[ef.POSITION_IDS].tolist() == [[4, 5, 6], [2, 3, 4]]
    pad_mask = feeds[ef.TREE_MASK][1]
    assert pad_mask.tolist() == np.eye(3, dtype=bool).tolist()  # padding rows see only themselves
    table = position_uniforms(3, engine.layout.max_seq_len + 1)
    assert feeds[ef.RAND_ACCEPT][0].tolist() == table[[5, 6, 7]].tolist()  # the numbers of the positions drawn
    assert feeds[ef.RAND_ACCEPT][1].tolist() == [0.0, 0.0, 0.0]  # greedy
    assert feeds[ef.TEMPERATURE].tolist() == pytest.approx([0.8, 0.0])
    assert feeds[ef.PATHS][1].tolist() == [[0, -1, -1]]


def test_each_row_gives_what_its_call_gives_alone_and_commits_what_it_accepted(mode_engines):
    engine = Engine(mode_engines["ngram", "fp32"], threads=1)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]

    def alone(ids, proposal_of):
        single = Batch(engine.layout, engine.backend, slots=1, capacity=64)
        single.add(Sequence(engine.layout, SamplingParams()))
        first = single.run([Call.prompt(ids)])[0]
        return single.run([Call.tree(proposal_of(first.tokens[-1]))])[0], single.lengths()[0]

    proposals = [lambda r: Proposal.chain([r, 3, 1, 2]), lambda r: Proposal.root(r)]
    want = [alone(ids, p) for ids, p in zip(prompts, proposals)]
    batch = Batch(engine.layout, engine.backend, slots=2, capacity=64)
    firsts = []
    for ids in prompts:
        staged = Batch(engine.layout, engine.backend, slots=1, capacity=64)
        seq = Sequence(engine.layout, SamplingParams())
        staged.add(seq)
        firsts.append(staged.run([Call.prompt(ids)])[0].tokens[-1])
        batch.add(seq, staged=staged)  # joins with the caches of its staged prefill
    results = batch.run([Call.tree(p(r)) for p, r in zip(proposals, firsts)])
    for (result, length), got, got_length in zip(want, results, batch.lengths()):
        assert got.tokens == result.tokens and got.nodes.tolist() == result.nodes.tolist()
        assert got_length == length  # the prompt, then the root and the accepted drafts
    assert isinstance(results[1].outputs, RowOutputs) and len(results[1].outputs[ef.ACCEPTED_TOKENS]) == 1
    batch.remove(batch.sequences[0])
    assert batch.size == 1 and batch.lengths() == [want[1][1]]  # the last row moved into the freed slot
