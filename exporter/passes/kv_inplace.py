"""Past + new K/V concatenated inside every attention -> the new rows written into the past buffer.

The traced base graph appends each layer's new K/V to the past inside the graph::

    past_key_values.i.key (B, kv, P, hd) ─┐
    present.i.key         (B, kv, S, hd) ─ Concat(axis=2) ─▶ (B, kv, P+S, hd) ─▶ attention

so every call copies the whole cache once per layer and tensor, a cost that grows with the context.
This pass (on the base and on the EAGLE drafter's graphs) turns the past input into the caller's buffer
and writes the S new rows into it::

    past_key_values.i.key (B, kv, P, hd) ─┐                                   P: the buffer's columns
    new rows              (B, kv, S, hd) ─ TensorScatter(axis=2) ─▶ present.i.key (B, kv, P, hd) ─▶ attention
    kv_write_index        (B,)           ─┘   row b's rows at columns [kv_write_index[b], +S)

ONNX Runtime's CPU kernel writes in place when the output is bound to the input's memory (IO
binding; :mod:`graphs.slots` does it), so only the S new rows move. The attention mask then spans the
buffer's P columns (the new rows at each row's own write position), which the attention (fused or
eager) consumes as before: a mask over key columns. The graph contract of the result is
:func:`graphs.contract.inplace_base_spec`.

Hand-written: no library rewrite targets ``TensorScatter`` (ONNX opset 24, built for exactly this
cache update); onnxruntime-genai's in-place cache is ``GroupQueryAttention``'s shared buffer, whose
CPU kernel refuses a batch of more than one sequence when more than one token is new
("batch_size must be 1 when sequence_length > 1 and past context is given"), i.e. a batched tree.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper, version_converter

from graphs import contract as C

SCATTER_OPSET = 24  # the first ONNX opset with TensorScatter


def write_in_place(proto: onnx.ModelProto, num_layers: int, q_heads: int, kv_heads: int, head_dim: int,
                   base_dir=None, max_positions: int | None = None, compact: bool = True,
                   layout: str = "bhsd") -> tuple[onnx.ModelProto, str]:
    """Rewrite the graph ``proto`` (every layer's K and V); returns (the new model, its K/V layout).

    Layout ``"bsh"`` where every layer is the fused attention this project's passes write (the
    compact form below); else, or with ``compact=False`` (the EAGLE drafter's graphs, whose one-call
    tree graph also reads the past in its unrolled tree levels), ``"bhsd"``: only the concatenations
    replaced. Raises ValueError when a layer's past is not concatenated with its new rows as traced."""
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    if opset == SCATTER_OPSET - 1:
        # 23 -> 24 only widens type lists (and gives Attention an optional input): the same graph.
        # onnx's converter would stop at the com.microsoft norms the fusion wrote.
        next(o for o in proto.opset_import if o.domain in ("", "ai.onnx")).version = SCATTER_OPSET
    elif opset < SCATTER_OPSET:
        proto = version_converter.convert_version(proto, SCATTER_OPSET)
    if compact:
        small = onnx.ModelProto()
        small.CopyFrom(proto)
        try:
            _compact(small, num_layers, q_heads, kv_heads, head_dim, base_dir, layout)
            if max_positions:
                _rotary_tables(small, int(max_positions), base_dir)
            return small, layout
        except _NoMatchError:
            pass
    _scatter_4d(proto, num_layers)
    return proto, "bhsd"


class _NoMatchError(Exception):
    pass


