"""Drafter training that scales to a real base on a CPU: distill once, cache the frozen base once, train.

    examples = distill(export_dir, prompts, cfg, log)          # the base's greedy answers, via graphs' engine
    cache = FeatureCache.build(model, examples, cfg, log)      # the features the drafter reads, computed once
    report = train_drafter(model, cache, cfg, log)             # HF Trainer on the cache; held-out acceptance

Why each phase is built this way:

- **Distillation through our own engine** (continuous batching over an autoregressive export): HF
  ``generate`` recomputes padding and keeps a batch until its longest row ends; the engine refills a
  row the moment a request finishes. Each example is a chat prompt and the base's greedy answer, so
  the drafter learns what the base will say at serving time.
- **Features once.** The base is frozen, so what the drafter reads (the last hidden state for Medusa
  and EAGLE-1, three layers' outputs for EAGLE-3) is a dataset: one no-grad forward per example, kept
  in float16 in a bounded cache, instead of a base forward at every step of every epoch.
- **Hard targets.** On self-distilled text the next token *is* the base's argmax, so the cross-entropy
  against it needs no logits (rows x 49k floats per token would not fit any cache).

A seconds budget bounds the whole run (distillation gets ``distill_share`` of it, in-flight answers
are kept as far as they got); every phase prints a line at least every ``PROGRESS_S`` seconds with its
rate and an ETA.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from exporter.speculative.distill import IGNORE_INDEX

PROGRESS_S = 10.0  # the longest silence of any phase
FEATURES_SHARE = 0.35  # of the budget left after distillation, the most the feature pass may take
MODES = {  # the drafters this trains, as convert() takes them
    "medusa": ("medusa", {"medusa_num_heads": 3, "medusa_num_layers": 1}),
    "eagle": ("eagle", {"eagle_num_layers": 1}),
    "eagle3": ("eagle", {"use_aux_hidden_state": True, "eagle_num_layers": 1}),
    # ModelOpt's defaults (block 8, D-PACE) with fewer layers for a 2-core CPU: ModelOpt's own small-base
    # launcher uses 2 (tools/launcher/examples/Qwen/Qwen3-0.6B/hf_online_dflash.yaml). Anchors: ModelOpt's
    # 512 are over 4096-token rows; here the shared LM head dominates a step (rows = batch x anchors x (b-1):
    # on SmolLM2, 8 x 16 x 7 rows x 576 x 49152 ~ 50 GFLOP forward, ~150 with backward), so 16 a sequence
    # keep a step at seconds on 2 cores (estimated, not measured). The mask token is picked by run().
    "dflash": ("dflash", {"dflash_architecture_config": {"num_hidden_layers": 2}, "dflash_num_anchors": 16}),
}


@dataclass
class TrainingConfig:
    """One drafter training run; every field has a default that fits a 2-core CPU and a ~135M base."""

    mode: str = "eagle3"
    """medusa | eagle (EAGLE-1) | eagle3 | dflash."""
    max_new_tokens: int = 96
    """Length of each distilled answer (tokens)."""
    distill_rows: int = 16
    """Requests the engine decodes at once while distilling."""
    seconds_budget: float | None = 360.0
    """The whole run: distillation + features + training (None: no bound, every step runs)."""
    distill_share: float = 0.45
    """Of the budget, the most distillation may take; the rest goes to features and training."""
    epochs: float = 8.0
    """Passes over the cached examples at most; under a budget, the steps that fit in the time left."""
    batch_size: int = 8
    learning_rate: float = 2e-3
    draft_vocab_size: int | None = 8192
    """EAGLE-3: the drafter's own head covers the base's most frequent answer tokens (d2t maps back).
    DFlash: the drafter's logits cover those tokens only (``dflash_draft_vocab_size``), its loss too.
    Medusa: the training loss runs over those tokens only; the exported heads keep the whole
    vocabulary (the projection over it is most of a training step's cost on a CPU)."""
    heldout_fraction: float = 0.1
    """Examples kept out of training, whose acceptance the report gives by category."""
    depth: int = 3
    """Chain length of the held-out acceptance estimate."""
    max_cache_bytes: int = 2 << 30
    """Bound of the feature cache; examples past it are dropped (and said)."""
    threads: int | None = None
    seed: int = 0
    drafter_config: dict = field(default_factory=dict)
    """Overrides of the mode's convert() config (e.g. {"medusa_num_heads": 4})."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown drafter mode {self.mode!r}; accepted: {', '.join(MODES)}")
        for name in ("max_new_tokens", "distill_rows", "batch_size", "depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainingConfig.{name} must be an int >= 1, got {v!r}")
        if self.seconds_budget is not None and not self.seconds_budget > 0:
            raise ValueError(f"TrainingConfig.seconds_budget must be > 0 or None, got {self.seconds_budget!r}")
        if not 0 < self.distill_share < 1 or not 0 <= self.heldout_fraction < 1:
            raise ValueError("distill_share must be in (0, 1) and heldout_fraction in [0, 1)")

    def convert_config(self, vocab: int | None = None) -> tuple[str, dict]:
        """(kind, convert() config); ``vocab``: the base's vocabulary, which an EAGLE-3 draft vocabulary
        must be smaller than (a base with fewer tokens keeps them all)."""
        kind, cfg = MODES[self.mode]
        cfg = {**cfg, **self.drafter_config}
        if self.mode == "eagle3" and self.draft_vocab_size and (vocab is None or self.draft_vocab_size < vocab):
            cfg.setdefault("draft_vocab_size", self.draft_vocab_size)
        return kind, cfg

    def dflash_vocab_size(self, vocab: int) -> int | None:
        """DFlash's ``dflash_draft_vocab_size`` for a base of ``vocab`` tokens (None: the whole)."""
        n = self.draft_vocab_size
        return n if n and n < vocab else None


@dataclass
class Example:
    prompt: list[int]
    answer: list[int]
    category: str = ""

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.answer


class Progress:
    """Lines with elapsed time, rate and ETA, at most every ``PROGRESS_S`` seconds (``force`` always)."""

    def __init__(self, phase: str, total: float, unit: str, log: Callable[[str], None] = print):
        self.phase, self.total, self.unit, self.log = phase, total, unit, log
        self.t0 = self.last = time.perf_counter()

    def __call__(self, done: float, extra: str = "", force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < PROGRESS_S:
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        rate = done / dt
        eta = f", ETA {max(self.total - done, 0) / rate:.0f} s" if rate > 0 and done < self.total else ""
        self.log(f"{self.phase}: {done:.0f}/{self.total:.0f} {self.unit}, {rate:.1f} {self.unit}/s{eta}"
                 f"{', ' + extra if extra else ''} [{dt:.0f} s]")


class Budget:
    """Deadlines of the phases of one run."""

    def __init__(self, seconds: float | None):
        self.start = time.perf_counter()
        self.seconds = seconds

    def deadline(self, share: float = 1.0) -> float | None:
        return None if self.seconds is None else self.start + share * self.seconds

    def left(self) -> float | None:
        return None if self.seconds is None else self.start + self.seconds - time.perf_counter()


# ---------------------------------------------------------------------------- distillation


def distill(export_dir, prompts: Sequence[tuple[str, list[int]]], cfg: TrainingConfig, deadline: float | None = None,
            log: Callable[[str], None] = print) -> list[Example]:
    """The base's greedy answers to ``prompts`` ((category, token ids) pairs), decoded by :mod:`graphs`.

    ``export_dir``: an export of the base (an autoregressive one is enough). Past ``deadline`` the
    requests in flight are cancelled and kept as far as they got; the ones not started are dropped."""
    import graphs
    from graphs.engine import EngineConfig

    dec = graphs.load(export_dir, provider="cpu", threads=cfg.threads, adaptive=False)
    engine = dec.engine(EngineConfig(max_batch=cfg.distill_rows))
    ids = {}
    for cat, p in prompts:
        rid = engine.add_request(list(p), max_new_tokens=cfg.max_new_tokens, mode="autoregressive",
                                 temperature=0.0)
        ids[rid] = Example(list(p), [], cat)
    prog = Progress("distill", len(ids), "answers", log)  # the ETA by answers: many end before max_new_tokens
    done = tokens = 0
    cut = False

    def rate() -> str:
        return f"{tokens} tokens, {tokens / max(time.perf_counter() - prog.t0, 1e-9):.1f} tokens/s"

    while engine.has_pending_requests():
        for ev in engine.step():
            ids[ev.request_id].answer += ev.token_ids
            tokens += len(ev.token_ids)
            done += ev.finish_reason is not None
        prog(done, rate())
        if deadline is not None and time.perf_counter() > deadline and not cut:
            cut = True
            for rid in list(ids):
                engine.remove_request(rid)
    prog(done, rate() + (" (time budget reached: the rest cut)" if cut else ""), force=True)
    return [e for e in ids.values() if len(e.answer) >= 2]


# ---------------------------------------------------------------------------- features


def feature_layers(model) -> tuple[str, tuple[int, ...]]:
    """What the converted ``model``'s drafter reads: ("hidden", ()) or ("aux", layer ids)."""
    if model.spec_mode == "eagle" and model.eagle_module.eagle3:
        return "aux", tuple(model.spec_config.eagle_aux_hidden_state_layer_ids)
    if model.spec_mode == "dflash":
        return "aux", tuple(model.spec_config.dflash_target_layer_ids)
    return "hidden", ()


def pick_mask_token(examples: list[Example], vocab_size: int, avoid=()) -> int:
    """DFlash's mask token when none is given: the highest id that no example (prompt or answer) holds
    and that is not in ``avoid`` (the special tokens): its frozen base embedding then means "unknown
    slot" only (docs/dflash.md, R1)."""
    seen = {t for e in examples for t in e.ids} | set(avoid)
    for t in range(vocab_size - 1, -1, -1):
        if t not in seen:
            return t
    raise ValueError("every token id of the vocabulary occurs in the training data: set dflash_mask_token_id")


@dataclass
class FeatureCache:
    """Per example: token ids, the loss mask (answer tokens) and the base's features (float16)."""

    kind: str  # "hidden" (post-norm last layer) or "aux" (the EAGLE-3 layers, concatenated)
    examples: list[Example]
    features: list[torch.Tensor]  # (len(ids), H or n_aux*H), float16

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.features)

    @classmethod
    @torch.no_grad()
    def build(cls, model, examples: list[Example], cfg: TrainingConfig, log: Callable[[str], None] = print,
              batch_tokens: int = 1024, deadline: float | None = None) -> FeatureCache:
        """One frozen-base forward per example (HF's own forward and attention), in groups of 64 examples
        in a seeded random order, each group batched by length; past ``deadline`` (or the cache's
        bound) the examples not yet computed are dropped, so what is kept is a random subset, not the
        shortest ones."""
        kind, layers = feature_layers(model)
        inner = model.model
        perm = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        order = [j for g in range(0, len(perm), 64)
                 for j in sorted(perm[g : g + 64], key=lambda i: len(examples[i].ids))]
        feats: list[torch.Tensor | None] = [None] * len(examples)
        prog = Progress("features", sum(len(e.ids) for e in examples), "tokens", log)
        done = used = 0
        i = 0
        while i < len(order):
            chunk = [order[i]]  # sorted by length in its group: the last row of a chunk is its widest
            while i + len(chunk) < len(order) and (i + len(chunk)) % 64 and \
                    (len(chunk) + 1) * len(examples[order[i + len(chunk)]].ids) <= batch_tokens:
                chunk.append(order[i + len(chunk)])
            i += len(chunk)
            width = len(examples[chunk[-1]].ids)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, j in enumerate(chunk):  # right padding: positions stay 0.. for every row
                ids[r, : len(examples[j].ids)] = torch.tensor(examples[j].ids)
                mask[r, : len(examples[j].ids)] = 1
            out = inner(input_ids=ids, attention_mask=mask, output_hidden_states=(kind == "aux"))
            if kind == "aux":  # hidden_states[0] is the embedding: layer i's output is [i + 1]
                f = torch.cat([out.hidden_states[k + 1] for k in layers], dim=-1)
            else:
                f = out.last_hidden_state
            for r, j in enumerate(chunk):
                feats[j] = f[r, : len(examples[j].ids)].to(torch.float16).clone()
                used += feats[j].numel() * 2
                done += len(examples[j].ids)
            prog(done)
            if used > cfg.max_cache_bytes:
                kept = sum(x is not None for x in feats)
                log(f"features: the cache reached its bound of {cfg.max_cache_bytes >> 20} MiB; "
                    f"keeping {kept} of {len(examples)} examples")
                break
            if deadline is not None and time.perf_counter() > deadline and i < len(order) and i % 64 == 0:
                kept = sum(x is not None for x in feats)
                log(f"features: time budget reached; keeping the {kept} of {len(examples)} examples computed "
                    f"(training keeps its share of the budget)")
                break
        prog(done, f"{used / 2**20:.0f} MiB cached", force=True)
        keep = [j for j in range(len(examples)) if feats[j] is not None]
        return cls(kind, [examples[j] for j in keep], [feats[j] for j in keep])

    def split(self, fraction: float, seed: int) -> tuple[FeatureCache, FeatureCache]:
        """(train, held-out): ``fraction`` of each category held out (at least one where it has two)."""
        g = torch.Generator().manual_seed(seed)
        by_cat: dict[str, list[int]] = {}
        for i, e in enumerate(self.examples):
            by_cat.setdefault(e.category, []).append(i)
        held = set()
        for idx in by_cat.values():
            k = min(len(idx) - 1, max(1 if fraction > 0 else 0, round(fraction * len(idx))))
            perm = torch.randperm(len(idx), generator=g).tolist()
            held |= {idx[p] for p in perm[: max(k, 0)]}
        pick = lambda keep: FeatureCache(self.kind, [self.examples[i] for i in keep], [self.features[i] for i in keep])
        return (pick([i for i in range(len(self.examples)) if i not in held]),
                pick([i for i in range(len(self.examples)) if i in held]))


class CachedFeatures(torch.utils.data.Dataset):
    """The cache as HF ``Trainer`` rows: input_ids, labels (-100 on the prompt) and the features."""

    def __init__(self, cache: FeatureCache):
        self.cache = cache

    def __len__(self):
        return len(self.cache.examples)

    def __getitem__(self, i):
        e = self.cache.examples[i]
        return {"input_ids": e.ids, "labels": [IGNORE_INDEX] * len(e.prompt) + e.answer,
                "features": self.cache.features[i]}


class FeatureCollator:
    """Right-pads rows into a batch: the features go to the converted model as ``base_features``
    (and ``loss_vocab``, where set, as Medusa's loss vocabulary)."""

    def __init__(self, loss_vocab: torch.Tensor | None = None):
        self.loss_vocab = loss_vocab

    def __call__(self, rows) -> dict:
        width = max(len(r["input_ids"]) for r in rows)
        dim = rows[0]["features"].shape[-1]
        batch = {
            "input_ids": torch.zeros(len(rows), width, dtype=torch.long),
            "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
            "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
            "base_features": torch.zeros(len(rows), width, dim),
        }
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            batch["input_ids"][i, :n] = torch.tensor(r["input_ids"])
            batch["attention_mask"][i, :n] = 1
            batch["labels"][i, :n] = torch.tensor(r["labels"])
            batch["base_features"][i, :n] = r["features"].float()
        if self.loss_vocab is not None:
            batch["loss_vocab"] = self.loss_vocab
        return batch


# ---------------------------------------------------------------------------- the draft vocabulary


def frequent_answer_tokens(examples: list[Example], n: int, vocab: int) -> tuple[torch.Tensor, float]:
    """(the ``n`` most frequent answer tokens, then ids in order, sorted; the share of answer tokens
    they cover)."""
    counts = Counter(t for e in examples for t in e.answer)
    top = [t for t, _ in counts.most_common(n)]
    rest = [t for t in range(vocab) if t not in set(top)][: n - len(top)]
    total = sum(counts.values())
    return torch.tensor(sorted(top + rest), dtype=torch.long), (sum(counts[t] for t in top) / total if total else 1.0)


def set_draft_vocab(model, examples: list[Example]) -> float:
    """EAGLE-3: the drafter's head covers the most frequent answer tokens (then ids in order).

    ``d2t[d] = target - d`` (the SafeAILab/ModelOpt convention); the head's rows restart from the
    base's lm_head rows of those tokens. Returns the share of answer tokens the vocabulary covers."""
    em = model.eagle_module
    n = em.lm_head.out_features
    ids, coverage = frequent_answer_tokens(examples, n, model.get_output_embeddings().weight.shape[0])
    with torch.no_grad():
        em.d2t.copy_(ids - torch.arange(n))
        em.lm_head.weight.copy_(model.get_output_embeddings().weight[ids])
    return coverage


def loss_vocab(model, examples: list[Example], cfg: TrainingConfig) -> tuple[torch.Tensor | None, float | None]:
    """Medusa, DFlash: the tokens the training loss runs over (``cfg.draft_vocab_size``), and their
    coverage; a DFlash drafter with a draft vocabulary keeps them (its ``draft_vocab``)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if cfg.mode == "dflash" and model.dflash_module.draft_vocab is not None:
        ids, coverage = frequent_answer_tokens(examples, len(model.dflash_module.draft_vocab), vocab)
        model.dflash_module.draft_vocab.copy_(ids)
        return ids, coverage
    if cfg.mode not in ("medusa", "dflash") or not cfg.draft_vocab_size or cfg.draft_vocab_size >= vocab:
        return None, None
    return frequent_answer_tokens(examples, cfg.draft_vocab_size, vocab)


# ---------------------------------------------------------------------------- training


def time_one_step(model, train: FeatureCache, cfg: TrainingConfig, collator: FeatureCollator) -> float:
    """Seconds of one training step (forward + backward on a random batch), measured."""
    g = torch.Generator().manual_seed(cfg.seed)
    rows = torch.randperm(len(train.examples), generator=g)[: cfg.batch_size].tolist()
    batch = collator([CachedFeatures(train)[i] for i in rows])
    model.train()
    t0 = time.perf_counter()
    model(**batch).loss.backward()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return max(dt, 1e-3)


def train_drafter(model, train: FeatureCache, cfg: TrainingConfig, work_dir, deadline: float | None = None,
                  log: Callable[[str], None] = print, vocab: torch.Tensor | None = None) -> dict:
    """Train the converted ``model``'s drafter on ``train`` with a HF ``Trainer`` (the base stays frozen);
    ``vocab``: the loss vocabulary of Medusa and DFlash (:func:`loss_vocab`)."""
    collator = FeatureCollator(vocab)
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    steps = max(1, math.ceil(cfg.epochs * len(train.examples) / cfg.batch_size))
    if deadline is not None:  # the schedule fits the time left, so its learning rate decays to the end
        per_step = time_one_step(model, train, cfg, collator)
        fit = int(0.9 * (deadline - time.perf_counter()) / per_step)
        if fit < steps:
            log(f"train: {steps} steps ({cfg.epochs:g} epochs) would take {steps * per_step:.0f} s; "
                f"{max(fit, 1)} fit in the budget ({per_step:.2f} s a step)")
            steps = max(fit, 1)
    prog = Progress("train", steps, "steps", log)
    state_out = {"stopped_at": None, "loss": None}

    class Callback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                state_out["loss"] = logs["loss"]

        def on_step_end(self, args, state, control, **kw):
            loss = state_out["loss"]
            prog(state.global_step, "" if loss is None else f"loss {loss:.3f}")
            if deadline is not None and time.perf_counter() > deadline:
                state_out["stopped_at"] = state.global_step
                control.should_training_stop = True

    args = TrainingArguments(
        output_dir=str(work_dir), max_steps=steps, per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate, warmup_steps=max(1, round(0.05 * steps)), lr_scheduler_type="cosine",
        weight_decay=0.0, logging_steps=max(1, min(10, steps // 20)), report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=cfg.seed, data_seed=cfg.seed, dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=CachedFeatures(train),
                      data_collator=collator, callbacks=[Callback()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    prog(steps if state_out["stopped_at"] is None else state_out["stopped_at"],
         f"loss {state_out['loss']:.3f}" if state_out["loss"] is not None else "", force=True)
    if state_out["stopped_at"] is not None:
        log(f"train: time budget reached after {state_out['stopped_at']} of {steps} steps")
    model.eval()
    return {"steps": steps, "stopped_at": state_out["stopped_at"], "final_loss": state_out["loss"]}


# ---------------------------------------------------------------------------- held-out acceptance


@torch.no_grad()
def heldout_acceptance(model, held: FeatureCache, depth: int = 3) -> dict:
    """Top-1 chain acceptance of the drafter on held-out answers, by category.

    At each answer position t the drafter drafts ``depth`` tokens feeding itself (as at serving time);
    a chain's accepted length is 1 + its leading correct drafts (the bonus token counts), so
    ``tau_chain`` is the mean accepted length a chain of this depth reaches on greedy decoding.
    ``per_position[k]``: the share of anchors whose first k+1 drafts are all right. DFlash: see
    :func:`dflash_heldout_acceptance` (its block, and trees from the block)."""
    from exporter.speculative.eagle import eagle_chain_predictions
    from exporter.speculative.medusa import medusa_logits

    if model.spec_mode == "dflash":
        return dflash_heldout_acceptance(model, held)
    by_cat: dict[str, list[torch.Tensor]] = {}
    for e, f in zip(held.examples, held.features):
        ids = torch.tensor([e.ids])
        feats = f[None].float()
        n_prompt = len(e.prompt)
        if model.spec_mode == "medusa":
            heads = medusa_logits(model.medusa_heads, feats).argmax(-1)[0]  # (S, heads)
            d = min(depth, heads.shape[1])
            preds = torch.stack([heads[:, k] for k in range(d)], -1)  # at t: x_{t+k+2}
        else:
            preds = eagle_chain_predictions(model, feats, ids, depth)[0]  # (S, depth): at t, x_{t+j+2}
            d = depth
        seq = ids.shape[1]
        anchors = range(max(n_prompt - 1, 0), seq - 2)  # x_{t+1} known, x_{t+2} an answer token
        for t in anchors:
            k = 0
            while k < d and t + k + 2 < seq and int(preds[t, k]) == int(ids[0, t + k + 2]):
                k += 1
            by_cat.setdefault(e.category, []).append(torch.tensor(k))
    out = {}
    for cat, ks in sorted(by_cat.items()):
        out[cat] = _acceptance(torch.stack(ks), depth)
    everything = [k for ks in by_cat.values() for k in ks]
    out["all"] = _acceptance(torch.stack(everything), depth) if everything else {}
    return out


@torch.no_grad()
def dflash_heldout_acceptance(model, held: FeatureCache, topk: int = 4, tree_sizes=None,
                              max_anchors: int = 600) -> dict:
    """A DFlash drafter's greedy acceptance on held-out answers, by category: each answer token t (the
    base's own greedy text, so a draft is accepted iff it is the next token) anchors one block.

    ``tau_chain``: 1 + the mean leading correct top-1 drafts (depth ``block_size - 1``, a verify of
    ``block_size`` nodes). For each T in ``tree_sizes`` (default: ``block_size``, the chain's verify
    budget, and twice it), walking the T-node tree along the true continuation as the greedy verify does:
    ``tau_tree[T]`` for the tree grown from the block's per-slot top-``topk`` by the drafter's path
    probability (:func:`graphs.dflash_tree.block_tree`), and ``tau_static_tree[T]`` for the static tree
    of the measured acceptance (``acceptance_by_slot_rank[s][r]``: how often slot s's rank-r token is
    right given the top-1 drafts before it were, :func:`graphs.trees.medusa_paths_from_acceptance`; in
    sample here, so optimistic) filled with each block's top-k (docs/dflash.md, R7). At most about
    ``max_anchors`` anchors, evenly strided over every answer: each is a block through the full LM head."""
    import numpy as np

    from exporter.speculative.dflash import dflash_block_topk
    from graphs.dflash_tree import block_tree
    from graphs.trees import medusa_candidates, medusa_paths_from_acceptance, medusa_tree

    b = model.dflash_module.block_size
    sizes = tuple(tree_sizes or (b, 2 * b))
    blocks = []  # (category, root token, top ids (b-1, K), top log-probs, truth)
    total = sum(max(len(e.ids) - 1 - max(len(e.prompt), 1), 0) for e in held.examples)
    stride = max(1, -(-total // max_anchors))
    for e, f in zip(held.examples, held.features):
        anchors = list(range(max(len(e.prompt), 1), len(e.ids) - 1, stride))
        if anchors:
            ids, lp = dflash_block_topk(model, f[None].float(), torch.tensor([e.ids]), anchors, topk)
            blocks += [(e.category, e.ids[t], ids[j].numpy(), lp[j].numpy(), e.ids[t + 1 : t + b])
                       for j, t in enumerate(anchors)]
    if not blocks:
        return {"all": {}}
    hits, seen = np.zeros((b - 1, topk)), np.zeros(b - 1)
    lead = []
    for _, _, ids, _, truth in blocks:
        k = 0
        while k < len(truth) and ids[k, 0] == truth[k]:
            k += 1
        lead.append(k)
        for s in range(min(k + 1, len(truth))):  # slots whose top-1 predecessors were all right
            seen[s] += 1
            hits[s] += ids[s] == truth[s]
    acc = hits / np.maximum(seen, 1)[:, None]  # (b-1, K)
    static = {size: medusa_tree(medusa_paths_from_acceptance(acc, size, min_prob=0.0) or [[0]]) for size in sizes}
    rows: dict[str, list] = {}
    for (cat, root, ids, lp, truth), k in zip(blocks, lead):
        walks = [tree_accepted(*block_tree(ids, lp, root, size), truth) for size in sizes]
        walks += [tree_accepted(t, medusa_candidates(t, root, ids), truth) for t in static.values()]
        rows.setdefault(cat, []).append((k, walks))
    rows["all"] = [r for cat in list(rows) for r in rows[cat]]
    out = {}
    for cat, rs in rows.items():
        mean = lambda i, rs=rs: 1 + sum(w[i] for _, w in rs) / len(rs)
        out[cat] = {**_acceptance(torch.tensor([k for k, _ in rs]), b - 1),
                    "tau_tree": {str(n): mean(i) for i, n in enumerate(sizes)},
                    "tau_static_tree": {str(n): mean(len(sizes) + i) for i, n in enumerate(sizes)}}
    out["all"]["acceptance_by_slot_rank"] = acc.round(4).tolist()
    return out


def tree_accepted(tree, tokens, truth: list[int]) -> int:
    """Drafts a greedy verify accepts from ``tree`` (node tokens ``tokens``) when the base's continuation
    is ``truth``: follow the child holding the next true token while there is one."""
    node = k = 0
    kids = tree.child_lists
    while k < len(truth):
        node = next((c for c in kids[node] if int(tokens[c]) == truth[k]), -1)
        if node < 0:
            break
        k += 1
    return k


def _acceptance(ks: torch.Tensor, depth: int) -> dict:
    return {"anchors": len(ks), "tau_chain": 1 + ks.float().mean().item(),
            "per_position": [(ks > k).float().mean().item() for k in range(depth)]}


# ---------------------------------------------------------------------------- one call


def save_examples(path, examples: list[Example]) -> None:
    """The distilled examples as JSON, written whole or not at all (a temporary file renamed)."""
    import json
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps([dataclasses.asdict(e) for e in examples]))
    tmp.replace(path)


def load_examples(path) -> list[Example]:
    import json
    from pathlib import Path

    return [Example(**e) for e in json.loads(Path(path).read_text())]


def run(model, export_dir, prompts: Sequence[tuple[str, list[int]]], cfg: TrainingConfig, work_dir,
        log: Callable[[str], None] = print, examples: list[Example] | None = None, distilled=None) -> dict:
    """Distill (unless ``examples`` are given), convert ``model`` in place, cache, train; returns a report.

    ``model``: the base (unconverted, float32); ``export_dir``: its autoregressive export.
    ``distilled``: a file that keeps the distilled examples: reused when it exists (the whole budget
    then goes to features and training), written after a distillation."""
    from exporter.speculative import convert

    budget = Budget(cfg.seconds_budget)
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    if examples is None and distilled is not None and os.path.isfile(distilled):
        examples = load_examples(distilled)
        log(f"reusing {len(examples)} distilled answers in {distilled} (delete it to distill again)")
    elif examples is None:
        examples = distill(export_dir, prompts, cfg, budget.deadline(cfg.distill_share), log)
        if distilled is not None:
            save_examples(distilled, examples)
    t_distill = time.perf_counter() - t0
    n_tokens = sum(len(e.answer) for e in examples)
    kind, drafter_cfg = cfg.convert_config(model.config.vocab_size)
    if kind == "dflash" and drafter_cfg.get("dflash_mask_token_id") is None:
        specials = [getattr(model.config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
        drafter_cfg["dflash_mask_token_id"] = pick_mask_token(
            examples, model.config.vocab_size, [t for s in specials for t in (s if isinstance(s, list) else [s])])
        log(f"dflash: mask token {drafter_cfg['dflash_mask_token_id']} (held by no distilled example)")
    if kind == "dflash" and "dflash_draft_vocab_size" not in drafter_cfg:
        drafter_cfg["dflash_draft_vocab_size"] = cfg.dflash_vocab_size(model.config.vocab_size)
    convert(model, [(kind, drafter_cfg)])
    coverage = set_draft_vocab(model, examples) if cfg.mode == "eagle3" else None
    vocab, vocab_coverage = loss_vocab(model, examples, cfg)
    coverage = coverage if vocab is None else vocab_coverage
    t1 = time.perf_counter()
    # features may take up to FEATURES_SHARE of the budget past distillation; training keeps the rest
    left = budget.left()
    cache = FeatureCache.build(model, examples, cfg, log, deadline=None if left is None else
                               time.perf_counter() + FEATURES_SHARE * max(left, 0.0))
    t_features = time.perf_counter() - t1
    train, held = cache.split(cfg.heldout_fraction, cfg.seed)
    log(f"drafter: {cfg.mode}, {sum(p.numel() for p in model.drafter.parameters()) / 1e6:.1f}M params; "
        f"{len(train.examples)} training / {len(held.examples)} held-out examples"
        + (f"; {'draft' if vocab is None else 'the loss'} vocabulary covers {coverage:.1%} of answer tokens"
           if coverage is not None else ""))
    t2 = time.perf_counter()
    trained = train_drafter(model, train, cfg, work_dir, budget.deadline(), log, vocab)
    if trained["stopped_at"] is not None and trained["stopped_at"] < trained["steps"] // 4:
        log(f"WARNING: the drafter trained {trained['stopped_at']} of {trained['steps']} steps within the budget: "
            f"it will accept little. Train again with a larger budget (the distilled answers are reused)")
    t_train = time.perf_counter() - t2
    acceptance = heldout_acceptance(model, held, cfg.depth) if held.examples else {}
    if acceptance:
        depth = model.dflash_module.block_size - 1 if cfg.mode == "dflash" else cfg.depth
        log(f"held-out acceptance (top-1 chain of depth {depth}): " + ", ".join(
            f"{c} {a['tau_chain']:.2f}" for c, a in acceptance.items() if a))
        if cfg.mode == "dflash" and acceptance.get("all"):
            a = acceptance["all"]
            log("held-out acceptance (DFlash trees from the block's top-4, by size; path probability | measured "
                "acceptance): " + ", ".join(f"{n} nodes {a['tau_tree'][n]:.2f} | {a['tau_static_tree'][n]:.2f}"
                                           for n in a["tau_tree"]))
    return {
        "config": dataclasses.asdict(cfg),
        "examples": len(examples), "answer_tokens": n_tokens,
        "seconds": {"distill": round(t_distill, 1), "features": round(t_features, 1), "train": round(t_train, 1)},
        "distill_tokens_per_s": n_tokens / t_distill if t_distill > 0 else None,
        "draft_vocab_coverage": coverage, "cache_mib": round(cache.nbytes / 2**20, 1),
        "training": trained, "heldout_acceptance": acceptance,
    }
