"""Shared fixtures: tiny converted models and their exports, built once per test session.

    def test_something(tiny_model_dir, exported):
        model_dir = tiny_model_dir("eagle3", "qwen3")   # saved with save_pretrained (HF checkpointing)
        out_dir = exported("medusa")                      # exported once, reused by every test

``kind`` is one of :data:`KINDS`: "medusa", "eagle" (EAGLE-1), "eagle3" (aux hidden states and a
draft vocabulary smaller than the base's) or "base" (no drafter). ``model_type`` is a supported
architecture ("llama", "mistral", "qwen2", "qwen3"). Treat the returned directories as read-only:
copy them (``shutil.copytree``) before changing anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # transformers 5.x draws a progress bar for every save/load; tests read stderr, so none here
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

# Drafter config per kind: the smallest drafters that exercise every graph input and output.
DRAFTERS: dict[str, tuple[str, dict] | None] = {
    "medusa": ("medusa", {"medusa_num_heads": 2, "medusa_num_layers": 1}),
    "eagle": ("eagle", {"eagle_num_layers": 1}),
    "eagle3": ("eagle", {"eagle_num_layers": 1, "use_aux_hidden_state": True, "draft_vocab_size": 128}),
    "base": None,
}
KINDS = tuple(DRAFTERS)
ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def write_tiny_tokenizer(model_dir: Path, vocab_size: int = 256) -> None:
    """A byte-level tokenizer over ``vocab_size`` ids (ids 0-2 are pad/bos/eos), saved offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # 256 printable stand-ins for the bytes
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        if len(vocab) >= vocab_size:
            break
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 512}\n'
    )


def build_tiny_model(model_type: str = "llama", kind: str = "medusa", seed: int = 0, **overrides):
    """A tiny random ``model_type`` model converted with the drafter of ``kind`` (float32, eval)."""
    from tiny import tiny_model

    from exporter.speculative import convert

    model = tiny_model(model_type, seed=seed, **overrides)
    if DRAFTERS[kind] is not None:
        torch_seed(seed + 1)  # drafter init independent of the base's
        convert(model, [DRAFTERS[kind]])
    return model.eval()


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def save_tiny_model(model, model_dir: Path, tokenizer: bool = True) -> Path:
    from exporter.speculative import enable_huggingface_checkpointing

    enable_huggingface_checkpointing()
    model.save_pretrained(model_dir)
    if tokenizer:
        write_tiny_tokenizer(model_dir, model.config.vocab_size)
    return model_dir


@pytest.fixture(scope="session", autouse=True)
def _verify_cache(tmp_path_factory):
    """The runtime's sha256 proof records (graphs.integrity) go to a temporary cache, not ~/.cache."""
    old = os.environ.get("SPECEXPORT_CACHE_DIR")
    os.environ["SPECEXPORT_CACHE_DIR"] = str(tmp_path_factory.mktemp("specexport-cache"))
    yield
    if old is None:
        os.environ.pop("SPECEXPORT_CACHE_DIR", None)
    else:
        os.environ["SPECEXPORT_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(kind, model_type="llama") -> Path``: a saved converted tiny model (cached)."""
    cache: dict[tuple[str, str], Path] = {}

    def make(kind: str = "medusa", model_type: str = "llama") -> Path:
        if kind not in DRAFTERS:
            raise ValueError(f"unknown kind {kind!r}; accepted: {KINDS}")
        key = (kind, model_type)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"model-{model_type}-{kind}")
            cache[key] = save_tiny_model(build_tiny_model(model_type, kind), d)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def exported(tiny_model_dir, tmp_path_factory):
    """``exported(kind, model_type="llama", dtype="float32") -> Path``: an export dir (cached, validated)."""
    from exporter.export import export

    cache: dict[tuple[str, str, str], Path] = {}

    def make(kind: str = "medusa", model_type: str = "llama", dtype: str = "float32") -> Path:
        key = (kind, model_type, dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"onnx-{model_type}-{kind}-{dtype}") / "out"
            export(tiny_model_dir(kind, model_type), out, dtype=dtype, log=lambda *a, **k: None)
            cache[key] = out
        return cache[key]

    return make


def dflash_prompts(n: int, seed: int = 0, length: int = 6) -> list[list[int]]:
    """Token prompts whose answers the :func:`trained_dflash` drafter was trained on (the first 16)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="session")
def trained_dflash(tmp_path_factory):
    """(export dir, training report): a tiny base and a DFlash drafter (block 4, logits over a draft
    vocabulary of 128 of the 256 tokens) trained on its own distilled answers of :func:`dflash_prompts`,
    exported; built once (test_dflash_loop, test_dflash_engine, test_device_executor)."""
    from tiny import tiny_model

    from exporter import pipeline
    from exporter.speculative import enable_huggingface_checkpointing
    from exporter.speculative import training as T

    quiet = dict(log=lambda *a, **k: None)
    d = tmp_path_factory.mktemp("dflash-trained")
    save_tiny_model(tiny_model(num_hidden_layers=6), d / "base")
    pipeline.export(d / "base", d / "ar", **quiet)
    cfg = T.TrainingConfig(mode="dflash", max_new_tokens=32, distill_rows=8, seconds_budget=None, epochs=15,
                           batch_size=8, learning_rate=5e-3, heldout_fraction=0.1, draft_vocab_size=128,
                           drafter_config={"dflash_block_size": 4})
    model = tiny_model(num_hidden_layers=6)
    examples = [(f"c{i % 2}", q) for i, q in enumerate(dflash_prompts(16))]
    report = T.run(model, d / "ar", examples, cfg, d / "work", **quiet)
    enable_huggingface_checkpointing()
    save_tiny_model(model, d / "model")
    pipeline.export(d / "model", d / "out", **quiet)
    return d / "out", report


def run_module(module: str, *args, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m module args...`` from the repository root; text output captured."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
