"""The trace stage: traceable wrappers for the base and draft graphs, and their ONNX export.

    trace_graphs(model, plan, tmp)   every graph of the plan into tmp (traced)

Each wrapper's ``forward`` takes exactly the graph contract's inputs, in order, and returns its
outputs, in order (:mod:`graphs.contract`). Submodules keep the HF attribute names (``model``,
``lm_head``, ``eagle_module``, ``medusa_heads``) so ONNX node names read like the model:
``/model/layers.0/self_attn/q_proj/MatMul``.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from exporter.modeling import BaseParts, base_forward, eager_attention, flatten_kv, pairs
from exporter.plan import ONNX_DTYPES, OPSET, TRACED_ROLES, aux_layer_ids, is_tree_role
from exporter.speculative.medusa import medusa_logits
from graphs import contract as C

__all__ = ["OPSET", "TRACED_ROLES", "aux_layer_ids", "export_graph", "flatten_kv", "graph_module", "trace_graphs"]


def _topk(logits: torch.Tensor, k: torch.Tensor):
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    scores, ids = torch.topk(logprobs, k[0], dim=-1)
    return ids, scores


class BaseGraph(nn.Module):
    """input_ids, position_ids, attention_mask, *past -> logits, hidden[, aux], *present."""

    def __init__(self, model):
        super().__init__()
        self.model = model.model
        self.lm_head = model.lm_head
        self.aux = aux_layer_ids(model)

    def forward(self, input_ids, position_ids, attention_mask, *past):
        past_kv = pairs(past) if past else None
        logits, hidden, aux, new = base_forward(self, input_ids, position_ids, attention_mask, past_kv, self.aux)
        return (logits, hidden, *(() if aux is None else (aux,)), *flatten_kv(new))


class MedusaGraph(nn.Module):
    """hidden_states, topk -> logits (B,S,heads,V), topk_ids, topk_logprobs."""

    def __init__(self, model):
        super().__init__()
        self.medusa_heads = model.medusa_heads

    def forward(self, hidden_states, topk):
        logits = medusa_logits(self.medusa_heads, hidden_states)  # (B, S, heads, V)
        ids, scores = _topk(logits, topk)
        return logits, ids, scores


class EagleGraph(nn.Module):
    """[aux_hidden,] hidden, input_ids, position_ids, attention_mask, *past, topk ->
    hidden_out, logits, topk_ids, topk_logprobs, *present."""

    def __init__(self, model):
        super().__init__()
        self.eagle_module = model.eagle_module
        self.base = BaseParts(model)
        self.eagle3 = model.eagle_module.eagle3

    def forward(self, *args):
        if self.eagle3:
            hidden, aux, input_ids, position_ids, mask, *rest = args
        else:
            hidden, input_ids, position_ids, mask, *rest = args
            aux = None
        *past, topk = rest
        past_kv = pairs(past) if past else None
        out, logits, new = self.eagle_module.step(self.base, hidden, input_ids, position_ids, mask, past_kv, aux)
        ids, scores = _topk(logits, topk)
        ids = self.eagle_module.draft_to_target(ids)
        return (out, logits, ids, scores, *flatten_kv(new))


class DFlashGraph(nn.Module):
    """aux_hidden, context_position_ids, input_ids, position_ids, attention_mask, *past, topk ->
    logits (slots 1..S-1), topk_ids, topk_logprobs, *present (the new context rows' K/V)."""

    def __init__(self, model):
        super().__init__()
        self.dflash_module = model.dflash_module
        self.base = BaseParts(model)
        vocab = model.dflash_module.draft_vocab
        # a draft vocabulary's head rows as a weight of their own: the graph reads those rows only
        self.head_rows = None if vocab is None else nn.Parameter(
            model.lm_head.weight.detach()[vocab].clone(), requires_grad=False)

    def forward(self, aux, context_position_ids, input_ids, position_ids, mask, *rest):
        *past, topk = rest
        past_kv = pairs(past) if past else None
        logits, new = self.dflash_module.step(self.base, aux, context_position_ids, input_ids, position_ids, mask,
                                              past_kv, self.head_rows)
        ids, scores = _topk(logits, topk)
        return (logits, ids, scores, *flatten_kv(new))


_DRAFT_GRAPHS = {"medusa": MedusaGraph, "eagle": EagleGraph, "dflash": DFlashGraph}


def graph_module(model, role: str) -> nn.Module:
    if is_tree_role(role):
        from exporter.eagle_tree import graph_for_role

        return graph_for_role(model, role)
    if role == "base":
        return BaseGraph(model)
    return _DRAFT_GRAPHS[model.spec_mode](model)


TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def example_inputs(spec: C.GraphSpec, sizes: dict[str, int], device="cpu") -> list[torch.Tensor]:
    """Tensors of the spec's shapes; symbolic dims from ``sizes``. Masks are causal over the past."""
    out = []
    for t in spec.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in t.dims]
        if t.name == C.TOPK_IN:
            out.append(torch.tensor([min(2, sizes.get(C.TOPK, 2))], dtype=torch.int64))
        elif t.name == C.ATTENTION_MASK and C.CONTEXT_POSITION_IDS not in spec.input_names:
            b, _, s, total = shape
            q = torch.arange(s)[:, None] + (total - s)
            out.append((torch.arange(total)[None, :] <= q).expand(b, 1, s, total).contiguous())
        elif t.name == C.ATTENTION_MASK and C.CONTEXT_POSITION_IDS in spec.input_names:  # DFlash: all visible
            out.append(torch.ones(shape, dtype=torch.bool))
        elif t.name == C.CONTEXT_POSITION_IDS:
            b, a = shape
            out.append((torch.arange(a) + sizes[C.PAST]).expand(b, a).contiguous())
        elif t.name == C.ROOT_INDEX:  # each sequence's last context row
            out.append(torch.full(shape, sizes[C.SEQ] - 1, dtype=torch.int64))
        elif t.name == C.POSITION_IDS:
            b, s = shape
            out.append((torch.arange(s) + sizes[C.PAST]).expand(b, s).contiguous())
        elif t.dtype == "int64":
            out.append(torch.randint(0, 8, shape, dtype=torch.int64))
        else:
            out.append(torch.randn(shape, dtype=TORCH_DTYPES[t.dtype]) * 0.1)
    return out


