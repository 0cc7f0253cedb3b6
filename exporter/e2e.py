"""End-to-end compare: greedy tokens of the PyTorch base vs the ONNX Runtime decoder.

Used by ``python -m exporter.compare model_dir out_dir --e2e [--prompt TEXT ...]``. For each prompt
the PyTorch base decodes greedily (HF ``generate``), and the runtime decodes the same prompt
speculatively and autoregressively; the report gives, per prompt, whether the three agree and the
first index where they differ.

A quantized base is a different model (``quantized=True``): speculative decoding must still return
exactly the greedy tokens of *the same quantized graphs*, so that is what passes or fails, and the
agreement with PyTorch (how many leading tokens match) is reported as a distance, not gated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from exporter.errors import UserError


@dataclass
class TokenRow:
    prompt: str
    torch_tokens: list[int]
    speculative_tokens: list[int]
    autoregressive_tokens: list[int]
    first_mismatch: int | None  # index into the new tokens, None when all gated sequences agree
    mean_accepted_length: float
    quantized: bool = False  # gate: speculative == autoregressive only; PyTorch agreement reported
    torch_agreement: int | None = None  # leading new tokens equal to PyTorch's (quantized rows)
    category: str = ""  # the built-in chat prompts' category ("" for other prompts)
    speculative_steps: int = 0  # base forwards that verified drafts
    accepted_per_pos: list[int] | None = None  # [k]: drafted steps that accepted more than k drafts

    @property
    def ok(self) -> bool:
        return self.first_mismatch is None


def _first_mismatch(*seqs: list[int]) -> int | None:
    n = max(len(s) for s in seqs)
    for i in range(n):
        if len({s[i] if i < len(s) else None for s in seqs}) > 1:
            return i
    return None


def check_prompts(prompts: list | None) -> None:
    """Refuse empty prompts up front: there is no last token to continue from."""
    for i, p in enumerate(prompts or []):
        if (isinstance(p, str) and not p) or (not isinstance(p, str) and len(p) == 0):
            raise UserError(f"--prompt #{i + 1} is empty; give each prompt at least one token of text")


def compare_tokens(model, decoder, prompts: list, max_new_tokens: int = 32, quantized: bool = False,
                   categories: list[str] | None = None) -> list[TokenRow]:
    """Greedy tokens of ``model`` (PyTorch) vs ``decoder`` (graphs.Decoder) for each prompt.

    ``quantized``: the decoder's base is quantized, a different model; see the module docstring.
    ``categories``: each prompt's category, for the acceptance by category.
    """
    check_prompts(prompts)
    rows = []
    eos = sorted(decoder.eos) or None
    for i, p in enumerate(prompts):
        ids = decoder.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise UserError(f"prompt #{i + 1} {p!r} encodes to no tokens; give each prompt at least one token of text")
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=decoder.pad)
        ref = out[0, len(ids):].tolist()
        spec = decoder.generate(ids, max_new_tokens=max_new_tokens) if decoder.kind else None
        ar = decoder.generate(ids, max_new_tokens=max_new_tokens, mode="autoregressive")
        spec_tokens = spec.token_ids if spec else ar.token_ids
        gated = (spec_tokens, ar.token_ids) if quantized else (ref, spec_tokens, ar.token_ids)
        agree = _first_mismatch(ref, ar.token_ids)
        rows.append(TokenRow(
            prompt=p if isinstance(p, str) else str(p),
            torch_tokens=ref,
            speculative_tokens=spec_tokens,
            autoregressive_tokens=ar.token_ids,
            first_mismatch=_first_mismatch(*gated),
            mean_accepted_length=spec.stats.mean_accepted_length if spec else 1.0,
            quantized=quantized,
            torch_agreement=(len(ref) if agree is None else agree) if quantized else None,
            category=categories[i] if categories else "",
            speculative_steps=spec.stats.speculative_steps if spec else 0,
            accepted_per_pos=list(spec.stats.accepted_per_pos) if spec else None,
        ))
    return rows


def default_prompts(decoder, n: int = 4, seed: int = 0) -> list:
    """Held-out chat prompts where the export has a chat template (one per category: see
    ``exporter.chat_prompts.rendered_heldout``), else ``n`` Python snippets, else random ids."""
    if decoder.tokenizer is not None:
        from exporter.prompts import DEFAULT_PROMPTS

        return DEFAULT_PROMPTS[:n]
    rng = np.random.default_rng(seed)
    vocab = decoder.manifest.source["vocab_size"]
    banned = decoder.eos | {decoder.pad}
    return [[int(t) for t in rng.integers(0, vocab, size=8) if int(t) not in banned] or [3] for _ in range(n)]


def by_category(rows: list[TokenRow]) -> dict:
    """tau and acceptance per draft position, per category (and "all"), of the speculative runs."""
    groups: dict[str, list[TokenRow]] = {}
    for r in rows:
        groups.setdefault(r.category or "all", []).append(r)
    if len(groups) > 1:
        groups["all"] = rows
    out = {}
    for cat, rs in groups.items():
        steps = sum(r.speculative_steps for r in rs)
        new = sum(len(r.speculative_tokens) for r in rs)
        forwards = sum(len(r.speculative_tokens) / r.mean_accepted_length for r in rs if r.mean_accepted_length)
        width = max((len(r.accepted_per_pos or []) for r in rs), default=0)
        out[cat] = {"prompts": len(rs), "tau": new / forwards if forwards else 1.0,
                    "acceptance_per_position": [sum((r.accepted_per_pos or [0] * width)[k]
                                                    if k < len(r.accepted_per_pos or []) else 0 for r in rs)
                                                / steps for k in range(width)] if steps else []}
    return out


def table(rows: list[TokenRow]) -> str:
    lines = [f"{'prompt':32} {'new':>4} {'tau':>5}  result"]
    for r in rows:
        verdict = "identical" if r.ok else f"DIFFER at new token {r.first_mismatch}"
        if r.quantized:
            verdict += f"; PyTorch agrees on the first {r.torch_agreement} of {len(r.torch_tokens)}"
        lines.append(f"{r.prompt[:32]!r:32} {len(r.torch_tokens):4d} {r.mean_accepted_length:5.2f}  {verdict}")
    if any(r.speculative_steps for r in rows):
        for cat, a in by_category(rows).items():
            lines.append(f"{cat:>14}: tau {a['tau']:.2f}, accepted per position "
                         + " ".join(f"{x:.2f}" for x in a["acceptance_per_position"]))
    bad = sum(not r.ok for r in rows)
    if any(r.quantized for r in rows):
        lines.append("PASS: greedy tokens identical (speculative, autoregressive, on the same quantized graphs; "
                     "PyTorch agreement is a distance, not gated)" if not bad else f"FAIL: {bad} prompt(s) differ")
    else:
        lines.append("PASS: greedy tokens identical (PyTorch, speculative, autoregressive)" if not bad
                     else f"FAIL: {bad} prompt(s) differ")
    return "\n".join(lines)


def to_json(rows: list[TokenRow]) -> dict:
    return {"ok": all(r.ok for r in rows), "by_category": by_category(rows),
            "rows": [{**asdict(r), "ok": r.ok} for r in rows]}