def _scatter_4d(proto: onnx.ModelProto, num_layers: int) -> None:
    """Each Concat(past, new) -> TensorScatter(past, new, kv_write_index), the (B, kv, P, hd) layout kept."""
    g = proto.graph
    pasts = {C.past_key(i): C.present_key(i) for i in range(num_layers)}
    pasts |= {C.past_value(i): C.present_value(i) for i in range(num_layers)}
    found = {}
    for k, node in enumerate(g.node):
        if node.op_type == "Concat" and len(node.input) == 2 and node.input[0] in pasts \
                and node.input[1] == pasts[node.input[0]]:
            axis = next((a.i for a in node.attribute if a.name == "axis"), None)
            if axis not in (2, -2):
                raise ValueError(f"{node.input[0]} is concatenated on axis {axis}, not the sequence axis")
            found[node.input[0]] = k
    missing = sorted(set(pasts) - set(found))
    if missing:
        raise ValueError(f"{len(missing)} past K/V inputs are not concatenated with their new rows as traced "
                         f"(first: {missing[0]})")
    rename = {}  # every use of a Concat's output reads the scattered buffer instead
    for past, k in found.items():
        node = g.node[k]
        present = pasts[past]
        new = "kv_new." + present[len("present."):]  # the S new rows, now internal
        rename[node.output[0]] = present
        for other in g.node:  # the producer of the new rows and its readers
            other.output[:] = [new if x == present else x for x in other.output]
            other.input[:] = [new if x == present else x for x in other.input]
        scatter = helper.make_node("TensorScatter", [past, new, C.KV_WRITE], [present], axis=2,
                                   name=f"kv_write/{present}")
        g.node[k].CopyFrom(scatter)
    for node in g.node:
        node.input[:] = [rename.get(x, x) for x in node.input]
        # a longer concatenation that starts with the same pair (the one-call EAGLE tree graph's tree
        # levels, Concat(past, new, level rows) after onnxscript's optimizer) reads the buffer too
        if node.op_type == "Concat" and len(node.input) > 2 and node.input[0] in pasts \
                and node.input[1] == "kv_new." + pasts[node.input[0]][len("present."):]:
            node.input[:] = [pasts[node.input[0]], *node.input[2:]]
    g.input.append(helper.make_tensor_value_info(C.KV_WRITE, TensorProto.INT64, [C.BATCH]))
    for t in g.input:
        if t.name == C.ATTENTION_MASK:
            t.type.tensor_type.shape.dim[3].dim_param = C.PAST
    for t in g.output:
        if t.name.startswith("present."):
            t.type.tensor_type.shape.dim[2].dim_param = C.PAST
    del g.value_info[:]  # shapes inferred on the old layout (P+S) no longer hold


