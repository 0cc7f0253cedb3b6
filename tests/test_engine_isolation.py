"""A bad request never touches another's (issue 39), in the engine: hostile numbers and failures of one
request's own work (its sampling, stop strings, text) beside six greedy requests that must finish with
their exact greedy tokens and text.

The cause: a temperature of 1e-310 divided the logits to inf, ``rng.choice`` raised "Probabilities
contain NaN" inside ``Engine.step`` and the server failed every request. The design: whatever one
request's own work raises ends that request alone (``finish_reason="error"``, the exception on its
event, its row freed); only a failure of a call the batch shares leaves ``step``. The HTTP version of
the fuzz (JSON strings through the server) is in test_serve_hostile.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

import graphs
from graphs.engine import EngineConfig
from graphs.errors import InputError
from graphs.sampling import MIN_TEMPERATURE, process_logits

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2], [11, 12], [3, 3, 8, 1], [20, 21, 22, 23, 24, 25], [9]]
N_GREEDY = 24  # tokens of each greedy request: long enough to overlap every hostile one

TINY = [5e-324, 1e-310, 2.2250738585072014e-308, 1e-300, MIN_TEMPERATURE / 2]
HUGE = [1e308, 1.7976931348623157e308, 10**30, 2**63, 2**64]
ODD = [0, 0.0, -0.0, -1, -1e-310, -1e308, math.nan, math.inf, -math.inf, True, "nan", "1e-310", "inf", None]
VALUES = [*TINY, *HUGE, *ODD, 1, 0.5]
# each numeric parameter, fuzzed alone on top of a base that makes it matter (sampling for top_p/top_k)
FUZZED = {"temperature": {"do_sample": True}, "top_p": {"temperature": 0.8, "seed": 1},
          "top_k": {"temperature": 0.8, "seed": 2}, "max_new_tokens": {}, "seed": {"temperature": 0.9},
          "max_length": {}, "deadline_s": {}}


@pytest.fixture(scope="module")
def exports(exported, tmp_path_factory):
    """The tiny Medusa export raw (general steps) and optimized (bound plain runs, greedy argmax)."""
    from exporter.optimize import optimize_export

    out = tmp_path_factory.mktemp("isolation") / "out"
    shutil.copytree(exported("medusa"), out)
    optimize_export(out, progress=None, time_gain=False, tune=False)
    return {"raw": exported("medusa"), "optimized": out}


def _greedy(dec) -> list[dict]:
    """The six greedy requests (three drafting, three plain) and their text decoded alone."""
    out = []
    for i, p in enumerate(PROMPTS):
        params = {"max_new_tokens": N_GREEDY, "speculation": "on" if i % 2 else "off"}
        ref = dec.generate(p, **params)
        out.append({"prompt": p, "params": params, "tokens": ref.token_ids, "text": ref.text,
                    "finish": ref.finish_reason})
    return out


def _run(engine, greedy: list[dict], hostile: list, max_steps: int = 5000) -> tuple[dict, dict]:
    """Add the greedy requests, then the hostile ones (a kwargs dict, or a made Request); step to the
    end. Returns ({id: tokens, text, finish, error}, {hostile index: "refused: ..." or its id})."""
    got: dict[int, dict] = {}
    ids = [engine.add_request(g["prompt"], **g["params"]) for g in greedy]
    placed = {}
    for i, h in enumerate(hostile):
        try:
            placed[i] = engine.add(h) if not isinstance(h, dict) else engine.add_request(h.pop("prompt"), **h)
        except InputError as e:  # refused at the door with one line: fine
            placed[i] = f"refused: {e}"
    for rid in [*ids, *(v for v in placed.values() if isinstance(v, int))]:
        got[rid] = {"tokens": [], "text": "", "finish": None, "error": None}
    for _ in range(max_steps):
        if not engine.has_pending_requests():
            break
        for ev in engine.step():  # never raises: nothing here fails a shared call
            g = got[ev.request_id]
            assert g["finish"] is None, "an event after the request finished"
            g["tokens"] += ev.token_ids
            g["text"] += ev.text
            g["finish"], g["error"] = ev.finish_reason, ev.error
    assert not engine.has_pending_requests()
    for g, rid in zip(greedy, ids):
        o = got[rid]
        assert (o["tokens"], o["text"], o["finish"]) == (g["tokens"], g["text"], g["finish"]), \
            f"greedy request {rid} ({g['params']}) is not its greedy output alone"
    m = engine.memory()
    assert m["rows_used"] == 0 and m["waiting"] == 0 and m["kv_allocated_bytes"] == 0  # every row freed
    return got, placed


@pytest.mark.parametrize("kind", ["raw", "optimized"])
def test_every_numeric_parameter_fuzzed_beside_six_greedy_requests(exports, kind):
    """Every numeric parameter at 0, subnormals, -0.0, +-huge, nan/inf and strings: each hostile request is
    refused at add_request with an InputError, or runs to an ordinary end (a subnormal temperature is
    greedy, never "error"); the six greedy requests beside them keep their exact greedy output."""
    dec = graphs.load(exports[kind], provider="cpu", threads=1)
    greedy = _greedy(dec)
    hostile = []
    for name, base in FUZZED.items():
        for k, v in enumerate(VALUES):
            h = {"prompt": PROMPTS[k % len(PROMPTS)], "max_new_tokens": 4, **base, name: v}
            if name == "max_length":
                del h["max_new_tokens"]
            hostile.append(h)
    engine = dec.engine(EngineConfig(max_batch=32, max_len=64, prefill_chunk=8))
    got, placed = _run(engine, greedy, [dict(h) for h in hostile])
    ran = {i: got[rid] for i, rid in placed.items() if isinstance(rid, int)}
    assert len(ran) > 40 and len(placed) - len(ran) > 20  # both kinds happened
    for i, o in ran.items():
        assert o["finish"] in ("length", "eos", "deadline"), (hostile[i], o["finish"], o["error"])
    for rid in placed.values():
        if not isinstance(rid, int):
            assert "\n" not in rid and len(rid) < 300, rid  # one line
    # a subnormal temperature is greedy: the same tokens as temperature 0
    tiny = [i for i, h in enumerate(hostile) if h.get("do_sample") and h["temperature"] in TINY]
    assert tiny and all(ran[i]["tokens"] == dec.generate(hostile[i]["prompt"], max_new_tokens=4).token_ids
                        for i in tiny)


class FailingSampler:
    """A request's sampler that raises at its ``at``-th use (0: the prefill's first token)."""

    def __init__(self, real, at: int):
        self.real, self.at, self.calls = real, at, 0
        self.temperature = real.temperature

    def _tick(self):
        self.calls += 1
        if self.calls > self.at:
            raise RuntimeError("injected sampling fault")

    def token(self, logits):
        self._tick()
        return self.real.token(logits)

    def accept(self, tree, tokens, logits):
        self._tick()
        return self.real.accept(tree, tokens, logits)


class FailingDetok:
    """A request's text decoder that raises at its ``at``-th token."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def step(self, tokenizer, token):
        self.calls += 1
        if self.calls > self.at:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected text fault")
        return "x"


