"""The engine's recorded numbers equal what it verified (graphs.engine Stats/totals against
Decoder.watch_verify(), which records every verified row): steps, plain steps, drafter calls,
draft tokens, accepted drafts, accepted-by-position, tokens per step. A forced planner switches
between full trees, plain steps and per-row cuts (some rows root-only inside a drafted step)."""

from __future__ import annotations

import numpy as np
import pytest

import graphs
from graphs.adaptive import IDLE, SPEC_OFF, Planner


class Cycling(Planner):
    """full trees, a plain step, then per-row cuts (row b: 1 + (b + k) % T nodes), in turn."""

    def plan(self, modes, full, gains, ceilings=None):
        k, n = len(self.history), len(modes)
        sizes = (full.copy() if k % 3 == 0 else np.ones(n, dtype=np.int64) if k % 3 == 1
                 else 1 + (np.arange(n) + k) % full)
        sizes = np.where(modes == IDLE, 0, np.where(modes == SPEC_OFF, 1, sizes)).astype(np.int64)
        self.history.append(int(sizes.max()))
        self.last_width = int(sizes.max())
        return sizes


def _expected(records):
    """What the stats should say, from the verified rows alone."""
    steps: dict[int, list] = {}
    for r in records:
        steps.setdefault(r.step, []).append(r)
    drafted_rows = [r for r in records if r.tree.size > 1]
    per_pos = [sum(len(r.accepted) - 1 > k for r in drafted_rows)
               for k in range(max((len(r.accepted) - 1 for r in drafted_rows), default=0))]
    return {"steps": len(steps), "plain_steps": sum(all(r.tree.size == 1 for r in rs) for rs in steps.values()),
            "accepted": [len(r.accepted) for r in records],
            "draft_tokens": sum(r.tree.size - 1 for r in drafted_rows),
            "accepted_drafts": sum(len(r.accepted) - 1 for r in drafted_rows),
            "accepted_per_pos": per_pos}


@pytest.mark.parametrize("prompts", [[[5, 6, 7]], [[5, 6, 7], [9, 3], [4, 4, 4, 8]]])
def test_stats_equal_the_verified_rows(exported, monkeypatch, prompts):
    dec = graphs.load(exported("medusa"), provider="cpu", threads=1)
    made = []
    monkeypatch.setattr(dec, "new_planner", lambda: made.append(Cycling()) or made[-1])
    with dec.watch_verify() as records:
        out = dec.generate(prompts if len(prompts) > 1 else prompts[0], max_new_tokens=10)
    results = out if isinstance(out, list) else [out]
    s = results[0].stats  # the batch's
    want = _expected(records)
    assert s.steps == want["steps"] == len(made[-1].history)
    assert s.plain_steps == want["plain_steps"] == made[-1].history.count(1) > 0
    assert s.speculative_steps == s.steps - s.plain_steps > 0
    assert s.draft_calls == s.speculative_steps  # Medusa: one heads call per drafted step
    assert sorted(s.accepted) == sorted(want["accepted"]) and s.mean_accepted_length == np.mean(want["accepted"])
    assert s.draft_tokens == want["draft_tokens"] > 0
    assert s.accepted_drafts == want["accepted_drafts"]
    assert s.accepted_per_pos == want["accepted_per_pos"]
    j = s.to_json()
    assert (j["steps"], j["plain_steps"], j["speculative_steps"]) == (s.steps, s.plain_steps, s.speculative_steps)
    # tokens emitted: one from each prefill, then what the rows accepted, less what max_new_tokens cut
    # from each request's last step
    assert s.new_tokens == sum(len(r.token_ids) for r in results) <= len(prompts) + sum(want["accepted"])
    by_req: dict[int, int] = {}
    for x in records:
        by_req[x.request_id] = by_req.get(x.request_id, 0) + len(x.accepted)
    assert len(by_req) == len(prompts) and all(v >= 10 - 1 for v in by_req.values())
