"""Nothing lost: the export under races, signals and leftovers (issue 10, "Data loss", "Signals").

Races are reproduced deterministically with a hook injected into the trace step (it runs while
the export is half done: creates a file in out_dir, starts a second export process, ...), never
with sleeps that may or may not overlap. The SIGTERM case runs the export in a subprocess that
signals "tracing now" through a file and waits; the test then sends SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_module
from helpers import one_line, run_export_main

import exporter.export as ex
import exporter.outdir
import exporter.trace
from exporter.loading import UserError
from graphs.manifest import MANIFEST, PARTIAL_MARK

QUIET = {"log": lambda *a, **k: None}


run_main = run_export_main


def ours(parent: Path) -> list[str]:
    """Temporaries, locks and backups of an export left in ``parent``."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") or ".previous-" in p.name)


def during_trace(monkeypatch, action):
    """Run ``action()`` once, while the first graph is being traced (the export is half done)."""
    real, done = exporter.trace.export_graph, []

    def hooked(*args, **kwargs):
        if not done:
            done.append(True)
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(exporter.trace, "export_graph", hooked)
    return done


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("medusa", "llama")


@pytest.fixture(scope="module")
def earlier(model, tmp_path_factory):
    """A finished export to copy as "the earlier export" of a test."""
    out = tmp_path_factory.mktemp("earlier") / "onnx"
    ex.export(model, out, validate=False, **QUIET)
    return out


def copy_export(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- files appearing mid-export


def test_file_created_in_absent_out_dir_during_export_is_kept(model, tmp_path, monkeypatch, capsys):
    """The issue's reproduction: out/precious.txt created while the export traces. It used to vanish."""
    out = tmp_path / "onnx"

    def create():
        out.mkdir()
        (out / "precious.txt").write_text("mine\n")

    hook = during_trace(monkeypatch, create)
    rc, err = run_main(capsys, model, out, "--no-validate")
    assert hook
    one_line(rc, err, "changed during the export", "precious.txt", "nothing was replaced", "export again")
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    assert (out / "precious.txt").read_text() == "mine\n"
    assert ours(tmp_path) == []


def test_file_added_to_earlier_export_during_overwrite_is_kept(model, earlier, tmp_path, monkeypatch, capsys):
    out = copy_export(earlier, tmp_path / "onnx")
    before = sorted(p.name for p in out.iterdir())
    hook = during_trace(monkeypatch, lambda: (out / "notes.txt").write_text("mine\n"))
    rc, err = run_main(capsys, model, out, "--no-validate", "--overwrite")
    assert hook
    one_line(rc, err, "changed during the export", "notes.txt", "not part of an export", "nothing was replaced")
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, "notes.txt"])
    assert ours(tmp_path) == []


def test_file_added_between_recheck_and_swap_is_kept(model, earlier, tmp_path, monkeypatch, capsys):
    """The last instant: a file lands in out_dir after the re-check, just before the atomic swap.
    The swapped-out tree then holds more than the earlier export, so it is kept, not deleted."""
    out = copy_export(earlier, tmp_path / "onnx")
    real = exporter.outdir._exchange

    def late(a, b):
        (Path(b) / "late.txt").write_text("mine\n")
        return real(a, b)

    monkeypatch.setattr(exporter.outdir, "_exchange", late)
    rc, err = run_main(capsys, model, out, "--overwrite", "--no-validate")
    assert rc == 0, err
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("onnx.previous-")]
    assert len(kept) == 1 and (kept[0] / "late.txt").read_text() == "mine\n"
    assert (out / MANIFEST).is_file() and not (out / "late.txt").exists()


def test_swap_without_renameat2_falls_back_without_loss(model, earlier, tmp_path, monkeypatch, capsys):
    out = copy_export(earlier, tmp_path / "onnx")

    def unsupported(a, b):
        raise OSError(38, "renameat2 is not available")  # ENOSYS

    monkeypatch.setattr(exporter.outdir, "_exchange", unsupported)
    rc, err = run_main(capsys, model, out, "--overwrite", "--no-validate")
    assert rc == 0, err
    assert (out / MANIFEST).is_file() and ours(tmp_path) == []


# ----------------------------------------------------------------------------- concurrent exports


