"""The optimize stage's gates decide on hand-set inputs near their boundaries (exporter.passes.parity,
exporter.optimizing.check_parity): a rewrite off by just over the tolerance is refused, one just
under (or exactly at it) passes, and what the report records is what was measured or configured.

The graphs are built here with onnx.helper (no torch, no export): logits are a lookup in an
initializer ``W`` (so perturbing ``W`` by ``d`` puts an error of exactly ``d`` on the logits), the
K/V presents lookups in ``K``/``V``, and an optional ``row_eps`` adds ``row_eps * (S - 1)`` to every
logit, so a token computed in a call of S rows differs from the same token in a call of S' rows by
``row_eps * |S - S'|``; ``row_single`` adds its value only to calls of one row (MLAS's M == 1 kernel):
what the rows check measures.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from exporter.compare_report import TOLERANCES
from exporter.errors import UserError
from exporter.optimizing import OptimizeOptions, check_parity, parity_tolerance
from exporter.passes import parity
from exporter.passes.parity import CASES, ROW_SIZES, TREE_CASES, Case, graph_parity, random_feed, row_consistency
from graphs import contract as C

V = 4  # vocabulary (random_feed draws ids below `vocab`, passed as V: every row of W is looked up)
W0 = np.array([[0.5, -0.25, 0.0, 0.125], [-0.5, 0.25, 0.125, 0.0], [0.25, 0.5, 0.0, -0.125],
               [0.0, 0.125, -0.5, 0.25]], dtype=np.float32)  # max |logit| 0.5 on every row
K0 = np.array([[0.5, 0.25], [-0.25, 0.5], [0.125, -0.5], [0.0, 0.5]], dtype=np.float32)


def _spec(file: str, topk: bool = False) -> C.GraphSpec:
    f = "float32"
    inputs = (C.TensorSpec(C.INPUT_IDS, "int64", (C.BATCH, C.SEQ)),
              C.TensorSpec(C.POSITION_IDS, "int64", (C.BATCH, C.SEQ)),
              C.TensorSpec(C.ATTENTION_MASK, "bool", (C.BATCH, 1, C.SEQ, C.TOTAL)),
              C.TensorSpec(C.past_key(0), f, (C.BATCH, 1, C.PAST, 2)),
              C.TensorSpec(C.past_value(0), f, (C.BATCH, 1, C.PAST, 2)))
    outputs = [C.TensorSpec(C.LOGITS, f, (C.BATCH, C.SEQ, V))]
    if topk:
        outputs.append(C.TensorSpec(C.TOPK_IDS, "int64", (C.BATCH, C.SEQ, 2)))
    outputs += [C.TensorSpec(C.present_key(0), f, (C.BATCH, 1, C.SEQ, 2)),
                C.TensorSpec(C.present_value(0), f, (C.BATCH, 1, C.SEQ, 2))]
    return C.GraphSpec(file, inputs, tuple(outputs))


ROW_VEC = np.array([1.0, 0.5, 0.25, 0.0], np.float32)  # the row effect differs across the vocabulary
ROW_SCALE = np.array([0.25, 1.0, 0.5, 0.5], np.float32)  # ... and by the token computed


def _row_token(seed: int, past: int = 20) -> int:
    """The first token of the chain the rows check calls (row ``past`` of its seeded random ids)."""
    return int(np.random.default_rng(seed).integers(0, V, past + 4)[past])


def _row_effect(eps: float, seed: int = 7) -> float:
    return 3 * eps * float(ROW_SCALE[_row_token(seed)])


def _graph(path: Path, w=W0, k=K0, row_eps: float = 0.0, topk: bool = False, proj=None, row_single: float = 0.0
           ) -> Path:
    """The lookup graph, plus one masked attention over the past and the new rows (keys K[ids],
    values -K[ids]) whose context goes through ``proj`` (2, V) into the logits: zero by default (the
    logits stay exact lookups), but the attention still runs, so a past, mask or position of the
    wrong shape fails the call as it would in a real graph."""
    spec = _spec(path.name, topk)
    dt = {"int64": TensorProto.INT64, "bool": TensorProto.BOOL, "float32": TensorProto.FLOAT}
    vi = [helper.make_tensor_value_info(t.name, dt[t.dtype], list(t.dims)) for t in spec.inputs]
    vo = [helper.make_tensor_value_info(t.name, dt[t.dtype], list(t.dims)) for t in spec.outputs]
    inits = [numpy_helper.from_array(np.asarray(w, np.float32), "W"),
             numpy_helper.from_array(np.asarray(k, np.float32), "K"),
             numpy_helper.from_array(np.array(row_eps, np.float32), "row_eps"),
             numpy_helper.from_array(np.array(row_single, np.float32), "row_single"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(1, np.int64), "idx1"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array([2], np.int64), "k2"),
             numpy_helper.from_array(ROW_VEC, "row_vec"),
             numpy_helper.from_array(ROW_SCALE, "row_scale"),
             numpy_helper.from_array(np.array([-1], np.int64), "axis_last"),
             numpy_helper.from_array(np.zeros((2, V), np.float32) if proj is None else np.asarray(proj, np.float32),
                                     "proj"),
             numpy_helper.from_array(np.array(-1e9, np.float32), "neg"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    nodes = [helper.make_node("Gather", ["W", C.INPUT_IDS], ["looked"]),
             helper.make_node("Shape", [C.INPUT_IDS], ["shape"]),
             helper.make_node("Gather", ["shape", "idx1"], ["s"]),
             helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
             helper.make_node("Sub", ["sf", "one"], ["sm1"]),
             helper.make_node("Mul", ["sm1", "row_eps"], ["shift_lin"]),
             helper.make_node("Equal", ["sf", "one"], ["is_one"]),
             helper.make_node("Cast", ["is_one"], ["is_one_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["is_one_f", "row_single"], ["shift_one"]),
             helper.make_node("Add", ["shift_lin", "shift_one"], ["shift0"]),
             helper.make_node("Mul", ["shift0", "row_vec"], ["shift1"]),
             helper.make_node("Gather", ["row_scale", C.INPUT_IDS], ["scale0"]),
             helper.make_node("Unsqueeze", ["scale0", "axis_last"], ["scale"]),
             helper.make_node("Mul", ["shift1", "scale"], ["shift"]),
             helper.make_node("Gather", ["K", C.INPUT_IDS], ["kk"]),
             helper.make_node("Unsqueeze", ["kk", "axis1"], [C.present_key(0)]),
             helper.make_node("Neg", [C.present_key(0)], [C.present_value(0)]),
             # attention: (B, 1, S, 2) x (B, 1, 2, P + S) -> masked softmax -> x (B, 1, P + S, 2)
             helper.make_node("Concat", [C.past_key(0), C.present_key(0)], ["keys"], axis=2),
             helper.make_node("Concat", [C.past_value(0), C.present_value(0)], ["vals"], axis=2),
             helper.make_node("Transpose", ["keys"], ["keys_t"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", [C.present_key(0), "keys_t"], ["scores"]),
             helper.make_node("Where", [C.ATTENTION_MASK, "scores", "neg"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["attn"], axis=-1),
             helper.make_node("MatMul", ["attn", "vals"], ["ctx4"]),
             helper.make_node("Squeeze", ["ctx4", "axis1"], ["ctx"]),
             helper.make_node("MatMul", ["ctx", "proj"], ["ctx_logits"]),
             # positions enter as 0 x position (B, S, 1): a position array of the wrong length fails the call
             helper.make_node("Cast", [C.POSITION_IDS], ["posf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["posf", "axis_last"], ["pos3"]),
             helper.make_node("Mul", ["pos3", "zero"], ["pos0"]),
             helper.make_node("Add", ["looked", "pos0"], ["looked_p"]),
             helper.make_node("Add", ["looked_p", "shift"], ["base_logits"]),
             helper.make_node("Add", ["base_logits", "ctx_logits"], [C.LOGITS])]
    if topk:
        nodes.append(helper.make_node("TopK", [C.LOGITS, "k2"], ["topv", C.TOPK_IDS], axis=-1))
    g = helper.make_graph(nodes, "tiny", vi, vo, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _perturbed(col: int, d: float, table=W0) -> np.ndarray:
    w = table.copy()
    w[:, col] += np.float32(d)
    return w


# ----------------------------------------------------------------------------- graph_parity: the tolerance

ATOL = RTOL = 2.0**-10  # dyadic: atol + rtol * 0.5 is exact, so "at the limit" is exactly at it
LIMIT = ATOL + RTOL * 0.5


@pytest.mark.parametrize(("factor", "ok"), [(0.99, True), (1.0, True), (1.01, False)])
@pytest.mark.parametrize("table", ["W", "K"])
def test_graph_parity_refuses_just_over_the_tolerance(tmp_path, factor, ok, table):
    """Every output is gated (logits and the K/V presents), in every case (batch 2 and batch 1):
    an error of limit * 0.99 or exactly the limit passes, limit * 1.01 is refused; the row records
    the error measured and the limit it was held to."""
    raw = _graph(tmp_path / "raw.onnx")
    d = LIMIT * factor
    new = (_graph(tmp_path / "new.onnx", w=_perturbed(3, d)) if table == "W"
           else _graph(tmp_path / "new.onnx", k=_perturbed(1, d, K0)))
    spec = _spec("raw.onnx")
    rows = graph_parity(raw, new, spec, spec, ATOL, RTOL, vocab=V)
    assert [(r.case, r.output) for r in rows] == [(c.name, o) for c in CASES for o in spec.output_names]
    hit = C.LOGITS if table == "W" else C.present_key(0)
    for r in rows:
        # the value output is -K: perturbed with the key
        hit_here = r.output == hit or (r.output == C.present_value(0) and table == "K")
        assert r.ok is (ok or not hit_here), r
        assert r.max_abs == pytest.approx(d if hit_here else 0.0, rel=1e-5, abs=1e-12)
        assert r.limit == ATOL + RTOL * 0.5  # max |raw| is 0.5 for every output and case
    assert any(r.case == CASES[0].name and CASES[0].batch > 1 for r in rows)


def test_graph_parity_not_strict_gates_only_finiteness(tmp_path):
    """strict=False (a quantized rewrite): a large error passes but is reported; a NaN or an inf fails."""
    raw = _graph(tmp_path / "raw.onnx")
    spec = _spec("raw.onnx")
    big = graph_parity(raw, _graph(tmp_path / "big.onnx", w=_perturbed(3, 0.25)), spec, spec, ATOL, RTOL, vocab=V,
                       strict=False)
    assert all(r.ok for r in big) and max(r.max_abs for r in big) == pytest.approx(0.25)
    strict = graph_parity(raw, _graph(tmp_path / "big.onnx", w=_perturbed(3, 0.25)), spec, spec, ATOL, RTOL, vocab=V)
    assert not all(r.ok for r in strict)
    for bad in (np.nan, np.inf):
        rows = graph_parity(raw, _graph(tmp_path / "bad.onnx", w=_perturbed(3, bad)), spec, spec, ATOL, RTOL,
                            vocab=V, strict=False)
        assert {r.output for r in rows if not r.ok} == {C.LOGITS}


def _expected_top1(case_index: int, flipped_ids: set[int]) -> float:
    ids = random_feed(_spec("x"), CASES[case_index], seed=case_index, vocab=V)[C.INPUT_IDS]
    return float(np.mean([i not in flipped_ids for i in ids.ravel()]))


def test_graph_parity_records_the_top1_agreement_and_topk_agreement_measured(tmp_path):
    """Row 0 of W gets its argmax moved (0 -> 1): top-1 agreement is the fraction of positions whose
    token is not 0, per case; topk_ids compare by agreement only (never failing the row)."""
    raw = _graph(tmp_path / "raw.onnx", topk=True)
    w = W0.copy()
    w[0, 1] = 0.75  # row 0 was [.5, -.25, 0, .125]: argmax 0 -> 1, top-2 {0, 3} -> {1, 0}
    new = _graph(tmp_path / "new.onnx", w=w, topk=True)
    spec = _spec("raw.onnx", topk=True)
    rows = graph_parity(raw, new, spec, spec, 1.0, 0.0, vocab=V)  # a loose tolerance: only agreement changes
    for i, case in enumerate(CASES):
        lg = next(r for r in rows if r.case == case.name and r.output == C.LOGITS)
        assert lg.top1 == pytest.approx(_expected_top1(i, {0}))
        tk = next(r for r in rows if r.case == case.name and r.output == C.TOPK_IDS)
        ids = random_feed(spec, case, seed=i, vocab=V)[C.INPUT_IDS].ravel()
        # top-2 ids of row 0 change from (0, 3) to (1, 0): both slots differ
        assert tk.ok and tk.max_abs == 0.0 and tk.limit == 0.0 and tk.top1 == pytest.approx(float(np.mean(ids != 0)))
        assert all(r.top1 is None for r in rows if r.output.startswith("present."))
    assert any(r.top1 < 1.0 for r in rows if r.output == C.LOGITS)


# ----------------------------------------------------------------------------- row consistency


def _chain(seed: int, past: int = 20) -> np.ndarray:
    """The chain of tokens row_consistency calls after its past (its seeded random ids)."""
    t = max(ROW_SIZES)
    return np.random.default_rng(seed).integers(0, V, past + t)[past:]


def _expected_rows(eps: float, single: float, seed: int = 7) -> tuple[float, float]:
    """(single, multi) for the synthetic graph: row j of an M-row call carries eps * (M - 1) (+ single
    when M == 1) times scale[token j]; the reference is the largest call."""
    t, chain = max(ROW_SIZES), _chain(seed)
    sc = ROW_SCALE[chain]
    one = abs(single - eps * (t - 1)) * sc[0]
    multi = max(eps * (t - m) * float(sc[:m].max()) for m in ROW_SIZES if m > 1)
    return float(one), float(multi)


@pytest.mark.parametrize(("eps", "single"), [(0.0, 0.0), (2.0**-12, 0.0), (0.0, 2.0**-8), (2.0**-10, 2.0**-8)])
def test_row_consistency_measures_the_row_effect(tmp_path, eps, single):
    """Calls of 1, 2, 3, 4, 6, 8, 12, 16 rows over the same past, row j against row j of the
    16-row call: the measured bounds are exactly the synthetic effect, for several seeds."""
    path = _graph(tmp_path / "g.onnx", row_eps=eps, row_single=single)
    for seed in (7, 0, 5):
        got = row_consistency(path, _spec("g.onnx"), V, seed=seed)
        want = _expected_rows(eps, single, seed)
        assert got["sizes"] == list(ROW_SIZES)
        assert got["single"] == pytest.approx(want[0], rel=1e-5, abs=1e-9)
        assert got["multi"] == pytest.approx(want[1], rel=1e-5, abs=1e-9)


def test_row_consistency_over_a_past_the_graph_computed(tmp_path):
    """With the attention's context in the logits, every call sees the same prefilled past: no row
    effect, nothing measured."""
    proj = np.array([[1.0, -0.5, 0.25, 2.0], [0.5, 1.0, -1.0, 0.0]])
    got = row_consistency(_graph(tmp_path / "g.onnx", proj=proj), _spec("g.onnx"), V)
    assert got["single"] < 1e-6 and got["multi"] < 1e-6


# ----------------------------------------------------------------------------- the stage's own gate


def _stage(tmp_path, new_w=W0, row_eps=0.0, role="base", row_single=0.0):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    # the row effect on both sides: parity itself passes
    _graph(out / f"{role}.onnx", row_eps=row_eps, row_single=row_single)
    _graph(tmp / f"{role}.onnx", w=new_w, row_eps=row_eps, row_single=row_single)
    spec = _spec(f"{role}.onnx")
    manifest = SimpleNamespace(graphs={role: spec}, source={"vocab_size": V})
    return out, tmp, manifest, {role: spec}


def _check(tmp_path, opts=None, **kw):
    lines = []
    report = check_parity(*_stage(tmp_path, **kw), opts or OptimizeOptions(), lines.append)
    return report, lines


def test_the_tolerance_is_compares_for_the_rewritten_dtype():
    for opts, key in ((OptimizeOptions(), ("float32", "cpu")), (OptimizeOptions(target="cuda"), ("float16", "cpu")),
                      (OptimizeOptions(float16=True), ("float16", "cpu"))):
        assert parity_tolerance(opts) == (TOLERANCES[key].atol, TOLERANCES[key].rtol)
    assert TOLERANCES[("float32", "cpu")].atol != TOLERANCES[("float16", "cpu")].atol  # the test can tell them apart


@pytest.mark.parametrize(("factor", "ok"), [(0.99, True), (1.01, False)])
def test_check_parity_refuses_a_rewrite_just_over_the_tolerance(tmp_path, factor, ok):
    """Through the stage's entry point with its own (float32, CPU) tolerance: a rewritten base whose
    weights are off by 0.99 x the limit is accepted and recorded as measured; 1.01 x is refused."""
    tol = TOLERANCES[("float32", "cpu")]
    limit = tol.atol + tol.rtol * 0.5
    d = limit * factor
    if not ok:
        with pytest.raises(UserError, match=r"optimized base graph disagrees with the raw one: logits in case "
                                            rf"{CASES[0].name}"):
            _check(tmp_path, new_w=_perturbed(3, d))
        return
    report, lines = _check(tmp_path, new_w=_perturbed(3, d))
    assert report["atol"] == tol.atol and report["rtol"] == tol.rtol and report["strict"] is True
    base = report["graphs"]["base"]
    assert base["ok"] is True and base["max_abs_logits"] == pytest.approx(d, rel=1e-3)
    assert base["min_top1"] == 1.0
    assert all(r["limit"] == pytest.approx(limit) for r in base["rows"])
    assert report["rows"]["single_max_abs"] == 0.0 and report["rows"]["multi_max_abs"] == 0.0
    assert any("ok" in x and "parity" in x for x in lines)


def test_check_parity_quantized_reports_and_does_not_gate(tmp_path):
    """A quantized base is another model: its error is recorded, not gated."""
    report, _ = _check(tmp_path, opts=OptimizeOptions(quantize="int4"), new_w=_perturbed(3, 0.25))
    assert report["strict"] is False and report["graphs"]["base"]["ok"] is True
    assert report["graphs"]["base"]["max_abs_logits"] == pytest.approx(0.25)
    assert OptimizeOptions(quantize_draft="int8").quant_for("draft") == "int8"
    assert _check(tmp_path, opts=OptimizeOptions(quantize_draft="int8"))[0]["strict"] is False


@pytest.mark.parametrize(("factor", "refused"), [(0.99, False), (1.0, False), (1.01, True)])
def test_check_parity_refuses_calls_of_several_rows_that_disagree(tmp_path, monkeypatch, factor, refused):
    """The several-row bound is the float32 atol, through the stage's entry point: just under and at it
    accepted and recorded as measured, just over refused (with the fix named)."""
    bound = TOLERANCES[("float32", "cpu")].atol
    monkeypatch.setattr(parity, "row_consistency", lambda *a, **k: {"single": 0.0, "multi": bound * factor,
                                                                    "sizes": list(ROW_SIZES)})
    if refused:
        with pytest.raises(UserError, match="calls of different sizes"):
            _check(tmp_path)
        return
    report, lines = _check(tmp_path)
    assert report["rows"]["multi_max_abs"] == bound * factor and report["rows"]["limit"] == bound
    assert report["rows"]["min_rows"] == 1 and any("rows" in x for x in lines)


@pytest.mark.parametrize(("single", "min_rows"), [(0.0, 1), (0.98e-4, 1), (1.02e-4, 2), (1.0, 2)])
def test_a_one_row_call_alone_off_sets_min_rows(tmp_path, single, min_rows):
    """Only one-row calls round otherwise (the synthetic graph's row_single): never refused, the
    runtime told to pad (min_rows 2) exactly when the single-row bound exceeds the limit."""
    report, lines = _check(tmp_path, row_single=single)
    assert report["rows"]["single_max_abs"] == pytest.approx(single * max(ROW_SCALE[_chain(s)[0]] for s in range(8)),
                                                             rel=2e-3, abs=1e-9)  # float32 logits near .5
    assert report["rows"]["multi_max_abs"] == 0.0 and report["rows"]["min_rows"] == min_rows
    assert any("two rows" in x for x in lines) is (min_rows == 2)


@pytest.mark.parametrize(("factor", "min_rows"), [(0.99, 1), (1.0, 1), (1.01, 2)])
def test_min_rows_at_the_single_row_bound(tmp_path, monkeypatch, factor, min_rows):
    """The one-row bound is the float32 atol exactly: at it no padding, just over it two rows."""
    bound = TOLERANCES[("float32", "cpu")].atol
    monkeypatch.setattr(parity, "row_consistency", lambda *a, **k: {"single": bound * factor, "multi": 0.0,
                                                                    "sizes": list(ROW_SIZES)})
    report, lines = _check(tmp_path)
    assert report["rows"]["min_rows"] == min_rows and report["rows"]["single_max_abs"] == bound * factor
    assert report["rows"]["sizes"] == list(ROW_SIZES)
    assert any("2/3/4/6/8/12/16 rows" in x for x in lines)  # the call sizes it measured, as logged


def test_the_stage_records_the_worst_seed_of_both_bounds(tmp_path):
    """A row effect small enough to pass: both recorded bounds are the worst of the eight seeds' (the
    seeds' chains start with tokens of different scales, so best and worst differ)."""
    eps = 2.0**-20
    report, _ = _check(tmp_path, row_eps=eps)
    want = [_expected_rows(eps, 0.0, seed) for seed in range(8)]
    assert len({w[1] for w in want}) > 1  # the seeds differ: min and max over them tell apart
    assert report["rows"]["single_max_abs"] == pytest.approx(max(w[0] for w in want), rel=1e-3)
    assert report["rows"]["multi_max_abs"] == pytest.approx(max(w[1] for w in want), rel=1e-3)


def test_the_synthetic_row_effect_is_refused_through_the_stage(tmp_path):
    """A real (linear in S) row effect: every call size disagrees, refused; at level 4 the message names
    --accuracy-level 0; a draft graph is never held to it (next test)."""
    with pytest.raises(UserError, match="calls of different sizes"):
        _check(tmp_path, row_eps=1e-3)
    with pytest.raises(UserError, match="--accuracy-level 0"):
        _check(tmp_path, opts=OptimizeOptions(quantize="int4"), row_eps=1e-3)
    with pytest.raises(UserError, match="--no-fuse"):  # float32 compute already: the fix is not the level
        _check(tmp_path, opts=OptimizeOptions(quantize="int4", accuracy_level=0), row_eps=1e-3)
    with pytest.raises(UserError, match="--no-fuse"):
        _check(tmp_path, row_eps=1e-3)


def test_a_draft_graph_is_gated_without_the_row_check(tmp_path):
    """The row-consistency check is the base's (it decides what is emitted); a draft graph is held to
    the tolerance only."""
    report, _ = _check(tmp_path, role="draft", row_eps=1e-2)
    assert "rows" not in report and report["graphs"]["draft"]["ok"] is True
    tol = TOLERANCES[("float32", "cpu")]
    with pytest.raises(UserError, match="optimized draft graph disagrees"):
        _check(tmp_path, role="draft", new_w=_perturbed(3, (tol.atol + tol.rtol * 0.5) * 1.01))


# ----------------------------------------------------------------------------- tree_parity (scripted runs)


def _tree_rows(monkeypatch, want, got, strict=True, strict_kv=None, atol=ATOL, rtol=RTOL):
    case = Case("scripted", 2, 4, 5)
    monkeypatch.setattr(parity, "_paired_runs", lambda *a, **k: iter([(case, want, got)]))
    spec = SimpleNamespace(output_names=list(want))
    return {r.output: r for r in parity.tree_parity(Path("raw"), Path("new"), spec, spec, atol, rtol, vocab=V,
                                                    strict=strict, strict_kv=strict_kv)}


def _tree_out(scores_delta=0.0, kv_delta=0.0, tokens=(5, 6, 7, 8)):
    scores = np.array([[0.0, -0.5, -0.25, -np.inf], [0.0, -0.125, -0.5, -0.25]])
    return {C.TREE_TOKENS: np.array([tokens, (1, 2, 3, 4)]), C.TREE_PARENTS: np.array([[-1, 0, 0, 1]] * 2),
            C.TREE_DEPTH: np.array([[0, 1, 1, 2]] * 2), C.TREE_MASK: np.ones((2, 4, 4), bool),
            C.TREE_SCORES: scores + np.where(np.isfinite(scores), scores_delta, 0.0) * (np.arange(4) == 1),
            C.present_key(0): np.full((2, 1, 4, 2), 0.5) + kv_delta * (np.arange(2) == 1)}  # one column off


@pytest.mark.parametrize(("factor", "ok"), [(0.99, True), (1.0, True), (1.01, False)])
def test_tree_parity_scores_and_kv_at_the_tolerance(monkeypatch, factor, ok):
    want = _tree_out()
    rows = _tree_rows(monkeypatch, want, _tree_out(scores_delta=LIMIT * factor, kv_delta=LIMIT * factor))
    for name in (C.TREE_SCORES, C.present_key(0)):
        assert rows[name].ok is ok and rows[name].limit == LIMIT
        assert rows[name].max_abs == pytest.approx(LIMIT * factor)
    assert all(rows[n].ok and rows[n].max_abs == 0.0 and rows[n].limit == 0.0 for n in parity._TREE_EXACT)
    assert rows[C.TREE_TOKENS].top1 == 1.0 and rows[C.TREE_PARENTS].top1 is None


def test_tree_parity_another_tree_fails_strict_only(monkeypatch):
    want, got = _tree_out(), _tree_out(tokens=(5, 6, 7, 9))  # one of 8 tree tokens differs
    rows = _tree_rows(monkeypatch, want, got)
    assert not rows[C.TREE_TOKENS].ok and rows[C.TREE_TOKENS].top1 == pytest.approx(7 / 8)
    assert rows[C.TREE_TOKENS].max_abs == 1.0 and rows[C.TREE_SCORES].ok
    loose = _tree_rows(monkeypatch, want, got, strict=False, strict_kv=True)
    assert loose[C.TREE_TOKENS].ok and loose[C.TREE_TOKENS].top1 == pytest.approx(7 / 8)


def test_tree_parity_kv_gate_follows_strict_kv(monkeypatch):
    """float16 drafter: the tree and its scores are reported, the context K/V still gated."""
    want, got = _tree_out(), _tree_out(scores_delta=0.25, kv_delta=0.25)
    rows = _tree_rows(monkeypatch, want, got, strict=False, strict_kv=True)
    assert rows[C.TREE_SCORES].ok and not rows[C.present_key(0)].ok
    rows = _tree_rows(monkeypatch, want, got, strict=False, strict_kv=False)
    assert rows[C.TREE_SCORES].ok and rows[C.present_key(0)].ok
    rows = _tree_rows(monkeypatch, want, got, strict=True)  # strict_kv defaults to strict
    assert not rows[C.TREE_SCORES].ok and not rows[C.present_key(0)].ok


def test_tree_parity_infinities_must_agree_and_nans_fail(monkeypatch):
    want = _tree_out()
    got = _tree_out()
    got[C.TREE_SCORES] = got[C.TREE_SCORES].copy()
    got[C.TREE_SCORES][0, 3] = -1.0  # raw underflowed to -inf there, the rewrite did not
    rows = _tree_rows(monkeypatch, want, got, strict=True)
    assert rows[C.TREE_SCORES].max_abs == np.inf and not rows[C.TREE_SCORES].ok
    assert _tree_rows(monkeypatch, want, got, strict=False)[C.TREE_SCORES].ok  # not strict: reported only
    got = _tree_out()
    got[C.TREE_SCORES] = got[C.TREE_SCORES].copy()
    got[C.TREE_SCORES][1, 1] = np.nan
    assert not _tree_rows(monkeypatch, want, got, strict=False)[C.TREE_SCORES].ok  # a NaN fails, strict or not
    assert _tree_rows(monkeypatch, want, _tree_out())[C.TREE_SCORES].max_abs == 0.0  # -inf on both sides agree
    gone = _tree_out()
    gone[C.TREE_SCORES] = np.full((2, 4), -np.inf)  # every score underflowed, on both sides: nothing differs
    row = _tree_rows(monkeypatch, gone, {**gone})[C.TREE_SCORES]
    assert (row.max_abs, row.limit, row.ok) == (0.0, ATOL, True)


def test_tree_cases_cover_batch_one_and_two():
    assert {c.batch for c in TREE_CASES} == {1, 2} and {c.batch for c in CASES} == {1, 2}


def test_graph_parity_empty_outputs_pass_with_the_atol(monkeypatch):
    """An output with no elements (a zero-length dimension) has no error, the limit is atol alone,
    no top-1 for logits and full agreement for topk_ids."""
    case = Case("empty", 1, 0, 3)
    want = {C.LOGITS: np.zeros((1, 0, V), np.float32), C.TOPK_IDS: np.zeros((1, 0, 2), np.int64)}
    monkeypatch.setattr(parity, "_paired_runs", lambda *a, **k: iter([(case, want, dict(want))]))
    spec = SimpleNamespace(outputs=[SimpleNamespace(name=n) for n in want])
    rows = {r.output: r for r in graph_parity(Path("raw"), Path("new"), spec, spec, ATOL, RTOL, vocab=V)}
    assert (rows[C.LOGITS].max_abs, rows[C.LOGITS].limit, rows[C.LOGITS].top1, rows[C.LOGITS].ok) == (0.0, ATOL, None,
                                                                                                      True)
    assert (rows[C.TOPK_IDS].max_abs, rows[C.TOPK_IDS].limit, rows[C.TOPK_IDS].top1) == (0.0, 0.0, 1.0)


def test_tree_parity_empty_outputs_agree(monkeypatch):
    want = {C.TREE_TOKENS: np.zeros((1, 0), np.int64), C.TREE_SCORES: np.zeros((1, 0))}
    rows = _tree_rows(monkeypatch, want, dict(want))
    assert (rows[C.TREE_TOKENS].top1, rows[C.TREE_TOKENS].ok, rows[C.TREE_TOKENS].max_abs) == (1.0, True, 0.0)
    assert (rows[C.TREE_SCORES].max_abs, rows[C.TREE_SCORES].limit, rows[C.TREE_SCORES].ok) == (0.0, ATOL, True)


# ----------------------------------------------------------------------------- the stage's tree-graph gate


def _tree_stage(monkeypatch, rows, opts, raises=None):
    """check_parity over one draft_tree.* role whose tree_parity returns ``rows`` (or raises)."""
    seen = {}

    def fake(raw, new, spec, new_spec, atol, rtol, vocab, strict, strict_kv=None, threads=1):
        seen.update(atol=atol, rtol=rtol, strict=strict, strict_kv=strict_kv, vocab=vocab)
        if raises:
            raise raises
        return rows

    monkeypatch.setattr(parity, "tree_parity", fake)
    role = C.TREE_ROLE_PREFIX + "2-2-4"
    spec = SimpleNamespace(file="t.onnx")
    manifest = SimpleNamespace(graphs={role: spec}, source={"vocab_size": V})
    lines = []
    report = check_parity(Path("out"), Path("tmp"), manifest, {role: spec}, opts, lines.append)
    return report["graphs"][role], seen, lines


def _trow(output, max_abs=0.0, top1=None, ok=True, case="c"):
    return parity.ParityRow(case, output, max_abs, 1e-4, top1, ok)


TREE_ROWS = [_trow(C.TREE_TOKENS, top1=1.0), _trow(C.TREE_TOKENS, top1=0.75, case="d"),
             _trow(C.TREE_SCORES, max_abs=2e-5), _trow(C.TREE_SCORES, max_abs=5e-5, case="d")]


@pytest.mark.parametrize(("opts", "strict", "strict_kv"), [
    (OptimizeOptions(), True, True), (OptimizeOptions(target="cuda"), False, True),
    (OptimizeOptions(quantize="int4"), False, False), (OptimizeOptions(quantize_draft="int8"), False, False)])
def test_tree_gate_strictness_follows_the_rewrite(monkeypatch, opts, strict, strict_kv):
    rec, seen, _ = _tree_stage(monkeypatch, TREE_ROWS, opts)
    assert (seen["strict"], seen["strict_kv"]) == (strict, strict_kv)
    assert (seen["atol"], seen["rtol"]) == parity_tolerance(opts) and seen["vocab"] == V
    assert rec["tree_tokens_equal"] == 0.75 and rec["max_abs_scores"] == 5e-5 and rec["ok"] is True
    assert len(rec["rows"]) == len(TREE_ROWS)


def test_tree_gate_refuses_a_failing_row(monkeypatch):
    rows = [*TREE_ROWS, _trow(C.present_key(0), max_abs=3e-4, ok=False, case="kv")]
    with pytest.raises(UserError, match=r"drafts another tree than the raw one: present.0.key in case kv"):
        _tree_stage(monkeypatch, rows, OptimizeOptions())


def test_tree_gate_float16_without_cpu_kernels_is_left_to_the_gpu(monkeypatch):
    rec, _, lines = _tree_stage(monkeypatch, None, OptimizeOptions(target="cuda"),
                                raises=RuntimeError("NOT_IMPLEMENTED : no kernel"))
    assert "skipped" in rec and any("skipped" in x for x in lines)
    with pytest.raises(UserError, match="does not run on ONNX Runtime's CPU EP"):
        _tree_stage(monkeypatch, None, OptimizeOptions(), raises=RuntimeError("NOT_IMPLEMENTED : no kernel"))
    with pytest.raises(UserError, match="does not run on ONNX Runtime's CPU EP"):
        _tree_stage(monkeypatch, None, OptimizeOptions(target="cuda"), raises=RuntimeError("segfault-ish"))


def test_base_gate_float16_without_cpu_kernels_is_left_to_the_gpu(tmp_path, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("NOT_IMPLEMENTED : no float16 kernel")

    monkeypatch.setattr(parity, "graph_parity", fail)
    report, _ = _check(tmp_path, opts=OptimizeOptions(target="cuda"))
    assert "skipped" in report["graphs"]["base"] and "rows" not in report
    with pytest.raises(UserError):
        _check(tmp_path, opts=OptimizeOptions())


def test_check_parity_records_the_worst_case(tmp_path):
    """The report's max |logits| error is the worst case's and its top-1 agreement the lowest case's
    (a quantized rewrite: recorded, not gated). Row 0 of W gets argmax 1 (error 1 where id 0 is
    looked up), row 1 a small error (.125): cases see different ids, so their numbers differ."""
    w = W0.copy()
    w[0, 1] = 0.75  # row 0 [.5, -.25, ...] -> [.5, .75, ...]: error 1, argmax 0 -> 1
    w[1, 3] = 0.125  # row 1: error .125, argmax unchanged
    report, _ = _check(tmp_path, opts=OptimizeOptions(quantize="int4"), new_w=w)
    base = report["graphs"]["base"]
    per_case_top1 = [_expected_top1(i, {0}) for i in range(len(CASES))]
    per_case_err = []
    for i, case in enumerate(CASES):
        ids = set(random_feed(_spec("x"), case, seed=i, vocab=V)[C.INPUT_IDS].ravel().tolist())
        per_case_err.append(max([1.0 if 0 in ids else 0.0, 0.125 if 1 in ids else 0.0]))
    assert len(set(per_case_top1)) > 1 and len(set(per_case_err)) > 1  # the cases differ: the test can fail
    assert base["min_top1"] == pytest.approx(min(per_case_top1))
    assert base["max_abs_logits"] == pytest.approx(max(per_case_err))


def test_the_row_check_measures_eight_seeds(tmp_path, monkeypatch):
    seeds = []
    real = parity.row_consistency

    def spy(*a, seed=7, **k):
        seeds.append(seed)
        return real(*a, seed=seed, **k)

    monkeypatch.setattr(parity, "row_consistency", spy)
    _check(tmp_path)
    assert seeds == list(range(8))
