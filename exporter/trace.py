"""Traceable wrappers for the base and draft graphs, and their ONNX export.

Each wrapper's ``forward`` takes exactly the graph contract's inputs, in order, and returns its
outputs, in order (:mod:`graphs.contract`). Submodules keep the HF attribute names (``model``,
``lm_head``, ``eagle_module``, ``medusa_heads``) so ONNX node names read like the model:
``/model/layers.0/self_attn/q_proj/MatMul``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from exporter.modeling import base_forward, eager_attention
from exporter.speculative.medusa import medusa_logits
from graphs import contract as C

OPSET = 17


def model_dims(model, dtype: str) -> C.ModelDims:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return C.ModelDims(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        dtype=dtype,
    )


def aux_layer_ids(model) -> tuple[int, ...]:
    if getattr(model, "spec_mode", None) == "eagle" and model.eagle_module.eagle3:
        return tuple(model.spec_config.eagle_aux_hidden_state_layer_ids)
    return ()


def draft_dims(model, dtype: str) -> C.ModelDims:
    mod = model.eagle_module
    base = model_dims(model, dtype)
    return C.ModelDims(
        num_layers=len(mod.layers),
        num_kv_heads=mod.num_kv_heads,
        head_dim=mod.head_dim,
        hidden_size=base.hidden_size,
        vocab_size=base.vocab_size,
        dtype=dtype,
    )


def graph_specs(model, dtype: str) -> dict[str, C.GraphSpec]:
    """The contract of every graph this model exports to: {"base": ..., "draft": ...}."""
    dims = model_dims(model, dtype)
    n_aux = len(aux_layer_ids(model))
    specs = {"base": C.base_graph_spec(dims, n_aux=n_aux)}
    mode = getattr(model, "spec_mode", None)
    if mode == "medusa":
        specs["draft"] = C.medusa_graph_spec(dims, num_heads=len(model.medusa_heads))
    elif mode == "eagle":
        mod = model.eagle_module
        vocab = mod.lm_head.out_features if mod.eagle3 else dims.vocab_size
        specs["draft"] = C.eagle_graph_spec(draft_dims(model, dtype), len(mod.layers), vocab, n_aux=n_aux)
    return specs


def _pairs(flat):
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def _flat(kv):
    return [t for pair in kv for t in pair]


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
        past_kv = _pairs(past) if past else None
        logits, hidden, aux, new = base_forward(self, input_ids, position_ids, attention_mask, past_kv, self.aux)
        return (logits, hidden, *(() if aux is None else (aux,)), *_flat(new))


class MedusaGraph(nn.Module):
    """hidden_states, topk -> logits (B,S,heads,V), topk_ids, topk_logprobs."""

    def __init__(self, model):
        super().__init__()
        self.medusa_heads = model.medusa_heads

    def forward(self, hidden_states, topk):
        logits = medusa_logits(self.medusa_heads, hidden_states)  # (B, S, heads, V)
        ids, scores = _topk(logits, topk)
        return logits, ids, scores


class _BaseParts(nn.Module):
    """The frozen base modules the EAGLE drafter reads (embeddings, rotary, lm_head)."""

    def __init__(self, model):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = model.model.embed_tokens
        self.model.rotary_emb = model.model.rotary_emb
        self.lm_head = model.lm_head


class EagleGraph(nn.Module):
    """[aux_hidden,] hidden, input_ids, position_ids, attention_mask, *past, topk ->
    hidden_out, logits, topk_ids, topk_logprobs, *present."""

    def __init__(self, model):
        super().__init__()
        self.eagle_module = model.eagle_module
        self.base = _BaseParts(model)
        self.eagle3 = model.eagle_module.eagle3

    def forward(self, *args):
        if self.eagle3:
            hidden, aux, input_ids, position_ids, mask, *rest = args
        else:
            hidden, input_ids, position_ids, mask, *rest = args
            aux = None
        *past, topk = rest
        past_kv = _pairs(past) if past else None
        out, logits, new = self.eagle_module.step(self.base, hidden, input_ids, position_ids, mask, past_kv, aux)
        ids, scores = _topk(logits, topk)
        ids = self.eagle_module.draft_to_target(ids)
        return (out, logits, ids, scores, *_flat(new))


def graph_module(model, role: str) -> nn.Module:
    if role == "base":
        return BaseGraph(model)
    return MedusaGraph(model) if model.spec_mode == "medusa" else EagleGraph(model)


TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def example_inputs(spec: C.GraphSpec, sizes: dict[str, int], device="cpu") -> list[torch.Tensor]:
    """Tensors of the spec's shapes; symbolic dims from ``sizes``. Masks are causal over the past."""
    out = []
    for t in spec.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in t.dims]
        if t.name == C.TOPK_IN:
            out.append(torch.tensor([min(2, sizes.get(C.TOPK, 2))], dtype=torch.int64))
        elif t.name == C.ATTENTION_MASK:
            b, _, s, total = shape
            q = torch.arange(s)[:, None] + (total - s)
            out.append((torch.arange(total)[None, :] <= q).expand(b, 1, s, total).contiguous())
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
    s0, s1 = (2, 3) if any(t.name == C.AUX_HIDDEN for t in spec.inputs) else (0, 0)
    seq = 5 if not s0 else s0 + s1
    return {C.BATCH: 2, C.SEQ: seq, C.PAST: 4, C.TOTAL: 4 + seq, C.TOPK: 2, C.AUX_SEQ: s0, C.DRAFT_SEQ: s1}


def export_graph(model, role: str, spec: C.GraphSpec, path: Path, opset: int = OPSET) -> Path:
    """Trace ``role`` ("base" | "draft") of ``model`` to ``path`` following ``spec``."""
    module = graph_module(model, role).eval()
    args = tuple(example_inputs(spec, trace_sizes(spec)))
    with torch.no_grad(), eager_attention(model.config), warnings.catch_warnings():
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
    return path
