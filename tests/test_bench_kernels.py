"""samples/bench_kernels.py (the docs' kernel table): every kernel built and timed at every row count,
and the row-consistency column tells the row-consistent forms from the per-tensor one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `samples` is not an installed package
from samples import bench_kernels

KERNELS = {"fp32", "int4-l0", "int4-l4", "int8-l4", "int8-tensor", "int8-row"}


def test_the_kernel_benchmark_reports_every_kernel_at_every_row_count(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert bench_kernels.main(["--k", "64", "--n", "128", "--layers", "2", "--rows", "1,3", "--rounds", "1",
                               "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["kernels"]) == KERNELS and report["rows"] == [1, 3]
    for name, r in report["kernels"].items():
        assert set(r["ms"]) == {"1", "3"} and all(v > 0 for v in r["ms"].values()), name
        assert r["relative_to_one_row"]["1"] == 1.0
    # exact int32 sums per row: a row's result never depends on the call's other rows
    assert report["kernels"]["int8-row"]["row_consistency_max_abs"] == 0.0
    assert "int8-row" in capsys.readouterr().out


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
    (y,) = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    ref = (x @ w)[:, :64]
    assert np.abs(y - ref).max() < 0.02 * np.abs(ref).max()


def test_bad_input_is_one_line(capsys):
    for argv in (["--rows", "a"], ["--rows", "1,,2"], ["--rows", "3,1"], ["--rows", "2,4"], ["--rounds", "0"],
                 ["--k", "0"], ["--layers", "0"], ["--k", "256", "--n", "128"]):
        assert bench_kernels.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
