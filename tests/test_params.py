"""The runtime API: GenerationParams (validation, generation_config.json defaults, keyword overrides),
incremental detokenization (DecodeStream), stream events' finish reason and stats, and the options
that must reach ONNX Runtime (session options, provider options, device_id)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

import graphs
import graphs.runtime
from graphs import sessions
from graphs.manifest import Manifest
from graphs.params import GenerationParams, check_prompt

# ------------------------------------------------------------------------------------------
# validation (one clear error naming the argument and the fix)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": float("nan")}, ValueError, r"temperature must be >= 0 and finite.*got nan"),
        ({"temperature": float("inf")}, ValueError, "temperature must be >= 0 and finite"),
        ({"top_k": 2.5}, ValueError, r"top_k must be >= 0 and an int.*got float 2\.5; e\.g\. top_k=2"),
        ({"stop": 123}, TypeError, r"stop_strings \(stop\) must be a string or a list of strings, got int 123"),
        ({"stop_strings": ["a", 5]}, TypeError, "stop_strings"),
        ({"stop": ""}, ValueError, "empty string"),
        ({"do_sample": "yes"}, TypeError, "do_sample must be True or False"),
        ({"eos_token_id": "2"}, TypeError, "eos_token_id must be a token id"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be an int >= 1"),
        ({"max_tokens": 3}, TypeError, r"unknown argument\(s\) \['max_tokens'\]"),
        ({"stop": "a", "stop_strings": "b"}, TypeError, "same argument"),
        ({"seed": -1}, ValueError, "seed must be an int >= 0"),
    ],
)
def test_bad_params_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        GenerationParams.build(**kwargs)


def test_numpy_scalars_are_accepted():
    p = GenerationParams.build(max_new_tokens=np.int64(4), top_k=np.int32(3), temperature=np.float32(0.5),
                               seed=np.uint8(7), eos_token_id=np.int64(2))
    assert (p.max_new_tokens, p.top_k, p.seed, p.eos_token_id) == (4, 3, 7, [2])
    assert type(p.max_new_tokens) is int and p.temperature == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ([1.7, 2.2], TypeError, r"prompt holds float 1\.7: token ids must be ints"),
        ("ab\ud800cd", ValueError, r"prompt holds an unpaired surrogate '\\ud800' at index 2"),
        (["ok", "x\udfffy"], ValueError, r"prompt\[1\] holds an unpaired surrogate"),
        ([[1, 2], 3.5], TypeError, r"prompt\[1\] is float 3\.5"),
        ({"a": 1}, TypeError, "prompt must be a string, a list of token ids"),
    ],
)
def test_bad_prompts(prompt, error, match):
    with pytest.raises(error, match=match):
        check_prompt(prompt)


def test_good_prompts():
    assert check_prompt([np.int64(5), 6]) == [[5, 6]]
    assert check_prompt(np.array([5, 6])) == [[5, 6]]
    assert check_prompt(["a", [1, 2]]) == ["a", [1, 2]]


def test_runtime_rejects_bad_input_before_running(exported):
    dec = graphs.load(exported("medusa"), provider="cpu")
    with pytest.raises(ValueError, match="temperature must be"):
        dec.generate([5, 6], temperature=float("nan"))
    with pytest.raises(TypeError, match="prompt holds float"):
        dec.generate([1.7, 2.2])
    with pytest.raises(ValueError, match="unpaired surrogate"):
        next(dec.stream("a\ud800"))
    assert len(dec.generate([5, 6], max_new_tokens=np.int64(4)).token_ids) == 4


# ------------------------------------------------------------------------------------------
# defaults: explicit > generation_config.json > ours


def test_resolution_order():
    cfg = GenerationParams.from_generation_config(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7,
         "eos_token_id": [2, 9], "num_beams": 1, "repetition_penalty": 1.0})
    r = GenerationParams().resolve(cfg)
    assert (r.do_sample, r.temperature, r.top_p, r.top_k, r.max_new_tokens, r.eos_token_ids) == (
        True, 0.6, 0.9, 20, 7, [2, 9])
    assert r.sources["temperature"] == "generation_config" and "(generation_config.json)" in r.describe()
    r = GenerationParams(max_new_tokens=3, temperature=0.9).resolve(cfg)
    assert (r.max_new_tokens, r.temperature, r.top_k) == (3, 0.9, 20)
    assert r.sources["max_new_tokens"] == r.sources["temperature"] == "argument"
    assert GenerationParams(do_sample=False).resolve(cfg).temperature == 0.0  # HF: do_sample=False is greedy
    assert GenerationParams(temperature=0).resolve(cfg).do_sample is False  # ours: temperature 0 is greedy
    assert GenerationParams(temperature=0.5).resolve().do_sample is True  # ours: a temperature alone samples
    r = GenerationParams(do_sample=True).resolve()  # HF defaults when sampling
    assert (r.temperature, r.top_p) == (1.0, 1.0)
    r = GenerationParams().resolve(GenerationParams(max_length=20))  # HF: prompt + new tokens
    assert r.new_tokens_for(15) == 5
    with pytest.raises(ValueError, match="max_length 20 leaves no room after a prompt of 20 tokens"):
        r.new_tokens_for(20)


def _with_generation_config(src, dst, config: dict):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(config))
    m = Manifest.read(dst, verify=False)
    m.write(dst)  # re-hash: the export now carries this generation_config.json
    return dst


def test_generation_config_json_gives_the_defaults(exported, tmp_path):
    d = _with_generation_config(exported("medusa"), tmp_path / "gen", {
        "do_sample": True, "temperature": 0.7, "top_k": 1, "max_new_tokens": 5, "eos_token_id": 2})
    dec = graphs.load(d, provider="cpu")
    used = dec.resolve()
    assert (used.do_sample, used.temperature, used.top_k, used.max_new_tokens) == (True, 0.7, 1, 5)
    greedy = dec.generate([5, 9, 3], max_new_tokens=12, do_sample=False).token_ids
    r = dec.generate([5, 9, 3], seed=0)  # top_k 1 from the file: sampling that must equal greedy
    assert r.token_ids == greedy[:5] or r.finish_reason == "eos"
    assert len(dec.generate([5, 9, 3], max_new_tokens=8, do_sample=False).token_ids) == 8  # explicit wins


def test_generate_cli_says_what_it_used(exported, tmp_path):
    from conftest import run_module

    d = _with_generation_config(exported("medusa"), tmp_path / "gen", {"max_new_tokens": 4, "do_sample": False})
    proc = run_module("exporter.generate", d, "--prompt", "ab", "--provider", "cpu", "--stop-strings", "zzz",
                      timeout=240)
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("[generation: max_new_tokens=4 (generation_config.json), greedy (generation_config.json)")
    assert "stop_strings=['zzz']" in first and "eos=[2] (manifest)" in first
    assert "4 tokens (length)" in proc.stderr


# ------------------------------------------------------------------------------------------
# text: DecodeStream, stop strings, events


MULTIBYTE = "héllo wörld, 日本語 ok → ✓ ç ñ € Ω"  # every byte in the tiny tokenizer's vocabulary


def _scripted(monkeypatch, ids: list[int], chunks=(1, 3, 2)):
    """Make every request emit exactly ``ids``: the first token from the prefill, then steps of 1, 3,
    2, ... tokens (speculative-like chunks): the proposer drafts a chain of the next scripted tokens
    and the sampler accepts all of it, the next one as the bonus (public engine parts, patched)."""
    from graphs import proposers, results
    from graphs.step import Drafts, Proposal
    from graphs.trees import Tree

    pointer: dict[int, list] = {}  # id(request) -> [request (kept alive), next index into ids]
    planned: dict[int, int] = {}  # id(tree) -> the index of its bonus token
    step = [0]

    def token(self, logits):
        return ids[0]

    def propose(self, rows, sizes):
        n = chunks[step[0] % len(chunks)]
        step[0] += 1
        out = []
        for r in rows:
            if r is None:
                out.append(Proposal(Tree.from_parents([-1]), np.array([0])))
                continue
            i = pointer.setdefault(id(r), [r, 1])[1]
            chain = ids[i : i + n - 1]
            tree = Tree.from_parents(list(range(-1, len(chain))))
            planned[id(tree)] = i + len(chain)
            pointer[id(r)][1] = i + len(chain) + 1
            out.append(Proposal(tree, np.array([r.root, *chain])))
        return Drafts(out)

    def accept(self, tree, tokens, logits):
        j = planned.pop(id(tree))
        return list(range(tree.size)), ids[j] if j < len(ids) else 0

    monkeypatch.setattr(results.Sampler, "token", token)
    monkeypatch.setattr(results.Sampler, "accept", accept)
    monkeypatch.setattr(proposers.Plain, "propose", propose)
    monkeypatch.setattr(proposers.Medusa, "propose", propose)


def test_streamed_text_equals_the_full_decode_on_multibyte_text(exported, monkeypatch):
    dec = graphs.load(exported("medusa"), provider="cpu")
    ids = dec.tokenizer.encode(MULTIBYTE).ids
    assert len(ids) > len(MULTIBYTE)  # multi-byte characters span several byte-level tokens
    _scripted(monkeypatch, ids)
    events = list(dec.stream("a", max_new_tokens=len(ids)))
    assert "".join(e.text for e in events) == dec.tokenizer.decode(ids) == MULTIBYTE
    assert all("\ufffd" not in e.text for e in events)  # partial characters are held back, never shown
    assert [e.finish_reason for e in events][-1] == "length" and not any(e.finish_reason for e in events[:-1])
    assert events[-1].stats is not None and events[-1].stats.new_tokens == len(ids)
    assert all(e.stats is None for e in events[:-1])
    assert dec.generate("a", max_new_tokens=len(ids)).text == MULTIBYTE
    # cut inside a character: the full decode shows U+FFFD at the end, and so does the stream
    cut = next(n for n in range(1, len(ids)) if dec.tokenizer.decode(ids[:n]).endswith("\ufffd"))
    events = list(dec.stream("a", max_new_tokens=cut))
    assert "".join(e.text for e in events) == dec.tokenizer.decode(ids[:cut])


def test_stop_string_across_multibyte_tokens(exported, monkeypatch):
    dec = graphs.load(exported("medusa"), provider="cpu")
    ids = dec.tokenizer.encode(MULTIBYTE).ids
    _scripted(monkeypatch, ids)
    events = list(dec.stream(["a", "b"], max_new_tokens=len(ids), stop_strings=["日本", "never"]))
    for b in (0, 1):
        mine = [e for e in events if e.index == b]
        assert "".join(e.text for e in mine) == "héllo wörld, "
        assert mine[-1].finish_reason == "stop"
    assert events[-1].stats is not None
    r = dec.generate("a", max_new_tokens=len(ids), stop="語")
    assert r.text == "héllo wörld, 日本" and r.finish_reason == "stop"
    assert dec.tokenizer.decode(r.token_ids).startswith("héllo wörld, 日本語")  # up to the completing token


def test_decode_is_incremental(exported, monkeypatch):
    """No per-step decode of the whole sequence: the full decode runs once per sequence, at its end."""
    dec = graphs.load(exported("medusa"), provider="cpu")
    calls = []
    real = dec.decode
    monkeypatch.setattr(dec, "decode", lambda ids: calls.append(len(ids)) or real(ids))
    r = dec.generate(["ab", "cd"], max_new_tokens=40)
    assert len(calls) == 2 and all(len(x.token_ids) > 1 for x in r)


# ------------------------------------------------------------------------------------------
# options that reach ONNX Runtime


def test_a_thread_count_per_session_under_the_shared_pool_is_a_one_line_error(exported):
    """Once the process runs every session on one pool (use_shared_thread_pool: the CLIs and the
    server), ORT refuses a session pool of its own with a raw error (and prints an "EP Error" banner
    first); the option is refused up front, naming the pool and the fix. In a child process: the pool
    is process-wide."""
    import subprocess
    import sys

    code = ("import graphs, graphs.errors, graphs.sessions as s\n"
            "assert s.use_shared_thread_pool(1)\n"
            "try:\n"
            f"    graphs.load({str(exported('medusa'))!r}, provider='cpu',\n"
            "                session_options={'intra_op_num_threads': 1})\n"
            "except graphs.errors.InputError as e:\n"
            "    print('REFUSED', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith("REFUSED session option intra_op_num_threads") and "shared" in line and "--threads" in line
    assert "EP Error" not in r.stdout + r.stderr


def test_session_options_reach_ort(exported):
    """In a child process: a per-session thread count is refused once the process shares one pool
    (above), and an earlier in-process test may have set that pool for good."""
    import subprocess
    import sys

    code = ("import graphs\n"
            f"dec = graphs.load({str(exported('eagle'))!r}, provider='cpu',\n"
            "    session_options={'intra_op_num_threads': 1, 'session.intra_op.allow_spinning': '1',\n"
            "                     'enable_mem_pattern': False})\n"
            "for s in (dec.base, dec.draft):\n"
            "    o = s.get_session_options()\n"
            "    assert o.intra_op_num_threads == 1 and o.enable_mem_pattern is False\n"
            "    assert o.get_session_config_entry('session.intra_op.allow_spinning') == '1'\n"
            "import onnxruntime as ort\n"
            "own = ort.SessionOptions()\n"
            "own.inter_op_num_threads = 3\n"
            f"dec = graphs.load({str(exported('eagle'))!r}, provider='cpu', session_options=own)\n"
            "assert dec.base.get_session_options().inter_op_num_threads == 3\n"
            "print('OK')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr
    with pytest.raises(TypeError, match="session_options must be"):
        graphs.load(exported("eagle"), provider="cpu", session_options=["x"])
    # a misspelt attribute is not silently turned into a config entry
    with pytest.raises(ValueError, match="unknown session option 'intra_op_num_thread'"):
        graphs.load(exported("eagle"), provider="cpu", session_options={"intra_op_num_thread": 1})


@pytest.mark.parametrize(("threads", "err", "match"), [
    (0, ValueError, "threads must be between 1 and"), (-1, ValueError, "threads must be between 1 and"),
    (100000, ValueError, "this machine's cores"), ("2", TypeError, "threads must be an int"),
    (True, TypeError, "threads must be an int")])
def test_threads_are_bounded_by_the_cores(exported, threads, err, match):
    """--threads 100000 once created 20,000 threads; 0 and -1 were accepted."""
    with pytest.raises(err, match=match):
        graphs.load(exported("eagle"), provider="cpu", threads=threads)
    with pytest.raises(err, match=match):
        sessions.use_shared_thread_pool(threads)


def test_adaptive_must_be_a_bool(exported):
    with pytest.raises(ValueError, match="adaptive must be True or False"):
        graphs.load(exported("medusa"), provider="cpu", adaptive="no")


def test_provider_options_and_device_id_reach_ort(exported, monkeypatch):
    assert sessions.provider_list("cuda", 3, {"gpu_mem_limit": 1 << 30}) == [
        ("CUDAExecutionProvider", {"device_id": 3, "gpu_mem_limit": 1 << 30}), "CPUExecutionProvider"]
    with pytest.raises(ValueError, match="device_id must be an int >= 0"):
        sessions.provider_list("cuda", -1)
    seen = []
    real = ort.InferenceSession

    def recording(path, sess_options=None, providers=None):
        seen.append(providers)
        return real(path, sess_options=sess_options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(sessions.ort, "InferenceSession", recording)
    graphs.load(exported("medusa"), provider="cpu", provider_options={"arena_extend_strategy": "kSameAsRequested"})
    assert seen and all(p == [("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})] for p in seen)
    # CUDA: pretend onnxruntime-gpu sees a GPU; the sessions are asked for CUDA device 1
    seen.clear()
    monkeypatch.setattr(sessions.ort, "get_available_providers", lambda: ["CUDAExecutionProvider",
                                                                          "CPUExecutionProvider"])
    dec = graphs.load(exported("medusa"), provider="cuda", device_id=1, io_binding=False)
    assert dec.device_id == 1 and len(seen) == 2  # base and draft
    assert all(p[0] == ("CUDAExecutionProvider", {"device_id": 1}) for p in seen)
