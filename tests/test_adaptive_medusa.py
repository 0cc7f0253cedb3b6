"""The adaptive policy in every speculative loop: Medusa, step-wise EAGLE and one-call EAGLE.

Unit tests of what the loops need from graphs.adaptive (static Medusa trees ranked by assumed
acceptance, host costs, one run seeding the next), then the loops on the trained tiny drafters of
test_runtime with a policy forced to switch every step (full trees, plain steps without the
drafter, per-sequence cuts of every size): greedy output stays the base's, the stats count both
kinds of step, and sampled output keeps the base distribution (test_spec_sampling's chi-square).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_runtime import N_NEW, PROMPTS, autoregressive_tokens, references, trained  # noqa: F401 (fixtures)
from test_spec_sampling import P_MIN, chi_square, exact_joint, sample_counts, setup  # noqa: F401 (fixture)

from graphs.adaptive import (
    IDLE,
    SPEC_ADAPTIVE,
    SPEC_OFF,
    AdaptiveConfig,
    Planner,
    RowGains,
    counterfactual_gain,
    cut_tree,
    plain_inputs,
    static_scores,
    sub_tree,
)
from graphs.sampling import greedy_accept
from graphs.trees import Tree, default_medusa_paths, medusa_tree

DEEP_WIDE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]]


def _ranked(paths) -> Tree:
    t = medusa_tree(paths)
    return Tree(t.parents, t.depth, t.mask, t.children, head=t.head, rank=t.rank, score=static_scores(t))


def test_static_scores_rank_the_default_tree_in_its_greedy_order():
    """default_medusa_paths adds nodes best-first by assumed acceptance: the scores rank them so."""
    paths = default_medusa_paths(3)
    tree = _ranked(paths)
    node_of = {tuple(p): i + 1 for i, p in enumerate(sorted(paths, key=lambda p: (len(p), p)))}
    greedy = tree.score[[node_of[tuple(p)] for p in paths]]
    assert np.all(np.diff(greedy) <= 1e-12)  # best first (ties, e.g. [0, 1] and [1, 0], in either order)
    # node order would rank [1] above [0, 0]; the scores do not
    assert tree.score[node_of[(0, 0)]] > tree.score[node_of[(1,)]]


@pytest.mark.parametrize("paths", [default_medusa_paths(3), DEEP_WIDE, [[0], [1], [2], [3]], [[0], [0, 0]]])
def test_cut_static_trees_are_ancestor_closed(paths):
    tree = _ranked(paths)
    assert np.all(tree.score[1:] < tree.score[tree.parents[1:]])  # strictly falling along every path
    for n in range(1, tree.size + 1):
        sub = sub_tree(tree, cut_tree(tree, n))
        assert sub.size == n and np.all(sub.parents[1:] >= 0)


@pytest.mark.parametrize("seed", range(4))
def test_gain_predicts_the_greedy_walk_on_cut_medusa_trees(seed):
    tree = _ranked(DEEP_WIDE)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 6, tree.size)
    logits = rng.standard_normal((tree.size, 6))
    logits[np.arange(tree.size), rng.integers(0, 6, tree.size)] += 4
    full, _ = greedy_accept(tree, tokens, logits)
    gain = counterfactual_gain(tree, full)
    for n in range(1, tree.size + 1):
        keep = cut_tree(tree, n)
        got, _ = greedy_accept(sub_tree(tree, keep), tokens[keep], logits[keep])
        assert len(got) == gain[n - 1]


def _costs(p: Planner, verify: dict, draft: float, host_plain: float, host_spec: float) -> Planner:
    for tokens, t in verify.items():
        p.costs.add_verify(tokens, t)
        p.costs.add_verify(tokens, t)  # (twice: a shape's first measurement may be cold)
    p.costs.add_draft(1, draft)
    p.costs.add_host(False, host_plain)
    p.costs.add_host(False, host_plain)  # (twice: a shape's first measurement is cold)
    p.costs.add_host(True, host_spec)
    return p


def test_host_time_decides_when_graph_costs_tie():
    """Equal graph costs, a tree that gains 1.5 tokens: drafted steps whose host work costs as much
    as a verify lose to plain steps; cheap host work wins."""
    for host_spec, want in ((0.0, 4), (1.0, 1)):
        p = _costs(Planner(AdaptiveConfig(probe_every=64)), {1: 1.0, 4: 1.0}, 0.0, 0.0, host_spec)
        got = int(p.plan(np.array([SPEC_ADAPTIVE]), np.array([4]), [np.array([1.0, 1.5, 1.5, 1.5])])[0])
        assert got in ((2, 3, 4) if want > 1 else (1,))


def test_the_margin_is_a_boundary():
    """A tree predicted just above margin x a plain step's rate speculates; just below, it does not."""
    margin = 1.05
    for gain, want_spec in ((2 * margin * 1.001, True), (2 * margin * 0.999, False)):
        p = _costs(Planner(AdaptiveConfig(margin=margin, probe_every=64)), {1: 1.0, 2: 2.0}, 0.0, 0.0, 0.0)
        width = int(p.plan(np.array([SPEC_ADAPTIVE]), np.array([2]), [np.array([1.0, gain])])[0])
        assert (width == 2) is want_spec, (gain, width)


