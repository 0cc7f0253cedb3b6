"""The Medusa heads' call bound once (graphs.sessions.BoundArrays): the same drafts as a plain run."""

from __future__ import annotations

import numpy as np

import graphs
from graphs import contract as C
from graphs.adaptive import root_only
from graphs.host import HostExecutor
from graphs.proposers import Medusa
from graphs.sessions import BoundArrays


class _Row:
    def __init__(self, state, root):
        self.draft, self.root = state, root


def _rows(dec, medusa, hiddens, roots):
    req = dec.new_request([5, 6, 7], dec.resolve(), 64)  # its tree: the export's default
    rows = []
    for h, r in zip(hiddens, roots):
        state = medusa.new_state(req)
        state.hidden = h
        rows.append(_Row(state, r))
    return rows


def test_bound_heads_call_drafts_what_session_run_drafts(exported):
    dec = graphs.load(exported("medusa"), provider="cpu")
    executor = HostExecutor(dec.model, 4, 64, 16)
    medusa = Medusa(executor)
    rng = np.random.default_rng(0)
    h = dec.draft_spec.input(C.HIDDEN).dims[2]
    hiddens = [rng.standard_normal(h).astype(np.float32) for _ in range(3)]
    for n_rows, sizes in ((1, [4]), (3, [4, 1, 3]), (2, [3, 3])):  # rows that draft vary: other shapes
        rows = _rows(dec, medusa, hiddens[:n_rows], [11, 12, 13][:n_rows])
        sizes = np.array(sizes, dtype=np.int64)
        drafts = medusa.propose(rows, sizes)
        assert drafts.calls == 1
        drafting = [b for b, s in enumerate(sizes) if s > 1]
        k = max(r.draft.topk for r in rows)
        (ids,) = dec.draft.run([C.TOPK_IDS], {C.HIDDEN: np.stack([hiddens[b] for b in drafting])[:, None],
                                             C.TOPK_IN: np.array([k], dtype=np.int64)})
        for b, (tree, cand) in enumerate((p.tree, p.tokens) for p in drafts.rows):
            if sizes[b] == 1:
                assert tree is root_only() and cand.tolist() == [rows[b].root]
                continue
            j = drafting.index(b)
            cut, heads, ranks = Medusa._cut(rows[b].draft, int(sizes[b]))
            assert tree is cut and cand[0] == rows[b].root
            assert cand[1:].tolist() == ids[j, 0, heads, ranks].tolist()
    # one binding per (drafting rows, top-k): the shapes seen above, each made once
    assert sorted(executor._heads) == sorted({(1, k), (2, k)})


def test_bound_arrays_refill_in_place(exported):
    """A second call with new inputs written into the bound arrays returns the new outputs (the
    arrays are the call's memory, not copies made at binding)."""
    dec = graphs.load(exported("medusa"), provider="cpu")
    h = dec.draft_spec.input(C.HIDDEN).dims[2]
    heads = dec.draft_spec.output(C.TOPK_IDS).dims[2]
    call = BoundArrays(dec.draft, {C.HIDDEN: ((1, 1, h), np.float32), C.TOPK_IN: ((1,), np.int64)},
                       {C.TOPK_IDS: ((1, 1, heads, 2), np.int64)})
    call.inputs[C.TOPK_IN][:] = 2
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.standard_normal((1, 1, h)).astype(np.float32)
        call.inputs[C.HIDDEN][:] = x
        got = call.run()[C.TOPK_IDS].copy()
        (want,) = dec.draft.run([C.TOPK_IDS], {C.HIDDEN: x, C.TOPK_IN: np.array([2], dtype=np.int64)})
        assert np.array_equal(got, want)
