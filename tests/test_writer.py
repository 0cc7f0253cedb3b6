"""The one writer (exporter.outdir.OutDir): optimize and tune change an export atomically.

A writer killed (SIGKILL: no cleanup runs) at any of its checkpoints leaves an export that loads and
verifies: the old one before the swap, the new one after it; the next writer removes what the killed
one left beside it. The writer is stopped at each point by a hook (it writes the point's name to a
pipe and stops itself), never by timing: the test reads the pipe, then kills it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import graphs
from exporter.outdir import OutDir, checkpoints
from graphs.manifest import MANIFEST, Manifest

REPO = Path(__file__).resolve().parents[1]

# Runs ``python -m exporter.<verb> args`` with a hook that, at checkpoint POINT, says so on the pipe
# FD and stops the process (SIGSTOP) until the test kills it.
STOP_AT = """
import os, signal, sys
import exporter.outdir as writer
point, fd, verb, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]

def stop(name):
    if name == point:
        os.write(fd, (name + "\\n").encode())
        os.kill(os.getpid(), signal.SIGSTOP)

main = __import__(f"exporter.{verb}", fromlist=["main"]).main
with writer.checkpoints(stop):
    sys.exit(main(args))
"""

OPTIMIZE_ARGS = ["--no-tune", "--quantize", "int8"]


def _tune_args(tmp: Path) -> list[str]:
    prompts = tmp / "prompts.txt"
    prompts.write_text("abc\nxyz\n")
    return ["--prompts", str(prompts), "--threads", "1", "--max-new-tokens", "4", "--budget-s", "0.1"]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _state(out: Path) -> dict:
    """What a reader sees: the manifest and every file's bytes' hash (full check), or the error."""
    m = Manifest.read(out, verify="full")
    return {"manifest": (out / MANIFEST).read_bytes(), "files": dict(m.files)}


def _kill_at(verb: str, point: str, out: Path, args: list[str]) -> bool:
    """Run ``verb`` on ``out`` until checkpoint ``point``, then SIGKILL it; False if it never got there."""
    r, w = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", STOP_AT, point, str(w), verb, str(out), *args], pass_fds=(w,),
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.close(w)
    said = ""
    try:
        with os.fdopen(r, "rb") as pipe:
            said = pipe.readline().decode().strip()  # blocks until the point, or EOF if the process ended
    finally:
        if said:
            os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    assert said or proc.returncode == 0, err.decode()
    return said == point


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.mark.parametrize("verb, point", [
    ("optimize", "opened"), ("optimize", "carried"), ("optimize", "optimized"), ("optimize", "staged"),
    ("optimize", "manifest"), ("optimize", "swapped"),
    ("tune", "carried"), ("tune", "measured"), ("tune", "manifest"), ("tune", "swapped"),
])
def test_a_writer_killed_at_any_point_leaves_a_valid_export(exported, tmp_path, verb, point):
    out = _copy(exported("medusa"), tmp_path / "out")
    args = OPTIMIZE_ARGS if verb == "optimize" else _tune_args(tmp_path)
    before = _state(out)
    assert _kill_at(verb, point, out, args), f"{verb} never reached {point}"
    after = _state(out)  # loads and verifies, every file hashed
    if point == "swapped":  # the new export is in place
        m = json.loads(after["manifest"])
        assert (m["optimization"] if verb == "optimize" else m["tree"].get("tuned"))
    else:  # the export as it was, byte for byte
        assert after == before
    dec = graphs.load(out, provider="cpu", threads=1)
    r = dec.generate([5, 6, 7], max_new_tokens=6)
    assert r.token_ids == dec.generate([5, 6, 7], max_new_tokens=6, mode="autoregressive").token_ids
    # the next writer of this out_dir cleans up what the killed one left beside it: its temporary
    # directory (marked), or after the swap the previous export (unmarked: only its own files)
    assert any(".tmp-" in name for name in _leftovers(out)), _leftovers(out)
    with OutDir(out, update=True):
        pass
    assert _leftovers(out) == []
    assert _state(out) == after


def test_update_keeps_modes_and_a_symlinked_out_dir(exported, tmp_path):
    """optimize and tune replace the link's target, keep the directory's and the files' own modes."""
    from exporter.pipeline import optimize_export, tune_export

    real = _copy(exported("medusa"), tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    os.chmod(real, 0o750)
    for p in real.iterdir():
        os.chmod(p, 0o640)
    optimize_export(link, quantize="int8", progress=None, time_gain=False, tune=False)
    tune_export(link, prompts=["abc"], threads=1, max_new_tokens=4, log=lambda *a, **k: None)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in real.iterdir()} == {0o640}
    m = Manifest.read(link, verify="full")
    assert m.optimization and m.tree["tuned"]
    assert _leftovers(real) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_a_failed_update_leaves_the_export_and_no_temporaries(exported, tmp_path):
    out = _copy(exported("medusa"), tmp_path / "out")
    before = _state(out)

    def fail(name):
        if name == "manifest":
            raise RuntimeError("boom at the manifest")

    from exporter.pipeline import optimize_export

    with checkpoints(fail), pytest.raises(RuntimeError, match="boom"):
        optimize_export(out, progress=None, time_gain=False, tune=False)
    assert _state(out) == before and _leftovers(out) == []