def test_long_run_prior_is_the_mean_of_every_observation():
    p = Planner()
    for g in ([1.0, 1.0, 1.0], [1.0, 2.0, 3.0], [1.0, 2.0, 2.0]):
        p.learn("k", np.array(g))
    assert np.allclose(p.prior("k"), [1, 5 / 3, 2]) and p.priors["k"][1] == 3
    assert p.prior("other") is None
    assert np.allclose(RowGains(3, p.prior("k")).gain, [1, 5 / 3, 2])  # a new request starts from it


def test_a_lucky_probe_halves_the_wait_instead_of_resetting_it():
    p = _costs(Planner(AdaptiveConfig(probe_every=2, max_probe_every=64, probe_steps=1)), {1: 1.0, 3: 1.0}, 0.2,
               0.0, 0.0)
    p.wait, p.plain_run = 32, 32
    modes, full = np.array([SPEC_ADAPTIVE]), np.array([3])
    assert int(p.plan(modes, full, [np.ones(3)])[0]) == 3 and p.probing  # past the wait: a probe
    assert int(p.plan(modes, full, [np.array([1.0, 2.0, 3.0])])[0]) == 3  # the probe accepted everything
    assert p.wait == 16


def test_plain_inputs():
    trees, cand, (depth, mask) = plain_inputs(np.array([7, 9]))
    assert [t.size for t in trees] == [1, 1] and cand.tolist() == [[7], [9]]
    assert depth.shape == (2, 1) and mask.shape == (2, 1, 1) and mask.all()


# ---------------------------------------------------------------------------------------------
# The loops, forced to switch


class Alternating(Planner):
    """Switches every step, whatever it measures: full trees, a plain step, then per-row cuts of every
    size (some rows root-only inside a drafted step). Deterministic, so a seeded run with it is
    reproducible."""

    def __init__(self, offset: int = 0):
        super().__init__()
        self.offset = offset

    def plan(self, modes, full, gains, ceilings=None):
        k = len(self.history) + self.offset
        n = len(modes)
        if k % 3 == 0:
            sizes = full.copy()
        elif k % 3 == 1:
            sizes = np.ones(n, dtype=np.int64)
        else:
            sizes = 1 + (np.arange(n) + k) % full
        sizes = np.where(modes == IDLE, 0, np.where(modes == SPEC_OFF, 1, sizes))
        self.history.append(int(sizes.max()))
        self.last_width = int(sizes.max())
        return sizes


def _force(monkeypatch, decoder, offset: int = 0) -> list[Alternating]:
    made: list[Alternating] = []

    def new_planner():
        made.append(Alternating(offset))
        return made[-1]

    monkeypatch.setattr(decoder, "new_planner", new_planner)
    return made


LOOPS = [("medusa", "auto"), ("eagle", "stepwise"), ("eagle3", "stepwise"), ("eagle", "one_call")]


@pytest.mark.parametrize(("kind", "draft"), LOOPS)
def test_forced_switching_keeps_greedy_exact(trained, autoregressive_tokens, monkeypatch, kind, draft):  # noqa: F811
    import graphs

    t = trained(kind)
    dec = graphs.load(t.out_dir, provider="cpu", threads=1, eagle_draft=draft)
    made = _force(monkeypatch, dec)
    results = dec.generate(PROMPTS[:4], max_new_tokens=N_NEW)
    assert [r.token_ids for r in results] == autoregressive_tokens[:4]
    s = results[0].stats
    widths = made[-1].history
    assert s.plain_steps == widths.count(1) > 0 and s.speculative_steps == len(widths) - widths.count(1) > 0
    calls = {"medusa": 1, "one_call": 1}.get(kind if kind == "medusa" else draft)
    if calls is None:  # step-wise: 1 + depth drafter calls per drafted step
        calls = 1 + dec.eagle_tree(None)["depth"]
    assert s.draft_calls == calls * s.speculative_steps
    assert max(s.accepted) > 2  # cut trees were still accepted: the drafter's rows caught up after plain steps
    assert s.to_json()["plain_steps"] == s.plain_steps


