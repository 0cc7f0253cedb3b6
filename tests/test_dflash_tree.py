"""graphs.dflash_tree: the chain and the top-k tree of a DFlash block, as the verify's Tree + tokens."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from graphs.dflash_tree import block_chain, block_tree, block_trees

IDS = np.array([[5, 9], [7, 8]])
LP = np.log(np.array([[0.6, 0.3], [0.5, 0.4]]))


def test_worked_example_of_the_docstring():
    tree, tokens = block_tree(IDS, LP, root_token=4, size=4)
    assert tree.parents.tolist() == [-1, 0, 0, 1] and tokens.tolist() == [4, 5, 9, 7]
    assert tree.depth.tolist() == [0, 1, 1, 2]
    np.testing.assert_allclose(np.exp(tree.score), [1, 0.6, 0.3, 0.3])
    assert tree.mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


def test_chain_is_the_top1_path_and_the_k1_tree():
    tree, tokens = block_chain(IDS, LP, 4)
    assert tree.parents.tolist() == [-1, 0, 1] and tokens.tolist() == [4, 5, 7]
    np.testing.assert_allclose(np.exp(tree.score), [1, 0.6, 0.3])
    t1, k1 = block_tree(IDS[:, :1], LP[:, :1], 4, size=10)
    assert t1.parents.tolist() == tree.parents.tolist() and k1.tolist() == tokens.tolist()
    short, toks = block_chain(IDS, LP, 4, size=2)
    assert short.size == 2 and toks.tolist() == [4, 5]


def _all_paths(lp):
    slots, k = lp.shape
    for d in range(1, slots + 1):
        for ranks in itertools.product(range(k), repeat=d):
            yield ranks, sum(lp[i, r] for i, r in enumerate(ranks))


@pytest.mark.parametrize("size", [1, 2, 5, 9, 14])
def test_tree_keeps_the_most_probable_prefix_closed_paths(size):
    """Against brute force: the kept nodes are the size-1 best paths (ties aside), every parent is kept,
    siblings come in score order, and each node's token is its slot's candidate."""
    rng = np.random.default_rng(size)
    slots, k = 4, 3
    p = rng.dirichlet(np.ones(20), size=slots)[:, :k]
    lp = np.log(np.sort(p, axis=1)[:, ::-1])
    ids = rng.integers(0, 1000, (slots, k))
    tree, tokens = block_tree(ids, lp, root_token=-7, size=size)
    best = sorted((s for _, s in _all_paths(lp)), reverse=True)[: size - 1]
    np.testing.assert_allclose(sorted(tree.score[1:], reverse=True), best)
    assert tree.size == size and tokens[0] == -7
    for n in range(1, tree.size):
        par = tree.parents[n]
        assert tree.depth[n] == tree.depth[par] + 1 and tree.score[n] <= tree.score[par] + 1e-12
        slot = tree.depth[n] - 1
        r = int(np.flatnonzero(ids[slot] == tokens[n])[0])
        assert math.isclose(tree.score[n] - tree.score[par], lp[slot, r])
    for kids in tree.children:
        assert list(tree.score[kids]) == sorted(tree.score[kids], reverse=True)


def test_nan_and_inf_never_enter_and_batches_take_per_row_sizes():
    lp = LP.copy()
    lp[0, 1] = np.nan
    tree, tokens = block_tree(IDS, lp, 4, size=10)
    assert 9 not in tokens.tolist() and tree.size == 4  # root, [5], [5, 7], [5, 8]
    ids = np.stack([IDS, IDS[:, ::-1]])
    lps = np.stack([LP, LP])
    out = block_trees(ids, lps, np.array([4, 6]), [3, 4])
    assert [t.size for t, _ in out] == [3, 4] and out[1][1][0] == 6
    chains = block_trees(ids, lps, np.array([4, 6]), [5, 5], topk=1)
    assert [c[1].tolist() for c in chains] == [[4, 5, 7], [6, 9, 8]]


@pytest.mark.parametrize("bad", [np.zeros((2,)), np.zeros((0, 2)), np.zeros((2, 3, 1))])
def test_bad_shapes_are_one_line(bad):
    with pytest.raises(ValueError, match="dflash tree"):
        block_tree(bad, bad, 1, 4)
    with pytest.raises(ValueError, match="size must be >= 1"):
        block_tree(IDS, LP, 1, 0)
