"""A small *real* model with a trained drafter, built in a few minutes on a CPU from text every machine has.

A random model is useless for speculative decoding: its drafter cannot be right more often than
chance, so the acceptance length the benchmark measures would be ~1. This module trains a tiny
Llama as a byte-level BPE language model on the Python standard library's own source files, lets it
generate its own training data (self-distillation), trains a drafter on that with a HF ``Trainer``,
and saves a ``model_dir`` the exporter takes::

    build_demo_model("demo", mode="medusa")   # -> demo/{config.json, model.safetensors, tokenizer.json, ...}

Deterministic given ``seed`` (and the Python version, whose standard library is the corpus), unless
``seconds_budget`` cuts training short.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
MODES = {
    "medusa": ("medusa", {"medusa_num_heads": 3, "medusa_num_layers": 1}),
    "eagle": ("eagle", {"eagle_num_layers": 1}),
    "eagle3": ("eagle", {"use_aux_hidden_state": True, "eagle_num_layers": 1}),
}


@dataclass(frozen=True)
class DemoSpec:
    """Sizes and step counts; the defaults take ~2-4 minutes on 2 CPU cores."""

    corpus_bytes: int = 3_000_000
    """Standard-library source read, in bytes (files in name order)."""
    vocab_size: int = 512
    """Byte-level BPE vocabulary: small enough that the embeddings stay cheap."""
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    """GQA, so the exported graphs exercise grouped K/V like real Llama/Qwen models."""
    intermediate_size: int = 384
    seq_len: int = 128
    base_steps: int = 600
    base_batch: int = 8
    base_lr: float = 5e-3
    """Many small steps at a high rate: the best held-out loss for ~90 s of CPU (measured)."""
    distill_prompts: int = 96
    """Held-out prompts the base continues greedily (the drafter's training text)."""
    prompt_len: int = 32
    distill_new_tokens: int = 96
    drafter_steps: int = 300
    drafter_batch: int = 16
    drafter_lr: float = 3e-3

    @classmethod
    def tiny(cls) -> DemoSpec:
        """Seconds, for tests: the pipeline runs end to end, the model learns little."""
        return cls(corpus_bytes=60_000, vocab_size=300, hidden_size=32, num_hidden_layers=2,
                   intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, seq_len=32,
                   base_steps=3, base_batch=4, distill_prompts=4, prompt_len=8, distill_new_tokens=8,
                   drafter_steps=3, drafter_batch=4)


class Clock:
    """Timed progress lines: ``[  12.3s] message``."""

    def __init__(self, log: Callable[[str], None] = print):
        self.start = time.perf_counter()
        self._log = log

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, msg: str) -> None:
        self._log(f"[{self.elapsed:7.1f}s] {msg}")


# --- corpus and tokenizer ------------------------------------------------------------------------


def read_corpus(max_bytes: int) -> list[str]:
    """Python standard-library sources (top-level ``*.py`` in name order), up to ``max_bytes``."""
    root = Path(os.path.dirname(os.__file__))
    texts, total = [], 0
    for f in sorted(root.glob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text[: max_bytes - total])
        total += len(texts[-1])
        if total >= max_bytes:
            break
    if not texts:
        raise RuntimeError(f"no Python sources under {root}")
    return texts


def build_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (any byte string encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_corpus(tok, texts: list[str]) -> torch.Tensor:
    """One token stream, files separated by ``</s>`` (when the tokenizer has it)."""
    eos = tok.token_to_id("</s>")
    sep = [] if eos is None else [eos]
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + sep
    return torch.tensor(ids, dtype=torch.long)


# --- base model ----------------------------------------------------------------------------------


def base_config(spec: DemoSpec, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=max(512, 4 * spec.seq_len),
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )


def windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])  # (n, length)


PROGRESS_S = 10.0  # the longest a training loop stays silent


