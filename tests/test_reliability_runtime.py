"""Nothing wrong in silence: the runtime against hostile manifests, tampering and bad numbers (issue 10).

- confinement: every file the runtime opens is inside out_dir, listed and hashed; unlisted files,
  symlinks, FIFOs, absolute and ``..`` paths are refused;
- tampering of every file kind, the external weight file included;
- the manifest's schema and the graphs' declared inputs, checked before anything is allocated;
- the sha256 proof record (hash once, then size/mtime/ctime/inode) and the ways to force a full check;
- tree arguments beyond the model, non-finite logits, and the command line's error style.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import run_module

import exporter.export as ex
import graphs
import graphs.integrity as integrity
from graphs import contract as C
from graphs.errors import ArtifactError, InputError, NonFiniteLogitsError
from graphs.manifest import MANIFEST, Manifest


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


class Replace:
    """Returned by a manifest edit: write ``value`` instead of the edited manifest."""

    def __init__(self, value):
        self.value = value


def edit_manifest(d: Path, change) -> Path:
    """Apply ``change(dict)`` to d/manifest.json (it may return a :class:`Replace`)."""
    data = json.loads((d / MANIFEST).read_text())
    new = change(data)
    (d / MANIFEST).write_text(json.dumps(new.value if isinstance(new, Replace) else data))
    return d


def flip_bit(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def load(d, **kw):
    return graphs.load(d, provider="cpu", threads=1, **kw)


@pytest.fixture(scope="module")
def external(tiny_model_dir, tmp_path_factory):
    """A Medusa export whose base weights live in base.onnx.data (external data), as at 1.1B scale."""
    out = tmp_path_factory.mktemp("external") / "onnx"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
        ex.export(tiny_model_dir("medusa"), out, log=lambda *a, **k: None)
    assert (out / "base.onnx.data").is_file()
    return out


# ----------------------------------------------------------------------------- tampering, every kind


FILE_KINDS = [("medusa", "base.onnx"), ("medusa", "draft.onnx"), ("eagle", "draft_tree_2_3_6.onnx"),
              ("medusa", "tokenizer.json"), ("medusa", "tokenizer_config.json"),
              ("external", "base.onnx.data"), ("external", "base.onnx")]


@pytest.mark.parametrize(("kind", "name"), FILE_KINDS, ids=[f"{k}-{n}" for k, n in FILE_KINDS])
def test_tampering_of_every_file_kind_is_caught(exported, external, tmp_path, kind, name):
    src = external if kind == "external" else exported(kind)
    d = copy(src, tmp_path / "t")
    flip_bit(d / name)
    with pytest.raises(ArtifactError, match=rf"{name} does not match its sha256"):
        load(d)


def test_external_data_export_runs_like_the_inline_one(exported, external):
    a = load(external).generate([5, 6, 7], max_new_tokens=8)
    b = load(exported("medusa")).generate([5, 6, 7], max_new_tokens=8)
    assert a.token_ids == b.token_ids


# ----------------------------------------------------------------------------- confinement


def test_unlisted_file_is_refused(exported, external, tmp_path):
    d = copy(exported("medusa"), tmp_path / "extra")
    (d / "extra.onnx").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=r"extra\.onnx is not listed in the manifest"):
        load(d)
    d = edit_manifest(copy(external, tmp_path / "unlisted-data"), lambda m: m["files"].pop("base.onnx.data"))
    with pytest.raises(ArtifactError, match=r"base\.onnx\.data is not listed in the manifest"):
        load(d, verify=False)  # even without hashing: ORT would open it


def test_external_data_outside_the_export_is_refused(external, tmp_path):
    """base.onnx pointing at ../base.onnx.data, manifest rehashed: ONNX Runtime must not read it."""
    import onnx

    d = copy(external, tmp_path / "d")
    shutil.move(d / "base.onnx.data", tmp_path / "base.onnx.data")
    proto = onnx.load(str(d / "base.onnx"), load_external_data=False)
    for t in proto.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "../base.onnx.data"
    (d / "base.onnx").write_bytes(proto.SerializeToString())
    data = json.loads((d / MANIFEST).read_text())
    del data["files"]["base.onnx.data"]
    Manifest.from_json(data).write(d)  # rehashed: every file in d is listed and matches
    with pytest.raises(ArtifactError, match=r"ONNX Runtime cannot load .*base\.onnx \(.*escapes model directory"):
        load(d)


def test_manifest_listing_no_files_is_refused(exported, tmp_path):
    d = edit_manifest(copy(exported("medusa"), tmp_path / "nofiles"), lambda m: m.update(files={}))
    with pytest.raises(ArtifactError, match=r"graphs\.base\.file 'base\.onnx' is not listed in files"):
        load(d)


@pytest.mark.parametrize("where", ["/abs", "../outside", "a/../../b"])
def test_graph_file_outside_the_export_is_refused(exported, tmp_path, where):
    outside = tmp_path / "outside"
    shutil.copy(exported("medusa") / "base.onnx", outside)
    path = str(tmp_path / "outside") if where == "/abs" else where

    def point_outside(m):
        m["graphs"]["base"]["file"] = path
        m["files"][path] = m["files"]["base.onnx"]

    d = edit_manifest(copy(exported("medusa"), tmp_path / "d"), point_outside)
    with pytest.raises(ArtifactError, match="not a plain relative path inside the export"):
        load(d)


def test_symlinked_file_is_refused(exported, tmp_path):
    d = copy(exported("medusa"), tmp_path / "link")
    outside = tmp_path / "tokenizer-elsewhere.json"
    shutil.move(d / "tokenizer.json", outside)
    (d / "tokenizer.json").symlink_to(outside)  # same bytes, same sha256: but outside the export
    with pytest.raises(ArtifactError, match=r"tokenizer\.json is a symlink"):
        load(d)


def test_fifo_tokenizer_is_refused_without_blocking(exported, tmp_path):
    d = copy(exported("medusa"), tmp_path / "fifo")
    (d / "tokenizer.json").unlink()
    os.mkfifo(d / "tokenizer.json")
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("graphs.load blocked on a FIFO"))
    signal.alarm(60)
    try:
        for verify in (True, False):
            with pytest.raises(ArtifactError, match=r"tokenizer\.json is not a regular file"):
                load(d, verify=verify)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- schema, before allocating


def _set(path: str, value):
    def change(m):
        *keys, last = path.split(".")
        node = m
        for k in keys:
            node = node[k]
        node[last] = value

    return change


SCHEMA_CASES = [
    ("list", lambda m: Replace([]), "manifest must be a JSON object, got list"),
    ("graphs_empty", _set("graphs", {}), "has no 'base' graph"),
    ("no_source", lambda m: m.pop("source"), "key 'source' is missing"),
    ("no_num_layers", lambda m: m["source"].pop("num_layers"), r"source\.num_layers is missing"),
    ("num_layers_float", _set("source.num_layers", 1e9), r"source\.num_layers must be an integer"),
    ("num_layers_huge", _set("source.num_layers", 10**9), r"num_layers = 1000000000 is outside \[1, 1024\]"),
    ("num_layers_wrong", _set("source.num_layers", 3), r"declares 4 past K/V layers where the manifest says 3"),
    ("head_dim_wrong", _set("source.head_dim", 8), r"past_key_values\.0\.key has dims"),
    ("vocab_wrong", _set("source.vocab_size", 1000), "logits do not end in the vocabulary size 1000"),
    ("drafter_kind", _set("drafter.kind", "lookahead"), "'lookahead' is unknown; this runtime reads medusa, eagle"),
    ("drafter_without_graph", lambda m: m["graphs"].pop("draft"), "must be both present or both absent"),
    ("medusa_heads", _set("drafter.num_heads", 5), "logits do not have 5 Medusa heads"),
    ("eos_string", _set("generation.eos_token_ids", "2"), "eos_token_ids must be a list of token ids"),
    ("no_generation", lambda m: m.pop("generation"), "key 'generation' is missing"),  # once accepted silently
    ("context_zero", _set("source.max_position_embeddings", 0), r"max_position_embeddings = 0 is outside"),
    ("tokenizer_outside", _set("tokenizer", "../tokenizer.json"), "not a plain relative path"),
    ("bad_digest", _set("files.base.onnx", "abc"), "is not a sha256 hex digest"),
    ("bad_dims", _set("graphs.base.inputs", [{"name": "input_ids", "dtype": "int64", "dims": [-1]}]), "bad dims"),
    # the base's one-sequence graph is a file of the export like the graphs: inside it, and hashed
    ("one_sequence_outside", _set("optimization", {"base": {"one_sequence": {"file": "../outside/evil.onnx"}}}),
     r"one_sequence\.file names '\.\./outside/evil\.onnx', which is not a plain relative path"),
    ("one_sequence_unlisted", _set("optimization", {"base": {"one_sequence": {"file": "base.gqa.onnx"}}}),
     "'base.gqa.onnx' is not listed in files"),
    ("one_sequence_not_a_record", _set("optimization", {"base": {"one_sequence": 3}}),
     r"optimization\.base\.one_sequence must be"),
]


@pytest.mark.parametrize(("name", "change", "match"), SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES])
def test_manifest_schema(exported, tmp_path, monkeypatch, name, change, match):
    def no_session(*a, **k):
        raise AssertionError("a session was built from an invalid manifest")

    monkeypatch.setattr("graphs.runtime.make_session", no_session)
    if name == "bad_digest":
        def change(m):
            m["files"]["base.onnx"] = "abc"
    d = edit_manifest(copy(exported("medusa"), tmp_path / name), change)
    with pytest.raises(ArtifactError, match=match):
        load(d)


def test_manifest_that_is_not_utf8(exported, tmp_path):
    d = copy(exported("medusa"), tmp_path / "latin1")
    (d / MANIFEST).write_bytes(b'{"format_version": 1, "x": "\xff"}')
    with pytest.raises(ArtifactError, match=r"manifest\.json is not UTF-8 text"):
        load(d)


def test_graph_file_that_does_not_match_its_declared_contract(exported, tmp_path):
    """draft.onnx copied over base.onnx and rehashed: the hash fits, the graph does not."""
    d = copy(exported("medusa"), tmp_path / "swapped")
    shutil.copy(d / "draft.onnx", d / "base.onnx")
    m = Manifest.read(d, verify=False)
    m.write(d)
    with pytest.raises(ArtifactError, match=r"base graph base\.onnx does not have the inputs its manifest declares"):
        load(d)


# ----------------------------------------------------------------------------- the sha256 proof record


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = integrity.sha256_file

    def counting(p, *a, **k):
        calls.append(Path(p).name)
        return real(p, *a, **k)

    monkeypatch.setattr(integrity, "sha256_file", counting)
    monkeypatch.setattr(integrity, "RACY_NS", 0)  # files copied a moment ago may be trusted in this test
    return calls


def test_hash_once_then_trust_the_proof_record(exported, tmp_path, counted):
    d = copy(exported("medusa"), tmp_path / "cached")
    n = len(Manifest.read(d, verify=False).files)
    load(d)
    assert len(counted) == n  # first load: every file hashed
    load(d)
    assert len(counted) == n  # second: the record matches, nothing hashed
    load(d, verify="full")
    assert len(counted) == 2 * n  # asked for: hashed again


def test_full_check_forced_by_environment(exported, tmp_path, counted, monkeypatch):
    d = copy(exported("medusa"), tmp_path / "env")
    load(d)
    monkeypatch.setenv("SPECEXPORT_VERIFY", "full")
    before = len(counted)
    load(d)
    assert len(counted) > before


def test_change_with_restored_mtime_is_still_caught(exported, tmp_path, counted):
    """Same size, mtime set back: the ctime (which utime cannot restore) and the record disagree."""
    d = copy(exported("medusa"), tmp_path / "sneaky")
    load(d)
    p = d / "base.onnx"
    st = p.stat()
    flip_bit(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert p.stat().st_size == st.st_size and p.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ArtifactError, match=r"base\.onnx does not match its sha256"):
        load(d)


def test_replaced_file_and_edited_manifest_are_caught(exported, tmp_path, counted):
    d = copy(exported("medusa"), tmp_path / "replaced")
    load(d)
    shutil.copy(d / "base.onnx", d / "base.tmp")
    flip_bit(d / "base.tmp")
    os.replace(d / "base.tmp", d / "base.onnx")  # new inode
    with pytest.raises(ArtifactError, match="sha256"):
        load(d)


def test_a_write_through_a_shared_mmap_is_caught_by_the_full_check(exported, tmp_path, counted):
    """Issue 19: writes through a shared writable mmap may leave size, mtime and ctime as the proof record
    has them, so the fast check (``verify="auto"``) is documented as not proving those bytes
    (docs/reliability.md); what it documents as the remedy, ``verify="full"``, catches them. (Whether the
    auto check notices depends on when the kernel stamps the page: not asserted.)"""
    import mmap

    d = copy(exported("medusa"), tmp_path / "mapped")
    load(d)  # hashed, the record kept
    with open(d / "base.onnx", "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[len(m) // 2] ^= 0x01
        m.flush()
    with pytest.raises(ArtifactError, match=r"base\.onnx does not match its sha256"):
        load(d, verify="full")


@pytest.mark.parametrize("verify", ["auto", "full"])
def test_a_base_swapped_before_the_first_batch_is_refused_not_decoded(exported, tmp_path, verify):
    """An optimized export opens base.onnx at the first batch of trees (its one-sequence graph runs
    everything else), long after graphs.load checked it: a base with other weights swapped in between
    is refused with the file named (it decoded before); the verified bytes put back decode as ever."""
    import onnx
    from onnx import numpy_helper

    from exporter.optimize import optimize_export

    d = copy(exported("medusa"), tmp_path / "lazy")
    optimize_export(d, progress=None, time_gain=False, tune=False)
    prompts = [[5, 9, 3], [7, 1, 4, 4]]
    want = [r.token_ids for r in load(d, verify="full").generate(prompts, max_new_tokens=6, mode="speculative")]
    dec = load(d, verify=verify)
    assert dec._one_sequence is not None and not dec.base.loaded  # (the lazy path this guards)
    original = (d / "base.onnx").read_bytes()
    model = onnx.load(str(d / "base.onnx"))
    big = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    big.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(big) * -3.0, big.name))
    onnx.save(model, str(tmp_path / "other.onnx"))
    os.replace(tmp_path / "other.onnx", d / "base.onnx")  # swapped after the load's check
    with pytest.raises(ArtifactError, match=r"base\.onnx changed after graphs\.load checked it"):
        dec.generate(prompts, max_new_tokens=6, mode="speculative")
    assert not dec.base.loaded
    (tmp_path / "back.onnx").write_bytes(original)
    os.replace(tmp_path / "back.onnx", d / "base.onnx")  # the verified bytes again (a new inode)
    assert [r.token_ids for r in dec.generate(prompts, max_new_tokens=6, mode="speculative")] == want
    assert dec.base.loaded


def test_young_files_are_hashed_every_time(exported, tmp_path, monkeypatch):
    """Within the racy window (a change in the same timestamp tick would be invisible) no record is kept."""
    d = copy(exported("medusa"), tmp_path / "young")
    calls = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: calls.append(1) or real(p, *a, **k))
    monkeypatch.setattr(integrity, "RACY_NS", 10**15)
    load(d)
    n = len(calls)
    load(d)
    assert len(calls) == 2 * n


def test_unknown_verify_mode(exported):
    with pytest.raises(ArtifactError, match="unknown verify='sometimes'"):
        load(exported("medusa"), verify="sometimes")


# ----------------------------------------------------------------------------- tree arguments beyond the model


@pytest.fixture(scope="module")
def decoders(exported):
    return {k: graphs.load(exported(k), provider="cpu", threads=1) for k in ("medusa", "eagle", "eagle3", "base")}


@pytest.mark.parametrize(
    ("kind", "tree", "match"),
    [
        ("medusa", [[0], [256]], "rank 256 asks for the top 257 tokens but the vocabulary has 256"),
        ("eagle", {"topk": 300}, "topk 300 exceeds the drafter's vocabulary of 256"),
        ("eagle3", {"topk": 129}, "topk 129 exceeds the drafter's vocabulary of 128"),
        ("eagle", {"total_tokens": 10**6}, "total_tokens 1000000 exceeds the"),
        ("eagle", {"topk": 2, "depth": 2, "total_tokens": 12}, "exceeds the 11 nodes"),
    ],
)
def test_tree_beyond_the_model(decoders, kind, tree, match):
    with pytest.raises(InputError, match=match):
        decoders[kind].generate([5, 6], max_new_tokens=2, tree=tree)


def test_largest_eagle_tree_still_runs(decoders):
    r = decoders["eagle"].generate([5, 6], max_new_tokens=4, tree={"topk": 2, "depth": 2, "total_tokens": 11})
    assert len(r.token_ids) == 4


def test_typical_acceptance_on_a_base_only_export(decoders):
    with pytest.raises(InputError, match=r"typical acceptance needs a Medusa drafter.*base only") as e:
        decoders["base"].generate([5, 6], max_new_tokens=2, temperature=0.5, acceptance="typical")
    assert "EAGLE" not in str(e.value)


# ----------------------------------------------------------------------------- non-finite logits


class PoisonedSession:
    """Wraps a base session: from its ``after``-th call on, logits get ``value`` at token 7."""

    def __init__(self, session, value, after: int):
        self.session, self.value, self.after, self.calls = session, value, after, 0

    def run(self, names, feed):
        out = self.session.run(names, feed)
        self.calls += 1
        if self.calls > self.after:
            i = names.index(C.LOGITS)
            out[i] = out[i].copy()
            out[i][..., 7] = self.value
        return out

    def __getattr__(self, name):
        return getattr(self.session, name)


@pytest.mark.parametrize("value", [np.inf, np.nan])
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("mode", ["autoregressive", "speculative"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("after", [0, 1])  # in the prefill, or in a later step
def test_non_finite_logits_raise_the_same_clear_error(decoders, value, kind, mode, temperature, after):
    dec = decoders[kind]
    clean = dec.base
    dec.base = PoisonedSession(clean, value, after)
    try:
        with pytest.raises(NonFiniteLogitsError, match=r"non-finite logits \(nan or inf\).*--dtype float32"):
            dec.generate([5, 6, 7], max_new_tokens=16, mode=mode, temperature=temperature, seed=0)
    finally:
        dec.base = clean


def test_minus_inf_logits_are_fine(exported):
    """-inf is a masked token, not an overflow: decoding goes on and never picks it."""
    dec = graphs.load(exported("medusa"), provider="cpu", threads=1)
    dec.base = PoisonedSession(dec.base, -np.inf, 0)
    for mode in ("autoregressive", "speculative"):
        r = dec.generate([5, 6, 7], max_new_tokens=8, mode=mode, temperature=0.8, seed=0)
        assert 7 not in r.token_ids


# ----------------------------------------------------------------------------- command line style


def _one_line(proc, *needles):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_generate_bad_flag_is_one_line(capsys):
    from exporter.generate import main

    with pytest.raises(SystemExit) as e:
        main(["out", "--prompt", "x", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines() == [
        "error: unrecognized arguments: --bogus (see python -m exporter.generate --help)"]


def test_generate_cli_tampered_manifest_is_one_line(exported, tmp_path):
    d = edit_manifest(copy(exported("medusa"), tmp_path / "d"), _set("source.num_layers", 10**9))
    _one_line(run_module("exporter.generate", d, "--prompt", "hi", timeout=240), "num_layers")


def test_run_cli_user_errors_and_bugs(capsys):
    from exporter.cli import run_cli
    from exporter.loading import UserError

    def raising(e):
        def body():
            raise e
        return body

    for e in (UserError("bad model"), InputError("bad prompt"), ArtifactError("bad export")):
        assert run_cli(raising(e)) == 2
        assert capsys.readouterr().err == f"error: {e}\n"
    for e in (ValueError("internal"), TypeError("internal"), KeyError("k")):  # bugs: traceback, exit 1
        assert run_cli(raising(e)) == 1
        err = capsys.readouterr().err
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith(
            f"error: internal error {type(e).__name__}") and "this is a bug" in err
    assert run_cli(raising(KeyboardInterrupt())) == 130
    assert run_cli(raising(FileNotFoundError(2, "No such file or directory", "x.json"))) == 2
    assert capsys.readouterr().err.endswith("error: x.json: No such file or directory\n")


def test_unparseable_tokenizer_is_one_clear_error(exported, tmp_path):
    """A tokenizer.json that parses as JSON but not as a tokenizer (with its sha256 rehashed, so the
    integrity check passes): one ArtifactError naming the file, not a raw tokenizers exception."""
    import json as _json

    d = copy(exported("medusa"), tmp_path / "tok")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    m = _json.loads((d / "manifest.json").read_text())
    import hashlib

    m["files"]["tokenizer.json"] = hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
    (d / "manifest.json").write_text(_json.dumps(m))
    with pytest.raises(ArtifactError, match="is not a tokenizer tokenizers can read"):
        load(d, verify="full")


# ----------------------------------------------------------------------------- allocation failures (issue 19)

_ALLOC_SCRIPT = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # the 40 GB can never be had, on any machine
import numpy as np
from onnx import TensorProto, helper, save
from graphs.errors import GraphMemoryError
from graphs.sessions import make_session
n = helper.make_node("ConstantOfShape", ["shape"], ["y"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0]))
r = helper.make_node("ReduceSum", ["y"], ["z"], keepdims=0)
g = helper.make_graph([n, r], "g", [helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
                      [helper.make_tensor_value_info("z", TensorProto.FLOAT, [])])
save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), sys.argv[1])
s = make_session(sys.argv[1], "cpu", 1)
try:
    s.run(None, {"shape": np.array([10**10], dtype=np.int64)})
except GraphMemoryError as e:
    print(e)
"""


