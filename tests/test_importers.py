"""Drafters trained elsewhere: each foreign layout round-trips into a fresh base; bad files fail clearly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny import tiny_model

from exporter.speculative import convert, is_converted, load_external_drafter, save_drafter
from exporter.speculative.importers import detect_format

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def _batch(seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (2, 12), generator=g)


def _trained_like(model, seed=1):
    """Randomise the drafter so a round trip cannot pass by matching a fresh initialisation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.drafter.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0))
    return model


def _source(arch, mode, cfg):
    return _trained_like(convert(tiny_model(arch), [(mode, dict(cfg))]))


def _state(model):
    return {k: v.detach().clone().contiguous() for k, v in model.drafter.state_dict().items()}


def _assert_same_drafter(src, dst):
    a, b = _state(src), _state(dst)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    ids = _batch()
    torch.testing.assert_close(src(input_ids=ids, labels=ids).loss, dst(input_ids=ids, labels=ids).loss)


def _medusa_foreign(model, prefix=""):
    """ModelOpt / FasterDecoding layout: head k is nn.Sequential(*blocks, lm_head)."""
    out = {}
    for k, head in enumerate(model.medusa_heads):
        for j, block in enumerate(head.medusa_layers):
            out[f"{prefix}{k}.{j}.linear.weight"] = block.linear.weight.detach().clone()
            out[f"{prefix}{k}.{j}.linear.bias"] = block.linear.bias.detach().clone()
        out[f"{prefix}{k}.{len(head.medusa_layers)}.weight"] = head.lm_head.weight.detach().clone()
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_fasterdecoding_medusa_round_trip(tmp_path, arch, suffix):
    src = _source(arch, "medusa", {"medusa_num_heads": 3, "medusa_num_layers": 2})
    state = _medusa_foreign(src)
    f = tmp_path / f"medusa_lm_head{suffix}"
    save_file(state, str(f)) if suffix == ".safetensors" else torch.save(state, f)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2}))
    assert detect_format(state) == "fasterdecoding_medusa"
    dst = load_external_drafter(tiny_model(arch), tmp_path)
    assert dst.spec_config.medusa_num_heads == 3 and dst.spec_config.medusa_num_layers == 2
    _assert_same_drafter(src, dst)


def test_fasterdecoding_shared_blocks_become_separate_weights(tmp_path):
    """FasterDecoding builds heads as `[ResBlock] * n`: one block, stored once by safetensors."""
    src = _source("llama", "medusa", {"medusa_num_heads": 2, "medusa_num_layers": 1})
    state = {k: v for k, v in _medusa_foreign(src).items()}
    for k in range(2):  # a 3-block head whose blocks are the same module: index 3 is the lm_head
        state[f"{k}.3.weight"] = state.pop(f"{k}.1.weight")
    f = tmp_path / "medusa_lm_head.safetensors"
    save_file(state, str(f))
    dst = load_external_drafter(tiny_model("llama"), f)
    assert dst.spec_config.medusa_num_layers == 3
    blocks = dst.medusa_heads[0].medusa_layers
    assert torch.equal(blocks[0].linear.weight, blocks[2].linear.weight)
    assert blocks[0].linear.weight.data_ptr() != blocks[2].linear.weight.data_ptr()  # own weights


@pytest.mark.parametrize("arch", ARCHS)
def test_modelopt_medusa_round_trip(tmp_path, arch):
    src = _source(arch, "medusa", {"medusa_num_heads": 2, "medusa_num_layers": 1})
    base = {k: v.detach().clone() for k, v in tiny_model(arch).state_dict().items()}
    save_file({**base, **_medusa_foreign(src, "medusa_heads.")}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa": {"num_medusa_heads": 2, "num_medusa_layers": 1}}))
    dst = load_external_drafter(tiny_model(arch), tmp_path, fmt="modelopt")
    _assert_same_drafter(src, dst)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "cfg",
    [
        {"eagle_num_layers": 2},
        {"use_aux_hidden_state": True, "draft_vocab_size": 100, "eagle_num_layers": 1},
    ],
    ids=["eagle1", "eagle3"],
)
def test_modelopt_eagle_round_trip(tmp_path, arch, cfg):
    src = _source(arch, "eagle", cfg)
    if src.eagle_module.eagle3:  # a real draft->target map: the 100 draft ids are spread over the vocab
        src.eagle_module.d2t.copy_(torch.arange(100) * 2 - torch.arange(100))
    state = {"eagle_module." + k: v for k, v in _state(src).items()}
    state["eagle_module.rotary_emb.inv_freq"] = torch.ones(8)  # a buffer some versions save; ignored
    save_file(state, str(tmp_path / "model.safetensors"))
    dst = load_external_drafter(tiny_model(arch), tmp_path)
    assert dst.spec_config.use_aux_hidden_state == cfg.get("use_aux_hidden_state", False)
    _assert_same_drafter(src, dst)