class BadStop(str):
    """A stop string whose length cannot be taken: the stop-string check raises."""

    def __len__(self):
        raise ValueError("injected stop-string fault")


@pytest.mark.parametrize("kind", ["raw", "optimized"])
def test_a_failure_of_one_requests_own_work_ends_that_request_only(exports, kind):
    """Sampling that raises (at the prefill's token, in a plain run, in a drafted step; greedy and
    sampled), a text decoder that raises, a stop string that cannot be matched: each such request ends
    with one event, finish_reason "error" and its exception, its row freed; the six greedy requests
    beside them keep their exact greedy output, and the engine serves on."""
    dec = graphs.load(exports[kind], provider="cpu", threads=1)
    greedy = _greedy(dec)
    faulty, expect = [], []
    for at in (0, 1, 3):
        for params in ({"speculation": "off"}, {"speculation": "on"}, {"temperature": 0.7, "seed": at}):
            r = dec.resolve(max_new_tokens=12, **params)
            req = dec.new_request(PROMPTS[at], r, 64)
            req.sampler = FailingSampler(req.sampler, at)
            faulty.append(req)
            expect.append("injected sampling fault")
        req = dec.new_request(PROMPTS[at + 1], dec.resolve(max_new_tokens=12, stop="zz"), 64)
        req.detok = FailingDetok(at)
        faulty.append(req)
        expect.append("injected text fault")
    req = dec.new_request(PROMPTS[2], dec.resolve(max_new_tokens=12, stop="zz"), 64)
    req.params.stop_strings = [BadStop("zz")]
    faulty.append(req)
    expect.append("injected stop-string fault")
    engine = dec.engine(EngineConfig(max_batch=10, max_len=64, prefill_chunk=4))
    got, placed = _run(engine, greedy, faulty)
    for i, want in enumerate(expect):
        o = got[placed[i]]
        assert o["finish"] == "error" and want in str(o["error"]), (i, o)
    # the engine serves on: a greedy request after them is still exact
    again, _ = _run(engine, greedy[:1], [])
    assert len(again) == 1


def test_process_logits_never_returns_nan_for_finite_logits():
    """Any temperature >= 0 (subnormal to the largest float), top_p down to the smallest float, top_k
    from 1 to beyond the vocabulary, logits spanning the whole float range: a distribution (finite,
    non-negative, summing to 1) whose best token is the argmax's. It returned nan for a subnormal
    temperature (logits / 1e-310 = inf) and for logits spanning the float range."""
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(50), np.array([-1.7e308, 1.7e308, 0.0, -np.inf]), np.full(7, 3.0),
            np.array([1e308, -1e308]), np.array([5e-324, 0.0, -5e-324])]
    for x in rows:
        for t in [0.0, -0.0, 5e-324, 1e-310, MIN_TEMPERATURE, 1e-3, 1.0, 1e300, 1.7976931348623157e308]:
            for top_p in (5e-324, 1e-9, 0.5, 1.0):
                for top_k in (0, 1, 2, 10**30):
                    p = process_logits(x, t, top_p, top_k)
                    assert np.isfinite(p).all() and (p >= 0).all() and abs(p.sum() - 1) < 1e-9, (x, t, top_p, top_k)
                    if t <= 1:  # (hotter, the probabilities may round equal: any of them is the best)
                        assert p[np.argmax(x)] == p.max()