def test_graph_asking_for_40_gb_is_one_clear_error(tmp_path):
    """A ConstantOfShape that would allocate 40 GB gave ONNX Runtime's raw error (and its own log line on
    stderr). A real allocation failure (the child's address space capped at 4 GB, so it fails on any
    machine) now surfaces at the session-run boundary as a GraphMemoryError naming the size, the node
    and what to do; ONNX Runtime prints nothing."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _ALLOC_SCRIPT, str(tmp_path / "big.onnx")], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("big.onnx asked ONNX Runtime for 40.0 GB in a ConstantOfShape node, more than "
                                   "this machine could give; use a shorter prompt, a smaller batch or tree (or more "
                                   "memory), and re-export the model if its graphs were edited"), proc.stdout
    assert "onnxruntime" not in proc.stderr and "bfc_arena" not in proc.stderr, proc.stderr


def test_allocation_failure_in_generate_is_one_line_exit_2(exported, monkeypatch, capsys):
    """Through the command line: the base graph's run failing to allocate (hooked: ONNX Runtime's own
    exception and text) is one ``error:`` line, exit 2, no traceback."""
    from helpers import one_line
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    import graphs.sessions as S
    from exporter.generate import main

    out = exported("medusa")  # built before the hook
    real = S.ort.InferenceSession

    class Hooked:
        def __init__(self, path, **kw):
            self._s, self._base = real(path, **kw), Path(path).name == "base.onnx"

        def __getattr__(self, name):
            return getattr(self._s, name)

        def run(self, *a):
            if self._base:
                raise ort_state.Fail("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running "
                                     "ConstantOfShape node. Name:'' Status Message: bfc_arena.cc:360 Failed to "
                                     "allocate memory for requested buffer of size 40000000000")
            return self._s.run(*a)

    monkeypatch.setattr(S.ort, "InferenceSession", Hooked)
    rc = main([str(out), "--prompt", "hi", "--max-new-tokens", "4"])
    one_line(rc, capsys.readouterr().err, "base.onnx asked ONNX Runtime for 40.0 GB in a ConstantOfShape node",
             "use a shorter prompt")


def test_other_run_errors_are_not_taken_for_memory(tmp_path):
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    from graphs.sessions import Session

    class Raw:
        def run(self, *a):
            raise ort_state.InvalidArgument("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : bad rank")

    with pytest.raises(ort_state.InvalidArgument):
        Session(Raw(), tmp_path / "x.onnx").run(None, {})


# ----------------------------------------------------------------------------- absurd batches (issue 19)

TINYLLAMA = {"num_layers": 22, "num_kv_heads": 4, "head_dim": 64}


def test_a_batch_of_2000_prompts_of_500_tokens_is_bounded():
    """generate(2000 prompts x 500 tokens) made one engine of 2000 rows (~100 GB of K/V on TinyLlama's
    shape) and one prefill call over 10**6 tokens. Now the rows fit a K/V bound and the rest queue."""
    from graphs.runtime import BATCH_KV_BYTES, BATCH_STEP_TOKENS, batch_config
    from graphs.slots import SlotCache

    cfg = batch_config(TINYLLAMA, np.float32, 2000, 500, 564)
    kv = SlotCache(22, cfg.max_batch, 4, 64, np.float32, cfg.max_len)
    assert 1 <= cfg.max_batch < 2000 and kv.bytes_per_column * cfg.max_len <= BATCH_KV_BYTES
    assert cfg.step_tokens <= BATCH_STEP_TOKENS and cfg.prefill_chunk == 500
    # an ordinary batch runs as it did: every prompt in one prefill call
    cfg = batch_config(TINYLLAMA, np.float32, 4, 30, 100)
    assert (cfg.max_batch, cfg.step_tokens, cfg.prefill_chunk) == (4, 120, 30)
    # one prompt longer than a call's token bound is still one chunk
    assert batch_config(TINYLLAMA, np.float16, 1, 20000, 20100).step_tokens == 20000


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_a_batch_over_the_bound_queues_and_decodes_the_same(decoders, monkeypatch, kind):
    """Over the bound (made 3 rows here), the prompts wait for a row: every row decodes the tokens it
    decodes alone (greedy) and as in an unbounded batch (seeded sampling)."""
    import graphs.runtime as rt

    dec = decoders[kind]
    prompts = [[5 + i, 9, 3 + i % 4] for i in range(11)]
    alone = [dec.generate(p, max_new_tokens=6).token_ids for p in prompts]
    sampled = [r.token_ids for r in dec.generate(prompts, max_new_tokens=6, temperature=0.9, seed=7)]
    src = dec.manifest.source
    per_row = 2 * src["num_layers"] * src["num_kv_heads"] * src["head_dim"] * dec.dtype.itemsize
    real, seen = rt.batch_config, []

    def recording(*a):
        seen.append(real(*a))
        return seen[-1]

    monkeypatch.setattr(rt, "batch_config", recording)
    monkeypatch.setattr(rt, "BATCH_KV_BYTES", per_row * (6 + 3 + 1) * 3)  # three rows of this batch's length
    assert [r.token_ids for r in dec.generate(prompts, max_new_tokens=6)] == alone
    assert seen[-1].max_batch == 3
    assert [r.token_ids for r in dec.generate(prompts, max_new_tokens=6, temperature=0.9, seed=7)] == sampled
