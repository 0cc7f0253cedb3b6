"""Damaged or hostile model directories are refused by name, before any tracing (issue 10).

Missing weights (a tensor gone from a shard or from the index) used to export with random values,
and compare then "passed" or failed only by chance; tokenizer symlinks pulled any readable file
into the export; a corrupt generation_config.json failed after tracing and a corrupt tokenizer.json
only at run time; --opset 99, a bogus rope_scaling and a garbage .pt drafter got misleading messages.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, run_module, save_tiny_model
from helpers import one_line, run_export_main

import exporter.export as ex
import exporter.trace
from exporter.loading import UserError, load_model
from graphs.manifest import MANIFEST

QUIET = {"log": lambda *a, **k: None}


run_main = run_export_main


@pytest.fixture
def no_tracing(monkeypatch):
    """Fail the test if the export gets as far as tracing."""

    def traced(*a, **k):
        raise AssertionError("the export traced a graph before refusing its input")

    monkeypatch.setattr(exporter.trace, "export_graph", traced)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- missing weights


@pytest.fixture(scope="module")
def missing_tensor(tiny_model_dir, tmp_path_factory) -> Path:
    from safetensors.torch import load_file, save_file

    d = copy(tiny_model_dir("medusa"), tmp_path_factory.mktemp("missing") / "model")
    state = load_file(str(d / "model.safetensors"))
    del state["model.layers.0.mlp.down_proj.weight"]
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A sharded checkpoint (several safetensors files and an index) of the tiny base."""
    from exporter.speculative import enable_huggingface_checkpointing

    d = tmp_path_factory.mktemp("sharded") / "model"
    enable_huggingface_checkpointing()
    build_tiny_model("llama", "base").save_pretrained(d, max_shard_size="100KB")
    data = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(data["weight_map"].values())) > 1, "expected several shards"
    return d


def _drop(d: Path, key: str, from_shard: bool) -> None:
    from safetensors.torch import load_file, save_file

    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = d / data["weight_map"].pop(key)
    index.write_text(json.dumps(data))
    if from_shard:
        state = load_file(str(shard))
        del state[key]
        save_file(state, str(shard), metadata={"format": "pt"})


def test_missing_tensor_is_refused_by_name(missing_tensor, tmp_path, capsys, no_tracing):
    rc, err = run_main(capsys, missing_tensor, tmp_path / "onnx")
    one_line(rc, err, "lacks 1 weight(s)", "model.layers.0.mlp.down_proj.weight", "random weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_tensor_missing_from_a_shard_and_the_index_is_refused(sharded, tmp_path):
    d = copy(sharded, tmp_path / "model")
    _drop(d, "model.layers.1.self_attn.q_proj.weight", from_shard=True)
    with pytest.raises(UserError, match=r"lacks 1 weight\(s\) of the model: model\.layers\.1\.self_attn\.q_proj"):
        load_model(d)


def test_tensor_missing_from_the_index_only_is_refused_or_loaded(sharded, tmp_path):
    """transformers 4.57 reads what the index maps (refused: the tensor would be random); 5.x reads
    every tensor of the shards (loaded with its saved value). Either way never random."""
    from safetensors.torch import load_file

    d = copy(sharded, tmp_path / "model")
    key = "model.norm.weight"
    shard = d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][key]
    saved = load_file(str(shard))[key]
    _drop(d, key, from_shard=False)
    try:
        model = load_model(d)
    except UserError as e:
        assert f"lacks 1 weight(s) of the model: {key}" in str(e)
    else:
        assert torch.equal(model.state_dict()[key], saved)


def test_complete_checkpoints_still_load(tiny_model_dir, tmp_path):
    """No false alarm: tied embeddings (lm_head not saved) and drafters restored from the checkpoint."""
    d = save_tiny_model(build_tiny_model("llama", "eagle", tie_word_embeddings=True), tmp_path / "tied")
    model = load_model(d)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ref = build_tiny_model("llama", "eagle", tie_word_embeddings=True)
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
    assert load_model(tiny_model_dir("eagle3")).spec_mode == "eagle"


