"""The context's n-gram index: which earlier occurrence of the latest tokens is continued, how long the copies are,
and that it grows by the new tokens only."""

from specbuild.runtime.context_index import MAX_MATCH, ContextIndex


def test_the_longest_suffix_ngram_that_occurred_before_is_looked_up():
    index = ContextIndex(3, [1, 7, 8, 2, 6, 7, 8, 9, 6, 7, 8])
    # suffix (7, 8) occurs at 1 and 5; the 3-gram (6, 7, 8) only at 4 -> the longest match wins
    assert index.matches() == [(3, 7)]
    assert index.continuations(lambda matched: 3) == [[9, 6, 7]]
    assert ContextIndex(2, [1, 2, 3]).matches() == [] and ContextIndex(2, []).continuations(lambda m: 1) == []


def test_the_longest_match_wins_then_the_most_recent():
    # the suffix 2-gram (3, 4) occurred at 1, 5 and 9; only the occurrence at 1 also agrees on the token before (7)
    tokens = [7, 3, 4, 1, 9, 3, 4, 2, 0, 3, 4, 8, 7, 3, 4]
    index = ContextIndex(2, tokens)
    assert index.matches() == [(3, 3), (2, 11), (2, 7)]  # (match length, continuation start)
    assert index.continuations(lambda matched: 2) == [[1, 9]]
    assert index.continuations(lambda matched: 2, candidates=3) == [[1, 9], [8, 7], [2, 0]]
    tokens[0] = 6  # now every occurrence matches 2 tokens: the most recent first
    index = ContextIndex(2, tokens)
    assert index.matches() == [(2, 11), (2, 7), (2, 3)]
    assert index.continuations(lambda matched: 2) == [[8, 7]]


def test_continuations_are_as_long_as_asked_and_end_with_the_context():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 5, 6, 7, 8, 2, 3, 4, 5]
    index = ContextIndex(3, tokens)
    assert index.matches()[0] == (4, 5)  # (3, 4, 5) recurs; the match runs back over 2: 4 tokens
    assert index.continuations(lambda matched: matched) == [[6, 7, 8, 9]]
    assert index.continuations(lambda matched: 100) == [tokens[5:]]
    long = ContextIndex(3, [5, *range(40), 5, *range(40)])
    assert long.matches()[0] == (MAX_MATCH, 41)  # a match is measured over MAX_MATCH tokens at most


def test_the_index_grows_by_the_new_tokens_only():
    index = ContextIndex(3, list(range(50)))
    before = sum(len(v) for v in index._starts.values())
    index.observe([7, 8])
    assert sum(len(v) for v in index._starts.values()) - before == 2 * 3  # two tokens, n-grams of 1..3 ending there
    assert index.tokens[-3:] == [49, 7, 8]
