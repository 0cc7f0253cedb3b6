"""Medusa heads: residual SiLU blocks on the base's last hidden state, one vocabulary head each.

Head k (0-based) reads the hidden state at position t and predicts the token at t+k+2 (the base
lm_head predicts t+1). Keys: ``medusa_heads.{k}.medusa_layers.{j}.linear``, ``medusa_heads.{k}.lm_head``.
ModelOpt and FasterDecoding hold each head as ``nn.Sequential(*blocks, lm_head)`` (keys ``{k}.{j}.linear``,
``{k}.{n}``); :mod:`exporter.speculative.importers` maps those files onto this layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exporter.speculative.config import MedusaConfig


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero so a new head starts as the base lm_head."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int):
        super().__init__()
        # A fresh block per layer: `[ResBlock(h)] * n` would share one block's weights n times.
        self.medusa_layers = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden, vocab: torch.Tensor | None = None):
        """Logits over the vocabulary, or over the token ids ``vocab`` only (training: a subset's rows
        of the projection, the same function of those tokens)."""
        for block in self.medusa_layers:
            hidden = block(hidden)
        return self.lm_head(hidden) if vocab is None else F.linear(hidden, self.lm_head.weight[vocab])


def build_medusa_heads(cfg: MedusaConfig, lm_head: nn.Linear) -> nn.ModuleList:
    """``cfg.medusa_num_heads`` heads whose vocabulary projections start as copies of ``lm_head``."""
    vocab, hidden = lm_head.weight.shape
    heads = nn.ModuleList(MedusaHead(hidden, vocab, cfg.medusa_num_layers) for _ in range(cfg.medusa_num_heads))
    with torch.no_grad():
        for h in heads:
            h.lm_head.weight.copy_(lm_head.weight)
    return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)


def medusa_logits(heads: nn.ModuleList, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (B, S, H) -> logits (B, S, heads, V)."""
    return torch.stack([h(hidden) for h in heads], dim=2)


def medusa_loss(logits: torch.Tensor, labels: torch.Tensor, decay: float) -> torch.Tensor:
    """Cross-entropy of head k at position t against labels[t+k+2], weighted decay**k.

    logits (B, S, heads, V); labels (B, S) with -100 where no loss is wanted.
    """
    total = logits.new_zeros((), dtype=torch.float32)
    seq = labels.shape[1]
    for k in range(logits.shape[2]):
        shift = k + 2
        if seq <= shift:
            break
        pred = logits[:, : seq - shift, k].float()  # (B, S-shift, V)
        target = labels[:, shift:]  # (B, S-shift)
        if (target != -100).any():
            total = total + decay**k * F.cross_entropy(pred.flatten(0, 1), target.flatten(), ignore_index=-100)
    return total


def medusa_rows_loss(heads: nn.ModuleList, hidden: torch.Tensor, labels: torch.Tensor, decay: float,
                     vocab: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`medusa_loss` of ``medusa_logits(heads, hidden)``, with each head run only on the rows whose
    target (k + 2 ahead) is set: a head's vocabulary projection is most of its cost, and on chat data
    most rows are prompt (measured on SmolLM2: 22 s a step at batch 16 with every row).

    ``vocab`` (sorted token ids): the softmax runs over those tokens only and rows whose target is not
    among them drop out; the vocabulary projection is the rest of the cost (on SmolLM2, 49,152 tokens
    against the ~8k its chat answers use)."""
    total = hidden.new_zeros((), dtype=torch.float32)
    seq = labels.shape[1]
    if vocab is not None:  # token id -> its index in vocab, -1 outside it
        index = torch.full((int(vocab.max()) + 1,), -1, dtype=torch.long, device=labels.device)
        index[vocab] = torch.arange(len(vocab), device=labels.device)
    for k, head in enumerate(heads):
        shift = k + 2
        if seq <= shift:
            break
        target = labels[:, shift:]  # (B, S-shift)
        ok = target != -100
        if vocab is not None:
            inside = torch.where(ok & (target <= len(index) - 1), index[target.clamp(0, len(index) - 1)], -1)
            ok, target = inside >= 0, inside
        if ok.any():
            logits = head(hidden[:, : seq - shift][ok], vocab)  # (rows, V or len(vocab))
            total = total + decay**k * F.cross_entropy(logits.float(), target[ok])
    return total