def test_compare_refuses_a_checkpoint_with_missing_weights(missing_tensor, exported):
    """compare must never pass by comparing two random initialisations: it refuses the checkpoint."""
    proc = run_module("exporter.compare", missing_tensor, exported("medusa"), timeout=240)
    one_line(proc.returncode, proc.stderr, "lacks 1 weight(s)", "model.layers.0.mlp.down_proj.weight")


# ----------------------------------------------------------------------------- tokenizer files and links


def test_tokenizer_symlink_outside_model_dir_is_refused(tiny_model_dir, tmp_path, capsys, no_tracing):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the export\n")
    d = copy(tiny_model_dir("medusa"), tmp_path / "model")
    (d / "special_tokens_map.json").symlink_to(secret)
    rc, err = run_main(capsys, d, tmp_path / "onnx")
    one_line(rc, err, "special_tokens_map.json is a symlink to", "outside", "copy the file")
    assert not (tmp_path / "onnx").exists()


def test_tokenizer_symlinks_inside_model_dir_or_hf_cache_are_copied_as_files(tiny_model_dir, tmp_path):
    """Links that stay in model_dir, and a Hugging Face cache snapshot (snapshots/<rev>/x -> ../../blobs/<sha>)."""
    repo = tmp_path / "models--tiny"
    snap = copy(tiny_model_dir("medusa"), repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    shutil.move(snap / "tokenizer.json", repo / "blobs" / "sha-tok")
    (snap / "tokenizer.json").symlink_to(Path("../../blobs/sha-tok"))
    shutil.move(snap / "tokenizer_config.json", snap / "real_config.json")
    (snap / "tokenizer_config.json").symlink_to("real_config.json")
    out = tmp_path / "onnx"
    ex.export(snap, out, validate=False, **QUIET)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file() and not (out / name).is_symlink()
    assert (out / "tokenizer.json").read_bytes() == (repo / "blobs" / "sha-tok").read_bytes()


@pytest.mark.parametrize(
    ("name", "content", "fragments"),
    [
        ("generation_config.json", "{not json", ["generation_config.json is not valid JSON"]),
        ("generation_config.json", b"\xff\xfe", ["generation_config.json is not valid JSON"]),
        ("generation_config.json", "[1, 2]", ["generation_config.json must hold a JSON object"]),
        ("generation_config.json", '{"eos_token_id": "2"}', ["eos_token_id must be a token id", "got '2'"]),
        ("tokenizer.json", '{"version": "1.0", "model": {"type": "Nope"}}', ["tokenizer.json cannot be read"]),
        ("tokenizer.json", "", ["tokenizer.json cannot be read"]),
    ],
)
def test_corrupt_side_files_are_refused_before_tracing(tiny_model_dir, tmp_path, capsys, no_tracing, name,
                                                       content, fragments):
    d = copy(tiny_model_dir("medusa"), tmp_path / "model")
    (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    rc, err = run_main(capsys, d, tmp_path / "onnx")
    one_line(rc, err, *fragments)


# ----------------------------------------------------------------------------- flags and configs


@pytest.mark.parametrize("opset", ["99", "5"])
def test_unsupported_opset(tiny_model_dir, tmp_path, capsys, opset):
    rc, err = run_main(capsys, tiny_model_dir("medusa"), tmp_path / "onnx", "--opset", opset)
    line = one_line(rc, err, f"--opset {opset} is not supported", "pass an opset from 17 to")
    assert "unexpected" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("rope", "fragments"),
    [
        ({"rope_type": "bogus", "factor": 2.0}, ["rope_scaling type 'bogus' is unknown", "linear"]),
        ({"rope_type": "linear", "factor": "x"}, ["rope_scaling factor must be a number", "'x'"]),
    ],
)
def test_bogus_rope_scaling_is_named_not_blamed_on_weights(tiny_model_dir, tmp_path, capsys, no_tracing, rope,
                                                           fragments):
    d = copy(tiny_model_dir("base"), tmp_path / "model")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = rope
    (d / "config.json").write_text(json.dumps(cfg))
    rc, err = run_main(capsys, d, tmp_path / "onnx")
    line = one_line(rc, err, *fragments)
    assert "corrupt" not in line and "weights" not in line


def test_garbage_pt_drafter_never_advises_weights_only_false(tiny_model_dir, tmp_path, capsys):
    import pickle

    bad = tmp_path / "drafter.pt"
    bad.write_bytes(pickle.dumps({"w": Path("x")}, protocol=2))  # a pickle of an object, not of tensors
    rc, err = run_main(capsys, tiny_model_dir("base"), tmp_path / "onnx", "--drafter", bad)
    line = one_line(rc, err, "cannot read the drafter", "weights-only")
    assert "weights_only" not in err and "does not fit" not in line
    bad.write_bytes(b"\x80\x02garbage")
    rc, err = run_main(capsys, tiny_model_dir("base"), tmp_path / "onnx", "--drafter", bad)
    one_line(rc, err, "drafter")
    assert "weights_only" not in err


def test_overwrite_non_export_needs_the_path_repeated(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "onnx"
    out.mkdir()
    (out / "mine.txt").write_text("x")
    rc, err = run_main(capsys, tiny_model_dir("medusa"), out, "--overwrite-non-export", "yes")
    one_line(rc, err, "--overwrite-non-export must repeat out_dir")
    assert (out / "mine.txt").read_text() == "x" and not (out / MANIFEST).exists()


# ----------------------------------------------------------------------------- issue 19


def test_shard_index_pointing_outside_the_model_dir_is_refused(sharded, tmp_path, capsys, no_tracing):
    """``"lm_head.weight": "../foreign/x.safetensors"`` was followed and the export exited 0."""
    d = copy(sharded, tmp_path / "model")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    key = "model.layers.1.self_attn.q_proj.weight"
    shard = data["weight_map"][key]
    shutil.copyfile(d / shard, foreign / "x.safetensors")
    data["weight_map"][key] = "../foreign/x.safetensors"
    index.write_text(json.dumps(data))
    rc, err = run_main(capsys, d, tmp_path / "onnx")
    one_line(rc, err, "model.safetensors.index.json", key, "'../foreign/x.safetensors'", "outside",
             "copy the shard")
    assert not (tmp_path / "onnx").exists()


def test_shard_that_is_a_link_out_of_the_model_dir_is_refused(sharded, tmp_path, capsys, no_tracing):
    d = copy(sharded, tmp_path / "model")
    data = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / sorted(set(data["weight_map"].values()))[0]
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    rc, err = run_main(capsys, d, tmp_path / "onnx")
    one_line(rc, err, shard.name, "is a symlink to", "outside", "copy the file")


def test_config_with_far_more_layers_than_the_checkpoint_fails_before_building(tiny_model_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """100,000 layers against a 2-layer checkpoint built the whole model before the missing-weights error."""
    import exporter.loading

    def built(*a, **k):
        raise AssertionError("the model was built before the layer count was checked")

    monkeypatch.setattr(exporter.loading, "_from_pretrained_checked", built)
    d = copy(tiny_model_dir("base"), tmp_path / "model")
    cfg = json.loads((d / "config.json").read_text())
    layers, cfg["num_hidden_layers"] = cfg["num_hidden_layers"], 100_000
    (d / "config.json").write_text(json.dumps(cfg))
    rc, err = run_main(capsys, d, tmp_path / "onnx")
    one_line(rc, err, "num_hidden_layers=100000", f"holds {layers} decoder layers", "fix num_hidden_layers")


@pytest.mark.parametrize("key, value", [("vocab_size", 10**9), ("hidden_size", 4096)])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_config_sizes_against_the_checkpoint_fail_before_building(tiny_model_dir, sharded, tmp_path, capsys,
                                                                  monkeypatch, key, value, layout):
    """Issue 19: ``vocab_size: 10**9`` in config.json failed with transformers' "For details look at the
    above report!" and no report above. Now the embedding's shape, read from the safetensors header,
    refuses it before the model is built, naming the key and the fix."""
    import exporter.loading

    def built(*a, **k):
        raise AssertionError("the model was built before the sizes were checked")

    monkeypatch.setattr(exporter.loading, "_from_pretrained_checked", built)
    d = copy(tiny_model_dir("base") if layout == "single" else sharded, tmp_path / "model")
    cfg = json.loads((d / "config.json").read_text())
    have = cfg[key]
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    rc, err = run_main(capsys, d, tmp_path / "onnx")
    one_line(rc, err, f"config.json says {key}={value}", "model.embed_tokens.weight", f"({key} {have})",
             f"fix {key} in config.json")
    assert not (tmp_path / "onnx").exists()


def test_shape_mismatch_the_header_cannot_show_is_still_one_clear_line(tiny_model_dir, tmp_path, capsys,
                                                                        monkeypatch):
    """Where the header check cannot run (a ``*.bin`` checkpoint; stood in for by disabling it),
    transformers' "look at the above report" is translated into a line naming config.json's sizes."""
    import exporter.inputs

    monkeypatch.setattr(exporter.inputs, "check_checkpoint_sizes", lambda *a: None)
    d = copy(tiny_model_dir("base"), tmp_path / "model")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] += 44
    (d / "config.json").write_text(json.dumps(cfg))
    rc, err = run_main(capsys, d, tmp_path / "onnx")
    line = one_line(rc, err, "do not have the shapes its config.json asks for", "fix the sizes in config.json")
    assert "above report" not in line


def test_symlinked_additional_chat_templates(tiny_model_dir, tmp_path, capsys, no_tracing):
    """A symlinked ``additional_chat_templates`` was dropped silently: a link inside the model directory
    is copied as a directory; one out of it is refused by name."""
    from exporter.inputs import copy_export_files

    d = copy(tiny_model_dir("base"), tmp_path / "model")
    (d / "templates").mkdir()
    (d / "templates" / "tool.jinja").write_text("{{ messages }}")
    (d / "additional_chat_templates").symlink_to(d / "templates")
    dst = tmp_path / "dst"
    dst.mkdir()
    copy_export_files(d, dst)
    assert (dst / "additional_chat_templates" / "tool.jinja").read_text() == "{{ messages }}"
    assert not (dst / "additional_chat_templates").is_symlink()

    elsewhere = tmp_path / "elsewhere"
    (d / "templates").rename(elsewhere)
    (d / "additional_chat_templates").unlink()
    (d / "additional_chat_templates").symlink_to(elsewhere)
    rc, err = run_main(capsys, d, tmp_path / "onnx")
    one_line(rc, err, "additional_chat_templates is a symlink to", "outside", "copy the directory")


def test_absurd_eagle_tree_fails_before_loading(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """``--eagle-trees 64,64,100000`` tried to allocate 20 GB; now the node bound refuses it at parse time."""
    import exporter.loading

    monkeypatch.setattr(exporter.loading, "load", lambda *a, **k: pytest.fail("loaded before the tree check"))
    rc, err = run_main(capsys, tiny_model_dir("eagle"), tmp_path / "onnx", "--eagle-trees", "64,64,100000")
    one_line(rc, err, "--eagle-trees", "total_tokens 100000 is over the 4096-node bound", "use a smaller tree")
    assert not (tmp_path / "onnx").exists()


def test_eagle_tree_longer_than_the_context_is_refused_before_tracing():
    from exporter.plan import check_tree

    with pytest.raises(UserError, match="does not fit the model's context of 512 positions"):
        check_tree(64, 64, 600, max_positions=512)
    check_tree(64, 64, 500, max_positions=512)
