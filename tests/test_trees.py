"""Draft trees: static Medusa trees from paths, and the EAGLE-2 dynamic tree builder."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from graphs.trees import (
    DynamicTreeBuilder,
    Tree,
    default_medusa_paths,
    load_tree_file,
    medusa_candidates,
    medusa_candidates_batch,
    medusa_tree,
)

# --------------------------------------------------------------------------------------------
# Tree and Medusa trees


def test_from_parents_worked_example():
    tree = Tree.from_parents([-1, 0, 0, 1])
    assert tree.size == 4 and tree.max_depth == 2
    np.testing.assert_array_equal(tree.depth, [0, 1, 1, 2])
    np.testing.assert_array_equal(
        tree.mask, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    )
    assert [c.tolist() for c in tree.children] == [[1, 2], [3], [], []]
    np.testing.assert_array_equal(tree.retrieve_paths(), [[0, 2, -1], [0, 1, 3]])


def test_root_only_tree():
    tree = Tree.from_parents([-1])
    assert tree.size == 1 and tree.max_depth == 0
    np.testing.assert_array_equal(tree.retrieve_paths(), [[0]])


@pytest.mark.parametrize("parents", [[0, 0], [-1, 2, 0], [-1, -1], [-1, 1]])
def test_tree_rejects_non_topological_parents(parents):
    with pytest.raises(ValueError, match=r"root|topological"):
        Tree.from_parents(parents)


def test_medusa_tree_worked_example():
    tree = medusa_tree([[1], [0, 1], [0], [1, 0], [0, 0]])  # order of the input does not matter
    # nodes: 0 root, 1 [0], 2 [1], 3 [0, 0], 4 [0, 1], 5 [1, 0]
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 1, 1, 2])
    np.testing.assert_array_equal(tree.depth, [0, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(tree.head, [-1, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(tree.rank, [-1, 0, 1, 0, 1, 0])
    assert [c.tolist() for c in tree.children] == [[1, 2], [3, 4], [5], [], [], []]
    expected_mask = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(tree.mask, expected_mask)
    np.testing.assert_array_equal(tree.retrieve_paths(), [[0, 1, 3], [0, 1, 4], [0, 2, 5]])


def test_medusa_children_come_in_rank_order():
    tree = medusa_tree([[2], [0], [1], [0, 2], [0, 0]])
    assert [tree.rank[c].tolist() for c in tree.children[:2]] == [[0, 1, 2], [0, 2]]


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([], "non-empty list of paths"),
        ("01", "non-empty list of paths"),
        ([[0], []], r"path \[\] must be a non-empty list"),
        ([[0], 1], "path 1 must be a non-empty list"),
        ([[0], [-1]], r"path \[-1\] has negative rank -1"),
        ([[0], [0]], r"path \[0\] appears twice"),
        ([[0], [0, 1.0]], r"path \[0, 1.0\] has non-integer rank 1.0"),
        ([[True]], "non-integer rank True"),
        ([[0], [1, 0]], r"path \[1, 0\] lacks its prefix \[1\]"),
        ([[0], [0, 0, 0]], r"path \[0, 0, 0\] lacks its prefix \[0, 0\]"),
    ],
)
def test_medusa_tree_rejects_bad_paths(paths, message):
    with pytest.raises(ValueError, match=message) as err:
        medusa_tree(paths)
    assert "\n" not in str(err.value)


def test_medusa_tree_accepts_numpy_ints():
    tree = medusa_tree([[np.int64(0)], [np.int32(1)]])
    np.testing.assert_array_equal(tree.rank, [-1, 0, 1])


def test_medusa_candidates():
    tree = medusa_tree([[0], [1], [0, 0]])
    topk_ids = np.array([[5, 9], [3, 4]])  # (heads, K)
    np.testing.assert_array_equal(medusa_candidates(tree, 7, topk_ids), [7, 5, 9, 3])
    batch = medusa_candidates_batch(tree, np.array([7, 8]), np.stack([topk_ids, topk_ids + 10]))
    np.testing.assert_array_equal(batch, [[7, 5, 9, 3], [8, 15, 19, 13]])
    assert batch.dtype == np.int64


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
def test_medusa_candidates_needs_enough_heads_and_k(shape):
    tree = medusa_tree([[0], [1], [0, 0]])  # needs 2 heads, top-2
    with pytest.raises(ValueError, match="needs 2 heads and top-2"):
        medusa_candidates(tree, 7, np.zeros(shape, dtype=np.int64))


def test_medusa_candidates_needs_a_medusa_tree():
    with pytest.raises(ValueError, match="not a Medusa tree"):
        medusa_candidates(Tree.from_parents([-1, 0]), 7, np.zeros((1, 1), dtype=np.int64))


def test_default_medusa_paths_worked_example():
    assert default_medusa_paths(2, 5) == [[0], [0, 0], [1], [0, 1]]
    assert default_medusa_paths(1) == [[0], [1], [2], [3]]  # later ranks are not worth a slot


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("size", [None, 2, 8, 16, 32])
def test_default_medusa_paths_is_a_valid_small_tree(num_heads, size):
    paths = default_medusa_paths(num_heads, size)
    tree = medusa_tree(paths)  # validates: prefixes present, no duplicates
    assert tree.size <= (size or 16)
    assert tree.max_depth <= num_heads
    assert tree.rank.max() <= 3  # top-4 from each head is enough
    if size is None:
        assert 5 <= tree.size <= 10


def test_default_medusa_paths_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_heads"):
        default_medusa_paths(0)
    with pytest.raises(ValueError, match="size"):
        default_medusa_paths(2, 1)


def test_load_tree_file_forms(tmp_path):
    paths = [[0], [1], [0, 0]]
    (tmp_path / "a.json").write_text(json.dumps(paths))
    (tmp_path / "b.json").write_text(json.dumps({"paths": paths}))
    assert load_tree_file(tmp_path / "a.json") == paths
    assert load_tree_file(str(tmp_path / "b.json")) == paths


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "does not exist"),
        ("[[0], [1]", "is not valid JSON"),
        ('{"choices": [[0]]}', "exactly the key 'paths'"),
        ('{"paths": [[0]], "x": 1}', "exactly the key 'paths'"),
        ('"0, 1"', "non-empty list of paths"),
        ("[0, 1]", "path 0 must be a non-empty list"),
        ("[[0], [1, 0]]", r"lacks its prefix \[1\]"),
    ],
)
def test_load_tree_file_errors(tmp_path, text, message):
    f = tmp_path / "tree.json"
    if text is not None:
        f.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_tree_file(f)
    assert "tree.json" in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# Dynamic (EAGLE-2) trees


def test_dynamic_tree_hand_checked():
    b = DynamicTreeBuilder(topk=2, depth=1, total_tokens=4)
    f = b.start([5, 6], np.log([0.6, 0.3]))
    np.testing.assert_array_equal(f.tokens, [5, 6])
    np.testing.assert_array_equal(f.depth, [1, 1])
    np.testing.assert_array_equal(f.parent_row, [0, 0])
    np.testing.assert_array_equal(f.attend, np.eye(2, dtype=bool))
    # a7 log .24, a8 log .18, b9 log .27, b7 log .03: b's best child beats a's children
    assert b.expand([[7, 8], [9, 7]], np.log([[0.4, 0.3], [0.9, 0.1]])) is None
    tree, tokens = b.finish(root_token=4)
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 2])
    np.testing.assert_array_equal(tokens, [4, 5, 6, 9])
    np.testing.assert_allclose(tree.score, np.log([1, 0.6, 0.3, 0.27]))
    assert tree.head is None and tree.rank is None
    assert b.finish()[1][0] == -1  # the builder never sees the root token


def test_dynamic_tree_frontier_attend_and_parent_rows():
    # topk=2, K=3. Layer 1: a (.5), b (.3), c (.2); frontier [a, b] (fed 0, 1).
    b = DynamicTreeBuilder(topk=2, depth=3, total_tokens=8)
    f1 = b.start([10, 11, 12], np.log([0.5, 0.3, 0.2]))
    np.testing.assert_array_equal(f1.tokens, [10, 11])
    # children: a: a20 .25, a21 .15, a22 .1; b: b23 .27, b24 .02, b25 .01 -> frontier [b23, a20]
    f2 = b.expand([[20, 21, 22], [23, 24, 25]], np.log([[0.5, 0.3, 0.2], [0.9, 0.07, 0.03]]))
    np.testing.assert_array_equal(f2.tokens, [23, 20])
    np.testing.assert_array_equal(f2.depth, [2, 2])
    np.testing.assert_array_equal(f2.parent_row, [1, 0])  # rows of the f1 drafter call: b, a
    # fed axis: 0 a, 1 b, 2 b23, 3 a20
    np.testing.assert_array_equal(f2.attend, [[0, 1, 1, 0], [1, 0, 0, 1]])
    # children of b23 (.27): 30 .27*.5; of a20 (.25): 31 .25*.9 -> frontier [a20-31, b23-30]
    f3 = b.expand([[30, 32], [31, 33]], np.log([[0.5, 0.5], [0.9, 0.1]]))
    np.testing.assert_array_equal(f3.tokens, [31, 30])
    np.testing.assert_array_equal(f3.parent_row, [1, 0])
    # fed axis: ... 4 a20-31, 5 b23-30
    np.testing.assert_array_equal(f3.attend, [[1, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 1]])
    assert b.expand(np.zeros((2, 3), dtype=np.int64), np.log(np.full((2, 3), 0.3))) is None
    with pytest.raises(RuntimeError, match="no more than"):
        b.expand(np.zeros((2, 3), dtype=np.int64), np.zeros((2, 3)))
    tree, tokens = b.finish()
    # best 7: a -.69, b -1.20, b23 -1.31, a20 -1.39, a20-31 -1.49, c -1.61, a21 -1.90
    # ordered by (depth, score): a, b, c | b23, a20, a21 | a20-31
    np.testing.assert_array_equal(tokens, [-1, 10, 11, 12, 23, 20, 21, 31])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 0, 2, 1, 1, 5])
    assert [c.tolist() for c in tree.children] == [[1, 2, 3], [5, 6], [4], [], [], [7], [], []]


def _fake_drafter(path: tuple[int, ...], k: int, vocab: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic top-K (ids, logprobs) for a token path, as a drafter would give."""
    rng = np.random.default_rng(zlib.crc32(np.array(path, dtype=np.int64).tobytes()))
    probs = rng.dirichlet(np.full(vocab, 0.3))  # (vocab,)
    ids = np.argsort(-probs)[:k]  # (k,) distinct
    return ids, np.log(probs[ids]).astype(np.float32)


