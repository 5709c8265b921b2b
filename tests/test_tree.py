"""Tests for specbuild.tree: presets, the normal form's derived arrays, parsing and error messages."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbuild.errors import SpecbuildError
from specbuild.tree import Tree, parse_tree, preset_info, preset_names

MC_SIM_7B_63_FIRST = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2]]


# ------------------------------------------------------------------------------------------- helpers
def _check_consistent(tree: Tree) -> None:
    n = tree.size
    parents, depths, mask, paths = tree.parents, tree.depths, tree.ancestor_mask, tree.paths
    assert parents.shape == (n,) and parents.dtype == np.int64 and parents[0] == -1
    assert depths.dtype == np.int64 and depths[0] == 0
    assert mask.shape == (n, n) and mask.dtype == bool
    assert tree.ranks[0] == 0
    for i in range(1, n):
        choice = tree.choices[i - 1]
        assert 0 <= parents[i] < i
        assert depths[i] == depths[parents[i]] + 1 == len(choice)
        assert tree.ranks[i] == choice[-1]
        parent_choice = () if parents[i] == 0 else tree.choices[parents[i] - 1]
        assert parent_choice == choice[:-1]
    # ancestor mask: row i = i plus its ancestors, nothing else
    for i in range(n):
        expected = set()
        node = i
        while node >= 0:
            expected.add(node)
            node = int(parents[node])
        assert set(np.flatnonzero(mask[i]).tolist()) == expected
    # paths: one row per leaf in node order, root first, consecutive parent links, -1 padding
    leaves = [i for i in range(n) if i not in set(parents[1:].tolist())]
    assert paths.shape == (len(leaves), tree.depth + 1)
    for row, leaf in zip(paths, leaves):
        valid = row[row >= 0]
        assert (row[len(valid) :] == -1).all()
        assert valid[0] == 0 and valid[-1] == leaf
        for a, b in zip(valid[:-1], valid[1:]):
            assert parents[b] == a
        assert mask[leaf, valid].all() and mask[leaf].sum() == len(valid)
    # sort order: by (len, choice)
    assert list(tree.choices) == sorted(tree.choices, key=lambda c: (len(c), c))


@st.composite
def prefix_closed_trees(draw):
    """Random prefix-closed choice sets built by growing children from existing nodes."""
    nodes = {()}
    for _ in range(draw(st.integers(0, 40))):
        parent = draw(st.sampled_from(sorted(nodes, key=lambda c: (len(c), c))))
        if len(parent) >= 6:
            continue
        nodes.add(parent + (draw(st.integers(0, 12)),))
    nodes.discard(())
    return sorted(nodes, key=lambda c: (len(c), c))


# ------------------------------------------------------------------------------------------- presets
def test_preset_names_include_published_and_ours():
    names = preset_names()
    for name in ("mc_sim_7b_63", "eagle1_mc_sim_7b_63", "chain4", "cpu16", "cpu24"):
        assert name in names
    assert preset_info("cpu16")["origin"] == "specbuild"
    assert preset_info("mc_sim_7b_63")["origin"] == "published"


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_is_valid(name):
    _check_consistent(parse_tree(name))


def test_mc_sim_7b_63_matches_published_statistics():
    tree = parse_tree("mc_sim_7b_63")
    assert tree.size == 64 and tree.num_draft == 63
    assert tree.depth == 4
    assert {d: int((tree.depths == d).sum()) for d in range(1, 5)} == {1: 10, 2: 28, 3: 23, 4: 2}
    assert tree.paths.shape == (42, 5)
    assert tree.max_top_k == 10
    assert tree.top_k_per_depth[0] == 10
    # the published list (its first entries) is a permutation of the normal form
    assert set(map(tuple, MC_SIM_7B_63_FIRST)) <= set(tree.choices)
    tree.check(top_k=10, max_depth=4, max_draft_len=63)


def test_eagle1_tree_statistics():
    tree = parse_tree("eagle1_mc_sim_7b_63")
    assert tree.num_draft == 25 and tree.depth == 5 and tree.paths.shape == (15, 6)


def test_cpu_presets_are_published_order_prefixes():
    mc = preset_info("mc_sim_7b_63")["choices"]
    assert parse_tree("cpu16") == Tree.from_choices(mc[:16])
    assert parse_tree("cpu24") == Tree.from_choices(mc[:24])
    assert parse_tree("cpu16").num_draft == 16 and parse_tree("cpu24").num_draft == 24
    assert parse_tree("chain4") == Tree.chain(4)


# ------------------------------------------------------------------------------------------- structure
def test_small_tree_arrays():
    tree = Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert tree.paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert tree.top_k_per_depth == [2, 2, 1]
    assert tree.max_top_k == 2
    assert tree.ancestor_mask[6].tolist() == [True, True, False, True, False, False, True]
    assert tree.to_list() == [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_empty_tree_and_chain():
    empty = Tree.from_choices([])
    assert empty.size == 1 and empty.depth == 0 and empty.max_top_k == 0
    assert empty.paths.tolist() == [[0]]
    assert empty.ancestor_mask.tolist() == [[True]]
    chain = Tree.chain(3)
    assert chain.choices == ((0,), (0, 0), (0, 0, 0))
    assert chain.paths.tolist() == [[0, 1, 2, 3]]
    assert chain.ancestor_mask.tolist() == np.tril(np.ones((4, 4), dtype=bool)).tolist()


def test_arrays_are_read_only():
    tree = Tree.chain(2)
    with pytest.raises(ValueError):
        tree.parents[0] = 5


def test_truncated_keeps_node_order_prefix():
    tree = parse_tree("mc_sim_7b_63")
    small = tree.truncated(16)
    assert small.choices == tree.choices[:16]
    _check_consistent(small)
    assert tree.truncated(0).size == 1
    assert tree.truncated(1000) == tree


def test_unsorted_input_is_sorted_and_equal():
    assert Tree.from_choices([[0, 0], [1], [0]]) == Tree.from_choices([[0], [1], [0, 0]])


@settings(max_examples=200, deadline=None)
@given(prefix_closed_trees())
def test_random_trees_are_consistent(choices):
    tree = Tree.from_choices(choices)
    assert [list(c) for c in tree.choices] == [list(c) for c in choices]
    _check_consistent(tree)


@settings(max_examples=200, deadline=None)
@given(prefix_closed_trees())
def test_paths_only_form_equals_full_form(choices):
    full = Tree.from_choices(choices)
    leaves = [list(full.choices[i - 1]) for i in np.flatnonzero(full.is_leaf) if i > 0]
    assert Tree.from_choices(leaves) == full
    # and the leaves read back from paths equal the leaves
    from_paths = [list(full.choices[row[row >= 0][-1] - 1]) for row in full.paths if len(row[row >= 0]) > 1]
    assert sorted(from_paths) == sorted(leaves)


def test_paths_only_medusa_example():
    assert Tree.from_choices([[0, 0, 0], [1, 2]]).to_list() == [[0], [1], [0, 0], [1, 2], [0, 0, 0]]


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "choices, fragment",
    [
        ([[0], [0, 1, 2], [0, 0]], "tree choice [0, 1, 2] lacks its prefix [0, 1]"),
        ([[0], [1], [0]], "lists choice [0] more than once"),
        ([[0], [-1]], "negative top-k index -1"),
        ([[0], []], "empty choice"),
        ([[0], [1.5]], "1.5"),
        ([[0], ["a"]], "'a'"),
        ([[0], [True]], "True"),
        ([[0], 3], "3"),
        ("[[0]]", "must be a list of choices"),
    ],
)
def test_from_choices_errors(choices, fragment):
    with pytest.raises(SpecbuildError) as err:
        Tree.from_choices(choices)
    assert fragment in str(err.value)


def test_check_errors():
    tree = Tree.from_choices([[0], [0, 12]])
    with pytest.raises(SpecbuildError, match=r"tree choice \[0, 12\] uses top-k index 12 but the build's top-k is 10"):
        tree.check(top_k=10)
    deep = Tree.chain(6)
    with pytest.raises(
        SpecbuildError, match=r"tree depth 6 exceeds the 5 Medusa heads \(choice \[0, 0, 0, 0, 0, 0\]\)"
    ):
        deep.check(max_depth=5, depth_limit_name="Medusa heads")
    with pytest.raises(SpecbuildError, match=r"tree depth 6 exceeds the maximum depth 5"):
        deep.check(max_depth=5)
    big = Tree.from_choices([[i] for i in range(70)])
    with pytest.raises(SpecbuildError, match="tree has 70 draft nodes but --max-draft-len is 63"):
        big.check(max_draft_len=63)
    with pytest.raises(SpecbuildError, match="medusa_choices choice"):
        tree.check(top_k=5, source="medusa_choices")
    tree.check(top_k=13, max_depth=2, max_draft_len=2)


def test_chain_and_truncate_errors():
    with pytest.raises(SpecbuildError, match="-1"):
        Tree.chain(-1)
    with pytest.raises(SpecbuildError, match="'x'"):
        Tree.chain("x")
    with pytest.raises(SpecbuildError, match="-2"):
        Tree.chain(2).truncated(-2)


# ------------------------------------------------------------------------------------------- parse_tree
def test_parse_tree_forms(tmp_path):
    expected = Tree.from_choices([[0], [1], [0, 0]])
    assert parse_tree("[[0],[1],[0,0]]") == expected
    assert parse_tree(" [[0, 0], [1]] ") == expected  # paths-only JSON
    assert parse_tree([[0], [1], [0, 0]]) == expected
    assert parse_tree(expected) is expected
    assert parse_tree('{"medusa_choices": [[0], [1], [0, 0]]}') == expected
    (tmp_path / "t.json").write_text(json.dumps([[0], [1], [0, 0]]))
    assert parse_tree(str(tmp_path / "t.json")) == expected
    (tmp_path / "t.yaml").write_text("choices:\n  - [0]\n  - [1]\n  - [0, 0]\n")
    assert parse_tree(str(tmp_path / "t.yaml")) == expected
    (tmp_path / "m.yml").write_text("medusa_choices: [[0], [1], [0, 0]]\n")
    assert parse_tree(tmp_path / "m.yml") == expected
    assert parse_tree("mc_sim_7b_63").num_draft == 63


def test_parse_tree_errors(tmp_path):
    with pytest.raises(SpecbuildError, match=r"unknown tree preset 'nope'; available: .*mc_sim_7b_63"):
        parse_tree("nope")
    with pytest.raises(SpecbuildError, match="not valid JSON"):
        parse_tree("[[0], [1")
    with pytest.raises(SpecbuildError, match="cannot read tree file"):
        parse_tree(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], oops]")
    with pytest.raises(SpecbuildError, match=r"bad.json.*not valid JSON"):
        parse_tree(str(bad))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("tree: [[0]]\n")
    with pytest.raises(SpecbuildError, match="'choices' or 'medusa_choices'"):
        parse_tree(str(wrong))
    lacking = tmp_path / "lacking.json"
    lacking.write_text("[[0], [0, 1, 2], [0, 0]]")
    with pytest.raises(SpecbuildError, match=r"lacking.json.*choice \[0, 1, 2\] lacks its prefix \[0, 1\]"):
        parse_tree(str(lacking))
    with pytest.raises(SpecbuildError, match="empty tree spec"):
        parse_tree("  ")
    with pytest.raises(SpecbuildError, match="tree spec must be"):
        parse_tree(42)


def test_tree_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, specbuild.tree as t; t.parse_tree('mc_sim_7b_63'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_is_chain():
    assert Tree.chain(3).is_chain and Tree.from_choices([]).is_chain
    assert not Tree.from_choices([[0], [1]]).is_chain and not Tree.from_choices([[0], [0, 0], [1]]).is_chain
