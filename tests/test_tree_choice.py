"""Which static tree the measured acceptance picks (graphs.trees): hand-set accuracies near each
boundary (a path just above / at / below ``min_prob``, ties, the size limit), and the expected
tokens it records, worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from graphs.trees import (
    _MIN_PATH_PROB,
    HEAD_DECAY,
    RANK_DECAY,
    TOP1,
    _path_prob,
    default_medusa_paths,
    expected_accepted,
    medusa_paths_from_acceptance,
)


def test_paths_from_acceptance_worked_example():
    acc = np.array([[0.6, 0.2], [0.5, 0.1]])
    # products: [0] .6, [1] .2, [0,0] .3, [0,1] .06, [1,0] .1, [1,1] .02
    assert medusa_paths_from_acceptance(acc, 4) == [[0], [0, 0], [1]]
    assert medusa_paths_from_acceptance(acc, 7) == [[0], [0, 0], [1], [1, 0], [0, 1], [1, 1]]
    assert medusa_paths_from_acceptance(acc, 2) == [[0]]
    assert medusa_paths_from_acceptance(acc, 100) == medusa_paths_from_acceptance(acc, 7)  # every node: 6


@pytest.mark.parametrize(("p", "kept"), [(0.01 * 0.999, False), (0.01, True), (0.01 * 1.001, True)])
def test_paths_from_acceptance_min_prob_boundary(p, kept):
    """A node whose product is below min_prob is left out, one exactly at it kept."""
    acc = np.array([[0.5, p]])
    assert medusa_paths_from_acceptance(acc, 8, min_prob=0.01) == ([[0], [1]] if kept else [[0]])


def test_paths_from_acceptance_default_min_prob():
    acc = np.array([[0.5, 0.0011, 0.0009]])
    assert medusa_paths_from_acceptance(acc, 8) == [[0], [1]]


def test_paths_from_acceptance_stops_at_the_last_head():
    """One head: no depth-2 paths, whatever the accuracy."""
    acc = np.array([[0.9, 0.8]])
    assert medusa_paths_from_acceptance(acc, 8) == [[0], [1]]
    acc = np.array([[0.9, 0.8], [0.9, 0.8], [0.9, 0.8]])
    paths = medusa_paths_from_acceptance(acc, 100)
    assert max(len(p) for p in paths) == 3 and len(paths) == 2 + 4 + 8


def test_paths_from_acceptance_children_use_the_next_heads_accuracy():
    """The child's product is the parent's times head (depth)'s accuracy, not head 0's."""
    acc = np.array([[0.5, 0.4], [0.9, 0.1]])
    # [0] .5, [1] .4, [0,0] .45, [1,0] .36, [0,1] .05, [1,1] .04
    assert medusa_paths_from_acceptance(acc, 5) == [[0], [0, 0], [1], [1, 0]]


def test_paths_from_acceptance_rejects_bad_shapes():
    for bad in (np.zeros(3), np.zeros((0, 2)), np.zeros((2, 2, 2))):
        with pytest.raises(ValueError, match="acc must be"):
            medusa_paths_from_acceptance(bad, 4)


def test_expected_accepted_is_one_plus_the_path_products():
    acc = np.array([[0.6, 0.2], [0.5, 0.1]])
    assert expected_accepted([[0], [0, 0], [1]], acc) == pytest.approx(1 + 0.6 + 0.3 + 0.2)
    assert expected_accepted([[1, 1]], acc) == pytest.approx(1 + 0.2 * 0.1)
    assert expected_accepted([], acc) == 1.0


def test_path_prob_is_the_assumed_product():
    assert _path_prob((0,)) == pytest.approx(TOP1)
    assert _path_prob((2,)) == pytest.approx(TOP1 * RANK_DECAY**2)
    assert _path_prob((0, 1)) == pytest.approx(TOP1 * TOP1 * HEAD_DECAY * RANK_DECAY)
    assert _path_prob((1, 0, 2)) == pytest.approx(math.prod([TOP1 * RANK_DECAY, TOP1 * HEAD_DECAY,
                                                             TOP1 * HEAD_DECAY**2 * RANK_DECAY**2]))


def test_default_paths_leave_out_nodes_below_one_percent():
    """One head: [0] .6, [1] .18, [2] .054, [3] .0162, [4] .00486 (below 1%): 5 nodes at most."""
    assert default_medusa_paths(1, 100) == [[0], [1], [2], [3]]
    assert _path_prob((3,)) > _MIN_PATH_PROB > _path_prob((4,))
    assert default_medusa_paths(1, 3) == [[0], [1]]  # size - 1 paths


def test_default_paths_best_first_over_heads():
    # [0] .6, [0,0] .288, [1] .18, [0,0,0] .1106, [0,1] .0864, [1,0] .0864 (tie: the smaller tuple), ...
    assert default_medusa_paths(3, 7) == [[0], [0, 0], [1], [0, 0, 0], [0, 1], [1, 0]]
    assert default_medusa_paths(2) == default_medusa_paths(2, 8) and len(default_medusa_paths(2)) == 7


def test_default_paths_bounds():
    assert default_medusa_paths(1, 2) == [[0]]
    with pytest.raises(ValueError):
        default_medusa_paths(1, 1)
    with pytest.raises(ValueError):
        default_medusa_paths(0, 4)
