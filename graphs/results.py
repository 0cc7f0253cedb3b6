"""What a decode run returns (results, stats, stream events) and how it picks tokens (Sampler)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphs.errors import InputError
from graphs.sampling import (
    MIN_TEMPERATURE,
    check_finite,
    greedy_accept,
    process_logits,
    sample_accept,
    typical_accept,
)
from graphs.trees import Tree


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # base forwards after prefill
    plain_steps: int = 0  # of them, forwards that verified no drafted token (autoregressive; adaptive fallback)
    accepted: list[int] = field(default_factory=list)  # tokens emitted per (step, live sequence); an
    # engine's totals keep the last ACCEPTED_WINDOW only (graphs.engine), the histogram below all of them
    accepted_counts: list[int] = field(default_factory=list)  # [k]: entries of ``accepted`` equal to k, exact
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_total: float = 0.0
    draft_calls: int = 0  # drafter graph calls after prefill (EAGLE step-wise: 1 + depth per step)
    time_to_first_token: float = 0.0  # seconds from the request's arrival to its first token (engine)
    draft_tokens: int = 0  # drafted tokens verified (tree nodes past the root, drafted steps only)
    accepted_drafts: int = 0  # of them, accepted (tokens emitted per drafted step, less the bonus)
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafted steps that accepted > k drafts

    def add_accepted(self, lengths: list[int], window: int | None = None) -> None:
        """Steps that emitted ``lengths`` tokens each: the list (its last ``window`` entries kept, None:
        all) and the exact histogram."""
        self.accepted += lengths
        if window is not None and len(self.accepted) > 2 * window:  # amortized: trimmed once per window
            del self.accepted[:-window]
        counts = self.accepted_counts
        for k in lengths:
            if k >= len(counts):
                counts += [0] * (k + 1 - len(counts))
            counts[k] += 1

    @property
    def histogram(self) -> list[int]:
        """[k]: steps that emitted k tokens, over every step (the list may hold the last ones only)."""
        if self.accepted_counts or not self.accepted:
            return list(self.accepted_counts)
        return np.bincount(self.accepted).tolist()  # a Stats filled by hand

    @property
    def mean_accepted_length(self) -> float:
        h = self.histogram
        n = sum(h)
        return sum(k * c for k, c in enumerate(h)) / n if n else 0.0

    @property
    def speculative_steps(self) -> int:
        """Base forwards that verified a drafted tree."""
        return self.steps - self.plain_steps

    @property
    def time_host(self) -> float:
        return max(0.0, self.time_total - self.time_prefill - self.time_draft - self.time_verify)

    @property
    def tokens_per_s(self) -> float:
        decode = self.time_total - self.time_prefill
        return self.new_tokens / decode if decode > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "plain_steps": self.plain_steps,
            "speculative_steps": self.speculative_steps,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_histogram": self.histogram,
            "tokens_per_s": self.tokens_per_s,
            "time_prefill": self.time_prefill,
            "time_draft": self.time_draft,
            "time_verify": self.time_verify,
            "time_host": self.time_host,
            "time_total": self.time_total,
            "draft_calls": self.draft_calls,
            "time_to_first_token": self.time_to_first_token,
            "draft_tokens": self.draft_tokens,
            "accepted_drafts": self.accepted_drafts,
            "accepted_per_pos": list(self.accepted_per_pos),
        }


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "eos" | "stop" | "length"
    stats: Stats


@dataclass
class StreamEvent:
    index: int  # which prompt of the batch
    token_ids: list[int]  # tokens accepted this step
    text: str  # their text ("" without a tokenizer)
    finish_reason: str | None = None  # on the sequence's last event: "eos" | "stop" | "length"
    stats: Stats | None = None  # on the run's last event: the final stats of the whole batch


@dataclass
class RequestEvent:
    """What one engine step says about one request (graphs.engine)."""

    request_id: int
    token_ids: list[int]  # tokens accepted this step
    text: str  # their text ("" without a tokenizer)
    finish_reason: str | None = None  # last event: "eos" | "stop" | "length" | "deadline" | "cancelled" | "error"
    stats: Stats | None = None  # on the last event: the request's own statistics
    error: BaseException | None = None  # finish_reason "error": what its own sampling, stop strings or text raised


class Sampler:
    """Greedy when temperature < MIN_TEMPERATURE (0 included); otherwise the base distribution after
    temperature/top-k/top-p."""

    def __init__(self, temperature, top_p, top_k, rng, acceptance):
        if not temperature >= 0 or temperature == float("inf"):
            raise InputError(f"temperature must be >= 0 and finite, got {temperature}")
        if not 0 < top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise InputError(f"top_k must be >= 0, got {top_k}")
        if temperature < MIN_TEMPERATURE:
            temperature = 0.0  # (a subnormal one would divide the logits to inf)
        self.temperature, self.top_p, self.top_k, self.rng = temperature, top_p, top_k, rng
        self.acceptance = acceptance

    def token(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            t = int(np.argmax(logits))
            check_finite(logits[t])  # nan wins argmax; +inf is an overflow: either way no real choice
            return t
        p = process_logits(logits, self.temperature, self.top_p, self.top_k)
        return int(self.rng.choice(p.shape[-1], p=p / p.sum()))

    def accept(self, tree: Tree, tokens: np.ndarray, logits: np.ndarray):
        if self.temperature == 0:
            return greedy_accept(tree, tokens, logits)
        probs = process_logits(logits, self.temperature, self.top_p, self.top_k)
        if self.acceptance == "typical":
            return typical_accept(tree, tokens, probs, self.rng)
        return sample_accept(tree, tokens, probs, self.rng)
