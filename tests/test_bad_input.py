"""Every bad input to convert (and to drafter loading) is a ValueError/TypeError naming the problem and the fix."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_config, tiny_model

from exporter.speculative import EagleConfig, MedusaConfig, convert, is_converted, load_drafter, save_drafter


@pytest.fixture
def model():
    return tiny_model("llama")


def test_unknown_mode(model):
    expected = r"unknown speculative mode 'hydra'; accepted: \['dflash', 'eagle', 'medusa'\]"
    with pytest.raises(ValueError, match=expected):
        convert(model, [("hydra", {})])
    assert not is_converted(model)


@pytest.mark.parametrize(
    ("mode", "cfg", "bad"),
    [
        ("medusa", {"medusa_num_head": 2}, "medusa_num_head"),  # misspelled
        ("medusa", {"eagle_num_layers": 1}, "eagle_num_layers"),  # the other mode's key
        ("eagle", {"eagle_layers": 1}, "eagle_layers"),
        ("eagle", {"eagle_architecture_config": {"num_layers": 2}}, "num_layers"),
        ("eagle", {"layer_overrides": {"vocab_size": 10}}, "vocab_size"),
    ],
)
def test_unknown_config_key_lists_accepted_keys(model, mode, cfg, bad):
    with pytest.raises(ValueError, match=rf"unknown .*key\(s\) \['{bad}'\]; accepted: \[.*'"):
        convert(model, [(mode, cfg)])
    assert not is_converted(model)


@pytest.mark.parametrize(
    ("mode", "cfg", "exc", "msg"),
    [
        ("medusa", {"medusa_num_heads": 0}, ValueError, r"medusa_num_heads must be >= 1, got 0"),
        ("medusa", {"medusa_num_layers": -1}, ValueError, r"medusa_num_layers must be >= 0, got -1"),
        ("medusa", {"medusa_num_heads": 2.5}, TypeError, r"medusa_num_heads must be an int, got float"),
        ("medusa", {"medusa_num_heads": True}, TypeError, r"medusa_num_heads must be an int, got bool"),
        ("medusa", {"medusa_loss_decay": 0}, ValueError, r"medusa_loss_decay must be in \(0, 1\], got 0"),
        ("eagle", {"eagle_num_layers": -2}, ValueError, r"eagle_num_layers must be >= 1, got -2"),
        ("eagle", {"eagle_num_layers": 0}, ValueError, r"eagle_num_layers must be >= 1, got 0"),
        ("eagle", {"eagle_ttt_steps": 0}, ValueError, r"eagle_ttt_steps must be >= 1, got 0"),
        ("eagle", {"draft_vocab_size": 10}, ValueError, r"draft_vocab_size needs use_aux_hidden_state=True"),
        ("eagle", {"use_aux_hidden_state": True, "draft_vocab_size": 0}, ValueError, r"draft_vocab_size must be >= 1"),
        ("eagle", {"use_aux_hidden_state": True, "draft_vocab_size": 1000}, ValueError,
         r"draft_vocab_size 1000 exceeds the base vocabulary \(256\)"),
        ("eagle", {"eagle_aux_hidden_state_layer_ids": [1]}, ValueError,
         r"eagle_aux_hidden_state_layer_ids needs use_aux_hidden_state=True"),
        ("eagle", {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 4]}, ValueError,
         r"eagle_aux_hidden_state_layer_ids \[4\] out of range: the base has layers 0\.\.3"),
        ("eagle", {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [-1, 1]}, ValueError,
         r"\[-1\] out of range: the base has layers 0\.\.3"),
        ("eagle", {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ["1"]}, ValueError,
         r"eagle_aux_hidden_state_layer_ids must be a list of ints"),
        ("eagle", {"eagle_architecture_config": "big"}, TypeError, r"eagle_architecture_config must be a dict"),
    ],
)
def test_bad_values(model, mode, cfg, exc, msg):
    with pytest.raises(exc, match=msg):
        convert(model, [(mode, cfg)])
    assert not is_converted(model)
    assert all(p.requires_grad for p in model.parameters())  # a failed convert leaves the model alone


@pytest.mark.parametrize(
    ("modes", "msg"),
    [
        ("medusa", r"modes must be a list with one \(mode, config\) pair"),
        ([], r"modes must be a list with one \(mode, config\) pair"),
        ([("medusa", {}), ("eagle", {})], r"modes must be a list with one \(mode, config\) pair"),
        ([("medusa",)], r"each mode must be a \(mode, config\) pair"),
    ],
)
def test_bad_modes_shape(model, modes, msg):
    with pytest.raises(ValueError, match=msg):
        convert(model, modes)


def test_config_of_the_wrong_type(model):
    with pytest.raises(TypeError, match=r"medusa config must be a dict or MedusaConfig, got EagleConfig"):
        convert(model, [("medusa", EagleConfig())])
    with pytest.raises(TypeError, match=r"eagle config must be a dict or EagleConfig, got list"):
        convert(model, [("eagle", [1])])
    convert(model, [("medusa", MedusaConfig(medusa_num_heads=1))])  # a config object is fine
    assert len(model.medusa_heads) == 1


def test_converting_twice(model):
    convert(model, [("medusa", {})])
    with pytest.raises(ValueError, match=r"already converted \(medusa\); convert a fresh base model"):
        convert(model, [("eagle", {})])
    assert model.spec_mode == "medusa"


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.Linear(4, 4),
        lambda: __import__("transformers").BertModel(__import__("transformers").BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)),
        lambda: __import__("transformers").BertForMaskedLM(__import__("transformers").BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)),
        lambda: tiny_model("llama").model,  # the decoder without its lm_head
        lambda: "meta-llama/Llama-3.2-1B",  # a name, not a model
    ],
    ids=["nn.Linear", "BertModel", "BertForMaskedLM", "LlamaModel", "str"],
)
def test_not_a_causal_lm(make):
    with pytest.raises(TypeError, match=r"expected a Hugging Face causal LM \(e\.g\. from AutoModelForCausalLM\), got"):
        convert(make(), [("medusa", {})])


def test_unsupported_architecture():
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        convert(gpt2, [("medusa", {})])
    assert not is_converted(gpt2)


def test_drafter_file_that_does_not_fit(tmp_path):
    save_drafter(convert(tiny_model("llama"), [("eagle", {})]), tmp_path)
    with pytest.raises(ValueError, match=r"trained for vocab_size=256, this base has vocab_size=128"):
        load_drafter(tiny_model("llama", vocab_size=128), tmp_path)
    with pytest.raises(ValueError, match=r"trained for model_type=llama, this base has model_type=qwen2"):
        load_drafter(tiny_model("qwen2"), tmp_path)
    # shapes that disagree though the recorded base matches (e.g. a hand-edited config)
    meta = json.loads((tmp_path / "drafter_config.json").read_text())
    meta["base"].pop("hidden_size")
    (tmp_path / "drafter_config.json").write_text(json.dumps(meta))
    base = tiny_model("llama", hidden_size=32)
    msg = r"drafter weight fc\.\w+ .* has shape \(64,.*\), this base needs \(32,.*different base model"
    with pytest.raises(ValueError, match=msg):
        load_drafter(base, tmp_path)
    assert not is_converted(base)  # left unconverted
    with pytest.raises(ValueError, match=r"no drafter_config\.json and drafter\.safetensors; save it with"):
        load_drafter(tiny_model("llama"), tmp_path / "nowhere")


def test_save_drafter_of_unconverted_model(tmp_path):
    with pytest.raises(ValueError, match=r"model has no drafter; call exporter\.speculative\.convert first"):
        save_drafter(tiny_model("llama"), tmp_path)


def test_tiny_config_types_are_supported():
    for t in ("llama", "mistral", "qwen2", "qwen3"):
        assert tiny_config(t).model_type == t