def _compact(proto: onnx.ModelProto, num_layers: int, nq: int, nkv: int, hd: int, base_dir=None,
             layout: str = "bhsd") -> None:
    """The fused attention block of every layer without the traced shape plumbing::

        q ─ Reshape ─ Transpose ─ RotaryEmbedding ─────────────────────────────┐
        k ─ Reshape ─ Transpose ─ RotaryEmbedding ─ Concat(past, ·) ──────────  Attention ─ Transpose ─ Reshape ─▶
        v ─ Reshape ─ Transpose ─────────────────── Concat(past, ·) ──────────┘

    (each Reshape's target computed from the input's shape at run time) becomes, ``layout="bhsd"``
    (K/V buffers (B, kv, P, hd))::

        qkv ─ Reshape(0, 0, nq + 2 nkv, hd) ─ Transpose ─ Split ─ q ─ RotaryEmbedding ────────────────┐
                                                               ─ k ─ RotaryEmbedding ─ TensorScatter(2) ─ Attention ─▶
                                                               ─ v ───────────────────── TensorScatter(2) ┘
        ─▶ Transpose ─ Reshape(0, 0, nq * hd) ─▶ (the output projection)

    (one MatMul for q, k and v where they are unbiased; else each its own constant Reshape and
    Transpose), or ``layout="bsh"`` (K/V buffers (B, P, kv * hd), genai's compact 3-D form)::

        q ─ RotaryEmbedding(num_heads) ──────────────────────────────────┐
        k ─ RotaryEmbedding(num_heads) ─ TensorScatter(past, ·, axis=1) ─  Attention(q_num_heads, kv_num_heads) ─▶
        v ──────────────────────────────── TensorScatter(past, ·, axis=1) ┘

    with each layer's cos/sin halves sliced once for all layers. The same arithmetic (the 3-D ONNX
    ops split heads as the Reshapes did); what the shape plumbing computed becomes dead and is
    removed. ``bsh`` has 4 nodes a layer fewer, but ONNX Attention's CPU kernel then reads each head's
    K/V with a stride of kv * hd: measured 1.5x slower per cached token than ``bhsd`` on a 2-core AVX2
    machine with the cache out of L2 (docs/benchmarks.md). Raises _NoMatchError on anything else (a
    q/k norm between the Reshape and the Transpose, partial rotary, ...): the caller keeps the traced
    4-D layout."""
    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {t.name: t for t in g.initializer}
    consts = {n.output[0]: n for n in g.node if n.op_type == "Constant"}

    def const(name):
        from onnx import numpy_helper

        if name in inits:
            return numpy_helper.to_array(inits[name]).reshape(-1).tolist()
        if name in consts:
            return numpy_helper.to_array(consts[name].attribute[0].t).reshape(-1).tolist()
        return None

    op, attrs = functools.partial(_produced, producer), _attrs

    def heads_of(reshape, heads):
        shape = const(reshape.input[1])
        if shape is None:  # Concat(B, S, heads or -1, hd) of dynamic dims and constants
            cat = op(reshape.input[1], "Concat")
            tail = [const(x) for x in cat.input[2:]]
            if len(cat.input) != 4 or None in tail:
                raise _NoMatchError("reshape target")
            shape = [0, 0] + [t[0] for t in tail]
        if shape[-1] != hd or shape[-2] not in (heads, -1):
            raise _NoMatchError(f"reshape to {shape}, not (B, S, {heads}, {hd})")

    def split_heads(x4, heads):
        """x4 = Transpose(Reshape(x3)) (B, heads, S, hd) -> x3 (B, S, heads * hd)."""
        t = op(x4, "Transpose")
        if attrs(t).get("perm") != [0, 2, 1, 3]:
            raise _NoMatchError("transpose")
        r = op(t.input[0], "Reshape")
        heads_of(r, heads)
        return r.input[0]

    attentions = [n for n in g.node if n.op_type == "Attention"]
    if len(attentions) != num_layers:
        raise _NoMatchError("not one Attention per layer")
    half = {}  # cos/sin (B, S, hd) -> its first half, sliced once
    new_nodes, drop, out_rename = [], set(), {}
    for att in attentions:
        if len(att.input) != 4 or set(attrs(att)) - {"scale"}:
            raise _NoMatchError("attention inputs")
        q4, k_all, v_all, mask = att.input
        rq = op(q4, "RotaryEmbedding")
        cat_k, cat_v = op(k_all, "Concat"), op(v_all, "Concat")
        past_k, new_k = cat_k.input
        past_v, new_v = cat_v.input
        if not (past_k.startswith("past_key_values.") and past_v.startswith("past_key_values.")):
            raise _NoMatchError("concat of a past")
        rk = op(new_k, "RotaryEmbedding")
        if attrs(rq) or attrs(rk):  # interleaved / partial rotary: keep the 4-D graph
            raise _NoMatchError("rotary attributes")
        q3, k3, v3 = split_heads(rq.input[0], nq), split_heads(rk.input[0], nkv), split_heads(new_v, nkv)
        fused = _fuse_qkv(g, producer, inits, q3, k3, v3, base_dir, heads=(nq, nkv, hd) if layout == "bhsd" else None)
        if fused is not None:
            new_nodes.append(("qkv", fused))
        after_t = [n for n in g.node if att.output[0] in n.input]
        if len(after_t) != 1 or after_t[0].op_type != "Transpose" or attrs(after_t[0]).get("perm") != [0, 2, 1, 3]:
            raise _NoMatchError("attention output transpose")
        after_r = [n for n in g.node if after_t[0].output[0] in n.input]
        if len(after_r) != 1 or after_r[0].op_type != "Reshape":
            raise _NoMatchError("attention output reshape")
        out3 = after_r[0].output[0]
        for cs in (rq.input[1], rq.input[2], rk.input[1], rk.input[2]):
            sl = op(cs, "Slice")
            if const(sl.input[1]) != [0] or const(sl.input[3]) not in ([2], [-1]):
                raise _NoMatchError("cos/sin slice")
            if sl.input[0] not in half:
                name = f"kv_rotary_half/{len(half)}"
                half[sl.input[0]] = name
                new_nodes.append(("head", [
                    onnx.helper.make_node("Constant", [], [name + "/ends"], value_ints=[hd // 2]),
                    onnx.helper.make_node("Constant", [], [name + "/starts"], value_ints=[0]),
                    onnx.helper.make_node("Constant", [], [name + "/axes"], value_ints=[2]),
                    onnx.helper.make_node("Slice", [sl.input[0], name + "/starts", name + "/ends", name + "/axes"],
                                          [name])]))
        layer = past_k[len("past_key_values."):].split(".")[0]
        pk, pv = C.present_key(int(layer)), C.present_value(int(layer))
        cq, sq = half[op(rq.input[1], "Slice").input[0]], half[op(rq.input[2], "Slice").input[0]]
        ck, sk = half[op(rk.input[1], "Slice").input[0]], half[op(rk.input[2], "Slice").input[0]]
        qr, kr = f"kv_q.{layer}", f"kv_new.{layer}.key"
        scale = attrs(att).get("scale", hd ** -0.5)
        # the same five ops in both layouts; "bsh" tells them the heads, "bhsd" splits and merges them
        split, merge = [], []
        if layout == "bsh":
            q, k, v, y, axis = q3, k3, v3, out3, 1
            rot_q, rot_k, heads = {"num_heads": nq}, {"num_heads": nkv}, {"q_num_heads": nq, "kv_num_heads": nkv}
        else:  # with the fused QKV, one Reshape + Transpose + Split for all three (_fuse_qkv)
            q, k, v = ((x + "/4d" for x in (q3, k3, v3)) if fused is not None else
                       (_to_heads(x, n, hd, split) for x, n in ((q3, nq), (k3, nkv), (v3, nkv))))
            y, axis, rot_q, rot_k, heads = f"kv_attn.{layer}", 2, {}, {}, {}
            merge = _from_heads(y, out3, nq * hd)
        new_nodes.append((att.name, [
            *split,
            onnx.helper.make_node("RotaryEmbedding", [q, cq, sq], [qr], name=f"rotary/q.{layer}", **rot_q),
            onnx.helper.make_node("RotaryEmbedding", [k, ck, sk], [kr], name=f"rotary/k.{layer}", **rot_k),
            onnx.helper.make_node("TensorScatter", [past_k, kr, C.KV_WRITE], [pk], axis=axis, name=f"kv_write/{pk}"),
            onnx.helper.make_node("TensorScatter", [past_v, v, C.KV_WRITE], [pv], axis=axis, name=f"kv_write/{pv}"),
            onnx.helper.make_node("Attention", [qr, pk, pv, mask], [y], scale=scale, name=f"attention.{layer}",
                                  **heads),
            *merge]))
        drop.update(id(n) for n in (att, rq, rk, cat_k, cat_v, after_t[0], after_r[0]))
        out_rename[pk], out_rename[pv] = pk, pv
    # the old presents (4-D new rows) were graph outputs: the outputs are now the buffers
    kept = [n for n in g.node if id(n) not in drop]
    olds = {C.present_key(i) for i in range(num_layers)} | {C.present_value(i) for i in range(num_layers)}
    for n in kept:  # the 4-D new rows under their old names: renamed, then dead
        n.output[:] = ["kv_dead/" + x if x in olds else x for x in n.output]
        n.input[:] = ["kv_dead/" + x if x in olds else x for x in n.input]
    body = [x for _, nodes in new_nodes for x in nodes]
    del g.node[:]
    g.node.extend(kept + body)
    g.input.append(onnx.helper.make_tensor_value_info(C.KV_WRITE, TensorProto.INT64, [C.BATCH]))
    for t in list(g.input) + list(g.output):
        if t.name.startswith(("past_key_values.", "present.")):
            dims = t.type.tensor_type.shape.dim
            del dims[:]
            for d in ((C.BATCH, C.PAST, nkv * hd) if layout == "bsh" else (C.BATCH, nkv, C.PAST, hd)):
                dims.add().CopyFrom(onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [d]).type.tensor_type
                                    .shape.dim[0])
        elif t.name == C.ATTENTION_MASK:
            t.type.tensor_type.shape.dim[3].dim_param = C.PAST
    del g.value_info[:]
    _topological(g, strict=False)
    _remove_dead(g)  # (walks back from the outputs: needs the order)
    _topological(g)  # every live node's inputs are produced


def _produced(producer: dict, name: str, kind: str):
    """The node of op type ``kind`` that produces ``name``; _NoMatchError when another op (or none) does."""
    n = producer.get(name)
    if n is None or n.op_type != kind:
        raise _NoMatchError(f"{name}: not {kind}")
    return n


def _attrs(n) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}