def test_manifest_is_written_atomically(tmp_path):
    """write_manifest: a temporary file renamed over manifest.json, nothing else left."""
    from exporter.outdir import write_manifest

    d = tmp_path / "d"
    d.mkdir()
    (d / "a.bin").write_bytes(b"abc")
    m = Manifest(source={}, graphs={})
    write_manifest(m, d)
    assert sorted(p.name for p in d.iterdir()) == ["a.bin", MANIFEST]
    assert json.loads((d / MANIFEST).read_text())["files"] == {"a.bin": m.files["a.bin"]}


def _files(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_every_writer_takes_the_same_lock(exported, tmp_path):
    """Issue 19: optimize and tune took no lock on the export. A writer holding it (an update here,
    in this process: flock is per open file) makes optimize, tune and an export --overwrite fail at
    once, naming the holder, with the export untouched."""
    from exporter.loading import UserError
    from exporter.pipeline import export, optimize_export, tune_export

    out = _copy(exported("medusa"), tmp_path / "out")
    before = _files(out)
    with OutDir(out, update=True):
        with pytest.raises(UserError, match=rf"an update of {out} is running \(pid {os.getpid()}\)"):
            optimize_export(out, progress=None, time_gain=False, tune=False)
        with pytest.raises(UserError, match=rf"an update of {out} is running"):
            tune_export(out, prompts=["abc"], threads=1, max_new_tokens=4, log=lambda *a, **k: None)
        with pytest.raises(UserError, match=rf"another export into {out} is running"):
            export(REPO / "no-model-needed", out, overwrite=True, log=lambda *a, **k: None)
    assert _files(out) == before


def test_an_update_rechecks_what_it_replaces(exported, tmp_path):
    """A writer that took no lock changes the manifest while optimize runs (hooked at the point the graphs
    are optimized): optimize re-checks under its lock before the swap, refuses, and keeps that change."""
    from exporter.loading import UserError
    from exporter.pipeline import optimize_export

    out = _copy(exported("medusa"), tmp_path / "out")
    theirs = json.loads((out / MANIFEST).read_text())
    theirs["note"] = "written by someone else"

    def other_writer(name):
        if name == "optimized":
            (out / MANIFEST).write_text(json.dumps(theirs))

    with checkpoints(other_writer), pytest.raises(UserError, match="was changed by someone else during the update"):
        optimize_export(out, progress=None, time_gain=False, tune=False)
    assert json.loads((out / MANIFEST).read_text()) == theirs and _leftovers(out) == []
