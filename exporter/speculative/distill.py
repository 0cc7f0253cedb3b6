"""Self-distillation data: train the drafter on what the base model itself says.

A drafter is judged by how often the *base* accepts its guesses, so the best training text is the
base's own greedy output (ModelOpt and EAGLE both recommend it): each example is a prompt followed by
the base's greedy continuation, with loss only on the continuation::

    prompt "def f(" -> base greedily continues "x):\\n    return x"
    input_ids = [d e f _ f ( x ) : ...]      labels = [-100 x6, x ) : ...]

:func:`self_distill` makes the examples; :class:`DraftDataset` and :class:`DraftCollator` feed them (or
any token lists) to a HF ``Trainer``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


def _encode(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("string prompts need a tokenizer; pass one, or pass prompts as lists of token ids")
        out = tokenizer.encode(prompt)
        ids = out.ids if hasattr(out, "ids") else out  # tokenizers.Tokenizer vs transformers tokenizers
    elif isinstance(prompt, torch.Tensor):
        ids = prompt.flatten().tolist()
    else:
        ids = prompt
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError(f"empty prompt {prompt!r}: each prompt needs at least one token")
    return ids


def _special_id(name: str, tokenizer, model):
    """``pad_token_id`` / ``eos_token_id`` from the tokenizer, else the model's configs."""
    for source in (tokenizer, getattr(model, "generation_config", None), model.config):
        value = getattr(source, name, None) if source is not None else None
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


@torch.no_grad()
def self_distill(
    model,
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int = 64,
    *,
    batch_size: int = 8,
    eos_token_id: int | None = None,
    progress=None,
) -> list[dict[str, list[int]]]:
    """Greedy continuations of ``prompts`` by ``model`` as training examples.

    ``model``: a HF causal LM, converted or not (a converted model's forward without ``labels`` is the
    base's). ``tokenizer``: anything with ``encode`` (``tokenizers.Tokenizer`` or a transformers
    tokenizer); ``None`` when the prompts are token-id lists. Prompts are batched with left padding.
    Returns one ``{"input_ids", "attention_mask", "labels"}`` dict of int lists per prompt; labels are
    ``-100`` on the prompt. A continuation ends at (and includes) the first EOS (``eos_token_id``, else
    the tokenizer's or the model's), as the base's own generation would. ``progress``: called with a
    line after every batch ("self-distillation: 16/48 prompts"), so a long run is not silent.
    """
    from transformers import GenerationConfig

    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of strings or of token-id lists")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    encoded = [_encode(tokenizer, p) for p in prompts]
    eos = eos_token_id if eos_token_id is not None else _special_id("eos_token_id", tokenizer, model)
    pad = _special_id("pad_token_id", tokenizer, model)
    pad = pad if pad is not None else (eos if eos is not None else 0)
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=_special_id("bos_token_id", tokenizer, model),
    )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    examples = []
    try:
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start : start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, p in enumerate(chunk):  # left padding: every prompt ends where generation starts
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg
            )  # (B, width + new)
            if progress is not None:
                progress(f"self-distillation: {min(start + batch_size, len(encoded))}/{len(encoded)} prompts")
            for row, p in enumerate(chunk):
                new = out[row, width:].tolist()
                if eos is not None and eos in new:  # finished rows are padded after their EOS
                    new = new[: new.index(eos) + 1]
                examples.append(
                    {
                        "input_ids": p + new,
                        "attention_mask": [1] * (len(p) + len(new)),
                        "labels": [IGNORE_INDEX] * len(p) + new,
                    }
                )
            log.info("self_distill: %d/%d prompts", len(examples), len(encoded))
    finally:
        model.train(was_training)
    return examples


class DraftDataset(Dataset):
    """A list of ``{"input_ids", ["attention_mask"], ["labels"]}`` examples, for a HF ``Trainer``."""

    def __init__(self, examples):
        self.examples = list(examples)
        for i, ex in enumerate(self.examples):
            if "input_ids" not in ex:
                raise ValueError(f"example {i} has no input_ids (keys: {sorted(ex)})")

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


@dataclass
class DraftCollator:
    """Right-pads a list of examples into a batch; pads get ``attention_mask=0`` and ``labels=-100``.

    Examples without ``labels`` train on every token; without ``attention_mask``, on all of them.
    """

    pad_token_id: int = 0
    max_length: int | None = None
    """Truncate longer examples (keeping the start) to this many tokens."""
    pad_to_multiple_of: int | None = None

    def __call__(self, features) -> dict[str, torch.Tensor]:
        rows = []
        for f in features:
            ids = _as_list(f["input_ids"])
            mask = _as_list(f["attention_mask"]) if f.get("attention_mask") is not None else [1] * len(ids)
            labels = _as_list(f["labels"]) if f.get("labels") is not None else list(ids)
            if not len(ids) == len(mask) == len(labels):
                raise ValueError(f"input_ids, attention_mask and labels differ in length: {len(ids)}, "
                                 f"{len(mask)}, {len(labels)}")
            if self.max_length is not None:
                ids, mask, labels = ids[: self.max_length], mask[: self.max_length], labels[: self.max_length]
            labels = [lab if m else IGNORE_INDEX for lab, m in zip(labels, mask)]
            rows.append((ids, mask, labels))
        width = max(len(r[0]) for r in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            "input_ids": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
            "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
        }
        for i, (ids, mask, labels) in enumerate(rows):
            n = len(ids)
            batch["input_ids"][i, :n] = torch.tensor(ids, dtype=torch.long)
            batch["attention_mask"][i, :n] = torch.tensor(mask, dtype=torch.long)
            batch["labels"][i, :n] = torch.tensor(labels, dtype=torch.long)
        return batch


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)