def _to_heads(x3: str, heads: int, hd: int, nodes: list) -> str:
    """(B, S, heads * hd) -> (B, heads, S, hd): a Reshape by a constant shape and a Transpose."""
    shape = onnx.helper.make_node("Constant", [], [x3 + "/heads"], value_ints=[0, 0, heads, hd])
    nodes += [shape, onnx.helper.make_node("Reshape", [x3, x3 + "/heads"], [x3 + "/bshd"]),
              onnx.helper.make_node("Transpose", [x3 + "/bshd"], [x3 + "/4d"], perm=[0, 2, 1, 3])]
    return x3 + "/4d"


def _from_heads(y4: str, out3: str, width: int) -> list:
    """(B, heads, S, hd) -> (B, S, heads * hd), the attention's output for the output projection."""
    return [onnx.helper.make_node("Transpose", [y4], [y4 + "/bshd"], perm=[0, 2, 1, 3]),
            onnx.helper.make_node("Constant", [], [y4 + "/merge"], value_ints=[0, 0, width]),
            onnx.helper.make_node("Reshape", [y4 + "/bshd", y4 + "/merge"], [out3])]


def _fuse_qkv(g, producer: dict, inits: dict, q3: str, k3: str, v3: str, base_dir,
              heads: tuple[int, int, int] | None = None) -> list | None:
    """q, k and v projections of one input, each a MatMul by a constant (K, N) weight -> one MatMul by
    the weights side by side and a Split: one weight stream and one kernel call instead of three.
    Each output column is the same dot product as before (parity checks it). None when the three
    are not such MatMuls (biases, quantized weights, shared weights): they stay as they are."""
    from onnx import numpy_helper

    mms = [producer.get(x) for x in (q3, k3, v3)]
    if any(m is None or m.op_type != "MatMul" or m.input[1] not in inits for m in mms):
        return None
    if len({m.input[0] for m in mms}) != 1 or len({m.input[1] for m in mms}) != 3:
        return None
    ws = [numpy_helper.to_array(inits[m.input[1]], base_dir=str(base_dir) if base_dir else "") for m in mms]
    if any(w.ndim != 2 for w in ws) or len({w.shape[0] for w in ws}) != 1:
        return None
    name = mms[0].input[1] + "/qkv"
    g.initializer.append(numpy_helper.from_array(np.concatenate(ws, axis=1), name))
    out = mms[0].output[0] + "/qkv"
    for m in mms:  # the three MatMuls become dead (their outputs are renamed to the Split's)
        m.output[0] = "kv_dead/" + m.output[0]
    # 3-D: split the columns into q, k, v; 4-D: split the heads at once (q3 + "/4d", ...: (B, heads, S, hd))
    sizes = [w.shape[1] for w in ws] if heads is None else [heads[0], heads[1], heads[1]]
    g.initializer.append(numpy_helper.from_array(np.array(sizes, dtype=np.int64), name + "/split"))
    nodes = [onnx.helper.make_node("MatMul", [mms[0].input[0], name], [out], name=name + "/MatMul")]
    if heads is None:
        x, outs, axis = out, [q3, k3, v3], -1
    else:
        nq, nkv, hd = heads
        x, outs, axis = _to_heads(out, nq + 2 * nkv, hd, nodes), [q3 + "/4d", k3 + "/4d", v3 + "/4d"], 1
    nodes.append(onnx.helper.make_node("Split", [x, name + "/split"], outs, axis=axis, name=name + "/Split"))
    return nodes


