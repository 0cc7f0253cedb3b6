"""Tree-attention forward passes over the HF modules of a base model (wrap, don't fork).

One function runs the base model with an explicit boolean tree mask, explicit position ids and an
explicit list of past K/V tensors, and returns the K/V of the new positions. It calls the HF
decoder layers themselves (eager attention) with a duck-typed cache, so every architecture detail
(GQA, q/k norms, biases, rotary scaling) stays HF's. The same function is traced to ONNX and used
as the PyTorch reference by compare, so the two can only differ by what export does.
"""

from __future__ import annotations

import contextlib

import torch

from exporter.hf_compat import cache_kwargs

PastKV = list[tuple[torch.Tensor, torch.Tensor]]


class NewRowsCache:
    """Duck-typed HF ``Cache``: concatenates past rows for attention, records the new rows.

    HF attention calls ``update(k, v, layer_idx)`` with the K/V of the new positions
    ``(B, kv_heads, S, head_dim)`` and attends over what it returns ``(B, kv_heads, P+S, head_dim)``.
    """

    def __init__(self, past: PastKV | None):
        self.past = past
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key, value, layer_idx, *_args, **_kwargs):  # extra args differ by HF version
        self.new[layer_idx] = (key, value)
        if not self.past:
            return key, value
        pk, pv = self.past[layer_idx]
        return torch.cat([pk, key], dim=2), torch.cat([pv, value], dim=2)

    def new_rows(self, n: int) -> PastKV:
        return [self.new[i] for i in range(n)]


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (B, 1, S, P+S), True = may attend -> additive float bias of the same shape."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, neg)


def causal_mask(batch: int, seq: int, past: int = 0, device=None) -> torch.Tensor:
    """bool (B, 1, S, P+S): each new position sees the whole past and the new positions up to itself."""
    q = torch.arange(seq, device=device)[:, None]
    k = torch.arange(past + seq, device=device)[None, :]
    return (k <= q + past).expand(batch, 1, seq, past + seq)


@contextlib.contextmanager
def eager_attention(config):
    """Run HF attention with the eager kernel (explicit additive mask), restoring the setting after."""
    old = getattr(config, "_attn_implementation", None)
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = old


def run_layers(layers, hidden, position_embeddings, bias, cache, position_ids, collect=False):
    """Run decoder ``layers``; return the last output (and every layer's output if ``collect``)."""
    outs = []
    for layer in layers:
        hidden = layer(
            hidden,
            attention_mask=bias,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            **cache_kwargs(layer, cache),
        )
        if isinstance(hidden, tuple):  # older HF layers return (hidden, ...)
            hidden = hidden[0]
        outs.append(hidden)
    return (hidden, outs) if collect else hidden


def base_forward(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    past: PastKV | None = None,
    aux_layer_ids: tuple[int, ...] = (),
):
    """The base graph's computation.

    Returns ``(logits, hidden, aux_hidden | None, new_kv)``: logits (B, S, V); hidden (B, S, H), the
    last layer after the final norm; aux_hidden (B, S, len(aux)*H), the outputs of the chosen
    layers (EAGLE-3); new_kv, per layer (B, kv_heads, S, head_dim).
    """
    inner = model.model
    hidden = inner.embed_tokens(input_ids)  # (B, S, H)
    pos_emb = inner.rotary_emb(hidden, position_ids)  # cos, sin: (B, S, head_dim)
    bias = mask_to_bias(attention_mask, hidden.dtype)  # (B, 1, S, P+S)
    cache = NewRowsCache(past)
    hidden, outs = run_layers(inner.layers, hidden, pos_emb, bias, cache, position_ids, collect=True)
    aux = torch.cat([outs[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
    hidden = inner.norm(hidden)
    logits = model.lm_head(hidden)
    return logits, hidden, aux, cache.new_rows(len(inner.layers))


def pairs(flat: list) -> PastKV:
    """[k0, v0, k1, v1, ...] -> [(k0, v0), (k1, v1), ...]: a graph's flat past inputs as layer pairs."""
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def flatten_kv(kv: PastKV) -> list[torch.Tensor]:
    return [t for pair in kv for t in pair]


class BaseParts(torch.nn.Module):
    """The frozen base modules the EAGLE drafter reads (embeddings, rotary, lm_head), under the HF names."""

    def __init__(self, model):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = model.model.embed_tokens
        self.model.rotary_emb = model.model.rotary_emb
        self.lm_head = model.lm_head