def pretrain_base(stream: torch.Tensor, vocab_size: int, spec: DemoSpec, seed: int, clock: Clock,
                  deadline: float | None = None):
    """Train a Llama from scratch on random windows of ``stream`` (AdamW, warmup + cosine)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(base_config(spec, vocab_size))
    clock(f"base: Llama {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{spec.base_steps} steps of {spec.base_batch}x{spec.seq_len} tokens")
    opt = torch.optim.AdamW(model.parameters(), lr=spec.base_lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, spec.base_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / spec.base_steps)))
    )
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0 = last = time.perf_counter()
    for step in range(spec.base_steps):
        batch = windows(stream, spec.base_batch, spec.seq_len, gen)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if step == 0 or now - last >= PROGRESS_S or step == spec.base_steps - 1:
            rate = (step + 1) / max(now - t0, 1e-9)
            clock(f"base step {step + 1}/{spec.base_steps}: loss {loss.item():.3f}, {rate:.2f} steps/s, "
                  f"ETA {(spec.base_steps - step - 1) / rate:.0f} s")
            last = now
        if deadline is not None and time.perf_counter() > deadline:
            clock(f"base: time budget reached after {step + 1} steps")
            break
    return model.eval()


@torch.no_grad()
def eval_loss(model, stream: torch.Tensor, spec: DemoSpec, n: int = 16) -> float:
    batch = windows(stream, n, spec.seq_len, torch.Generator().manual_seed(1234))
    return model(input_ids=batch, labels=batch).loss.item()


# --- drafter -------------------------------------------------------------------------------------


def drafter_examples(model, stream: torch.Tensor, spec: DemoSpec, data: str, seed: int, clock: Clock):
    """``"distill"``: the base's greedy continuations of held-out prompts; ``"text"``: raw windows."""
    from exporter.speculative import self_distill

    gen = torch.Generator().manual_seed(seed + 1)
    if data == "text":
        rows = windows(stream, spec.distill_prompts, spec.seq_len, gen)
        return [{"input_ids": r.tolist(), "attention_mask": [1] * len(r), "labels": r.tolist()} for r in rows]
    if data != "distill":
        raise ValueError(f"unknown data {data!r}; accepted: 'distill', 'text'")
    prompts = windows(stream, spec.distill_prompts, spec.prompt_len, gen).tolist()
    examples = self_distill(model, None, prompts, spec.distill_new_tokens, batch_size=16, progress=clock)
    clock(f"self-distilled {len(examples)} examples, {sum(len(e['input_ids']) for e in examples)} tokens")
    return examples