TABLE_BYTES = 256 << 20  # cos/sin tables above this stay computed in the graph


def _rotary_tables(proto: onnx.ModelProto, max_positions: int, base_dir) -> None:
    """The cos/sin halves the graph computes from ``position_ids`` (Cast, Mul by the inverse
    frequencies, Concat, Cos, Sin, Slice: 8 nodes) -> two ``Gather`` rows of tables (max_positions,
    hd/2) computed by *running that very subgraph* once on positions 0 .. max_positions - 1 with
    ONNX Runtime: the same kernels on the same values, so every entry is what the graph computed
    (genai's graphs carry such tables too). Left as it is when the subgraph reads anything but
    ``position_ids`` and constants, or the tables would exceed TABLE_BYTES."""
    import onnxruntime as ort
    from onnx import numpy_helper

    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    halves = [n.output[0] for n in g.node if n.op_type == "Slice" and n.output[0].startswith("kv_rotary_half/")]
    if not halves:
        return
    hd2 = None
    inits = {t.name: t for t in g.initializer}
    need, nodes, seen = list(halves), [], set()
    while need:
        x = need.pop()
        if x in seen or x == "" or x == C.POSITION_IDS or x in inits:
            continue
        seen.add(x)
        n = producer.get(x)
        if n is None:  # another graph input: not a function of the positions alone
            return
        nodes.append(n)
        need.extend(n.input)
    used = sorted({x for n in nodes for x in n.input if x in inits})
    sub_inits = [numpy_helper.from_array(numpy_helper.to_array(inits[x], base_dir=str(base_dir or "")), x)
                 for x in used]
    order = [n for n in g.node if n in nodes]  # the graph's own order is topological
    sub = onnx.helper.make_model(
        onnx.helper.make_graph(order, "rotary_tables",
                               [onnx.helper.make_tensor_value_info(C.POSITION_IDS, TensorProto.INT64, [1, None])],
                               [onnx.helper.make_tensor_value_info(h, TensorProto.FLOAT, None) for h in halves],
                               sub_inits),
        opset_imports=list(proto.opset_import))
    from graphs.sessions import default_session_options  # honours a process-wide thread pool (bench)

    so = default_session_options(1)
    tables = ort.InferenceSession(sub.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        halves, {C.POSITION_IDS: np.arange(max_positions, dtype=np.int64)[None]})
    hd2 = tables[0].shape[-1]
    if len(halves) * max_positions * hd2 * 4 > TABLE_BYTES:
        return
    for h, table in zip(halves, tables):
        name = h + "/table"
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(table[0]), name))
        slice_node = producer[h]
        slice_node.CopyFrom(onnx.helper.make_node("Gather", [name, C.POSITION_IDS], [h], axis=0,
                                                  name=h + "/Gather"))
    _remove_dead(g)