@pytest.mark.parametrize("arch", ARCHS)
def test_safeailab_eagle1_round_trip(tmp_path, arch):
    src = _source(arch, "eagle", {"eagle_num_layers": 1, "use_input_layernorm_in_first_layer": False})
    state = _state(src)
    assert "layers.0.input_layernorm.weight" not in state  # SafeAILab's first layer has no input norm
    state["embed_tokens.weight"] = src.model.embed_tokens.weight.detach().clone()  # the base's; ignored
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "bias": True}))
    assert detect_format(state) == "safeailab_eagle"
    dst = load_external_drafter(tiny_model(arch), tmp_path)
    assert dst.spec_config.use_input_layernorm_in_first_layer is False
    _assert_same_drafter(src, dst)


def _eagle3_foreign(model):
    state = {}
    for k, v in _state(model).items():
        state["midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k] = v
    vocab = model.config.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(model.eagle_module.lm_head.out_features) + model.eagle_module.d2t] = True
    state["t2d"] = t2d  # target->draft mask: not needed by the drafter; ignored
    state["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    return state


@pytest.mark.parametrize("arch", ARCHS)
def test_safeailab_eagle3_round_trip(tmp_path, arch):
    src = _source(arch, "eagle", {"use_aux_hidden_state": True, "draft_vocab_size": 64})
    src.eagle_module.d2t.copy_(torch.arange(64) * 3 - torch.arange(64))
    state = _eagle3_foreign(src)
    assert detect_format(state) == "safeailab_eagle3"
    save_file(state, str(tmp_path / "model.safetensors"))
    dst = load_external_drafter(tiny_model(arch), tmp_path / "model.safetensors")
    assert dst.spec_config.draft_vocab_size == 64
    assert dst.spec_config.eagle_aux_hidden_state_layer_ids == src.spec_config.eagle_aux_hidden_state_layer_ids
    _assert_same_drafter(src, dst)


def test_llama_style_eagle3_into_qwen2_gets_zero_attention_biases(tmp_path):
    """SafeAILab's drafter attention has no biases; a Qwen2 drafter layer has q/k/v biases: zero = none."""
    src = _source("qwen2", "eagle", {"use_aux_hidden_state": True})
    state = _eagle3_foreign(src)
    for p in ("q", "k", "v"):
        state.pop(f"midlayer.self_attn.{p}_proj.bias")
        getattr(src.eagle_module.layers[0].self_attn, f"{p}_proj").bias.data.zero_()
    save_file(state, str(tmp_path / "model.safetensors"))
    _assert_same_drafter(src, load_external_drafter(tiny_model("qwen2"), tmp_path))


def test_aux_layer_ids_from_config_json_and_overrides(tmp_path):
    # 8 layers: the default aux layers are [1, 3, 4]; this drafter fuses 2 others and the file cannot say which
    base = lambda: tiny_model("llama", num_hidden_layers=8)
    cfg = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 6]}
    src = _trained_like(convert(base(), [("eagle", cfg)]))
    save_file(_eagle3_foreign(src), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"fuses 2 base layers and names none.*eagle_aux_hidden_state_layer_ids"):
        load_external_drafter(base(), tmp_path)
    ids = {"eagle_aux_hidden_state_layer_ids": [0, 6]}
    _assert_same_drafter(src, load_external_drafter(base(), tmp_path, config=ids))
    (tmp_path / "config.json").write_text(json.dumps({"eagle_config": ids}))
    _assert_same_drafter(src, load_external_drafter(base(), tmp_path))


def test_own_drafter_format_is_accepted(tmp_path):
    src = _source("llama", "medusa", {"medusa_num_heads": 2})
    save_drafter(src, tmp_path)
    _assert_same_drafter(src, load_external_drafter(tiny_model("llama"), tmp_path))


