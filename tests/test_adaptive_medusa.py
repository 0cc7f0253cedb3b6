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
    AdaptiveConfig,
    AdaptivePolicy,
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


def test_host_time_decides_when_graph_costs_tie():
    """Equal graph costs, a tree that gains 1.5 tokens: drafted steps whose host work costs as much
    as a verify lose to plain steps; cheap host work wins."""
    for host_spec, want in ((0.0, 4), (1.0, 1)):
        p = AdaptivePolicy(1, 4)
        p.verify[:] = 1.0
        p.draft, p.host_plain, p.host_spec = 0.0, 0.0, host_spec
        p.gain[0] = [1.0, 1.5, 1.5, 1.5]
        p.wait = 1000  # no probe
        assert int(p.plan(np.array([True]))[0]) in ((2, 3, 4) if want > 1 else (1,))


def test_host_time_is_measured_between_plans():
    p = AdaptivePolicy(1, 3)
    live = np.array([True])
    p.plan(live)
    p.observe(None, [[0]], 1, 0.0, None, live)  # a plain step with free graphs: all wall time is host
    p.plan(live)
    assert p.host_plain >= 0 and np.isnan(p.host_spec)
    chain = Tree.from_parents([-1, 0, 1], score=np.array([0.0, -1, -2]))
    p.observe([chain], [[0, 1]], 3, 0.0, 0.0, live)
    p.plan(live)
    assert p.host_spec >= 0


def test_carry_seeds_costs_and_the_long_run_gain():
    cfg = AdaptiveConfig(probe_every=2, max_probe_every=16)
    a = AdaptivePolicy(2, 3, cfg)
    a.verify[1], a.verify[3], a.draft, a.host_plain, a.host_spec = 1.0, 2.0, 0.5, 0.1, 0.2
    a.gain[0], a.gain[1] = [1, 1, 1], [1, 1, np.nan]  # the last text was hard...
    a.long_gain, a.long_n = np.array([1.0, 3.0, 4.0]), 40  # ...but speculation pays in the long run
    a.wait, a.plain_run = 8, 3
    b = AdaptivePolicy(3, 3, cfg).carry(a)
    assert b.verify[1] == 1.0 and b.verify[3] == 2.0 and (b.draft, b.host_plain, b.host_spec) == (0.5, 0.1, 0.2)
    assert b.gain.shape == (3, 3) and np.allclose(b.gain, [[1, 3, 4]] * 3) and b.long_n == 40
    assert (b.wait, b.plain_run) == (2, 0)  # speculates from the start, probes soon if that changes
    assert int(b.plan(np.ones(3, dtype=bool)).min()) > 1
    a.long_gain = np.array([1.0, 1.05, 1.1])  # speculation does not pay here: start plain, keep the wait
    c = AdaptivePolicy(1, 3, cfg).carry(a)
    assert (c.wait, c.plain_run) == (8, 3) and int(c.plan(np.ones(1, dtype=bool))[0]) == 1
    assert np.isnan(AdaptivePolicy(1, 4).carry(a).gain).all()  # another tree size: nothing carried


def test_long_run_gain_is_the_mean_of_every_observation():
    p = AdaptivePolicy(1, 3)
    chain = Tree.from_parents([-1, 0, 1], score=np.array([0.0, -1, -2]))
    live = np.array([True])
    for acc in ([0], [0, 1, 2], [0, 1]):
        p.observe([chain], [acc], 3, 1.0, 0.1, live)
    assert np.allclose(p.long_gain, [1, (1 + 2 + 2) / 3, (1 + 3 + 2) / 3]) and p.long_n == 3


def test_plain_inputs():
    trees, cand, (depth, mask) = plain_inputs(np.array([7, 9]))
    assert [t.size for t in trees] == [1, 1] and cand.tolist() == [[7], [9]]
    assert depth.shape == (2, 1) and mask.shape == (2, 1, 1) and mask.all()


# ---------------------------------------------------------------------------------------------
# The loops, forced to switch


class Alternating(AdaptivePolicy):
    """Switches every step, whatever it measures: a full tree, a plain step, then per-sequence cuts
    of every size (some sequences root-only inside a drafted step). Deterministic, so a seeded run
    with it is reproducible."""

    def __init__(self, batch: int, tree_size: int, offset: int = 0):
        super().__init__(batch, tree_size)
        self.offset = offset

    def plan(self, live: np.ndarray) -> np.ndarray:
        k, bsz = len(self.history) + self.offset, self.gain.shape[0]
        if k % 3 == 0:
            return np.full(bsz, self.t)
        if k % 3 == 1:
            return np.ones(bsz, dtype=np.int64)
        return 1 + (np.arange(bsz) + k) % self.t


def _force(monkeypatch, decoder, offset: int = 0) -> list[Alternating]:
    made: list[Alternating] = []

    def new_policy(bsz, tree_size, sampler, key):
        made.append(Alternating(bsz, tree_size, offset))
        return made[-1]

    monkeypatch.setattr(decoder, "_new_policy", new_policy)
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
        calls = 1 + dec._eagle_tree(None)["depth"]
    assert s.draft_calls == calls * s.speculative_steps
    assert max(s.accepted) > 2  # cut trees were still accepted: the drafter's rows caught up after plain steps
    assert s.to_json()["plain_steps"] == s.plain_steps