def train_drafter(model, examples, spec: DemoSpec, work_dir: Path, seed: int, clock: Clock,
                  deadline: float | None = None):
    """Train the drafter of a converted ``model`` with a plain HF ``Trainer`` (the base stays frozen)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from exporter.speculative import DraftCollator, DraftDataset

    class Progress(TrainerCallback):  # a line every PROGRESS_S seconds, with the last logged loss
        loss, t0, last = None, time.perf_counter(), time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.loss = logs["loss"]

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            if state.global_step == 1 or now - self.last >= PROGRESS_S or state.global_step == state.max_steps:
                rate = state.global_step / max(now - self.t0, 1e-9)
                loss = "" if self.loss is None else f", loss {self.loss:.3f}"
                clock(f"drafter step {state.global_step}/{state.max_steps}: {rate:.2f} steps/s, "
                      f"ETA {(state.max_steps - state.global_step) / rate:.0f} s{loss}")
                self.last = now
            if deadline is not None and time.perf_counter() > deadline:
                clock(f"drafter: time budget reached after {state.global_step} steps")
                control.should_training_stop = True

    args = TrainingArguments(
        output_dir=str(work_dir),
        max_steps=spec.drafter_steps,
        per_device_train_batch_size=spec.drafter_batch,
        learning_rate=spec.drafter_lr,
        warmup_steps=max(1, round(0.05 * spec.drafter_steps)),  # an int: 5.x dropped warmup_ratio
        lr_scheduler_type="cosine",
        weight_decay=0.0,
        logging_steps=max(1, min(50, spec.drafter_steps // 4)),
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=DraftDataset(examples),
        data_collator=DraftCollator(pad_token_id=0, max_length=spec.prompt_len + spec.distill_new_tokens),
        callbacks=[Progress()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return model.eval()


@torch.no_grad()
def drafter_accuracy(model, examples) -> dict:
    """Top-1 agreement of the drafter with the base's greedy tokens on ``examples``.

    Medusa: head k at t predicts x_{t+k+2}; the expected accepted length of a top-1 chain is
    1 + mean over t of the number of leading heads that are right. EAGLE: its first step's top-1
    accuracy (it sees the true x_{t+1}); the benchmark measures the real acceptance of the tree.
    """
    from exporter.modeling import causal_mask
    from exporter.speculative import DraftCollator
    from exporter.speculative.medusa import medusa_logits

    batch = DraftCollator(pad_token_id=0)(examples)
    ids, labels = batch["input_ids"], batch["labels"]
    valid = labels != -100
    _, hidden, aux = model.base_outputs(ids, batch["attention_mask"])
    bsz, seq = ids.shape
    if model.spec_mode == "medusa":
        pred = medusa_logits(model.medusa_heads, hidden).argmax(-1)  # (B, S, heads)
        heads = pred.shape[2]
        n = seq - heads - 1  # anchors whose every target exists
        hits = torch.stack([(pred[:, :n, k] == ids[:, k + 2 : k + 2 + n]) for k in range(heads)], -1)
        ok = valid[:, heads + 1 : heads + 1 + n]  # the farthest target is a generated token
        chain = hits.long().cumprod(-1).sum(-1)[ok].float()  # leading correct heads
        per_head = [hits[..., k][ok].float().mean().item() for k in range(heads)]
        return {"head_top1": per_head, "tau_top1_chain": 1 + chain.mean().item()}
    em = model.eagle_module
    pos = torch.arange(seq - 1).expand(bsz, -1)
    mask = causal_mask(bsz, seq - 1)
    if em.eagle3:
        _, logits, _ = em.step(model, hidden[:, :0], ids[:, 1:], pos, mask, None, aux[:, :-1])
    else:
        _, logits, _ = em.step(model, hidden[:, :-1], ids[:, 1:], pos, mask)
    pred = em.draft_to_target(logits.argmax(-1))[:, :-1]  # at t: x_{t+2}
    ok = valid[:, 2:]
    acc = (pred == ids[:, 2:])[ok].float().mean().item()
    return {"step0_top1": acc, "tau_lower_bound": 1 + acc}


# --- saving --------------------------------------------------------------------------------------


def save_model_dir(model, tok, out_dir: Path, report: dict | None = None) -> Path:
    """``save_pretrained`` (base + drafter, safetensors) plus a tokenizer both libraries load.

    Saving needs nothing special; loading the drafter back needs
    ``exporter.speculative.enable_huggingface_checkpointing()`` before ``from_pretrained``.
    """
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False)
    model.save_pretrained(out_dir)  # also writes generation_config.json
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=model.config.max_position_embeddings,
    )
    hf_tok.save_pretrained(out_dir)  # tokenizer.json, tokenizer_config.json, special_tokens_map.json
    if report is not None:
        (out_dir / "demo_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return out_dir


def build_demo_model(
    out_dir,
    mode: str = "medusa",
    seconds_budget: float | None = None,
    seed: int = 0,
    *,
    spec: DemoSpec | None = None,
    data: str = "distill",
    log: Callable[[str], None] = print,
) -> Path:
    """Pretrain a tiny Llama on stdlib sources, attach and train a ``mode`` drafter, save to ``out_dir``.

    ``mode``: ``medusa``, ``eagle`` (EAGLE-1) or ``eagle3``. ``seconds_budget``: stop training
    early past it (base pretraining gets 60% of it); ``None`` runs every step (deterministic).
    """
    from exporter.speculative import convert

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; accepted: {sorted(MODES)}")
    spec = spec or DemoSpec()
    out_dir = Path(out_dir)
    clock = Clock(log)
    deadline = None if seconds_budget is None else time.perf_counter() + seconds_budget
    base_deadline = None if seconds_budget is None else time.perf_counter() + 0.6 * seconds_budget
    torch.manual_seed(seed)

    texts = read_corpus(spec.corpus_bytes)
    tok = build_tokenizer(texts, spec.vocab_size)
    stream = encode_corpus(tok, texts)
    split = int(0.95 * len(stream))
    train, held_out = stream[:split], stream[split:]
    clock(f"corpus: {len(texts)} stdlib files, {sum(map(len, texts)) / 1e6:.1f} MB, {len(stream)} tokens "
          f"(BPE vocab {tok.get_vocab_size()})")

    model = pretrain_base(train, tok.get_vocab_size(), spec, seed, clock, base_deadline)
    held_loss = eval_loss(model, held_out, replace(spec, seq_len=min(spec.seq_len, len(held_out) // 2)))
    clock(f"base: held-out loss {held_loss:.3f}")
    sample = model.generate(
        input_ids=torch.tensor([tok.encode("def ").ids]), max_new_tokens=32, do_sample=False, pad_token_id=0
    )
    clock(f"base greedy sample: {tok.decode(sample[0].tolist())!r}")

    examples = drafter_examples(model, held_out if data == "distill" else train, spec, data, seed, clock)
    kind, cfg = MODES[mode]
    convert(model, [(kind, dict(cfg))])
    clock(f"converted to {mode}: {sum(p.numel() for p in model.drafter.parameters()) / 1e6:.2f}M drafter params")
    eval_examples = examples[: max(1, len(examples) // 8)]
    train_examples = examples[len(eval_examples) :] or examples
    train_drafter(model, train_examples, spec, out_dir / "_trainer", seed, clock, deadline)
    acc = drafter_accuracy(model, eval_examples)
    clock(f"drafter on held-out self-distilled text: {acc}")

    report = {"mode": mode, "seed": seed, "spec": asdict(spec), "data": data,
              "base_heldout_loss": held_loss, "drafter": acc, "seconds": round(clock.elapsed, 1)}
    save_model_dir(model, tok, out_dir, report)
    _rmtree(out_dir / "_trainer")
    clock(f"saved {out_dir}")
    return out_dir


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