def _remove_dead(g) -> None:
    needed = {o.name for o in g.output}
    keep = []
    for n in reversed(list(g.node)):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(x for x in n.input if x)
    keep.reverse()
    del g.node[:]
    g.node.extend(keep)
    used = {x for n in g.node for x in n.input}
    inits = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)


def _topological(g, strict: bool = True) -> None:
    """Order nodes so each comes after its inputs' producers (the new nodes were appended).
    ``strict=False``: nodes whose inputs nothing produces any more (dead ones, about to be removed)
    go last instead of raising."""
    ready = {t.name for t in g.input} | {t.name for t in g.initializer} | {""}
    pending, out = list(g.node), []
    while pending:
        rest = []
        for n in pending:
            if all(x in ready for x in n.input):
                out.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            if strict:
                raise ValueError("the rewritten graph has a cycle or a missing input")
            out += rest
            break
        pending = rest
    del g.node[:]
    g.node.extend(out)


# ----------------------------------------------------------------------------- one sequence: GroupQueryAttention

ONE_SEQUENCE_SUFFIX = ".gqa.onnx"  # base.onnx -> base.gqa.onnx, beside it
# rows of zeros past the cos/sin tables: the kernel wants its tables as long as the call's columns,
# which pass max_position_embeddings by up to a tree's width near the end of the context (positions
# never do, so the rows are never read); the runtime sends wider calls to the base
TABLE_MARGIN = 256


