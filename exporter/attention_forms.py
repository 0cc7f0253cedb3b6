"""The two attention forms of a ``--target cuda`` base, and the measurement that chooses between them.

    base.onnx       ONNX ``Attention`` (opset 24) fed the tree mask as a float additive ``attn_mask``
    base.gqa.onnx   ``com.microsoft.GroupQueryAttention`` fed the tree mask as ``attention_bias``

Both add the same mask to the scaled scores, so a non-causal tree, holes in a batch's cache and a
past mean what they meant in the traced graph (the optimize stage checks each against the raw
trace). On CUDA they reach different kernels: GQA with any bias runs its unfused kernel (ONNX
Runtime PR #29525); ONNX ``Attention`` tries flash (which takes no mask), then the memory-efficient
kernel, which takes an additive float mask, then the unfused one (PR #27542). Which is faster for
trees on a given GPU is measured there, never assumed: :func:`measure` times both on the calls both
take, :func:`choose` records the faster in the manifest (``optimization.base.attention_forms``).
Optimizing on a machine without CUDA builds both, records the Attention form as the default and
says how to measure (``python -m exporter.optimize OUT --measure-forms`` on the GPU machine).

The GQA form takes the calls its kernel computes as the tree asks: one token per row of any batch,
or one sequence (batch 1) after a past or a causal prefill. A batch of several trees after a past is
refused by its input check on every provider ("batch_size must be 1 when sequence_length > 1 and
past context is given"), so such calls run the Attention form whatever was chosen.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from exporter.errors import UserError
from graphs import contract as C

FORMS = ("attention", "gqa")
DEFAULT_FORM = "attention"  # takes every call; the GQA form only some (above)
PAST = 256  # the measured calls' context: long enough that the attention, not the call, is timed
TREE_SIZES = (4, 8, 16)
STEP_BATCH = 4  # one token per row of a batch: the other call both forms take
REPEATS = 20
MEASURE_HINT = "python -m exporter.optimize {out} --measure-forms (on the machine with the GPU)"


def forms_record(base: dict, base_file: str, out_hint: str = "OUT") -> dict:
    """The ``attention_forms`` record of a ``--target cuda`` base from its optimization record
    ``base`` (its ``one_sequence`` entry is the GQA form): the candidates, the default choice, and
    how the choice is to be made. Not measured yet."""
    one = base.get("one_sequence")
    fused = "attention" in (base.get("passes") or [])  # --no-fuse: the traced eager attention
    candidates = {"attention": {"file": base_file, "op": "Attention" if fused else "eager (MatMul, Add, Softmax)",
                                "mask": "attn_mask, float additive" if fused else "added to the scores",
                                "calls": "every call"}}
    if one:
        candidates["gqa"] = {"file": one["file"], "op": "com.microsoft.GroupQueryAttention",
                             "mask": "attention_bias, float additive", "calls": one.get("calls", ""),
                             "max_columns": one.get("max_columns")}
    return {"candidates": candidates, "chosen": DEFAULT_FORM, "decided": "default",
            "measure": MEASURE_HINT.format(out=out_hint) if one else "one form only: nothing to choose",
            "measured": None}


def measured_calls(max_columns: int | None) -> list[tuple[str, int, int, int]]:
    """(name, batch, new tokens, past) of the calls both forms take: one token per row at batch 1 and
    :data:`STEP_BATCH`, and a tree of each :data:`TREE_SIZES` size at batch 1, after ``PAST`` tokens
    (fewer where the model's positions end sooner: both forms' rotary tables end there, the GQA
    form's zero rows after them are never read)."""
    from exporter.passes.kv_inplace import TABLE_MARGIN

    positions = None if max_columns is None else int(max_columns) - TABLE_MARGIN
    past = PAST if positions is None else max(1, min(PAST, positions - max(TREE_SIZES) - 1))
    return ([("step_b1", 1, 1, past), (f"step_b{STEP_BATCH}", STEP_BATCH, 1, past)]
            + [(f"tree{t}_b1", 1, t, past) for t in TREE_SIZES])


def _bound_call(session, spec: C.GraphSpec, feed: dict, device: str):
    """A no-argument callable running ``session`` on ``feed`` with every input and output on
    ``device`` (IO binding; each ``present.*`` bound to its ``past_key_values.*`` buffer, as the
    device path binds them), so the timing is the graph's, not host copies'."""
    import onnxruntime as ort

    binding = session.io_binding()
    values = {k: ort.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in feed.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    for t in spec.outputs:
        if t.name.startswith("present."):
            binding.bind_ortvalue_output(t.name, values["past_key_values." + t.name[len("present."):]])
        else:
            binding.bind_output(t.name, device, 0)

    def call():
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()

    return call


def measure(out_dir: Path, record: dict, spec: C.GraphSpec, vocab: int, provider: str = "cuda",
            repeats: int = REPEATS, log=print) -> dict:
    """Median milliseconds of each form's graph (files of ``out_dir``) on each of
    :func:`measured_calls`, on ``provider`` ("cuda" where the choice is meant; "cpu" runs the same code).
    ``spec``: the base's contract (both forms share it). Returns the ``measured`` record."""
    from exporter.passes.parity import Case, random_feed
    from graphs.sessions import make_session

    cands = record["candidates"]
    if "gqa" not in cands:
        raise UserError("this export has one attention form only (no base.gqa.onnx): nothing to measure")
    if not C.kv_in_place(spec):
        raise UserError("the attention forms share the in-place K/V contract; this base concatenates its K/V: "
                        "re-export and optimize without --no-kv-in-place")
    device = "cuda" if provider == "cuda" else "cpu"
    sessions = {form: make_session(Path(out_dir) / cands[form]["file"], provider) for form in FORMS}
    calls = {}
    for name, batch, seq, past in measured_calls(cands["gqa"].get("max_columns")):
        feed = random_feed(spec, Case(name, batch, seq, past, holes_all=True), vocab=vocab)
        feed[C.KV_WRITE] = np.full(batch, past, dtype=np.int64)
        ms = {}
        for form in FORMS:
            run = _bound_call(sessions[form], spec, {k: np.ascontiguousarray(v) for k, v in feed.items()}, device)
            run()  # warm-up: kernel selection, allocations
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t0)
            ms[form] = float(np.median(ts)) * 1e3
        calls[name] = {f"{form}_ms": ms[form] for form in FORMS}
        log(f"  [base] forms     {name:10} Attention {ms['attention']:.3f} ms, GroupQueryAttention "
            f"{ms['gqa']:.3f} ms ({provider})", flush=True)
    return {"provider": provider, "repeats": repeats, "calls": calls}


def choose(record: dict, measured: dict, log=print) -> dict:
    """Record ``measured`` in the forms record and choose the form with the smaller total time over
    the measured calls (each call weighs the same: a step and a tree verify alternate in decoding).
    Returns the record."""
    totals = {form: sum(c[f"{form}_ms"] for c in measured["calls"].values()) for form in FORMS}
    chosen = min(FORMS, key=lambda f: totals[f])
    measured["total_ms"] = totals
    record.update({"chosen": chosen, "decided": "measured", "measured": measured})
    log(f"  [base] forms     chosen: {chosen} ({totals[chosen]:.2f} ms over {len(measured['calls'])} calls vs "
        f"{max(totals.values()):.2f} ms; {measured['provider']})", flush=True)
    return record