def test_concurrent_export_into_the_same_out_dir_fails_cleanly(model, tmp_path, monkeypatch, capsys):
    """A second export *process* started while the first one traces: it fails at once, the first wins."""
    out = tmp_path / "onnx"
    second = []
    during_trace(monkeypatch, lambda: second.append(run_module("exporter.export", model, out, "--no-validate")))
    rc, err = run_main(capsys, model, out, "--no-validate")
    assert rc == 0, err
    (proc,) = second
    one_line(proc.returncode, proc.stderr, f"another export into {out} is running (pid {os.getpid()})")
    assert (out / MANIFEST).is_file()
    assert ours(tmp_path) == []  # the lock file goes with the export that held it


def test_lock_is_per_out_dir_and_released_after_failure(model, tmp_path, monkeypatch):
    """In-process: the same lock refuses a second claim; another out_dir is independent; a failed
    export releases the lock (the next export into that out_dir runs)."""
    a = exporter.outdir.OutDir(tmp_path / "a")
    a.open()
    try:
        with pytest.raises(UserError, match=r"another export into .* is running"):
            exporter.outdir.OutDir(tmp_path / "a").open()
        b = exporter.outdir.OutDir(tmp_path / "b")
        b.open()
        b.close()
    finally:
        a.close()
    assert ours(tmp_path) == []

    def boom():
        raise RuntimeError("boom")

    during_trace(monkeypatch, boom)
    with pytest.raises(RuntimeError, match="boom"):
        ex.export(model, tmp_path / "a", validate=False, **QUIET)
    assert ours(tmp_path) == [] and not (tmp_path / "a").exists()
    monkeypatch.undo()
    ex.export(model, tmp_path / "a", validate=False, **QUIET)
    assert (tmp_path / "a" / MANIFEST).is_file()


# ----------------------------------------------------------------------------- --overwrite, modes, links


def test_overwrite_replaces_an_earlier_export_and_keeps_its_mode(model, earlier, tmp_path, capsys):
    out = copy_export(earlier, tmp_path / "onnx")
    out.chmod(0o750)
    old_inode = (out / MANIFEST).stat().st_ino
    rc, err = run_main(capsys, model, out, "--overwrite", "--no-validate")
    assert rc == 0, err
    assert (out / MANIFEST).stat().st_ino != old_inode
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert ours(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_new_out_dir_honours_the_umask(model, tmp_path, umask):
    old = os.umask(umask)
    try:
        ex.export(model, tmp_path / "onnx", validate=False, **QUIET)
    finally:
        os.umask(old)
    out = tmp_path / "onnx"
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) & ~(0o666 & ~umask) == 0, p.name  # never more than the umask allows
        assert stat.S_IMODE(p.stat().st_mode) & 0o400


def test_symlinked_out_dir_stays_a_link(model, earlier, tmp_path, capsys):
    target = copy_export(earlier, tmp_path / "real-onnx")
    link = tmp_path / "onnx"
    link.symlink_to(target)
    rc, err = run_main(capsys, model, link, "--overwrite", "--no-validate")
    assert rc == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (target / MANIFEST).is_file()
    assert ours(tmp_path) == []


# ----------------------------------------------------------------------------- signals and stale temporaries

SIGTERM_SCRIPT = """
import sys, time
from pathlib import Path
import exporter.export as ex
import exporter.trace
ready = Path(sys.argv[3])
def traced(*a, **k):
    ready.write_text("tracing")
    while True:
        time.sleep(0.05)  # blocks here until the test's SIGTERM arrives
exporter.trace.export_graph = traced
sys.exit(ex.main([sys.argv[1], sys.argv[2], "--no-validate"]))
"""