def group_query_graph(proto: onnx.ModelProto, num_layers: int, nq: int, nkv: int
                      ) -> tuple[onnx.ModelProto, int] | None:
    """The compact ``bhsd`` graph (:func:`_compact`, with its fused QKV and its cos/sin tables) with
    each layer's attention block as one ``com.microsoft.GroupQueryAttention``::

        qkv ─ Reshape ─ Transpose ─ Split ─ q ─ RotaryEmbedding ─────────────────────────┐
                                          ─ k ─ RotaryEmbedding ─ TensorScatter(2) ─ Attention ─ Transpose ─ Reshape ─▶
                                          ─ v ──────────────────── TensorScatter(2) ┘
    becomes::

        qkv (B, S, (nq + 2 nkv) hd) ─ GroupQueryAttention(past buffers shared with the presents,
                                      seqlens_k, cos/sin tables, position_ids, the mask as bias) ─▶

    (q, k and v each (B, S, heads * hd) where they are projected apart, as with biases)

    the kernel onnxruntime-genai's graphs run: rotary, the cache write and the attention in one op
    that reads each row's own length (``seqlens_k``) rather than the buffer's every column, 9 nodes a
    layer fewer. The same inputs and outputs as ``proto`` (the runtime binds the same buffers): the
    per-row lengths are computed in the graph from ``kv_write_index`` and the call's width.

    Only for the calls the CPU kernel computes as the tree asks: one token per row (any batch), or
    one sequence (batch 1) with a past (a tree after ancestors, as GQA adds the bias inside its causal
    mask) or a causal prefill; it refuses a batch of several sequences with several new tokens
    ("batch_size must be 1 when sequence_length > 1 and past context is given") and in a prefill
    (no past) takes positions 0..S-1 whatever ``position_ids`` says. The runtime picks this graph
    for those calls and ``proto`` for the others (graphs.runtime). Hand-written: no library rewrite
    targets GroupQueryAttention from ONNX Attention. Rewrites ``proto`` in place (no copy of its
    weights) and returns (it, the widest call it takes: write column + new rows, its rotary tables'
    length); None, ``proto`` untouched, when it is not that compact form."""
    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for x in n.input:
            consumers.setdefault(x, []).append(n)
    inits = {t.name: t for t in g.initializer}
    only, attrs = functools.partial(_produced, producer), _attrs
    try:
        attentions = [n for n in g.node if n.op_type == "Attention"]
        if len(attentions) != num_layers:
            raise _NoMatchError("not one Attention per layer")
        drop, body, tables, bias = set(), [], None, None
        for att in attentions:
            q, pk, pv, mask = att.input
            # softmax_precision: float16's float32 softmax (exporter.passes.fp16). GQA has no such
            # attribute: its softmax precision is its kernel's, which the parity gates measure
            if set(attrs(att)) - {"scale", "softmax_precision"}:
                raise _NoMatchError("attention attributes")
            rq = only(q, "RotaryEmbedding")
            sk, sv = only(pk, "TensorScatter"), only(pv, "TensorScatter")
            rk = only(sk.input[1], "RotaryEmbedding")
            if producer.get(rq.input[0]) is not None and producer[rq.input[0]].op_type == "Split":
                split = only(rq.input[0], "Split")  # the fused QKV: GQA takes it packed
                if list(split.output) != [rq.input[0], rk.input[0], sv.input[1]]:
                    raise _NoMatchError("q, k, v not one split")
                tr = only(split.input[0], "Transpose")
                rs = only(tr.input[0], "Reshape")
                qkv, plumbing = [rs.input[0], "", ""], [split, tr, rs]
            else:  # each its own Reshape + Transpose (biased projections)
                heads = [only(x, "Transpose") for x in (rq.input[0], rk.input[0], sv.input[1])]
                reshapes = [only(t.input[0], "Reshape") for t in heads]
                qkv, plumbing = [r.input[0] for r in reshapes], heads + reshapes
            if attrs(rq) or attrs(rk) or rq.input[1:] != rk.input[1:]:
                raise _NoMatchError("rotary")
            cos, sin = (only(x, "Gather") for x in rq.input[1:])
            if cos.input[1] != C.POSITION_IDS or cos.input[0] not in inits or sin.input[0] not in inits:
                raise _NoMatchError("cos/sin not tables")
            tables = (cos.input[0], sin.input[0])
            if bias not in (None, mask):
                raise _NoMatchError("layers with different masks")
            bias = mask
            t_out = consumers.get(att.output[0], [])
            if len(t_out) != 1 or t_out[0].op_type != "Transpose":
                raise _NoMatchError("attention output")
            r_out = consumers.get(t_out[0].output[0], [])
            if len(r_out) != 1 or r_out[0].op_type != "Reshape":
                raise _NoMatchError("attention output")
            layer = sk.output[0][len("present."):].split(".")[0]
            scale = attrs(att).get("scale")
            body.append(onnx.helper.make_node(
                "GroupQueryAttention",
                [*qkv, sk.input[0], sv.input[0], "gqa/seqlens_k", "gqa/total_sequence_length",
                 "gqa/cos", "gqa/sin", C.POSITION_IDS, "gqa/bias"],
                [r_out[0].output[0], sk.output[0], sv.output[0]], domain="com.microsoft",
                name=f"gqa.{layer}", do_rotary=1, num_heads=nq, kv_num_heads=nkv,
                **({"scale": scale} if scale else {})))
            drop.update(id(n) for n in (att, rq, rk, sk, sv, *plumbing, t_out[0], r_out[0]))
    except _NoMatchError:
        return None
    positions, half = inits[tables[0]].dims
    table_type = inits[tables[0]].data_type
    # per row: the last column its call writes (GQA's seqlens_k); the call's columns: the longest
    # row's (the kernel wants its cos/sin tables and the bias that wide, not the buffer's capacity,
    # which may pass max_position_embeddings by the cache's headroom)
    def ints(name, values):
        return onnx.helper.make_node("Constant", [], [name], value=onnx.helper.make_tensor(
            name, TensorProto.INT64, [len(values)], values))

    head = [
        ints("gqa/zero", [0]), ints("gqa/one", [1]), ints("gqa/axis1", [1]), ints("gqa/axis3", [3]),
        onnx.helper.make_node("Shape", [C.INPUT_IDS], ["gqa/ids_shape"]),
        onnx.helper.make_node("Gather", ["gqa/ids_shape", "gqa/axis1"], ["gqa/width"], axis=0),
        onnx.helper.make_node("Sub", ["gqa/width", "gqa/one"], ["gqa/width_1"]),
        onnx.helper.make_node("Add", [C.KV_WRITE, "gqa/width_1"], ["gqa/last"]),
        onnx.helper.make_node("Cast", ["gqa/last"], ["gqa/seqlens_k"], to=TensorProto.INT32),
        onnx.helper.make_node("ReduceMax", ["gqa/last", "gqa/zero"], ["gqa/max_last"], keepdims=1),
        onnx.helper.make_node("Add", ["gqa/max_last", "gqa/one"], ["gqa/columns"]),
        onnx.helper.make_node("Squeeze", ["gqa/columns"], ["gqa/columns0"]),
        onnx.helper.make_node("Cast", ["gqa/columns0"], ["gqa/total_sequence_length"], to=TensorProto.INT32),
        onnx.helper.make_node("Slice", [bias, "gqa/zero", "gqa/columns", "gqa/axis3"], ["gqa/bias"]),
        # the tables' own dtype: float16 in a --target cuda graph (GQA wants them in the query's type)
        onnx.helper.make_node("Constant", [], ["gqa/table_margin"], value=onnx.helper.make_tensor(
            "gqa/table_margin", table_type, [TABLE_MARGIN, half],
            np.zeros(TABLE_MARGIN * half, onnx.helper.tensor_dtype_to_np_dtype(table_type)))),
        # two constants: folded into one table when ONNX Runtime loads the graph
        onnx.helper.make_node("Concat", [tables[0], "gqa/table_margin"], ["gqa/cos"], axis=0),
        onnx.helper.make_node("Concat", [tables[1], "gqa/table_margin"], ["gqa/sin"], axis=0),
    ]
    kept = [n for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(head + kept + body)
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    del g.value_info[:]
    _topological(g, strict=False)
    _remove_dead(g)
    _topological(g)
    return proto, positions + TABLE_MARGIN
