"""Integrity of an export directory: every file confined, listed and hashed; the hash paid once.

:func:`verify_files` checks, before any file is opened for use:

1. confinement: every entry under ``out_dir`` is a regular file or a directory (no symlinks, FIFOs
   or devices) and every file is listed in the manifest's ``files`` (so ONNX Runtime cannot be
   handed an unlisted external-data file), nothing listed is missing;
2. content: the sha256 of every listed file.

Hashing 4.4 GB (TinyLlama's size) costs seconds on every start, so step 2 is skipped when a *proof
record* written after the last full check still matches: for every file its size, mtime_ns,
ctime_ns, inode and device, plus the manifest's own sha256. Changing a file's bytes through the
file system changes its mtime and ctime, and the ctime cannot be set back from user space
(``utime`` sets it to now), so a matching record means the bytes are the ones that were hashed.
What it cannot see is a change under the file system (a raw disk write, bit rot): ask for the full
check with ``graphs.load(..., verify="full")`` or ``SPECEXPORT_VERIFY=full``.

Records live in ``$SPECEXPORT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/specexport`` or
``~/.cache/specexport``), ``verified/<sha256 of out_dir's real path>.json``; never inside ``out_dir``,
which may be read-only. A cache that cannot be written just means a full check next time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import time
from pathlib import Path

from graphs.errors import ArtifactError

VERIFY_MODES = ("auto", "full", "none")
# a file changed within the file system's timestamp tick after it was hashed keeps its mtime/ctime
# (git's "racy clean" problem): no record is written while a file is younger than this
RACY_NS = 2_000_000_000


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_mode(verify) -> str:
    """``verify`` (True/"auto", "full", False/"none"), overridden by SPECEXPORT_VERIFY=full."""
    mode = {True: "auto", False: "none"}.get(verify, verify) if isinstance(verify, bool) else verify
    if mode not in VERIFY_MODES:
        raise ArtifactError(f"unknown verify={verify!r}; accepted: True, False, {', '.join(VERIFY_MODES)}")
    if os.environ.get("SPECEXPORT_VERIFY", "").lower() == "full" and mode == "auto":
        return "full"
    return mode


def cache_dir() -> Path:
    if os.environ.get("SPECEXPORT_CACHE_DIR"):
        return Path(os.environ["SPECEXPORT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specexport"


def _record_path(root: Path) -> Path:
    return cache_dir() / "verified" / f"{hashlib.sha256(os.fsencode(root)).hexdigest()}.json"


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def check_confined(out_dir: Path, files: dict[str, str], manifest_name: str) -> dict[str, os.stat_result]:
    """Step 1; returns each listed file's lstat."""
    root = Path(os.path.realpath(out_dir))
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            mode = os.lstat(p).st_mode
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
                raise ArtifactError(f"{p} is {kind}; an export holds regular files only: re-export the model")
            if rel not in files and rel != manifest_name:
                raise ArtifactError(f"{p} is not listed in the manifest (an export holds only the files it "
                                    f"hashed); remove it or re-export the model")
    stats = {}
    for rel in files:
        p = root / rel
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            raise ArtifactError(f"{out_dir / rel} is listed in the manifest but missing; re-export the model") from None
        if not stat.S_ISREG(st.st_mode) or os.path.realpath(p) != str(p):
            raise ArtifactError(f"{out_dir / rel} is not a regular file inside the export; re-export the model")
        stats[rel] = st
    return stats


def verify_files(out_dir: Path, files: dict[str, str], manifest_bytes: bytes, manifest_name: str,
                 verify=True) -> dict[str, list[int]]:
    """Raise ArtifactError unless ``out_dir`` holds exactly the listed files with their sha256. Returns
    each file's stat key as checked, for :func:`recheck` before a file is opened later."""
    out_dir = Path(out_dir)
    mode = verify_mode(verify)
    stats = check_confined(out_dir, files, manifest_name)
    keys = {rel: _stat_key(st) for rel, st in sorted(stats.items())}
    if mode == "none":
        return keys
    root = Path(os.path.realpath(out_dir))
    record = {"manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(), "files": keys}
    path = _record_path(root)
    if mode == "auto":
        try:
            if json.loads(path.read_text()) == record:
                return keys
        except (OSError, ValueError):
            pass
    for rel, digest in files.items():
        if sha256_file(root / rel) != digest:
            raise ArtifactError(
                f"{out_dir / rel} does not match its sha256 in the manifest (modified or truncated); re-export "
                f"the model"
            )
    after = {rel: _stat_key(os.lstat(root / rel)) for rel in sorted(files)}
    youngest = max((max(k[1], k[2]) for k in after.values()), default=0)
    if after == record["files"] and time.time_ns() - youngest > RACY_NS:  # the record proves what we read
        _save(path, record)
    return keys


def recheck(out_dir: Path, files: dict[str, str], checked: dict[str, list[int]], rels, verify=True) -> None:
    """Before opening ``rels`` long after :func:`verify_files` checked them (a session made at the first
    batch): each must still be the file that was checked (its stat key unchanged: a rename or a write
    moves it), else its bytes are hashed again and must be the manifest's; ``verify="full"`` hashes
    always. A file swapped in between is refused, never decoded."""
    mode = verify_mode(verify)
    if mode == "none":
        return
    root = Path(os.path.realpath(out_dir))
    for rel in rels:
        p = root / rel
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise ArtifactError(f"{Path(out_dir) / rel} was removed after graphs.load checked it; reload "
                                f"the export") from None
        if mode == "auto" and _stat_key(st) == checked.get(rel):
            continue
        if not stat.S_ISREG(st.st_mode) or sha256_file(p) != files[rel]:
            raise ArtifactError(f"{Path(out_dir) / rel} changed after graphs.load checked it (its sha256 no "
                                f"longer matches the manifest); restore the export and load it again")


def _save(path: Path, record: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass  # no cache: the next load checks everything again


def forget(out_dir: Path) -> None:
    """Drop the proof record of ``out_dir`` (the next load hashes every file)."""
    with contextlib.suppress(OSError):
        _record_path(Path(os.path.realpath(out_dir))).unlink()
