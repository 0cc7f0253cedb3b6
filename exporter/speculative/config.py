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


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """ModelOpt's choice of the base layers a DFlash drafter fuses (one per draft layer), spread over
    1..L-3 (ModelOpt ``plugins/modeling_dflash.py::build_target_layer_ids``; z-lab's is the same):
    (36, 5) -> [1, 9, 17, 25, 33], (30, 3) -> [1, 14, 27], (6, 2) -> [1, 3]. Python's round (banker's)."""
    if num_target_layers < num_draft_layers:
        raise ValueError(
            f"num_target_layers ({num_target_layers}) must be >= num_draft_layers ({num_draft_layers})"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start = min(1, num_target_layers - 1)
    end = max(start, num_target_layers - 3)
    span = end - start
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# ModelOpt ``dflash/default_config.py::default_dflash_config``: merged under the user's
# ``dflash_architecture_config`` at convert time (``dflash/conversion.py``).
DEFAULT_DFLASH_ARCHITECTURE = {
    "num_hidden_layers": 5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "_attn_implementation": "sdpa",
}
# Architecture keys this drafter reads; the dims left unset take the base's (what ModelOpt's
# ``HFDFlashModel.modify`` means to do: its Qwen3Config defaults shadow the base's, docs/dflash.md 1.2).
_DFLASH_DIM_KEYS = {"intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                    "max_position_embeddings"}
_DFLASH_ARCH_KEYS = set(DEFAULT_DFLASH_ARCHITECTURE) | _DFLASH_DIM_KEYS | {"projector_type"}


@dataclass
class DFlashConfig:
    """ModelOpt's ``DFlashConfig`` (``modelopt/torch/speculative/config.py``): the same names and defaults,
    so a ModelOpt ``dflash`` config works unchanged. DFlash (z-lab, arXiv 2602.06036) drafts a whole
    block ``[anchor, mask x (b-1)]`` in one call from the base's hidden states of a few layers."""

    dflash_block_size: int = 8
    """Tokens per block, the anchor included: b-1 tokens are drafted per call."""
    dflash_mask_token_id: int | None = None
    """The token of the b-1 drafted slots; its embedding is the base's (frozen, shared). ModelOpt falls
    back to the tokenizer's mask token; this convert has no tokenizer, so it must be set (training
    picks a token the distilled data never holds)."""
    dflash_architecture_config: dict = field(default_factory=dict)
    """Draft layers: ``num_hidden_layers`` (5) and the keys of ModelOpt's default_dflash_config; dims unset
    (heads, kv heads, head_dim, intermediate_size, rope_theta) are the base's."""
    dflash_target_layer_ids: list[int] | None = None
    """(This project's extension.) Base layers fused; None = ``build_target_layer_ids(L, num layers)``."""
    dflash_freeze_base_model: bool = True
    """The base is always frozen here."""
    dflash_self_logit_distillation: bool = True
    """Soft targets (the base's distribution) where the base's logits are at hand; hard targets on the
    feature cache (self-distilled text: the label is the base's argmax)."""
    dflash_loss_objective: str = "dpace"
    """Position weights: "dpace" (D-PACE, arXiv 2605.18810, confidence-derived) or "decay" (Eq. 4)."""
    dflash_loss_decay_factor: float = 0.0
    """gamma of the decay weights exp(-(k-1)/gamma) (0 disables; used by "decay" only)."""
    dflash_dpace_alpha: float = 0.5
    """D-PACE smoothing alpha in (0, 1]."""
    dflash_num_anchors: int = 512
    """Blocks sampled per sequence per step (random answer positions)."""
    dflash_offline: bool = False
    """Accepted, no effect: training here always reads cached base features (or runs the base)."""
    dflash_report_acc: bool = True
    """Accepted, no effect."""
    dflash_use_torch_compile: bool = True
    """Accepted, no effect."""
    dflash_draft_vocab_size: int | None = None
    """Ours, not ModelOpt's: the drafter's logits over this many tokens only (the ``draft_vocab``
    buffer, the rows of the base's head it keeps; the rest -inf). Set where the drafter trained its
    loss over them (samples/train_drafter.py): on a CPU the head over the whole vocabulary is most of
    a draft call. None: the whole vocabulary (ModelOpt's and z-lab's drafters)."""
    dflash_swa_window_size: int | None = None
    """Sliding-window drafter attention: not supported yet (None only)."""
    dflash_export_rope_scaling: dict = field(default_factory=dict)
    """YaRN & co. at export: not supported yet ({} only)."""
    # Domino / DSpark heads (projector_type): accepted at their defaults so ModelOpt dicts load; unused.
    dflash_lambda_base_start: float = 1.0
    dflash_lambda_base_decay_ratio: float = 1.0
    dflash_ce_loss_alpha: float = 0.1
    dflash_l1_loss_alpha: float = 0.9
    dflash_confidence_head_alpha: float = 0.0

    def __post_init__(self):
        arch = self.dflash_architecture_config
        if not isinstance(arch, dict):
            raise TypeError("dflash_architecture_config must be a dict")
        unknown = sorted(set(arch) - _DFLASH_ARCH_KEYS)
        if unknown:
            raise ValueError(
                f"unknown dflash_architecture_config key(s) {unknown}; accepted: {sorted(_DFLASH_ARCH_KEYS)}"
            )
        if arch.get("projector_type") not in (None, "dflash"):
            raise ValueError(f"dflash_architecture_config.projector_type {arch['projector_type']!r} is not "
                             f"supported (Domino/DSpark heads); use 'dflash' or leave it unset")
        self.dflash_architecture_config = {**DEFAULT_DFLASH_ARCHITECTURE, **arch}
        self.dflash_architecture_config.pop("projector_type", None)
        _positive_int("dflash_block_size", self.dflash_block_size, minimum=2)
        _positive_int("dflash_num_anchors", self.dflash_num_anchors)
        _positive_int("dflash_architecture_config.num_hidden_layers",
                      self.dflash_architecture_config["num_hidden_layers"])
        if self.dflash_mask_token_id is not None:
            _positive_int("dflash_mask_token_id", self.dflash_mask_token_id, minimum=0)
        if self.dflash_draft_vocab_size is not None:
            _positive_int("dflash_draft_vocab_size", self.dflash_draft_vocab_size)
        if self.dflash_loss_objective not in ("dpace", "decay"):
            raise ValueError(f"dflash_loss_objective must be 'dpace' or 'decay', got {self.dflash_loss_objective!r}")
        if not 0.0 < self.dflash_dpace_alpha <= 1.0:
            raise ValueError(f"dflash_dpace_alpha must be in (0, 1], got {self.dflash_dpace_alpha}")
        if self.dflash_loss_decay_factor < 0:
            raise ValueError(f"dflash_loss_decay_factor must be >= 0, got {self.dflash_loss_decay_factor}")
        if not self.dflash_freeze_base_model:
            raise ValueError("dflash_freeze_base_model=False is not supported: the base stays frozen")
        if self.dflash_swa_window_size is not None:
            raise ValueError("dflash_swa_window_size is not supported yet (sliding-window drafters); leave it None")
        if self.dflash_export_rope_scaling:
            raise ValueError("dflash_export_rope_scaling is not supported yet; leave it {}")
        ids = self.dflash_target_layer_ids
        if ids is not None:
            ids = list(ids)
            if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError(f"dflash_target_layer_ids must be a non-empty list of ints, got {ids}")
            self.dflash_target_layer_ids = ids

    @property
    def num_layers(self) -> int:
        return self.dflash_architecture_config["num_hidden_layers"]

    @classmethod
    def from_dict(cls, cfg: dict) -> DFlashConfig:
        _check_keys(cls, cfg, "dflash")
        return cls(**cfg)

    def resolve(self, base_config) -> DFlashConfig:
        """Fill the target layers and check them and the mask token against the base model."""
        n = base_config.num_hidden_layers
        if self.dflash_target_layer_ids is None:
            self.dflash_target_layer_ids = build_target_layer_ids(n, self.num_layers)
        bad = [i for i in self.dflash_target_layer_ids if not 0 <= i < n - 1]
        if bad:  # HF's hidden_states[L] is post-norm while the base graph emits layer outputs pre-norm
            raise ValueError(f"dflash_target_layer_ids {bad} out of range: a DFlash drafter reads layers "
                             f"0..{n - 2} of this {n}-layer base (not the last)")
        if self.dflash_mask_token_id is None:
            raise ValueError("dflash_mask_token_id is unset: pass the id of a token the training data never "
                             "holds, e.g. the tokenizer's mask token (ModelOpt's fallback)")
        if self.dflash_mask_token_id >= base_config.vocab_size:
            raise ValueError(f"dflash_mask_token_id {self.dflash_mask_token_id} is outside the base vocabulary "
                             f"({base_config.vocab_size})")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


MODES = {"medusa": MedusaConfig, "eagle": EagleConfig, "dflash": DFlashConfig}


def parse_mode_config(mode, config) -> MedusaConfig | EagleConfig | DFlashConfig:
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
