"""Drafters for a frozen HF causal LM: Medusa heads, EAGLE-1/EAGLE-3 and DFlash, ModelOpt-style.

    from exporter.speculative import convert, enable_huggingface_checkpointing
    convert(model, [("medusa", {"medusa_num_heads": 2, "medusa_num_layers": 1})])
    enable_huggingface_checkpointing()
    Trainer(model=model, ...).train(); model.save_pretrained(d)
    AutoModelForCausalLM.from_pretrained(d)   # the converted model again
"""

from exporter.speculative.config import DFlashConfig, EagleConfig, MedusaConfig
from exporter.speculative.convert import convert, is_converted

__all__ = ["DFlashConfig", "EagleConfig", "MedusaConfig", "convert", "is_converted"]

from exporter.speculative.checkpoint import (
    disable_huggingface_checkpointing,
    enable_huggingface_checkpointing,
    load_drafter,
    save_drafter,
)

__all__ += [
    "disable_huggingface_checkpointing",
    "enable_huggingface_checkpointing",
    "load_drafter",
    "save_drafter",
]

from exporter.speculative.importers import FORMATS, load_external_drafter  # noqa: E402

__all__ += ["FORMATS", "load_external_drafter"]

from exporter.speculative.distill import DraftCollator, DraftDataset, self_distill  # noqa: E402

__all__ += ["DraftCollator", "DraftDataset", "self_distill"]