def trace_sizes(spec: C.GraphSpec) -> dict[str, int]:
    # Distinct small sizes for every symbolic dim so that no two get unified by the tracer.
    if C.CONTEXT_POSITION_IDS in spec.input_names:  # DFlash: A context rows, S block slots, P cached
        a, s, p = 3, 4, 5
        return {C.BATCH: 2, C.SEQ: s, C.PAST: p, C.TOTAL: p + a + s, C.TOPK: 2, C.AUX_SEQ: a}
    s0, s1 = (2, 3) if any(t.name == C.AUX_HIDDEN for t in spec.inputs) else (0, 0)
    seq = 5 if not s0 else s0 + s1
    return {C.BATCH: 2, C.SEQ: seq, C.PAST: 4, C.TOTAL: 4 + seq, C.TOPK: 2, C.AUX_SEQ: s0, C.DRAFT_SEQ: s1}


# Submodules whose own ``forward`` is never called (the wrappers call their children directly), by
# graph role: without a scope of their own their children's nodes would read ``/layers.0/...``.
_UNCALLED_PARENTS = {"base": ("model",), "draft": ("eagle_module", "dflash_module", "base.model", "base")}


def _uncalled_parents(role: str) -> tuple[str, ...]:
    return _UNCALLED_PARENTS["draft" if is_tree_role(role) else role]


def _called_children(module: nn.Module):
    """Children of ``module``, looking through containers (ModuleList/ModuleDict are never called)."""
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _called_children(child)
        else:
            yield child


