"""Shared test helpers: a chi-square p-value without scipy, and a torch-threads context."""

from __future__ import annotations

import contextlib
import math


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_pre = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1:  # series for P, Q = 1 - P
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_pre))
    # continued fraction for Q (modified Lentz)
    tiny = 1e-300
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return math.exp(log_pre) * h


@contextlib.contextmanager
def torch_threads(n: int):
    """Few threads: the 2-core CI machines are shared, and oversubscribed OpenMP crawls."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_export_main(capsys, *args) -> tuple[int, str]:
    """``python -m exporter.export args`` in process: (exit code, stderr)."""
    import exporter.export as ex

    try:
        rc = ex.main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def one_line(rc: int, err: str, *fragments: str) -> str:
    """Assert a user error: exit 2, one ``error:`` line holding every fragment, no traceback."""
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for f in fragments:
        assert f in lines[0], f"{f!r} not in {lines[0]!r}"
    return lines[0]


def assert_greedy_within_bound(dec, prompt: list[int], ar: list[int], spec: list[int], bound: float) -> None:
    """Greedy speculative tokens ``spec`` against autoregressive ``ar`` from the same graphs, under the
    contract for graphs whose rows are not bit-identical across call shapes: equal, or diverging first
    where the autoregressive step's top-2 logit margin is within twice ``bound`` (the graph's recorded
    row consistency bounds each logit, so the difference of two moves by up to twice it) -- a near-tie
    the kernels' rounding may resolve either way. Anything else fails."""
    import numpy as np

    from graphs.slots import SlotCache

    n = min(len(ar), len(spec))
    first = next((i for i in range(n) if ar[i] != spec[i]), None)
    if first is None:
        assert len(ar) == len(spec) or not (ar[n:] or spec[n:]), "one output stopped early with no divergence"
        return
    seq = list(prompt) + list(ar[:first])
    src = dec.manifest.source
    s = len(seq)
    kv = SlotCache(src["num_layers"], 1, src["num_kv_heads"], src["head_dim"], dec.dtype, s, layout=dec.kv_layout)
    kv.add_row()
    logits = dec.base_forward(kv, np.array([seq]), np.arange(s)[None], np.tril(np.ones((1, s, s), dtype=bool)))
    last = np.sort(logits["logits"][0, -1].astype(np.float64))
    margin = float(last[-1] - last[-2])
    assert margin <= 2 * bound, (f"speculative diverges from autoregressive at token {first} where the top-2 "
                                 f"margin {margin:.3g} exceeds twice the graph's row bound {bound:.3g}")
