"""Supported base architectures, one registry entry each.

The tracer and the drafters use the HF modules of the base (embeddings, decoder layers, final
norm, rotary embedding, lm_head) as they are; what differs per architecture is only which
decoder-layer and norm classes to build drafter layers from. To add an architecture whose
modules follow the Llama layout, register it here and add its config to the tests.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    module: str  # transformers.models.<x>.modeling_<x>
    decoder_layer: str  # class name of one decoder layer
    rms_norm: str  # class name of its RMSNorm

    def _mod(self):
        return importlib.import_module(self.module)

    @property
    def decoder_layer_cls(self):
        return getattr(self._mod(), self.decoder_layer)

    @property
    def rms_norm_cls(self):
        return getattr(self._mod(), self.rms_norm)


ARCHITECTURES: dict[str, ArchSpec] = {}


def register_architecture(spec: ArchSpec) -> ArchSpec:
    ARCHITECTURES[spec.model_type] = spec
    return spec


for _t, _name in [("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3")]:
    register_architecture(
        ArchSpec(_t, f"transformers.models.{_t}.modeling_{_t}", f"{_name}DecoderLayer", f"{_name}RMSNorm")
    )


def get_arch(config) -> ArchSpec:
    """The registry entry for a HF config, or a ValueError naming what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


def check_causal_lm(model) -> ArchSpec:
    """Check ``model`` is a HF causal LM of a supported architecture; return its ArchSpec."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or not hasattr(model, "lm_head"):
        raise TypeError(
            f"expected a Hugging Face causal LM (e.g. from AutoModelForCausalLM), got {type(model).__name__}"
        )
    spec = get_arch(model.config)
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, attr):
            raise TypeError(f"{type(model).__name__} has no model.{attr}; it is not a decoder-only causal LM")
    return spec