@contextlib.contextmanager
def scoped_node_names(root: nn.Module, paths: tuple[str, ...]):
    """While tracing, open the ONNX name scope of each module in ``paths`` around its children's calls.

    The TorchScript exporter names a node after the chain of *called* modules, so
    ``BaseGraph.model`` (whose ``forward`` is not used: :func:`base_forward` calls its layers)
    would be missing: ``/layers.0/self_attn/...``. Hooks on the children of each listed module push
    its scopes (``model``; ``base`` then ``model`` for ``base.model``) for the duration of each child
    call, giving ``/model/layers.0/self_attn/q_proj/MatMul``. The hooks are removed on exit.
    """
    handles = []
    claimed: set[int] = set()
    if not hasattr(torch._C, "_jit_onnx_create_full_scope_name"):  # a torch without TorchScript naming
        paths = ()
    for path in paths:  # deepest path first claims its children
        try:
            parent = root.get_submodule(path)
        except AttributeError:
            continue
        atoms = path.split(".")
        chain = [root.get_submodule(".".join(atoms[: i + 1])) for i in range(len(atoms))]
        names = [torch._C._jit_onnx_create_full_scope_name(torch.typename(type(m)), a) for m, a in zip(chain, atoms)]
        for child in _called_children(parent):
            if id(child) in claimed or any(child is m for m in chain):
                continue
            claimed.add(id(child))

            def push(_module, _args, names=names):
                state = torch._C._get_tracing_state()
                if state is not None:
                    for n in names:
                        state.push_scope(n)

            def pop(_module, _args, _out, names=names):
                state = torch._C._get_tracing_state()
                if state is not None:
                    for _ in names:
                        state.pop_scope()

            handles.append(child.register_forward_pre_hook(push))
            handles.append(child.register_forward_hook(pop, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def apply_contract_shapes(proto, spec: C.GraphSpec) -> None:
    """Make the graph's declared I/O exactly the contract's: names, elem types, fixed and symbolic dims.

    The tracer leaves some output dims as made-up names (``Addpresent.0.key_dim_3`` for a K/V
    head_dim, ``TopKtopk_ids_dim_2`` for the Medusa head count) where shape inference lost them.
    """
    graph = proto.graph
    for values, specs, what in ((graph.input, spec.inputs, "input"), (graph.output, spec.outputs, "output")):
        got = [v.name for v in values]
        want = [t.name for t in specs]
        if got != want:
            raise RuntimeError(f"traced graph {spec.file} {what}s {got} differ from the contract {want}")
        for v, t in zip(values, specs):
            tt = v.type.tensor_type
            if tt.elem_type != ONNX_DTYPES[t.dtype]:
                raise RuntimeError(
                    f"traced graph {spec.file} {what} {t.name} has ONNX type {tt.elem_type}, "
                    f"the contract says {t.dtype}"
                )
            tt.shape.ClearField("dim")
            for d in t.dims:
                dim = tt.shape.dim.add()
                if isinstance(d, str):
                    dim.dim_param = d
                else:
                    dim.dim_value = d


def export_graph(model, role: str, spec: C.GraphSpec, path: Path, opset: int = OPSET) -> Path:
    """Trace ``role`` ("base" | "draft") of ``model`` to ``path`` following ``spec``.

    Weights over protobuf's 2 GB limit land in external data files beside ``path``
    (the caller consolidates them).
    """
    import onnx

    module = graph_module(model, role).eval()
    args = tuple(example_inputs(spec, trace_sizes(spec)))
    with (
        torch.no_grad(),
        eager_attention(model.config),
        scoped_node_names(module, _uncalled_parents(role)),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=spec.input_names,
            output_names=spec.output_names,
            dynamic_axes=spec.dynamic_axes(),
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    proto = onnx.load(str(path), load_external_data=False)  # the graph only: weights stay on disk
    if is_tree_role(role):  # the unrolled tree's shape plumbing folded (exporter.eagle_tree)
        from exporter.eagle_tree import simplify_traced

        proto = simplify_traced(proto, path.parent)
    apply_contract_shapes(proto, spec)
    onnx.save(proto, str(path))
    return path


# ----------------------------------------------------------------------------- the stage

EXTERNAL_DATA_BYTES = 1 << 31  # protobuf's 2 GB limit: larger graphs keep weights in one .data file
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def trace_graphs(model, plan, tmp: Path, *, external_data_bytes: int | None = None, steps=None) -> list[str]:
    """Every graph of ``plan`` (:class:`exporter.plan.ExportPlan`) into ``tmp``: the traced ones from
    ``model`` cast to the plan's dtype. Returns the roles written.

    ``steps``: the export's progress (:class:`exporter.pipeline.Steps`), or None."""
    import copy

    step = steps or (lambda what: contextlib.nullcontext())
    traced = model if plan.dtype == "float32" else copy.deepcopy(model).to(TORCH_DTYPES[plan.dtype])
    trace = [r for r in plan.specs if r in TRACED_ROLES]
    trees = [r for r in plan.specs if is_tree_role(r)]
    with step("trace base graph"):
        trace_one(traced, "base", plan.specs["base"], tmp, plan.opset, external_data_bytes)
    with step("trace draft graph" if "draft" in trace else "trace draft graph (none: base only)"):
        if "draft" in trace:
            trace_one(traced, "draft", plan.specs["draft"], tmp, plan.opset, external_data_bytes)
        for role in trees:  # one-call EAGLE-2 trees (exporter.eagle_tree)
            trace_one(traced, role, plan.specs[role], tmp, plan.opset, external_data_bytes)
    del traced
    return list(plan.specs)


def trace_one(model, role: str, spec: C.GraphSpec, tmp: Path, opset: int = OPSET,
              external_data_bytes: int | None = None) -> None:
    """Trace into a scratch dir, then store as one .onnx (+ one .onnx.data if over
    ``external_data_bytes``, default :data:`EXTERNAL_DATA_BYTES`)."""
    limit = EXTERNAL_DATA_BYTES if external_data_bytes is None else external_data_bytes
    scratch = tmp / f"_trace_{role}"
    scratch.mkdir()
    path = export_graph(model, role, spec, scratch / spec.file, opset=opset)
    files = list(scratch.iterdir())
    size = sum(f.stat().st_size for f in files)
    if size < limit and len(files) == 1:
        path.rename(tmp / spec.file)
    else:
        consolidate_external_data(path, tmp / spec.file)
    shutil.rmtree(scratch)


def _tensors(graph):
    """Every TensorProto stored in ``graph``: initializers and constant attributes, subgraphs too."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for g in attr.graphs:
                yield from _tensors(g)


def consolidate_external_data(src: Path, dst: Path, min_bytes: int = 1024, align: int = 4096) -> Path:
    """Rewrite ``src`` (weights inline or in per-tensor files beside it) as ``dst`` + ``dst.data``.

    Streams tensor by tensor, so the weights never sit in memory all at once (``onnx.load`` of a
    1.1B-parameter graph would hold all 4.4 GB, and ``onnx.save`` a second copy). Tensors under
    ``min_bytes`` stay inline; offsets are page-aligned so ONNX Runtime can mmap them.
    """
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    proto = onnx.load(str(src), load_external_data=False)
    data_name = f"{dst.name}.data"
    with open(dst.parent / data_name, "wb") as out:
        for t in _tensors(proto.graph):
            if uses_external_data(t):
                info = ExternalDataInfo(t)
                with open(src.parent / info.location, "rb") as f:
                    f.seek(info.offset or 0)
                    data = f.read(info.length) if info.length else f.read()
                del t.external_data[:]
            elif t.HasField("raw_data") and len(t.raw_data) >= min_bytes:
                data = t.raw_data
                t.ClearField("raw_data")
            else:
                continue
            offset = -(-out.tell() // align) * align
            out.seek(offset)
            out.write(data)
            for key, value in (("location", data_name), ("offset", offset), ("length", len(data))):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            t.data_location = onnx.TensorProto.EXTERNAL
            del data
    onnx.save(proto, str(dst))
    return dst


