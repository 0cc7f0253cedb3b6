"""Load a model directory for export: a HF causal LM, with its drafter, or with ``--drafter PATH``.

Every failure becomes a :class:`UserError` with one line that names the problem and the fix. Weights
load through safetensors (or ``torch.load(weights_only=True)`` inside transformers); remote code
is never run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from exporter.errors import UserError

__all__ = ["UserError", "load", "load_model"]  # UserError lives in exporter.errors; importable here as before


def _check_model_dir(model_dir: Path) -> dict:
    if not model_dir.exists():
        raise UserError(f"model_dir {model_dir} does not exist; pass a directory saved with save_pretrained")
    if not model_dir.is_dir():
        raise UserError(f"model_dir {model_dir} is not a directory; pass a directory saved with save_pretrained")
    if not os.access(model_dir, os.R_OK | os.X_OK):
        raise UserError(f"model_dir {model_dir} is not readable; check its permissions")
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        raise UserError(f"{model_dir} has no config.json: it is not a Hugging Face model directory")
    try:
        data = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg} is not valid JSON ({e}); re-save the model") from None
    weights = list(model_dir.glob("*.safetensors")) + list(model_dir.glob("*.bin"))
    if not weights:
        raise UserError(f"{model_dir} has no weights (*.safetensors or *.bin); save the model with save_pretrained")
    return data


def load(model_dir, *, drafter=None, trust_remote_code: bool = False):
    """The load stage: ``model_dir`` checked (its side files first: generation_config.json, tokenizer.json,
    before any tracing), then the PyTorch model with its drafter (:func:`load_model`)."""
    from exporter.inputs import COPIED_FILES, check_export_inputs

    check_export_inputs(Path(model_dir), COPIED_FILES)
    return load_model(model_dir, drafter=drafter, trust_remote_code=trust_remote_code)


def load_model(model_dir, drafter: str | os.PathLike | None = None, trust_remote_code: bool = False):
    """The PyTorch model to export: float32, eval mode, drafter attached if there is one."""
    import torch  # here, not at module level: the CLIs import UserError without needing torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from exporter.arch import get_arch
    from exporter.hf_compat import no_progress_bars
    from exporter.speculative.checkpoint import enable_huggingface_checkpointing

    model_dir = Path(model_dir)
    _check_model_dir(model_dir)
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise UserError(f"{model_dir} needs its own Python code to load (auto_map in config.json); review that "
                            f"code, then pass --trust-remote-code") from None
        raise UserError(f"cannot read the config in {model_dir}: {_one_line(e)}") from None
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise UserError(
            f"{model_dir} holds a {archs[0]} ({config.model_type}), not a causal language model; export needs a "
            f"decoder-only causal LM saved from AutoModelForCausalLM"
        )
    try:
        get_arch(config)
    except ValueError as e:
        raise UserError(f"{model_dir}: {e}") from None
    from exporter.inputs import check_checkpoint_layers, check_checkpoint_sizes, check_rope

    check_rope(config, model_dir)
    check_checkpoint_layers(config, model_dir)
    check_checkpoint_sizes(config, model_dir)
    if drafter is not None and getattr(config, "speculative_decoding", None):
        raise UserError(f"{model_dir} already holds a drafter; drop --drafter or export the plain base")
    enable_huggingface_checkpointing()
    try:
        with no_progress_bars():
            model = _from_pretrained_checked(AutoModelForCausalLM, model_dir, torch.float32, trust_remote_code)
    except UserError:
        raise
    except (ValueError, TypeError) as e:
        raise UserError(f"cannot load {model_dir}: {_one_line(e)}") from None
    except Exception as e:
        if "ignore_mismatched_sizes" in str(e):  # transformers: "... look at the above report", none above
            raise UserError(f"the weights in {model_dir} do not have the shapes its config.json asks for; fix the "
                            f"sizes in config.json (vocab_size, hidden_size, ...) or re-save the model") from None
        raise UserError(
            f"cannot load the weights in {model_dir} (corrupt or truncated?): {_one_line(e)}"
        ) from None
    if drafter is not None:
        from exporter.speculative.importers import load_external_drafter

        path = Path(drafter)
        if not path.exists():
            raise UserError(f"--drafter {path} does not exist")
        try:
            load_external_drafter(model, path)
        except (ValueError, TypeError) as e:
            if _unsafe_advice(e):
                raise UserError(f"cannot read the drafter {path}: {_one_line(e)}") from None
            raise UserError(f"drafter {path} does not fit {model_dir}: {_one_line(e)}") from None
        except Exception as e:  # safetensors/pickle errors of a damaged file have no common base class
            raise UserError(f"cannot read the drafter {path} (corrupt or truncated?): {_one_line(e)}") from None
    return model.eval()


def _from_pretrained_checked(auto_cls, model_dir: Path, dtype, trust_remote_code: bool):
    """``from_pretrained`` that refuses a checkpoint lacking some of the model's weights.

    transformers fills missing tensors with a random init and only logs it (and our checkpointing
    silences that log): an export, and every compare against it, would then run on weights nobody
    trained. The base loads with ``output_loading_info=True``; the drafter is restored strictly after.
    """
    from exporter.speculative.checkpoint import (
        huggingface_checkpointing_disabled,
        quiet_transformers,
        restore_drafter,
    )
    from exporter.speculative.convert import CONFIG_KEY

    with huggingface_checkpointing_disabled(), quiet_transformers():  # drafter keys are "unexpected" here
        model, info = auto_cls.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code,
                                               output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserError(
            f"the checkpoint in {model_dir} lacks {len(missing)} weight(s) of the model: "
            f"{', '.join(missing[:3])}{more}; a shard or index entry is missing: re-save the model (exporting "
            f"would use random weights)"
        )
    saved = getattr(model.config, CONFIG_KEY, None)
    if saved:
        restore_drafter(model, saved, model_dir)
    return model


def _unsafe_advice(e: BaseException) -> bool:
    """torch.load's refusal, whose text advises retrying with weights_only=False (never do that)."""
    text = str(e)
    return ("weights_only" in text and "False" in text) or "Weights only load failed" in text


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    if _unsafe_advice(e):  # torch's UnpicklingError advice (retry with weights_only=False) is unsafe
        return "not a weights-only PyTorch file (a pickle of code or objects is never loaded); save plain tensors"
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
