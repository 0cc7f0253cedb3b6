"""Drafter configs: typed, validated, unknown keys rejected.

Field names follow ModelOpt's (``medusa_num_heads``, ``eagle_num_layers``, ...), so a config
written for ``mtsp.convert`` works here unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _check_keys(cls, cfg: dict, what: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"unknown {what} config key(s) {unknown}; accepted: {sorted(known)}")


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass
class MedusaConfig:
    medusa_num_heads: int = 2
    """Heads; head k predicts the token k+2 positions ahead (the base lm_head predicts k=1)."""
    medusa_num_layers: int = 1
    """Residual SiLU blocks per head, each with its own weights."""
    medusa_loss_decay: float = 0.8
    """Loss weight of head k is decay**k: far heads are less accurate and matter less (Medusa paper)."""

    def __post_init__(self):
        _positive_int("medusa_num_heads", self.medusa_num_heads)
        _positive_int("medusa_num_layers", self.medusa_num_layers, minimum=0)
        if not 0 < self.medusa_loss_decay <= 1:
            raise ValueError(f"medusa_loss_decay must be in (0, 1], got {self.medusa_loss_decay}")

    @classmethod
    def from_dict(cls, cfg: dict) -> MedusaConfig:
        _check_keys(cls, cfg, "medusa")
        return cls(**cfg)


# Keys of ModelOpt's newer ``eagle_architecture_config`` that map onto our fields.
_ARCH_KEY_MAP = {
    "num_hidden_layers": "eagle_num_layers",
    "use_aux_hidden_state": "use_aux_hidden_state",
    "eagle_aux_hidden_state_layer_ids": "eagle_aux_hidden_state_layer_ids",
    "draft_vocab_size": "draft_vocab_size",
    "use_input_layernorm_in_first_layer": "use_input_layernorm_in_first_layer",
}
# Keys that override the drafter layer's HF config (sizes of its decoder layer).
_LAYER_OVERRIDE_KEYS = {
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "attention_bias", "mlp_bias",
}


@dataclass
class EagleConfig:
    eagle_num_layers: int = 1
    """Decoder layers in the drafter, of the base's own architecture."""
    use_aux_hidden_state: bool = False
    """EAGLE-3: fuse hidden states of several base layers instead of reading only the last one."""
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    """EAGLE-3 base layers to fuse; None = ModelOpt's choice (1, L//2-1, L-4), clamped to [0, L)."""
    draft_vocab_size: int | None = None
    """EAGLE-3: a drafter vocabulary smaller than the base's, mapped back through ``d2t``."""
    use_input_layernorm_in_first_layer: bool = True
    """EAGLE-1: SafeAILab's drafter skips the first layer's input norm; ModelOpt keeps it."""
    eagle_ttt_steps: int = 3
    """EAGLE-3 training-time test: drafting steps unrolled in training (the drafter feeds itself)."""
    eagle_hidden_loss_weight: float = 1.0
    """EAGLE-1: weight of the smooth-L1 hidden-state regression (the CE term has weight 0.1)."""
    eagle_loss_decay: float = 0.8
    """EAGLE-3: weight of TTT step j is decay**j."""
    layer_overrides: dict = field(default_factory=dict)
    """Drafter-layer HF config overrides (from ``eagle_architecture_config``)."""
    eagle_architecture_config: dict | None = None
    """ModelOpt's newer nested form; merged into the fields above by ``__post_init__``."""

    def __post_init__(self):
        arch = self.eagle_architecture_config
        if arch is not None:
            if not isinstance(arch, dict):
                raise TypeError("eagle_architecture_config must be a dict")
            known = set(_ARCH_KEY_MAP) | _LAYER_OVERRIDE_KEYS
            unknown = sorted(set(arch) - known)
            if unknown:
                raise ValueError(
                    f"unknown eagle_architecture_config key(s) {unknown}; accepted: {sorted(known)}"
                )
            for k, v in arch.items():
                if k in _ARCH_KEY_MAP:
                    setattr(self, _ARCH_KEY_MAP[k], v)
                else:
                    self.layer_overrides[k] = v
            self.eagle_architecture_config = None
        if not isinstance(self.layer_overrides, dict):
            raise TypeError(f"layer_overrides must be a dict, got {type(self.layer_overrides).__name__}")
        unknown = sorted(set(self.layer_overrides) - _LAYER_OVERRIDE_KEYS)
        if unknown:
            raise ValueError(f"unknown layer_overrides key(s) {unknown}; accepted: {sorted(_LAYER_OVERRIDE_KEYS)}")
        _positive_int("eagle_num_layers", self.eagle_num_layers)
        _positive_int("eagle_ttt_steps", self.eagle_ttt_steps)
        if self.draft_vocab_size is not None:
            _positive_int("draft_vocab_size", self.draft_vocab_size)
            if not self.use_aux_hidden_state:
                raise ValueError("draft_vocab_size needs use_aux_hidden_state=True (an EAGLE-3 drafter)")
        if not 0 < self.eagle_loss_decay <= 1:
            raise ValueError(f"eagle_loss_decay must be in (0, 1], got {self.eagle_loss_decay}")
        ids = self.eagle_aux_hidden_state_layer_ids
        if ids is not None and len(ids) == 0:  # ModelOpt's default config spells "the default layers" as []
            ids = self.eagle_aux_hidden_state_layer_ids = None
        if ids is not None:
            ids = list(ids)
            if not self.use_aux_hidden_state:
                raise ValueError(
                    "eagle_aux_hidden_state_layer_ids needs use_aux_hidden_state=True (an EAGLE-3 drafter)"
                )
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError(f"eagle_aux_hidden_state_layer_ids must be a list of ints, got {ids}")
            self.eagle_aux_hidden_state_layer_ids = ids

    @classmethod
    def from_dict(cls, cfg: dict) -> EagleConfig:
        _check_keys(cls, cfg, "eagle")
        return cls(**cfg)

    def resolve(self, base_config) -> EagleConfig:
        """Fill base-dependent defaults and check them against the base model."""
        n = base_config.num_hidden_layers
        if self.use_aux_hidden_state:
            ids = self.eagle_aux_hidden_state_layer_ids
            if ids is None:
                ids = [min(1, n - 1), max(0, n // 2 - 1), max(0, n - 4)]
            bad = [i for i in ids if not 0 <= i < n]
            if bad:
                raise ValueError(
                    f"eagle_aux_hidden_state_layer_ids {bad} out of range: the base has layers 0..{n - 1}"
                )
            self.eagle_aux_hidden_state_layer_ids = list(ids)
            if self.draft_vocab_size is None:
                self.draft_vocab_size = base_config.vocab_size
            if self.draft_vocab_size > base_config.vocab_size:
                raise ValueError(
                    f"draft_vocab_size {self.draft_vocab_size} exceeds the base vocabulary "
                    f"({base_config.vocab_size})"
                )
        return self

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("eagle_architecture_config")
        return d


MODES = {"medusa": MedusaConfig, "eagle": EagleConfig}


def parse_mode_config(mode, config) -> MedusaConfig | EagleConfig:
    if mode not in MODES:
        raise ValueError(f"unknown speculative mode {mode!r}; accepted: {sorted(MODES)}")
    cls = MODES[mode]
    if isinstance(config, cls):
        return config
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise TypeError(f"{mode} config must be a dict or {cls.__name__}, got {type(config).__name__}")
    return cls.from_dict(dict(config))
