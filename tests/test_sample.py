"""The sample trains a drafter end to end (tiny settings) and saves a model_dir the exporter can load."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `samples` is not an installed package

from samples import train_drafter


@pytest.mark.parametrize("mode", ["medusa", "eagle3"])
def test_sample_writes_a_loadable_model_dir(tmp_path, mode):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exporter.speculative import enable_huggingface_checkpointing, is_converted

    out = train_drafter.main(["--out", str(tmp_path / "m"), "--mode", mode, "--tiny"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "demo_report.json"} <= {f.name for f in out.iterdir()}
    assert not (out / "_trainer").exists()
    with enable_huggingface_checkpointing():
        model = AutoModelForCausalLM.from_pretrained(out)
    assert is_converted(model)
    assert model.config.speculative_decoding["mode"] == ("medusa" if mode == "medusa" else "eagle")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == model.config.vocab_size
    assert tok.decode(tok.encode("def f(x):\n    return x").ids) == "def f(x):\n    return x"  # byte-level
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token_id == model.config.eos_token_id == 2 and hf_tok.pad_token_id == 0
    ids = torch.tensor([tok.encode("import os\n").ids])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    report = json.loads((out / "demo_report.json").read_text())
    assert report["mode"] == mode and report["seed"] == 0


def test_sample_is_deterministic_given_the_seed(tmp_path):
    from safetensors.torch import load_file

    a = train_drafter.main(["--out", str(tmp_path / "a"), "--tiny", "--seed", "3"])
    b = train_drafter.main(["--out", str(tmp_path / "b"), "--tiny", "--seed", "3"])
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_sample_trains_a_drafter_for_an_existing_base(tmp_path):
    from exporter.speculative import enable_huggingface_checkpointing

    base = train_drafter.main(["--out", str(tmp_path / "base"), "--tiny"])  # carries a Medusa drafter
    with enable_huggingface_checkpointing():  # as other code in the process may have done: --base loads the base
        out = train_drafter.main(["--out", str(tmp_path / "eagle"), "--tiny", "--mode", "eagle", "--base", str(base)])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculative_decoding"]["mode"] == "eagle"
    assert (out / "tokenizer.json").is_file()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("eagle_module.") for k in keys) and not any(k.startswith("medusa_heads.") for k in keys)
