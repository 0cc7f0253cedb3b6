"""Build the device path's small graphs (graphs.device; their contracts in graphs.contract): the
selection of each node's token, the K/V compaction after a verify, K/V copies, rows brought back."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from exporter.plan import ONNX_DTYPES
from graphs import contract as C


def value_info(t: C.TensorSpec):
    return helper.make_tensor_value_info(t.name, ONNX_DTYPES[t.dtype], list(t.dims))


# ---------------------------------------------------------------- the device path's graphs (graphs.device)

DEVICE_OPSET = 24  # TensorScatter (the compaction's in-place write, as the base's own)


def _save(nodes, name: str, spec: C.GraphSpec, path: Path, opset: int) -> Path:
    graph = helper.make_graph(nodes, name, [value_info(t) for t in spec.inputs],
                              [value_info(t) for t in spec.outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="specexport")
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _const(name: str, vals: list):
    value = helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals)
    return helper.make_node("Constant", [], [name], value=value)


def build_select(spec: C.GraphSpec, path: Path) -> Path:
    """:func:`graphs.contract.select_graph_spec`: ArgMax over the vocabulary (the first of equal
    logits), and whether a node's logits hold a nan or +inf (numpy's argmax would pick it): their sum
    in float32 is nan or +inf exactly then (-inf alone, a masked token, sums to -inf; a sum of finite
    logits cannot reach the float32 range). One pass over the logits besides the ArgMax."""
    x = C.LOGITS
    nodes = [_const("axes", [-1]),
             helper.make_node("ArgMax", [x], [C.ARGMAX], axis=-1, keepdims=0, select_last_index=0)]
    if spec.input(C.LOGITS).dtype != "float32":
        nodes.append(helper.make_node("Cast", [x], ["x32"], to=TensorProto.FLOAT))
        x = "x32"
    nodes += [
        helper.make_node("ReduceSum", [x, "axes"], ["total"], keepdims=0),
        helper.make_node("IsNaN", ["total"], ["nan"]),
        helper.make_node("IsInf", ["total"], ["inf"], detect_negative=0),
        helper.make_node("Or", ["nan", "inf"], [C.NONFINITE]),
    ]
    return _save(nodes, "device_select", spec, path, DEVICE_OPSET)


def build_kv_compact(spec: C.GraphSpec, path: Path) -> Path:
    """:func:`graphs.contract.kv_compact_graph_spec`: per buffer, the kept columns gathered
    (GatherElements on the column axis), then written at each row's own column (TensorScatter)."""
    n = sum(1 for t in spec.inputs if t.name.startswith("cache."))
    rank = len(spec.input(C.cache_in(0)).dims)
    axis = rank - 2  # the column axis: (B, cap, D) or (B, kv, cap, hd)
    nodes = [helper.make_node("Shape", [C.cache_in(0)], ["cshape"]),
             helper.make_node("Shape", [C.SRC_COLUMNS], ["ishape"])]
    if rank == 3:  # index (B, A) -> (B, A, 1) -> (B, A, D)
        nodes += [_const("ax", [2]), _const("s2", [2]), _const("s3", [3]),
                  helper.make_node("Unsqueeze", [C.SRC_COLUMNS, "ax"], ["idx"]),
                  helper.make_node("Slice", ["cshape", "s2", "s3"], ["d"]),
                  helper.make_node("Concat", ["ishape", "d"], ["tshape"], axis=0)]
    else:  # (B, A) -> (B, 1, A, 1) -> (B, kv, A, hd)
        nodes += [_const("ax", [1, 3]), _const("s0", [0]), _const("s1", [1]), _const("s2", [2]),
                  _const("s3", [3]), _const("s4", [4]),
                  helper.make_node("Unsqueeze", [C.SRC_COLUMNS, "ax"], ["idx"]),
                  helper.make_node("Slice", ["cshape", "s0", "s2"], ["bk"]),
                  helper.make_node("Slice", ["ishape", "s1", "s2"], ["a"]),
                  helper.make_node("Slice", ["cshape", "s3", "s4"], ["hd"]),
                  helper.make_node("Concat", ["bk", "a", "hd"], ["tshape"], axis=0)]
    nodes.append(helper.make_node("Expand", ["idx", "tshape"], ["gidx"]))
    for j in range(n):
        nodes.append(helper.make_node("GatherElements", [C.cache_in(j), "gidx"], [f"kept.{j}"], axis=axis))
        nodes.append(helper.make_node("TensorScatter", [C.cache_in(j), f"kept.{j}", C.KV_WRITE], [C.cache_out(j)],
                                      axis=axis))
    return _save(nodes, "device_kv_compact", spec, path, DEVICE_OPSET)


