"""An independent PyTorch reference for the base graph: Hugging Face's own forward with its own cache.

compare's tree-mask cases run :func:`exporter.modeling.base_forward`, the very function that was
traced, so a bug in it (wrong layers for the EAGLE-3 auxiliary states, a wrong mask or position)
is in the graph *and* in that reference, and they agree. These cases use none of the exporter's
modelling code: the converted model's top-level HF ``forward`` (it calls ``super().forward`` when
no labels are given) with a ``transformers.DynamicCache``, the model's own attention implementation
(sdpa or eager, whatever it loaded with) and HF's own causal masking; the auxiliary states are read
from ``output_hidden_states`` at the configured layer ids. Only causal inputs can be checked this
way (HF's forward has no tree masks), so the cases are:

- ``hf_prefill_b2``: 7 tokens, batch 2, no past;
- ``hf_step{1,2,3}_b2``: three one-token decode steps, each token HF's own greedy choice; the graph
  is fed HF's cache as its past, so each row is one graph call's error (nothing accumulates);
- ``hf_chunk4_b2``: 4 tokens at once over a past of 10 (past > 0 with S > 1).

(Shorter inside a sliding window smaller than 15 tokens: see :func:`_lengths`.)

``output_hidden_states`` is ``(embeddings, out(layer 0), ..., out(layer L-2), norm(out(layer L-1)))``
on 4.57 and 5.x alike: layer ``i``'s output is entry ``i + 1`` except for the last layer, whose
entry is after the final norm. For that one id the reference is taken with a forward hook on HF's
last decoder layer (still HF's module, not ours).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

from graphs import contract as C


@dataclass
class HFCase:
    name: str
    inputs: list[torch.Tensor]  # the base graph's inputs, in contract order
    ref: dict[str, np.ndarray]  # output name -> HF's value; outputs not listed are not checked here


def configured_aux_layers(model) -> tuple[int, ...]:
    """The EAGLE-3 / DFlash aux layer ids as configured (the model's drafter config), not as the tracer reads them."""
    if getattr(model, "spec_mode", None) == "dflash":
        return tuple(model.spec_config.dflash_target_layer_ids)
    if getattr(model, "spec_mode", None) != "eagle":
        return ()
    cfg = model.spec_config
    if not getattr(cfg, "use_aux_hidden_state", False):
        return ()
    return tuple(cfg.eagle_aux_hidden_state_layer_ids or ())


def _hf_class(model) -> type:
    """The HF class whose ``forward`` runs (the converted class is a subclass of it)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.") and "forward" in vars(cls):
            return cls
    return type(model)


def _cache_keyword(model) -> str:
    # HF renamed the cache keyword of the top-level forward (``past_key_values`` -> ``cache`` on 5.x,
    # the old name deprecated there); read it from the signature, as exporter.hf_compat does for layers.
    params = inspect.signature(inspect.unwrap(_hf_class(model).forward)).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)  # sliding-window layers where the config has them
    except TypeError:  # a DynamicCache without the config argument
        return DynamicCache()


def _layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # 4.56+ and 5.x
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]  # older DynamicCache


class _HFRunner:
    """Runs the HF model step by step on one DynamicCache, recording what the graph must reproduce."""

    def __init__(self, model, aux_ids: tuple[int, ...]):
        self.model = model
        self.aux_ids = aux_ids
        self.n_layers = model.config.num_hidden_layers
        self.cache = _new_cache(model)
        self.keyword = _cache_keyword(model)
        self.last_layer_out: torch.Tensor | None = None

    def _hook(self, _module, _args, out):
        self.last_layer_out = out[0] if isinstance(out, tuple) else out

    def step(self, ids: torch.Tensor) -> dict[str, np.ndarray]:
        past = self.cache.get_seq_length()
        handle = self.model.model.layers[-1].register_forward_hook(self._hook)
        try:
            with torch.no_grad():
                out = self.model(ids, use_cache=True, output_hidden_states=True, **{self.keyword: self.cache})
        finally:
            handle.remove()
        hs = out.hidden_states  # (embeddings, layer outputs..., normed last): L + 1 entries
        if len(hs) != self.n_layers + 1:
            raise RuntimeError(f"HF returned {len(hs)} hidden states for {self.n_layers} layers")
        ref = {C.LOGITS: out.logits, C.HIDDEN: hs[-1]}
        if self.aux_ids:
            layers = [self.last_layer_out if i == self.n_layers - 1 else hs[i + 1] for i in self.aux_ids]
            ref[C.AUX_HIDDEN] = torch.cat(layers, dim=-1)  # (B, S, n_aux * H)
        s = ids.shape[1]
        for i in range(self.n_layers):
            k, v = _layer_kv(self.cache, i)  # (B, kv, past + S, hd)
            if k.shape[2] != past + s:
                raise RuntimeError(f"HF cache layer {i} holds {k.shape[2]} rows, expected {past + s}")
            ref[C.present_key(i)], ref[C.present_value(i)] = k[:, :, past:], v[:, :, past:]
        return {name: t.detach().float().numpy().copy() for name, t in ref.items()}

    def past(self) -> list[torch.Tensor]:
        """The cache so far, flattened in contract order (key 0, value 0, key 1, ...), copied."""
        flat = []
        for i in range(self.n_layers):
            k, v = _layer_kv(self.cache, i)
            flat += [k.detach().clone(), v.detach().clone()]
        return flat


def causal_bool_mask(b: int, s: int, past: int) -> torch.Tensor:
    """bool (B, 1, S, past+S): built here, independently of exporter.modeling.causal_mask."""
    full = torch.ones(s, past + s, dtype=torch.bool).tril(diagonal=past)
    return full.expand(b, 1, s, past + s).contiguous()


def hf_base_cases(model, spec: C.GraphSpec, seed: int = 0) -> list[HFCase]:
    """The causal cases with HF's own forward as the reference (see the module docstring)."""
    g = torch.Generator().manual_seed(seed + 7)
    vocab = spec.output(C.LOGITS).dims[-1]
    k0 = spec.input(C.past_key(0))
    kv, hd = k0.dims[1], k0.dims[3]
    b = 2
    runner = _HFRunner(model, configured_aux_layers(model))
    cases = []

    def case(name: str, ids: torch.Tensor) -> torch.Tensor:
        past_flat = runner.past() if runner.cache.get_seq_length() else [
            torch.zeros(b, kv, 0, hd) for _ in range(2 * runner.n_layers)]
        p = runner.cache.get_seq_length()
        s = ids.shape[1]
        ref = runner.step(ids)
        pos = torch.arange(p, p + s).expand(b, s).contiguous()
        cases.append(HFCase(name, [ids, pos, causal_bool_mask(b, s, p), *past_flat], ref))
        return torch.from_numpy(ref[C.LOGITS][:, -1:]).argmax(-1)  # (B, 1): HF's greedy next token

    prefill, chunk = _lengths(model.config)
    name = "hf_prefill_b2" if prefill == 7 else f"hf_prefill{prefill}_b2"
    nxt = case(name, torch.randint(0, vocab, (b, prefill), generator=g))
    for step in (1, 2, 3):
        nxt = case(f"hf_step{step}_b2", nxt)
    case(f"hf_chunk{chunk}_b2", torch.randint(0, vocab, (b, chunk), generator=g))
    return cases


def _lengths(config) -> tuple[int, int]:
    """(prefill, chunk) lengths: 7 and 4, shortened to stay inside a sliding window, where HF's forward
    would mask (and its cache drop) what the graphs, by design, attend (the runtime caps the context there)."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    budget = 14 if not window else max(5, min(14, int(window) - 1))  # prefill + 3 steps + chunk
    prefill = min(7, max(2, budget - 7))
    return prefill, min(4, max(1, budget - prefill - 3))
