"""What a verify of M tree rows costs against one row, per matmul kernel ONNX Runtime offers on this CPU,
and whether each gives a row the same result whatever the call's row count (the lossless contract).

    python samples/bench_kernels.py [--k 512] [--n 1536] [--layers 12] [--rows 1,2,3,4,6,8,16]
        [--threads 2] [--rounds 7] [--blocks 32,64,128] [--force-fp32] [--json F]

A chain of ``--layers`` matmuls (K x N weights, the 19M model's MLP shape by default; ``--k 2048 --n
5632`` is TinyLlama-1.1B's) run bare under ONNX Runtime, one graph per kernel:

- ``fp32``: MatMul (MLAS SGEMM);
- ``int4-l0`` / ``int4-l4``: MatMulNBits, 4-bit blocks of 32 (``exporter.passes.quantize``: ORT's
  MatMulNBitsQuantizer, as ``exporter.optimize --quantize int4`` writes them) at accuracy level 0
  (float compute) and 4 (int8 compute: activations quantized per row and block; the default, and
  onnxruntime-genai's);
- ``int8-l4``: MatMulNBits with 8-bit blocks at level 4 (``--quantize int8``);
- ``int8-tensor``: DynamicQuantizeMatMul (ORT's quantize_dynamic): activations quantized with one scale
  for the whole call, so a row's result depends on the other rows (not row-consistent: shown, never
  written by optimize);
- ``int8-row``: activations quantized per row by hand (Abs, ReduceMax, scale, round, uint8), integer
  MatMulInteger, rescaled per row and column: row-consistent by construction (exact int32 sums). No
  library writes this form (quantize_dynamic quantizes per tensor), hence the hand-built graph.
- with ``--blocks``, ``int4-l0-bB`` / ``int4-l4-bB`` for each other block size B (``--block-size``);
  with ``--force-fp32``, ``int4-l4-fp32``: the int4-l4 graph run with the session option
  ``mlas.qnbit.force_fp32`` (MLAS computes it in float32, as level 0).

Row consistency is reported twice: a row alone against the same row inside a call of M rows (the
autoregressive step against a verify: MLAS has separate M == 1 kernels), and calls of 2+ rows against
the largest (verifies of different sizes against each other).

Every round runs each kernel at each row count, kernels interleaved (the same machine state for all);
the median over rounds is reported, with each cost relative to one row and, per kernel, the largest
difference between a row computed alone and inside a call of M rows. A speculative step pays off when
tau(T) * t(1) / t(T) > 1: this says how much room each kernel leaves for it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # exporter, from a checkout


def _chain(k: int, n: int, layers: int, rng):
    """x (M, k) -> [MatMul (k, n) -> first k columns] x layers: the chain keeps each call's input k wide."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, x = [], [], "x"
    consts = {"s0": [0], "sk": [k], "ax": [1]}
    inits += [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in consts.items()]
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"y{i}"]),
                  helper.make_node("Slice", [f"y{i}", "s0", "sk", "ax"], [f"x{i}"])]
        x = f"x{i}"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", k])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


W_MAX = 63  # the per-row form's weight range: 7 bits (see _per_row_int8)