def _grow(topk, depth, total_tokens, k, root=3):
    """Run the builder against the fake drafter; check frontiers, return what was drafted."""
    b = DynamicTreeBuilder(topk, depth, total_tokens)
    drafted: dict[tuple[int, ...], float] = {}  # token path (root first) -> cumulative score
    ids, lp = _fake_drafter((root,), k)
    f = b.start(ids, lp)
    layer = {(root, int(t)): float(s) for t, s in zip(ids, lp)}
    prev_paths = [(root,)]
    fed: list[tuple[int, ...]] = []
    calls = 0
    while f is not None:
        drafted |= layer
        paths = [(*prev_paths[r], int(t)) for r, t in zip(f.parent_row, f.tokens)]
        assert all(p in layer for p in paths)
        assert np.all(f.depth == len(paths[0]) - 1)
        # the frontier is the best `topk` of the newest layer
        assert min(layer[p] for p in paths) >= max([v for p, v in layer.items() if p not in paths] + [-1e9])
        assert len(paths) == min(topk, len(layer))
        # attend: fed ancestors (previous frontiers) and itself, over every node fed so far
        fed += paths
        expected = [[p[: len(q)] == q for q in fed] for p in paths]
        np.testing.assert_array_equal(f.attend, expected)
        out = [_fake_drafter(p, k) for p in paths]
        ids = np.stack([o[0] for o in out])  # (rows, k)
        lp = np.stack([o[1] for o in out])  # (rows, k)
        layer = {
            (*p, int(t)): drafted[p] + float(s) for p, row_ids, row_lp in zip(paths, ids, lp)
            for t, s in zip(row_ids, row_lp)
        }
        prev_paths = paths
        f = b.expand(ids, lp)
        calls += 1
    drafted |= layer
    assert calls == depth
    return b, drafted


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_tree_properties(seed):
    rng = np.random.default_rng(seed)
    topk, depth, total, K = int(rng.integers(1, 5)), int(rng.integers(1, 5)), int(rng.integers(2, 30)), 4
    b, drafted = _grow(topk, depth, total, K, root=seed)
    tree, tokens = b.finish(root_token=seed)
    assert tree.size == min(total, 1 + len(drafted))
    assert tokens.dtype == np.int64 and tokens[0] == seed
    # re-indexed topologically (Tree checks parents[i] < i), every path was drafted, scores add up
    paths = [(seed,)]
    for i in range(1, tree.size):
        paths.append((*paths[tree.parents[i]], int(tokens[i])))
        assert paths[i] in drafted
        assert tree.score[i] == pytest.approx(drafted[paths[i]], abs=1e-9)
    assert tree.max_depth <= depth + 1
    np.testing.assert_array_equal(tree.depth, [len(p) - 1 for p in paths])
    # the kept nodes are the best ones
    kept = set(paths[1:])
    if len(kept) < len(drafted):
        assert min(drafted[p] for p in kept) >= max(v for p, v in drafted.items() if p not in kept)
    for kids in tree.children:  # children by score, best first
        assert np.all(np.diff(tree.score[kids]) <= 0)
    assert np.all(np.diff(tree.depth) >= 0)  # nodes by depth