@pytest.mark.parametrize(("kind", "draft"), LOOPS)
def test_the_real_policy_keeps_greedy_exact_and_seeds_the_next_run(trained, autoregressive_tokens, kind, draft):  # noqa: F811
    import graphs

    t = trained(kind)
    dec = graphs.load(t.out_dir, provider="cpu", threads=1, eagle_draft=draft)  # adaptive: the default
    assert [r.token_ids for r in dec.generate(PROMPTS[4:7], max_new_tokens=N_NEW)] == autoregressive_tokens[4:7]
    assert dec.costs.verify and dec.costs.draft and len(dec.priors) == 1  # what the machine measured
    measured = dict(dec.costs.verify)
    with dec.watch_verify() as records:
        results = dec.generate(PROMPTS[7:10], max_new_tokens=N_NEW)
    assert [r.token_ids for r in results] == autoregressive_tokens[7:10]
    s = results[0].stats
    # one setting: the second run carried the first's costs and gains
    assert len(dec.priors) == 1 and set(measured) <= set(dec.costs.verify)
    steps: dict[int, list[int]] = {}
    for rec in records:  # one record per (step, live row): a step is plain if no row drafted
        steps.setdefault(rec.step, []).append(rec.tree.size)
    assert len(records) == len(s.accepted) and len(steps) == s.steps
    assert s.plain_steps == sum(max(sizes) == 1 for sizes in steps.values())
    assert s.speculative_steps == s.steps - s.plain_steps
    # (a tiny drafter on this machine may not pay at all: then its first plain decision waits
    # max_probe_every steps for a probe, longer than these requests; test_forced_switching sees both)


def test_seeded_sampling_stays_reproducible_and_policy_free(trained):  # noqa: F811
    import graphs

    dec = graphs.load(trained("medusa").out_dir, provider="cpu", threads=1)
    a = dec.generate(PROMPTS[:2], max_new_tokens=N_NEW, temperature=0.9, seed=5)
    assert a[0].stats.plain_steps == 0  # speculation "on": trees that do not follow measured times
    b = dec.generate(PROMPTS[:2], max_new_tokens=N_NEW, temperature=0.9, seed=5)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@pytest.mark.parametrize(("kind", "draft"), [("medusa", "auto"), ("eagle", "stepwise"), ("eagle", "auto")])
def test_forced_switching_keeps_the_base_distribution(setup, monkeypatch, kind, draft):  # noqa: F811
    """test_spec_sampling's chi-square, every step switching (offset by seed: each step meets every
    kind of plan)."""
    import graphs

    decoders, base = setup
    dec = decoders[kind]
    if draft != "auto":
        dec = graphs.load(dec.out_dir, provider="cpu", threads=1, eagle_draft=draft)
        dec.eos = set()  # as setup's: the tiny vocabulary holds the EOS id
    counts = np.zeros_like(exact_joint(base), dtype=np.int64)
    taus = []
    for seed in range(8):
        _force(monkeypatch, dec, offset=seed % 3)
        c, tau = sample_counts(dec, seeds=[seed], temperature=1.0)
        counts += c
        taus.append(tau)
    assert np.mean(taus) > 1.02, "drafts are (almost) never accepted; the test would prove little"
    stat, dof, p = chi_square(counts, exact_joint(base))
    print(f"\n{kind} adaptive (forced): chi2 {stat:.1f} dof {dof} p {p:.3g} tau {np.mean(taus):.2f}")
    assert p > P_MIN


class Pairs(Planner):
    """Two drafted steps (the full trees), then two plain ones, over and over."""

    def plan(self, modes, full, gains, ceilings=None):
        drafted = len(self.history) % 4 < 2
        sizes = np.where(modes == IDLE, 0, np.where(modes == SPEC_OFF, 1, full if drafted else 1))
        self.history.append(int(sizes.max()))
        self.last_width = int(sizes.max())
        return sizes


def test_the_engine_marks_steps_right_after_a_switch_cold(trained, monkeypatch):  # noqa: F811
    """A drafted step after a plain step or the prefill, and a lone plain step after a drafted one,
    reach the costs as cold (graphs.adaptive.Costs); the steps after them as warm."""
    import graphs

    dec = graphs.load(trained("medusa").out_dir, provider="cpu", threads=1)
    monkeypatch.setattr(dec, "new_planner", lambda: Pairs(costs=dec.costs))
    seen = {"draft": [], "host": []}
    add_draft, add_host = dec.costs.add_draft, dec.costs.add_host

    def draft(rows, seconds, cold=False):
        seen["draft"].append(cold)
        add_draft(rows, seconds, cold)

    def host(drafted, seconds, rows=1, cold=False):
        seen["host"].append((drafted, cold))
        add_host(drafted, seconds, rows, cold)

    monkeypatch.setattr(dec.costs, "add_draft", draft)
    monkeypatch.setattr(dec.costs, "add_host", host)
    res = dec.generate(PROMPTS[0], max_new_tokens=24)
    steps = res.stats.speculative_steps
    assert steps >= 4 and seen["draft"] == [True, False] * (steps // 2) + [True] * (steps % 2)
    # each decode step's host record: drafted steps cold, warm; plain steps (runs of one) cold, warm
    want = [(True, True), (True, False), (False, True), (False, False)]
    assert seen["host"] == [want[i % 4] for i in range(len(seen["host"]))]