def build_kv_copy(spec: C.GraphSpec, path: Path) -> Path:
    """:func:`graphs.contract.kv_copy_graph_spec`: one Pad (zeros) per buffer."""
    n = sum(1 for t in spec.inputs if t.name.startswith("cache."))
    nodes = [helper.make_node("Pad", [C.cache_in(j), C.PADS], [C.cache_out(j)], mode="constant") for j in range(n)]
    return _save(nodes, "device_kv_copy", spec, path, DEVICE_OPSET)


def build_rows(spec: C.GraphSpec, path: Path) -> Path:
    """:func:`graphs.contract.rows_graph_spec`: one Gather of rows."""
    nodes = [helper.make_node("Gather", [C.ROWS_IN, C.ROW_INDEX], [C.ROWS_OUT], axis=0)]
    return _save(nodes, "device_rows", spec, path, DEVICE_OPSET)


def build_sample(spec: C.GraphSpec, path: Path) -> Path:
    """:func:`graphs.contract.sample_graph_spec`: graphs.sampling.process_logits in float32, then each
    node's probabilities of the tree's tokens and draws by inverse CDF."""
    mk = helper.make_node
    f32 = TensorProto.FLOAT
    neg = helper.make_tensor("neg", f32, [], [float("-inf")])
    nodes = [
        _const("last", [-1]), _const("s0", [0]), _const("s2", [2]), _const("s3", [3]), _const("col", [-1, 1, 1]),
        _const("one", [1]),
        _const("ax1", [1]), _const("ax2", [2]),
        mk("Constant", [], ["neg"], value=neg),
        mk("Constant", [], ["zero"], value=helper.make_tensor("zero", f32, [], [0.0])),
        mk("Constant", [], ["onef"], value=helper.make_tensor("onef", f32, [], [1.0])),
        mk("Cast", [C.LOGITS], ["x32"], to=f32),
        mk("ReduceMax", ["x32", "last"], ["top"], keepdims=1),
        mk("Sub", ["x32", "top"], ["xs"]),
        mk("Reshape", [C.TEMPERATURE, "col"], ["t3"]),
        mk("Div", ["xs", "t3"], ["x"]),  # (B, S, V) in [-inf, 0]
        mk("Shape", ["x"], ["xshape"]),
        mk("Slice", ["xshape", "s2", "s3"], ["vocab"]),
        mk("TopK", ["x", "vocab"], ["sorted", "order"], axis=-1, largest=1, sorted=1),
        # top-k: the k-th largest logit per row (ties at it kept)
        mk("Sub", [C.TOP_K, "one"], ["k0"]),
        mk("Reshape", ["k0", "col"], ["k3"]),
        mk("Slice", ["xshape", "s0", "s2"], ["bs"]),
        mk("Concat", ["bs", "one"], ["bs1"], axis=0),
        mk("Expand", ["k3", "bs1"], ["kidx"]),
        mk("GatherElements", ["sorted", "kidx"], ["kth"], axis=-1),
        mk("GreaterOrEqual", ["x", "kth"], ["keep_k"]),
        mk("Where", ["keep_k", "x", "neg"], ["xk"]),
        mk("Softmax", ["xk"], ["probs"], axis=-1),
        # top-p by rank (TopK puts the lower index first among equals: numpy's stable argsort)
        mk("GreaterOrEqual", ["sorted", "kth"], ["keep_sk"]),
        mk("Where", ["keep_sk", "sorted", "neg"], ["sk"]),
        mk("Softmax", ["sk"], ["sp"], axis=-1),
        mk("CumSum", ["sp", "last"], ["above"], exclusive=1),
        mk("Reshape", [C.TOP_P, "col"], ["p3"]),
        mk("Less", ["above", "p3"], ["keep_sorted"]),
        mk("GreaterOrEqual", ["p3", "onef"], ["no_top_p"]),  # top_p 1: no cut (rounding must not cut the tail)
        mk("Or", ["keep_sorted", "no_top_p"], ["keep_s"]),
        mk("ConstantOfShape", ["xshape"], ["none"], value=helper.make_tensor("f", TensorProto.BOOL, [1], [False])),
        mk("ScatterElements", ["none", "order", "keep_s"], ["keep"], axis=-1),
        mk("Where", ["keep", "probs", "zero"], ["p2"]),
        mk("ReduceSum", ["p2", "last"], ["mass"], keepdims=1),
        mk("Div", ["p2", "mass"], ["p"]),
        # each node's probabilities of every node's token: [b, n, m] = p[b, n, node_tokens[b, m]]
        mk("Unsqueeze", [C.NODE_TOKENS, "ax1"], ["tok3"]),
        mk("Shape", [C.NODE_TOKENS], ["tshape"]),
        mk("Gather", ["tshape", "ax1"], ["s1"], axis=0),
        mk("Concat", ["tshape", "s1"], ["bss"], axis=0),
        mk("Expand", ["tok3", "bss"], ["tidx"]),
        mk("GatherElements", ["p", "tidx"], [C.NODE_PROBS], axis=-1),
        # draws: the first index whose cumulative mass exceeds u * total (numpy's searchsorted, right)
        mk("CumSum", ["p", "last"], ["cdf"]),
        mk("Slice", ["cdf", "last", "vocab", "last"], ["total"]),
        mk("Mul", [C.UNIFORMS, "total"], ["target"]),  # (B, S, R)
        mk("Unsqueeze", ["cdf", "ax2"], ["cdf4"]),  # (B, S, 1, V)
        mk("Unsqueeze", ["target", "last"], ["target4"]),  # (B, S, R, 1)
        mk("LessOrEqual", ["cdf4", "target4"], ["below"]),
        mk("Cast", ["below"], ["below_i"], to=TensorProto.INT32),
        mk("ReduceSum", ["below_i", "last"], ["count"], keepdims=0),
        mk("Cast", ["count"], [C.DRAWS], to=TensorProto.INT64),
    ]
    return _save(nodes, "device_sample", spec, path, DEVICE_OPSET)


BUILDERS = {C.SELECT_ROLE: build_select, C.COMPACT_ROLE: build_kv_compact, C.COPY_ROLE: build_kv_copy,
            C.ROWS_ROLE: build_rows, C.SAMPLE_ROLE: build_sample, C.DRAFT_COPY_ROLE: build_kv_copy}


def build_device_graphs(base: C.GraphSpec, out: Path, draft: C.GraphSpec | None = None) -> dict[str, C.GraphSpec]:
    """Write the device path's graphs for ``base`` (K/V in place) into ``out``; returns their specs by
    role. ``draft``: the EAGLE / DFlash drafter's graph; where it writes its K/V in place, a copy graph
    for its buffers too (device.draft_kv_copy: growth, a row moved)."""
    specs = C.device_graph_specs(base, draft)
    for role, spec in specs.items():
        BUILDERS[role](spec, out / spec.file)
    return specs
