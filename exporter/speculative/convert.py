"""``convert(model, [(mode, config)])``: attach a drafter to a HF causal LM in place.

Like ModelOpt's ``mtsp.convert``, the model keeps its identity: its class becomes a subclass of
its own class (same name, so ``config.architectures`` is unchanged) whose ``forward`` returns the
base logits and, given ``labels``, the drafter's loss, so a plain HF ``Trainer`` trains the
drafter. The base is frozen. The drafter config is stored in ``model.config.speculative_decoding``
so that ``save_pretrained`` records it and :func:`enable_huggingface_checkpointing` restores it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from exporter.arch import check_causal_lm
from exporter.modeling import base_forward, causal_mask, eager_attention
from exporter.speculative.config import DFlashConfig, EagleConfig, MedusaConfig, parse_mode_config
from exporter.speculative.dflash import DFlashModule, dflash_loss
from exporter.speculative.eagle import EagleModule, eagle_loss
from exporter.speculative.medusa import build_medusa_heads, medusa_rows_loss

CONFIG_KEY = "speculative_decoding"
# state_dict prefixes of the drafter, by mode
DRAFTER_ATTR = {"medusa": "medusa_heads", "eagle": "eagle_module", "dflash": "dflash_module"}
DRAFTER_PREFIX = {mode: attr + "." for mode, attr in DRAFTER_ATTR.items()}


class SpeculativeModel:
    """Mixin placed in front of the base class by :func:`convert`."""

    spec_mode: str
    spec_config: MedusaConfig | EagleConfig | DFlashConfig

    @property
    def drafter(self) -> nn.Module:
        return getattr(self, DRAFTER_ATTR[self.spec_mode])

    def base_outputs(self, input_ids, attention_mask=None):
        """Frozen base pass: (logits, post-norm hidden, EAGLE-3 / DFlash target layers | None)."""
        bsz, seq = input_ids.shape
        mask = causal_mask(bsz, seq, device=input_ids.device)
        if attention_mask is not None:  # padding: no query attends a pad key
            mask = mask & attention_mask[:, None, None, :].bool()
            mask = mask | torch.eye(seq, dtype=torch.bool, device=input_ids.device)  # no empty rows
        position_ids = torch.arange(seq, device=input_ids.device).expand(bsz, seq)
        aux = ()
        if self.spec_mode == "eagle":
            aux = tuple(self.spec_config.eagle_aux_hidden_state_layer_ids or ())
        elif self.spec_mode == "dflash":
            aux = tuple(self.spec_config.dflash_target_layer_ids)
        with torch.no_grad(), eager_attention(self.config):
            logits, hidden, aux_h, _ = base_forward(self, input_ids, position_ids, mask, None, aux)
        return logits, hidden, aux_h

    def forward(self, input_ids=None, attention_mask=None, labels=None, base_features=None, loss_vocab=None,
                **kwargs):
        """Base logits; given ``labels``, the drafter's loss too. ``base_features``: what the drafter
        reads, from a cache of the frozen base (:mod:`exporter.speculative.training`): the post-norm
        hidden (B, L, H), or EAGLE-3's / DFlash's layers (B, L, n_aux*H); then the base does not run.
        ``loss_vocab``: Medusa's and DFlash's loss over those token ids only."""
        if labels is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if base_features is not None and self.spec_mode == "dflash":
            logits, hidden, aux = None, None, base_features
        elif base_features is not None:
            eagle3 = self.spec_mode == "eagle" and self.eagle_module.eagle3
            aux = base_features if eagle3 else None
            # EAGLE-3 reads no post-norm hidden: a slice of the right width stands in for its shape
            logits, hidden = None, base_features[..., : self.config.hidden_size] if eagle3 else base_features
        else:
            logits, hidden, aux = self.base_outputs(input_ids, attention_mask)
        valid = labels != -100
        if attention_mask is not None:
            valid = valid & attention_mask.bool()
        if self.spec_mode == "medusa":
            masked = labels.masked_fill(~valid, -100)
            loss = medusa_rows_loss(self.medusa_heads, hidden, masked, self.spec_config.medusa_loss_decay,
                                    loss_vocab)
        elif self.spec_mode == "dflash":
            loss = dflash_loss(self.dflash_module, self.spec_config, self, (logits, aux), input_ids, valid,
                              loss_vocab)
        else:
            loss = eagle_loss(self.eagle_module, self.spec_config, self, (logits, hidden, aux), input_ids, valid)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


_CLASS_CACHE: dict[type, type] = {}


def _speculative_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        # Same __name__ as the base class: save_pretrained writes it into config.architectures.
        new = type(cls.__name__, (SpeculativeModel, cls), {"__module__": __name__})
        new.__qualname__ = f"Speculative[{cls.__qualname__}]"
        _CLASS_CACHE[cls] = new
    return _CLASS_CACHE[cls]


def is_converted(model) -> bool:
    return isinstance(model, SpeculativeModel)


def convert(model, modes):
    """Convert ``model`` in place to carry a drafter; returns it.

    ``modes``: ``[("medusa", {"medusa_num_heads": 2, "medusa_num_layers": 1})]`` or
    ``[("eagle", {"eagle_num_layers": 1})]`` (EAGLE-3: ``{"use_aux_hidden_state": True, ...}``) or
    ``[("dflash", {"dflash_mask_token_id": 3, "dflash_architecture_config": {"num_hidden_layers": 2}})]``.
    """
    if is_converted(model):
        raise ValueError(
            f"model is already converted ({model.spec_mode}); convert a fresh base model instead"
        )
    arch = check_causal_lm(model)
    if not isinstance(modes, (list, tuple)) or len(modes) != 1:
        raise ValueError("modes must be a list with one (mode, config) pair, e.g. [('medusa', {...})]")
    pair = modes[0]
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        raise ValueError(f"each mode must be a (mode, config) pair, got {pair!r}")
    mode, cfg = pair[0], parse_mode_config(*pair)
    base_cfg = model.config
    param = next(model.parameters())

    # Build (and validate) the drafter before touching the model: a bad config leaves it unchanged.
    if mode == "medusa":
        drafter = build_medusa_heads(cfg, model.get_output_embeddings())
    elif mode == "dflash":
        cfg.resolve(base_cfg)
        drafter = DFlashModule(cfg, base_cfg).to(device=param.device, dtype=param.dtype)
    else:
        cfg.resolve(base_cfg)
        drafter = EagleModule(cfg, base_cfg, arch)
        if drafter.eagle3:
            with torch.no_grad():  # start the draft head from the base lm_head rows it covers
                ids = torch.arange(cfg.draft_vocab_size) + drafter.d2t
                drafter.lm_head.weight.copy_(model.get_output_embeddings().weight[ids])
                drafter.norm.weight.copy_(model.model.norm.weight)
        drafter = drafter.to(device=param.device, dtype=param.dtype)

    for p in model.parameters():
        p.requires_grad_(False)
    setattr(model, DRAFTER_ATTR[mode], drafter)
    model.__class__ = _speculative_class(type(model))
    model.spec_mode = mode
    model.spec_config = cfg
    model.config.speculative_decoding = {"mode": mode, "config": _cfg_dict(cfg)}
    return model


def _cfg_dict(cfg) -> dict:
    return cfg.to_dict() if isinstance(cfg, (EagleConfig, DFlashConfig)) else dict(vars(cfg))


@contextlib.contextmanager
def undo_convert_on_error(model):
    """Run a convert-then-load sequence; if it raises, return ``model`` to its unconverted state.

    So a drafter file that does not fit leaves the base usable (unconverted, trainable as before).
    """
    cls = type(model)
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    try:
        yield model
    except BaseException:
        if is_converted(model) and not issubclass(cls, SpeculativeModel):
            model._modules.pop(DRAFTER_ATTR[model.spec_mode], None)
            model.__class__ = cls
            for attr in ("spec_mode", "spec_config"):
                model.__dict__.pop(attr, None)
            if hasattr(model.config, CONFIG_KEY):
                delattr(model.config, CONFIG_KEY)
            for name, p in model.named_parameters():
                p.requires_grad_(grads.get(name, p.requires_grad))
        raise


def convert_from_saved(model, saved: dict):
    """Re-convert a freshly loaded base from ``config.speculative_decoding``."""
    if not isinstance(saved, dict) or "mode" not in saved:
        raise ValueError(
            f"malformed {CONFIG_KEY} entry {saved!r}; expected {{'mode': 'medusa'|'eagle'|'dflash', 'config': {{...}}}}"
        )
    return convert(model, [(saved["mode"], dict(saved.get("config") or {}))])
