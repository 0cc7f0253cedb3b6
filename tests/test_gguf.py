"""GGUF in (exporter.gguf): a tiny llama written as GGUF converts, loads, is cached and exports; every bad
file is one clear line.

The GGUF files are synthetic: a tiny random Llama written the way llama.cpp's convert_hf_to_gguf.py
writes one (q/k rows permuted, a gpt2-style byte-level BPE tokenizer with merges and a ChatML template
in the metadata), so transformers' GGUF reader takes the same path as for a real file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from exporter import gguf as G
from exporter.errors import UserError

HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 64, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + sorted(bytes_to_unicode().values()) + ["".join(m) for m in MERGES]  # 264 tokens


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(_tokens()), hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # not all ones, so a misplaced norm shows
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py LlamaModel.permute); transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, *, arch: str = "llama", tokenizer: bool = True, f64: bool = False, seed: int = 0):
    """A tiny Llama as a GGUF file; returns the HF model it was written from.

    ``arch`` is general.architecture; ``tokenizer=False`` leaves out every tokenizer.* key; ``f64`` stores
    one tensor as F64 (a type the gguf package does not dequantize).
    """
    import gguf

    model = tiny_llama(seed)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_context_length(256)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    if tokenizer:
        tokens = _tokens()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3: control, 1: normal
        w.add_token_merges([" ".join(m) for m in MERGES])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_chat_template(CHATML)
    # token embeddings as Q8_0 blocks: a real dequantization on the way in
    embd = sd["model.embed_tokens.weight"]
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", gguf.quants.quantize(embd, q8), raw_dtype=q8)  # bytes; shape from them
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], HEADS))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], KV_HEADS))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    norm = sd["model.norm.weight"]
    w.add_tensor("output_norm.weight", norm.astype(np.float64) if f64 else norm)
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


class Log(list):
    """A ``log`` that keeps its lines."""

    def __call__(self, *args, **_kw):
        self.append(" ".join(map(str, args)))

    def has(self, text: str) -> bool:
        return any(text in line for line in self)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path of a good tiny GGUF, the HF model it was written from)."""
    d = tmp_path_factory.mktemp("gguf")
    return d / "tiny.Q8_0.gguf", write_tiny_gguf(d / "tiny.Q8_0.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    """(cache root, the converted directory, its log) for the good tiny GGUF."""
    root, log = tmp_path_factory.mktemp("gguf-cache"), Log()
    return root, G.resolve_gguf(tiny_gguf[0], root=root, log=log), log


@pytest.fixture
def calls(monkeypatch):
    """Counts conversions: every call of exporter.gguf.convert_gguf, which still runs."""
    seen = []
    real = G.convert_gguf

    def counting(*args, **kwargs):
        seen.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(G, "convert_gguf", counting)
    return seen


# ----------------------------------------------------------------------------- the good file


def test_tiny_gguf_converts_to_a_model_directory_equal_to_the_gguf_model(tiny_gguf, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, original = tiny_gguf
    root, out, log = converted
    assert out.parent == root and len(out.name) == 64  # <root>/<sha256>
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", G.SOURCE_FILE} <= names
    assert not any(n.endswith((".bin", ".pt", ".gguf")) for n in names)
    for phase in ("hashing", "dequantizing", "saving", "checking the saved directory"):
        assert log.has(f"gguf: {phase}"), log
    assert all(" done in " in line for line in log if line.startswith("gguf: dequantizing") and "..." not in line)

    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 40, 70, 260, 262, 99, 2]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
    # and the weights are the HF model's the file was written from (q/k un-permuted; Q8_0 within a step)
    got, want = ours.state_dict(), original.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        if key == "model.embed_tokens.weight":
            step = value.abs().amax(dim=1, keepdim=True) / 127  # Q8_0: 32 values share one scale
            assert ((got[key] - value).abs() <= step).all()
        else:
            assert torch.equal(got[key], value), key

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHATML and tok.eos_token == "<|im_end|>" and len(tok) == len(_tokens())
    assert tok("the in")["input_ids"] == AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)(
        "the in")["input_ids"]


def test_second_resolve_reuses_the_cache(tiny_gguf, converted, calls):
    root, out, _ = converted
    log = Log()
    assert G.resolve_gguf(tiny_gguf[0], root=root, log=log) == out
    assert calls == []  # nothing converted again
    assert log == [f"gguf: reusing the converted GGUF in {out}"]  # not even hashed again: same size and mtime


def test_a_changed_file_is_hashed_again(tiny_gguf, converted, tmp_path, calls):
    root, out, _ = converted
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf[0].read_bytes())
    log = Log()
    assert G.resolve_gguf(copy, root=root, log=log) == out  # same bytes, same conversion
    assert log.has("gguf: hashing copy.gguf") and calls == []


def test_resolve_model_takes_a_gguf_or_a_directory_holding_one(tiny_gguf, converted, monkeypatch, calls):
    from exporter.hub import resolve_model

    root, out, _ = converted
    monkeypatch.setattr(G, "cache_root", lambda: root)
    assert resolve_model(tiny_gguf[0]) == out
    assert resolve_model(tiny_gguf[0].parent) == out  # its directory holds only this .gguf
    assert calls == []


def test_cache_root_is_the_projects_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECEXPORT_CACHE_DIR", str(tmp_path))
    assert G.cache_root() == tmp_path / "gguf"
    monkeypatch.delenv("SPECEXPORT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert G.cache_root() == tmp_path / "xdg" / "specexport" / "gguf"


def test_hashing_prints_progress(tmp_path):
    f = tmp_path / "big.gguf"
    f.write_bytes(b"GGUF" + bytes(3 << 20))
    log = Log()
    import hashlib

    assert G.sha256_streamed(f, log=log, every_s=0.0) == hashlib.sha256(f.read_bytes()).hexdigest()
    assert log.has("gguf: hashing big.gguf: 100%") and log[-1].startswith("gguf: hashed big.gguf in ")


# ----------------------------------------------------------------------------- a conversion killed midway


def test_a_killed_conversion_leaves_nothing_and_its_leftovers_go(tiny_gguf, tmp_path, monkeypatch):
    path = tiny_gguf[0]
    root = tmp_path / "cache"

    def killed(src, out_dir, **_kw):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(G, "convert_gguf", killed)
    with pytest.raises(KeyboardInterrupt):
        G.resolve_gguf(path, root=root, log=Log())
    assert [p.name for p in root.iterdir()] == [G.INDEX_FILE]  # no <sha256>/, no temporary directory

    sha = G.file_sha256(path, root=root, log=Log())
    dead = root / f".{sha}.tmp-999999999"  # what a SIGKILL leaves: a pid that no longer runs
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    monkeypatch.undo()
    log = Log()
    out = G.resolve_gguf(path, root=root, log=log)
    assert out == root / sha and log.has("gguf: converted")
    assert sorted(p.name for p in root.iterdir()) == sorted([sha, G.INDEX_FILE])


# ----------------------------------------------------------------------------- bad files, one line each


def _one_line_error(path, root) -> str:
    with pytest.raises(UserError) as info:
        G.resolve_gguf(path, root=root, log=Log())
    text = str(info.value)
    assert "\n" not in text
    assert not any(p.is_dir() for p in root.iterdir()), "nothing converted, nothing left behind"
    return text


def test_unsupported_architecture_is_named(tmp_path, calls):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, arch="frobnicator")
    text = _one_line_error(path, tmp_path)
    assert text.startswith(f"{path}: transformers cannot load GGUF architecture 'frobnicator' (general.architecture)")
    assert "llama" in text and "qwen3" in text  # the ones it loads
    assert calls == []


def test_truncated_gguf(tiny_gguf, tmp_path, calls):
    data = tiny_gguf[0].read_bytes()
    for cut in (len(data) // 2, 3000, len(data) - 1):  # in the tensors, in the metadata, the last byte
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        text = _one_line_error(path, tmp_path)
        assert text.startswith(f"{path} is truncated") and text.endswith("download or convert it again"), text
    assert calls == []


def test_not_a_gguf_file(tmp_path, calls):
    path = tmp_path / "model.gguf"
    path.write_text("<html>404 Not Found</html>")
    assert _one_line_error(path, tmp_path) == (
        f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a .gguf file or a "
        f"Hugging Face model directory")
    assert calls == []


def test_missing_tokenizer(tmp_path, calls):
    path = tmp_path / "notok.gguf"
    write_tiny_gguf(path, tokenizer=False)
    text = _one_line_error(path, tmp_path)
    assert text.startswith(f"{path} has no tokenizer in its metadata (tokenizer.ggml.model/tokens); the export "
                           f"needs one")
    assert calls == []


def test_quantization_type_it_cannot_dequantize_is_named(tmp_path, calls):
    path = tmp_path / "f64.gguf"
    write_tiny_gguf(path, f64=True)
    text = _one_line_error(path, tmp_path)
    assert text.startswith(f"{path} stores tensors as F64, which the gguf package cannot dequantize (it can: ")
    assert "Q4_1" in text and "Q8_0" in text
    assert calls == []


def test_directory_with_two_gguf_files(tmp_path, calls):
    from exporter.hub import resolve_model

    for name in ("a.Q4_0.gguf", "b.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(UserError) as info:
        resolve_model(tmp_path)
    assert str(info.value) == (f"{tmp_path} holds 2 .gguf files (a.Q4_0.gguf, b.Q8_0.gguf); pass the one to use, "
                               f"e.g. {tmp_path / 'a.Q4_0.gguf'}")
    assert calls == []


def test_find_gguf_leaves_model_directories_and_hub_ids_alone(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "extra.gguf").write_bytes(b"GGUF")
    assert G.find_gguf(tmp_path) is None  # a model directory that also holds a GGUF
    assert G.find_gguf("org/name") is None
    assert G.find_gguf(tmp_path / "sub") is None
    with pytest.raises(UserError, match=r"absent\.gguf does not exist or is not a file; pass the path of a \.gguf"):
        G.find_gguf(tmp_path / "absent.gguf")


# ----------------------------------------------------------------------------- the export command


def test_export_command_takes_a_gguf(tiny_gguf, tmp_path, monkeypatch, capsys):
    from exporter.export import main

    monkeypatch.setenv("SPECEXPORT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "onnx"
    assert main([str(tiny_gguf[0]), str(out), "--no-validate"]) == 0
    printed = capsys.readouterr().out
    assert "gguf: converted tiny.Q8_0.gguf" in printed
    assert (out / "manifest.json").is_file() and (out / "config.json").is_file()
    assert any(p.suffix == ".onnx" for p in out.iterdir())
    assert "<|im_start|>" in "".join(p.read_text() for p in out.iterdir() if "chat_template" in p.name
                                      or p.name == "tokenizer_config.json")
    converted = next((tmp_path / "cache" / "gguf").glob("[0-9a-f]*"))
    assert os.listdir(converted)  # the conversion stays cached for the next export