@pytest.mark.parametrize(("kind", "draft"), LOOPS)
def test_the_real_policy_keeps_greedy_exact_and_seeds_the_next_run(trained, autoregressive_tokens, kind, draft):  # noqa: F811
    import graphs

    t = trained(kind)
    dec = graphs.load(t.out_dir, provider="cpu", threads=1, eagle_draft=draft)  # adaptive: the default
    assert [r.token_ids for r in dec.generate(PROMPTS[4:7], max_new_tokens=N_NEW)] == autoregressive_tokens[4:7]
    first = dec.last_policy
    assert first is not None and len(first.history) == dec.last_stats.steps
    assert [r.token_ids for r in dec.generate(PROMPTS[7:10], max_new_tokens=N_NEW)] == autoregressive_tokens[7:10]
    second, s = dec.last_policy, dec.last_stats
    assert second is not first and len(dec._policies) == 1  # one setting: the second run carried the first
    assert s.plain_steps == second.history.count(1) and s.speculative_steps == len(second.history) - s.plain_steps


def test_seeded_sampling_stays_reproducible_and_policy_free(trained):  # noqa: F811
    import graphs

    dec = graphs.load(trained("medusa").out_dir, provider="cpu", threads=1)
    a = dec.generate(PROMPTS[:2], max_new_tokens=N_NEW, temperature=0.9, seed=5)
    assert dec.last_policy is None and a[0].stats.plain_steps == 0
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


def test_plain_decisions_are_reused_until_a_recheck_or_the_probe(monkeypatch):
    """While plain, plan() decides again only every recheck_every steps (a plain step's host work
    stays near autoregressive's), and still probes on time."""
    p = AdaptivePolicy(1, 4, AdaptiveConfig(probe_every=4, max_probe_every=64, recheck_every=3))
    p.verify[:] = 1.0
    p.draft, p.host_plain, p.host_spec = 1.0, 0.0, 0.0
    p.gain[0] = [1.0, 1.1, 1.1, 1.1]
    p.wait = 10
    calls = []
    real = p.rates
    monkeypatch.setattr(p, "rates", lambda b: calls.append(b) or real(b))
    live = np.array([True])
    sizes = []
    for _ in range(12):
        n = int(p.plan(live)[0])
        sizes.append(n)
        if n == 1:
            p.observe(None, [[0]], 1, 1.0, None, live)
        else:
            break
    assert sizes == [1] * 10 + [4]  # the probe comes after `wait` plain steps
    assert len(calls) == 5  # decided at plain_run 0, 3, 6, 9 and 10 (the probe)


def test_a_lucky_probe_halves_the_wait_instead_of_resetting_it():
    p = AdaptivePolicy(1, 3, AdaptiveConfig(probe_every=2, max_probe_every=64))
    p.verify[:] = 1.0
    p.draft, p.host_plain, p.host_spec = 0.2, 0.0, 0.0
    p.gain[0] = [1.0, 1.0, 1.0]
    p.wait, p.plain_run = 32, 32
    chain = Tree.from_parents([-1, 0, 1], score=np.array([0.0, -1, -2]))
    live = np.array([True])
    p.observe([chain], [[0, 1, 2]], 3, 1.0, 0.2, live)  # the probe accepted everything
    assert p.plan_is_speculative(0)
    assert p.wait == 16


def test_a_clearly_paying_full_tree_is_kept_without_deciding_every_step(monkeypatch):
    """While the full tree beats a plain step by fast_margin, plan() decides (and observe() updates
    gains) only every recheck_every drafted steps; when the gain collapses the next decision sees it."""
    p = AdaptivePolicy(1, 3, AdaptiveConfig(recheck_every=4, fast_margin=1.25))
    p.verify[:] = 1.0
    p.draft, p.host_plain, p.host_spec = 0.2, 0.0, 0.0
    p.gain[0] = [1.0, 2.0, 3.0]  # full tree: 3 tokens / 1.2 s vs 1 / 1 s plain: 2.5x
    chain = Tree.from_parents([-1, 0, 1], score=np.array([0.0, -1, -2]))
    calls = []
    real = p.rates
    monkeypatch.setattr(p, "rates", lambda b: calls.append(b) or real(b))
    live = np.array([True])
    for _ in range(8):
        assert int(p.plan(live)[0]) == 3
        p.observe([chain], [[0, 1, 2]], 3, 1.0, 0.2, live)
    assert len(calls) == 3  # plan() decided at steps 0 and 4 only, observe() checked step 4 (without: 15)
    for _ in range(40):  # nothing accepted any more: the policy must notice and go plain
        n = int(p.plan(live)[0])
        if n == 1:
            break
        p.observe([chain], [[0]], 3, 1.0, 0.2, live)
    assert n == 1