def test_own_save_pretrained_dir_is_a_modelopt_checkpoint(tmp_path):
    src = _source("qwen3", "eagle", {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 2]})
    src.save_pretrained(tmp_path)  # config.json carries speculative_decoding: the exact config
    _assert_same_drafter(src, load_external_drafter(tiny_model("qwen3"), tmp_path))


# --- bad files -------------------------------------------------------------------------------


def test_wrong_hidden_size_names_tensor_and_shapes(tmp_path):
    src = _source("llama", "medusa", {"medusa_num_heads": 2})
    save_file(_medusa_foreign(src), str(tmp_path / "medusa_lm_head.safetensors"))
    base = tiny_model("llama", hidden_size=32)
    with pytest.raises(ValueError, match=r"tensor '0\.\d\.(linear\.)?weight'.*shape \(\d+, 64\), expected \(\d+, 32\)"):
        load_external_drafter(base, tmp_path)
    assert not is_converted(base)
    assert all(p.requires_grad for p in base.parameters())  # left as it was
    convert(base, [("medusa", {})])  # and still convertible


def test_wrong_vocab_size(tmp_path):
    src = _source("llama", "eagle", {"use_aux_hidden_state": True})
    save_file(_eagle3_foreign(src), str(tmp_path / "model.safetensors"))
    msg = r"'lm_head\.weight'.*shape \(256, 64\), expected \(draft_vocab_size <= 128, 64\)"
    with pytest.raises(ValueError, match=msg):
        load_external_drafter(tiny_model("llama", vocab_size=128), tmp_path)


def test_wrong_fc_shape(tmp_path):
    src = _source("llama", "eagle", {})
    state = _state(src)
    state["fc.weight"] = torch.zeros(64, 100)
    save_file(state, str(tmp_path / "d.safetensors"))
    with pytest.raises(ValueError, match=r"'fc\.weight'.*shape \(64, 100\), expected \(64, 128\)"):
        load_external_drafter(tiny_model("llama"), tmp_path / "d.safetensors")


def test_wrong_layer_shape(tmp_path):
    src = _source("llama", "eagle", {"eagle_num_layers": 1})
    state = _state(src)
    state["layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(state, str(tmp_path / "d.safetensors"))
    with pytest.raises(ValueError, match=r"'layers\.0\.self_attn\.o_proj\.weight'.*\(64, 32\), expected \(64, 64\)"):
        load_external_drafter(tiny_model("llama"), tmp_path / "d.safetensors")


def test_drafter_for_another_architecture(tmp_path):
    src = _source("qwen3", "eagle", {})  # has q_norm / k_norm, which a Llama layer lacks
    save_file(_state(src), str(tmp_path / "d.safetensors"))
    with pytest.raises(ValueError, match=r"[qk]_norm.*no place.*another architecture"):
        load_external_drafter(tiny_model("llama"), tmp_path / "d.safetensors")
    src = _source("llama", "eagle", {})
    save_file(_state(src), str(tmp_path / "d.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor for 'layers\.0\.self_attn\.q_norm\.weight'"):
        load_external_drafter(tiny_model("qwen3"), tmp_path / "d.safetensors")


def test_unknown_format(tmp_path):
    save_file({"foo.weight": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match=r"unrecognised drafter format.*accepted formats.*fasterdecoding_medusa"):
        load_external_drafter(tiny_model("llama"), tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match=r"unknown drafter format 'vllm'.*accepted.*safeailab_eagle3"):
        load_external_drafter(tiny_model("llama"), tmp_path, fmt="vllm")
    with pytest.raises(ValueError, match="does not exist"):
        load_external_drafter(tiny_model("llama"), tmp_path / "missing")
    with pytest.raises(ValueError, match=r"no weight file"):
        load_external_drafter(tiny_model("llama"), (tmp_path / "empty").mkdir() or tmp_path / "empty")


def test_pickle_with_code_is_refused(tmp_path):
    torch.save({"w": torch.zeros(1), "f": print}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"weights_only=True"):
        load_external_drafter(tiny_model("llama"), tmp_path / "bad.pt")


def test_into_converted_model_refused(tmp_path):
    src = _source("llama", "medusa", {})
    save_drafter(src, tmp_path)
    with pytest.raises(ValueError, match="already has a medusa drafter"):
        load_external_drafter(src, tmp_path)