@pytest.mark.parametrize("logprob", [0.0, 1e-7, np.nan])
def test_dynamic_tree_ties_keep_ancestors(logprob):
    # every score equal (or clipped / NaN): the kept set must still be ancestor-closed
    b = DynamicTreeBuilder(topk=3, depth=3, total_tokens=12)
    f = b.start(np.arange(3), np.full(3, logprob))
    while f is not None:
        f = b.expand(np.arange(3)[None].repeat(f.size, 0), np.full((f.size, 3), logprob))
    tree, _ = b.finish()  # raises if a kept node's parent was dropped
    assert tree.size == 12


def test_dynamic_tree_smaller_than_total_when_little_was_drafted():
    b = DynamicTreeBuilder(topk=1, depth=1, total_tokens=10)
    f = b.start([4], [-0.1])
    assert b.expand([[5]], [[-0.2]]) is None and f.size == 1
    tree, tokens = b.finish(1)
    np.testing.assert_array_equal(tree.parents, [-1, 0, 1])
    np.testing.assert_array_equal(tokens, [1, 4, 5])


def test_dynamic_tree_rejects_misuse():
    with pytest.raises(ValueError, match=">= 1"):
        DynamicTreeBuilder(0, 2, 8)
    b = DynamicTreeBuilder(2, 2, 8)
    with pytest.raises(RuntimeError, match="start"):
        b.expand([[1, 2]], [[-1.0, -2.0]])
    with pytest.raises(RuntimeError, match="start"):
        b.finish()
    with pytest.raises(ValueError, match="must be"):
        b.start([1, 2], [-1.0])
    b.start([1, 2, 3], [-1.0, -2.0, -3.0])
    with pytest.raises(ValueError, match=r"must be \(2, K\)"):
        b.expand([[1, 2]], [[-1.0, -2.0]])
