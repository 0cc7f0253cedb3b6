"""Build the small K/V-update graph the runtime uses with IO binding (see graphs.contract)."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from exporter.plan import ONNX_DTYPES
from graphs import contract as C


def value_info(t: C.TensorSpec):
    return helper.make_tensor_value_info(t.name, ONNX_DTYPES[t.dtype], list(t.dims))


def build_kv_update(spec: C.GraphSpec, path: Path, opset: int = 17) -> Path:
    """Write the graph of :func:`graphs.contract.kv_update_graph_spec` to ``path``.

    ::

        new.j (B,kv,S,hd) --GatherElements(axis=2, accept_index expanded to (B,kv,A,hd))--> rows
        cache.j --ScatterElements(axis=2, indices write_start+arange(A) expanded, rows)--> cache_out.j
    """
    n = sum(1 for t in spec.inputs if t.name.startswith("cache."))
    c = lambda name, vals: helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals))
    nodes = [
        c("k0", [0]), c("k1", [1]), c("k2", [2]), c("k3", [3]), c("k4", [4]), c("axes13", [1, 3]),
        c("one", [1]),
        # target shape (B, kv, A, hd)
        helper.make_node("Shape", [C.cache_new(0)], ["new_shape"]),
        helper.make_node("Shape", [C.ACCEPT_INDEX], ["idx_shape"]),
        helper.make_node("Slice", ["new_shape", "k0", "k2"], ["b_kv"]),
        helper.make_node("Slice", ["idx_shape", "k1", "k2"], ["a"]),
        helper.make_node("Slice", ["new_shape", "k3", "k4"], ["hd"]),
        helper.make_node("Concat", ["b_kv", "a", "hd"], ["rows_shape"], axis=0),
        # gather index (B, 1, A, 1) -> (B, kv, A, hd)
        helper.make_node("Unsqueeze", [C.ACCEPT_INDEX, "axes13"], ["idx4"]),
        helper.make_node("Expand", ["idx4", "rows_shape"], ["gather_idx"]),
        # scatter index: write_start + arange(A), as (1, 1, A, 1) -> (B, kv, A, hd)
        helper.make_node("Squeeze", ["a"], ["a_scalar"]),
        helper.make_node("Squeeze", [C.WRITE_START], ["w_scalar"]),
        helper.make_node("Add", ["w_scalar", "a_scalar"], ["w_end"]),
        helper.make_node("Squeeze", ["one"], ["one_scalar"]),
        helper.make_node("Range", ["w_scalar", "w_end", "one_scalar"], ["cols"]),
        helper.make_node("Unsqueeze", ["cols", "k0"], ["cols1"]),
        helper.make_node("Unsqueeze", ["cols1", "k1"], ["cols2"]),
        helper.make_node("Unsqueeze", ["cols2", "k3"], ["cols4"]),
        helper.make_node("Expand", ["cols4", "rows_shape"], ["scatter_idx"]),
    ]
    for j in range(n):
        nodes.append(helper.make_node("GatherElements", [C.cache_new(j), "gather_idx"], [f"rows.{j}"], axis=2,
                                      name=f"/kv_update/{j}/gather"))
        nodes.append(helper.make_node("ScatterElements", [C.cache_in(j), "scatter_idx", f"rows.{j}"],
                                      [C.cache_out(j)], axis=2, name=f"/kv_update/{j}/scatter"))
    graph = helper.make_graph(nodes, "kv_update", [value_info(t) for t in spec.inputs],
                              [value_info(t) for t in spec.outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="specexport")
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
