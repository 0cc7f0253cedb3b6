"""Tiny random HF causal LMs built offline from configs (tests only; the demo model is exporter/demo_model.py)."""

from __future__ import annotations

import torch

TINY_DEFAULTS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_config(model_type: str = "llama", **overrides):
    from transformers import AutoConfig

    kw = {**TINY_DEFAULTS, **overrides}
    if model_type == "qwen3":
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    return cfg


def tiny_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A random causal LM of ``model_type`` (llama, mistral, qwen2, qwen3), eval mode, float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    return model.eval()