def test_sigterm_during_export_removes_the_temporary_directory(model, tmp_path):
    out, ready = tmp_path / "onnx", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(model), str(out), str(ready)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():  # the export is now inside the trace step, its temporary dir on disk
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the export never reached the trace step"
            time.sleep(0.05)
        assert [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the temporary exists before the signal
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "error: terminated by SIGTERM; temporary files removed"
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ready"]


def test_stale_temporaries_of_the_same_out_dir_are_removed(model, tmp_path):
    """What a killed export (SIGKILL, power loss) leaves is removed by the next export into that out_dir;
    a look-alike without our marker, and another out_dir's temporaries, are not touched."""
    stale = tmp_path / ".onnx.tmp-dead1234"
    stale.mkdir()
    (stale / PARTIAL_MARK).write_text("12345\n")
    (stale / "base.onnx").write_bytes(b"\0" * 1000)
    lookalike = tmp_path / ".onnx.tmp-mine"
    lookalike.mkdir()
    (lookalike / "notes.txt").write_text("mine\n")
    other = tmp_path / ".other.tmp-dead9876"
    other.mkdir()
    (other / PARTIAL_MARK).write_text("1\n")
    ex.export(model, tmp_path / "onnx", validate=False, **QUIET)
    assert not stale.exists()
    assert (lookalike / "notes.txt").read_text() == "mine\n" and other.is_dir()


def test_partial_marker_never_reaches_the_export(earlier):
    assert not (earlier / PARTIAL_MARK).exists()
    assert PARTIAL_MARK not in json.loads((earlier / MANIFEST).read_text())["files"]


# ----------------------------------------------------------------------------- disk full (issue 19)


def _enospc(path=None):
    return OSError(28, "No space left on device", str(path) if path else None)


def _full_disk(monkeypatch, where: str) -> None:
    """A full disk at one write of the export (never a real one): the write puts some bytes on disk,
    then fails as write(2) does, with ENOSPC."""
    import shutil

    import onnx

    if where == "graph":  # the tracer's graph file, half written

        def save(proto, f, *a, **k):
            Path(f).write_bytes(proto.SerializeToString()[:100])
            raise _enospc(f)

        monkeypatch.setattr(onnx, "save", save)
    elif where == "torch":  # torch's C++ writer: a RuntimeError holding the system's words
        def export(*a, **k):
            raise RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos 64 vs 0: "
                               "No space left on device")

        monkeypatch.setattr(exporter.trace.torch.onnx, "export", export)
    elif where == "side file":  # copying tokenizer.json and the other side files
        real_copy = shutil.copyfile

        def copyfile(src, dst, *a, **k):
            if Path(src).name == "tokenizer.json":
                Path(dst).write_bytes(b'{"half')
                raise _enospc(dst)
            return real_copy(src, dst, *a, **k)

        monkeypatch.setattr(shutil, "copyfile", copyfile)
    elif where == "manifest":
        def write_manifest(manifest, d):
            (Path(d) / MANIFEST).write_text('{"half')
            raise _enospc(Path(d) / MANIFEST)

        monkeypatch.setattr(exporter.outdir, "write_manifest", write_manifest)
    elif where == "temporary":  # the marker of the temporary directory, the export's very first write
        real_write = Path.write_text

        def write_text(self, *a, **k):
            if self.name == PARTIAL_MARK:
                raise _enospc(self)
            return real_write(self, *a, **k)

        monkeypatch.setattr(Path, "write_text", write_text)


FULL_AT = ["temporary", "graph", "torch", "side file", "manifest"]


@pytest.mark.parametrize("where", FULL_AT)
def test_disk_full_during_a_new_export_leaves_nothing(model, tmp_path, monkeypatch, capsys, where):
    """Issue 19: export with the disk full ended in a traceback ("internal error OSError"). Now one line
    naming the problem and the fix, exit 2, no out_dir, no temporary, no lock."""
    out = tmp_path / "onnx"
    _full_disk(monkeypatch, where)
    rc, err = run_main(capsys, model, out, "--no-validate")
    one_line(rc, err, "disk full", "free some space")
    assert not out.exists() and ours(tmp_path) == [], ours(tmp_path)


@pytest.mark.parametrize("where", FULL_AT)
def test_disk_full_during_overwrite_keeps_the_earlier_export(model, earlier, tmp_path, monkeypatch, capsys, where):
    out = copy_export(earlier, tmp_path / "onnx")
    before = snapshot(out)
    _full_disk(monkeypatch, where)
    rc, err = run_main(capsys, model, out, "--no-validate", "--overwrite")
    line = one_line(rc, err, "disk full", "free some space")
    assert where == "temporary" or f"the earlier export in {out} is untouched" in line, line
    monkeypatch.undo()
    assert snapshot(out) == before and ours(tmp_path) == [], ours(tmp_path)
    graphs_load_ok(out)


def test_too_little_space_for_the_weights_fails_before_tracing(model, tmp_path, monkeypatch, capsys):
    """The weights alone would not fit: refused before the (long) trace, not when the disk fills."""
    import shutil

    monkeypatch.setattr(exporter.trace, "export_graph", lambda *a, **k: pytest.fail("traced"))
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**6, 10**6 - 1000, 1000))
    rc, err = run_main(capsys, model, tmp_path / "onnx", "--no-validate")
    one_line(rc, err, "not enough disk space for the export", "GB are free", "free some space")
    assert not (tmp_path / "onnx").exists() and ours(tmp_path) == []


def snapshot(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(d.rglob("*")) if p.is_file()}


def graphs_load_ok(out: Path) -> None:
    import graphs

    graphs.load(out, provider="cpu", threads=1).generate([1, 2, 3], max_new_tokens=2)
