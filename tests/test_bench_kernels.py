"""samples/bench_kernels.py (the docs' kernel table): every kernel built and timed at every row count,
and the row-consistency column tells the row-consistent forms from the per-tensor one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `samples` is not an installed package
from samples import bench_kernels

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "bench_kernels.py"

KERNELS = {"fp32", "int4-l0", "int4-l4", "int8-l4", "int8-tensor", "int8-row"}


def test_the_kernel_benchmark_reports_every_kernel_at_every_row_count(tmp_path):
    """Every kernel timed at every row count; the per-row int8 form is row-consistent."""
    # its own process: the sample makes sessions with their own threads, which a process-wide ORT pool
    # (set by CLIs that other tests run in this process) forbids
    out = tmp_path / "k.json"
    r = subprocess.run([sys.executable, str(SAMPLE), "--k", "64", "--n", "128", "--layers", "2", "--rows", "1,3",
                        "--rounds", "1", "--threads", "1", "--json", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["kernels"]) == KERNELS and report["rows"] == [1, 3]
    for name, k in report["kernels"].items():
        assert set(k["ms"]) == {"1", "3"} and all(v > 0 for v in k["ms"].values()), name
        assert k["relative_to_one_row"]["1"] == 1.0
    # exact int32 sums per row: a row's result never depends on the call's other rows
    assert report["kernels"]["int8-row"]["row_consistency_max_abs"] == 0.0
    assert "int8-row" in r.stdout


def test_per_row_int8_is_close_to_the_float_matmul():
    """The hand-built per-row form computes the matmul (within int8 rounding), not just something
    consistent."""
    import onnx
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    base = bench_kernels._chain(64, 128, 1, rng)
    w = onnx.numpy_helper.to_array(next(t for t in base.graph.initializer if t.name == "w0"))
    q = bench_kernels._per_row_int8(base)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    from graphs.sessions import default_session_options  # the process-wide ORT pool, where a CLI set one

    sess = ort.InferenceSession(q.SerializeToString(), default_session_options(1), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x})
    ref = (x @ w)[:, :64]
    assert np.abs(y - ref).max() < 0.02 * np.abs(ref).max()


def test_per_row_int8_cannot_saturate_without_vnni():
    """x86 without VNNI sums adjacent u8 x s8 products in int16 with saturation: the per-row form's
    weights stay within 7 bits so that no pair of products can reach it, on any machine (8-bit
    weights failed the closeness test above on an AVX2-only CI machine, 13% off)."""
    import onnx

    q = bench_kernels._per_row_int8(bench_kernels._chain(64, 128, 2, np.random.default_rng(0)))
    weights = [onnx.numpy_helper.to_array(t) for t in q.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert len(weights) == 2
    for w in weights:
        assert np.abs(w.astype(np.int32)).max() == bench_kernels.W_MAX == 63
        assert np.iinfo(np.int16).max >= 2 * 255 * bench_kernels.W_MAX


def test_bad_input_is_one_line(capsys):
    for argv in (["--rows", "a"], ["--rows", "1,,2"], ["--rows", "3,1"], ["--rows", "2,4"], ["--rounds", "0"],
                 ["--k", "0"], ["--layers", "0"], ["--k", "256", "--n", "128"]):
        assert bench_kernels.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
