"""DFlash drafters trained elsewhere: z-lab's layout (= ModelOpt's export) and ModelOpt's raw checkpoint,
written synthetically from a converted tiny model, load into a fresh base as the same drafter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny import tiny_model

from exporter.speculative import convert, is_converted, load_external_drafter
from exporter.speculative.importers import detect_format

ARCH = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
        "intermediate_size": 96}  # not the base's dims (64 hidden, 4/2 heads of 16): read from the tensors
CFG = {"dflash_block_size": 4, "dflash_mask_token_id": 250, "dflash_target_layer_ids": [0, 2],
       "dflash_architecture_config": ARCH}


def _trained(arch="qwen3"):
    torch.manual_seed(3)
    model = convert(tiny_model(arch), [("dflash", dict(CFG))])
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.dflash_module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0))
    return model


def _state(model):
    return {k: v.detach().clone().contiguous() for k, v in model.dflash_module.state_dict().items()}


def _zlab_config(model, **over):
    b = model.config
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 4,
           "dflash_config": {"mask_token_id": 250, "target_layer_ids": [0, 2]}, "hidden_size": b.hidden_size,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
           "intermediate_size": 96, "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": b.vocab_size,
           "rope_theta": 10000.0, "rope_scaling": None, "num_target_layers": b.num_hidden_layers,
           "layer_types": ["full_attention"] * 2, "tie_word_embeddings": False, "max_position_embeddings": 512}
    return {**cfg, **over}


def _same(src, dst):
    a, b = _state(src), _state(dst)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert dst.spec_config.dflash_target_layer_ids == src.spec_config.dflash_target_layer_ids
    ids = torch.randint(3, 250, (2, 14), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    la = src(input_ids=ids, labels=ids).loss
    torch.manual_seed(5)
    torch.testing.assert_close(la, dst(input_ids=ids, labels=ids).loss)


def _write_zlab(tmp_path, src, **over):
    state = _state(src)
    state["embed_tokens.weight"] = src.get_input_embeddings().weight.detach().clone()  # some ship it: ignored
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(_zlab_config(src, **over)))
    return state


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_zlab_layout_round_trip(tmp_path, arch):
    src = _trained(arch)
    state = _write_zlab(tmp_path, src)
    assert detect_format(state) == "zlab_dflash"  # fc.weight + layers.*: not EAGLE-1
    dst = load_external_drafter(tiny_model(arch), tmp_path)
    assert dst.spec_mode == "dflash" and dst.dflash_module.block_size == 4 and dst.dflash_module.mask_token_id == 250
    d = dst.dflash_module.dims
    assert (d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size) == (8, 4, 8, 96)
    _same(src, dst)


def test_modelopt_raw_checkpoint(tmp_path):
    """ModelOpt's training checkpoint: the base's keys plus dflash_module.*; block size and mask token are in
    its own state (not read): without them one line naming the fix, with them the same drafter."""
    src = _trained("llama")
    base = {k: v.detach().clone().contiguous() for k, v in src.state_dict().items()
            if not k.startswith("dflash_module.")}
    base.pop("lm_head.weight", None)  # tied
    full = {**base, **{"dflash_module." + k: v for k, v in _state(src).items()}}
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert detect_format(full) == "modelopt"
    fresh = tiny_model("llama")
    with pytest.raises(ValueError, match="dflash_mask_token_id") as e:
        load_external_drafter(fresh, tmp_path)
    assert "\n" not in str(e.value) and not is_converted(fresh)
    dst = load_external_drafter(fresh, tmp_path, config={"dflash_mask_token_id": 250, "dflash_block_size": 4,
                                                         "dflash_target_layer_ids": [0, 2]})
    _same(src, dst)
    # no ids given: ModelOpt's build_target_layer_ids(4 base layers, 2 draft layers)
    other = load_external_drafter(tiny_model("llama"), tmp_path, config={"dflash_mask_token_id": 250,
                                                                         "dflash_block_size": 4})
    assert other.spec_config.dflash_target_layer_ids == [1, 1]


def test_our_save_pretrained_is_read_as_modelopt_with_its_exact_config(tmp_path):
    from exporter.speculative import enable_huggingface_checkpointing

    src = _trained("llama")
    enable_huggingface_checkpointing()
    src.save_pretrained(tmp_path)
    dst = load_external_drafter(tiny_model("llama"), tmp_path, fmt="modelopt")
    assert dst.spec_config == src.spec_config
    _same(src, dst)


@pytest.mark.parametrize("over, fragment", [
    ({"hidden_size": 128}, "hidden_size=128"),
    ({"num_target_layers": 30}, "num_target_layers=30"),
    ({"num_attention_heads": 4}, "its tensors say 8"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "not supported yet"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "only full attention"),
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, "does not say its mask token"),
    ({"dflash_config": {"mask_token_id": 250, "target_layer_ids": [0, 1, 2]}}, "fuses 2"),
])
def test_bad_zlab_files_are_one_line(tmp_path, over, fragment):
    _write_zlab(tmp_path, _trained("llama"), **over)
    fresh = tiny_model("llama")
    with pytest.raises(ValueError) as e:
        load_external_drafter(fresh, tmp_path)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not is_converted(fresh)


def test_draft_vocabulary_and_unknown_layouts_are_refused(tmp_path):
    src = _trained("llama")
    state = _write_zlab(tmp_path, src)
    save_file({**state, "lm_head.weight": torch.zeros(256, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="shares the base's LM head"):
        load_external_drafter(tiny_model("llama"), tmp_path)
    with pytest.raises(ValueError, match="unrecognised drafter format") as e:
        detect_format(["blocks.0.weight", "head.weight"])
    assert "zlab_dflash" in str(e.value) and "\n" not in str(e.value)


def test_export_with_a_zlab_drafter(tmp_path, capsys):
    """python -m exporter.export BASE OUT --drafter ZLAB_DIR: the drafter's own dims (8 heads of 8, not the
    base's) in the draft graph's cache, validated against PyTorch."""
    from conftest import save_tiny_model

    from exporter import pipeline
    from graphs.manifest import Manifest

    src = _trained("llama")
    (tmp_path / "zl").mkdir()
    _write_zlab(tmp_path / "zl", src)
    save_tiny_model(tiny_model("llama"), tmp_path / "base")
    pipeline.export(tmp_path / "base", tmp_path / "out", drafter=tmp_path / "zl", log=lambda *a, **k: None)
    m = Manifest.read(tmp_path / "out")
    assert m.validation["ok"] and (m.drafter["num_kv_heads"], m.drafter["head_dim"]) == (4, 8)
    assert m.graphs["draft"].input("past_key_values.0.key").dims[1:] == (4, "past_sequence", 8)


def test_modelopt_raw_checkpoint_reads_modelopt_state(tmp_path):
    """ModelOpt's HF checkpointing writes modelopt_state.pth (plain dicts): block size and mask token come
    from it, so the raw checkpoint loads (and exports, --drafter) with no config=."""
    src = _trained("llama")
    full = {**{k: v.contiguous() for k, v in src.state_dict().items() if not k.startswith("dflash_module.")},
            **{"dflash_module." + k: v for k, v in _state(src).items()}}
    full.pop("lm_head.weight", None)
    save_file(full, str(tmp_path / "model.safetensors"))
    mo_cfg = {"dflash_block_size": 4, "dflash_mask_token_id": 250, "dflash_offline": False,
              "dflash_loss_objective": "dpace", "dflash_architecture_config": {
                  "num_hidden_layers": 2, "hidden_act": "silu", "rms_norm_eps": 1e-6, "_attn_implementation": "sdpa"}}
    torch.save({"modelopt_state_dict": [("dflash", {"config": mo_cfg, "metadata": {}})], "modelopt_version": "0.40"},
               tmp_path / "modelopt_state.pth")
    dst = load_external_drafter(tiny_model("llama"), tmp_path, config={"dflash_target_layer_ids": [0, 2]})
    assert dst.dflash_module.block_size == 4 and dst.dflash_module.mask_token_id == 250
    _same(src, dst)