def _per_row_int8(proto):
    """Each MatMul of ``proto`` as per-row dynamic int8: scale_r = max|x_r| / 127, q = round(x / scale_r)
    + 128 (uint8), MatMulInteger against 7-bit weights in [-63, 63] (per-column scales), * scale_r * scale_c.

    7 bits, not 8 (onnxruntime's ``reduce_range``): on x86 without VNNI, MLAS's u8 x s8 kernel sums
    adjacent products in int16 with saturation (vpmaddubsw), and 255 * 127 * 2 overflows it; 255 * 63 * 2
    does not. With full-range weights a CI machine with AVX2 alone got errors of 13% of the output's
    range (0.0748 of 0.572, exactly what the saturating sum computes) where VNNI machines got 0.8%."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    extra = [numpy_helper.from_array(np.array(v, dt), name) for name, v, dt in
             (("q/inv127", 1 / 127, np.float32), ("q/tiny", 1e-30, np.float32), ("q/128", 128, np.float32),
              ("q/zp", 128, np.uint8), ("q/last", [-1], np.int64))]
    nodes = []
    for node in g.node:
        if node.op_type != "MatMul":
            nodes.append(node)
            continue
        x, w_name = node.input
        w = numpy_helper.to_array(inits.pop(w_name))
        col = np.maximum(np.abs(w).max(0) / W_MAX, 1e-30).astype(np.float32)
        extra += [numpy_helper.from_array(np.round(w / col).astype(np.int8), w_name),
                  numpy_helper.from_array(col, w_name + "/scale")]
        p = node.output[0] + "/"
        nodes += [helper.make_node("Abs", [x], [p + "abs"]),
                  helper.make_node("ReduceMax", [p + "abs", "q/last"], [p + "max"], keepdims=1),
                  helper.make_node("Mul", [p + "max", "q/inv127"], [p + "s0"]),
                  helper.make_node("Max", [p + "s0", "q/tiny"], [p + "s"]),
                  helper.make_node("Div", [x, p + "s"], [p + "d"]),
                  helper.make_node("Round", [p + "d"], [p + "r"]),
                  helper.make_node("Add", [p + "r", "q/128"], [p + "u"]),
                  helper.make_node("Cast", [p + "u"], [p + "q"], to=TensorProto.UINT8),
                  helper.make_node("MatMulInteger", [p + "q", w_name, "q/zp"], [p + "i"]),
                  helper.make_node("Cast", [p + "i"], [p + "f"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", [p + "f", p + "s"], [p + "fr"]),
                  helper.make_node("Mul", [p + "fr", w_name + "/scale"], [node.output[0]])]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(list(inits.values()) + extra)
    onnx.checker.check_model(proto)
    return proto


FORCE_FP32 = {"mlas.qnbit.force_fp32": "1"}  # the session option that makes MLAS compute level 4 in float32


def build(k: int, n: int, layers: int, work: Path, log=print, blocks=(32,), force_fp32: bool = False
          ) -> dict[str, Path]:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from exporter.passes.quantize import quantize_weights  # what `exporter.optimize --quantize` runs

    base = _chain(k, n, layers, np.random.default_rng(0))
    paths = {"fp32": work / "fp32.onnx"}
    onnx.save(base, paths["fp32"])
    for name, bits, level in (("int4-l0", 4, 0), ("int4-l4", 4, 4), ("int8-l4", 8, 4)):
        paths[name] = work / f"{name}.onnx"
        onnx.save(quantize_weights(onnx.load(paths["fp32"]), bits, 32, level)[0], paths[name])
    if force_fp32:
        paths["int4-l4-fp32"] = paths["int4-l4"]  # the same graph; measure() adds FORCE_FP32 to its session
    for block in (b for b in blocks if b != 32):
        for level in (0, 4):
            name = f"int4-l{level}-b{block}"
            paths[name] = work / f"{name}.onnx"
            onnx.save(quantize_weights(onnx.load(paths["fp32"]), 4, block, level)[0], paths[name])
    paths["int8-tensor"] = work / "int8-tensor.onnx"
    # reduce_range: 7-bit weights, for the same saturation as the per-row form's (see _per_row_int8)
    quantize_dynamic(str(paths["fp32"]), str(paths["int8-tensor"]), weight_type=QuantType.QInt8, reduce_range=True)
    paths["int8-row"] = work / "int8-row.onnx"
    onnx.save(_per_row_int8(onnx.load(paths["fp32"])), paths["int8-row"])
    log(f"built {len(paths)} graphs: {layers} x MatMul ({k} x {n}) each")
    return paths


def measure(paths: dict[str, Path], k: int, rows: list[int], threads: int, rounds: int, calls: int = 30,
            log=print) -> dict:
    import onnxruntime as ort

    def session(name, p):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        for key, value in (FORCE_FP32 if name.endswith("-fp32") else {}).items():
            so.add_session_config_entry(key, value)
        return ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])

    sessions = {name: session(name, p) for name, p in paths.items()}
    x = np.random.default_rng(1).standard_normal((max(rows), k)).astype(np.float32)
    consistency, multi = {}, {}
    for name, s in sessions.items():  # row r alone vs inside a call of M rows, every M; and M rows vs the most
        alone = np.concatenate([s.run(None, {"x": x[r:r + 1]})[0] for r in range(max(rows))])
        most = s.run(None, {"x": x[: max(rows)]})[0]
        consistency[name] = max(float(np.abs(s.run(None, {"x": x[:m]})[0] - alone[:m]).max()) for m in rows)
        multi[name] = max([float(np.abs(s.run(None, {"x": x[:m]})[0] - most[:m]).max()) for m in rows if m > 1]
                          or [0.0])
    times = {name: {m: [] for m in rows} for name in sessions}
    for rnd in range(rounds):
        for m in rows:
            for name, s in sessions.items():
                feed = {"x": x[:m]}
                for _ in range(3):
                    s.run(None, feed)
                t = time.perf_counter()
                for _ in range(calls):
                    s.run(None, feed)
                times[name][m].append((time.perf_counter() - t) / calls * 1e3)
        log(f"round {rnd + 1}/{rounds}", flush=True)
    out = {}
    for name in sessions:
        ms = {m: statistics.median(v) for m, v in times[name].items()}
        out[name] = {"ms": ms, "relative_to_one_row": {m: ms[m] / ms[rows[0]] for m in rows},
                     "row_consistency_max_abs": consistency[name], "multi_row_consistency_max_abs": multi[name]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=512, help="input features of each matmul (default: 512)")
    ap.add_argument("--n", type=int, default=1536, help="output features of each matmul (default: 1536)")
    ap.add_argument("--layers", type=int, default=12, help="matmuls in the chain (default: 12)")
    ap.add_argument("--rows", default="1,2,3,4,6,8,16", help="row counts M of a call (the first is the base)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--blocks", default="32", help="int4 block sizes to add at levels 0 and 4 (default: 32 only)")
    ap.add_argument("--force-fp32", action="store_true",
                    help="add int4-l4 run with the session option mlas.qnbit.force_fp32")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows = []
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        blocks = []
    problem = next((msg for bad, msg in (
        (not rows or rows[0] != 1 or rows != sorted(set(rows)),
         f"--rows {args.rows!r} must be increasing row counts from 1, e.g. 1,2,4,8"),
        (min(args.k, args.n, args.layers, args.rounds, args.threads) < 1,
         "--k, --n, --layers, --rounds and --threads must each be >= 1"),
        (args.k > args.n, f"--k {args.k} must be <= --n {args.n} (the chain keeps each call's first k columns)"),
        (not blocks or any(b < 16 or b & (b - 1) for b in blocks),
         f"--blocks {args.blocks!r} must be powers of two >= 16, e.g. 32,64,128"),
    ) if bad), None)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-kernels.") as work:
        paths = build(args.k, args.n, args.layers, Path(work), blocks=blocks, force_fp32=args.force_fp32)
        res = measure(paths, args.k, rows, args.threads, args.rounds)
    print(f"ms per call of {args.layers} x ({args.k} x {args.n}), relative to {rows[0]} row(s); row consistency")
    print(f"{'kernel':14s} " + " ".join(f"{m:>12d}" for m in rows) + "   max |alone - in a call|  2+ rows")
    for name, r in res.items():
        cells = " ".join(f"{r['ms'][m]:6.3f} {r['relative_to_one_row'][m]:4.2f}x" for m in rows)
        print(f"{name:14s} {cells}   {r['row_consistency_max_abs']:.1e}  {r['multi_row_consistency_max_abs']:.1e}")
    if args.json:
        report = {"schema": "specexport.bench_kernels/1", "k": args.k, "n": args.n, "layers": args.layers,
                  "rows": rows, "threads": args.threads, "rounds": args.rounds, "kernels": res}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
