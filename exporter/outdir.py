"""Where an export is written: a lock on ``out_dir``, a temporary directory beside it, one atomic move.

    target = OutDir(out_dir, overwrite=False, inputs=[model_dir])
    tmp = target.open()          # lock, remove stale temporaries of this out_dir, check, mkdir tmp
    try:
        ...write the export into tmp...
        target.commit(manifest)  # re-check under the lock, write the manifest, move into place
    finally:
        target.close()           # tmp removed if still there, lock released

What is guaranteed:

- Two exports into one ``out_dir`` never race: the second fails at once with a one-line error
  (``fcntl.flock`` on ``.NAME.lock`` beside ``out_dir``; the kernel drops it if the process dies).
- Nothing the user did not ask to replace is deleted. ``out_dir`` is checked when the export starts
  and again under the lock just before the move. The move itself cannot destroy what appeared in
  between: into an absent or empty ``out_dir`` it is ``rename(2)``, which fails on a non-empty
  directory; over an earlier export it is ``renameat2(RENAME_EXCHANGE)`` (an atomic swap), and the
  swapped-out tree is deleted only if it still holds nothing but that export's files.
- ``--overwrite`` replaces an earlier export (a directory whose files are all listed in its
  ``manifest.json``) and nothing else; other contents need ``overwrite_non_export`` (the CLI's
  ``--overwrite-non-export OUT_DIR``, which must repeat the path).
- A symlinked ``out_dir`` stays a symlink: the export replaces the directory it points to.
- The new directory gets the mode of the one it replaces, or ``0o777 & ~umask`` (not ``mkdtemp``'s 0700).
- Temporaries left by a killed export (``.NAME.tmp-*`` holding our marker file) are removed by the
  next export into the same ``out_dir``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import json
import os
import secrets
import shutil
import stat
from pathlib import Path

from exporter.loading import UserError
from graphs.manifest import MANIFEST, PARTIAL_MARK


def foreign_entries(d: Path) -> list[str]:
    """Paths under ``d`` that are not part of an export: files its manifest does not list (all of
    them without a readable manifest), anything that is not a regular file, empty directories."""
    listed: set[str] = set()
    try:
        data = json.loads((d / MANIFEST).read_bytes())
        if isinstance(data, dict) and "format_version" in data and isinstance(data.get("files"), dict):
            listed = set(data["files"]) | {MANIFEST}
    except (OSError, ValueError):
        pass
    out = []
    for root, dirs, files in os.walk(d):
        rel_root = Path(root).relative_to(d)
        for name in dirs:  # os.walk does not descend into symlinked dirs: list them here
            p = Path(root) / name
            if p.is_symlink() or not any(os.scandir(p)):
                out.append((rel_root / name).as_posix())
        for name in files:
            rel = (rel_root / name).as_posix()
            if rel not in listed or not stat.S_ISREG(os.lstat(Path(root) / name).st_mode):
                out.append(rel)
    return sorted(out)


def _exchange(a: Path, b: Path) -> None:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); OSError if unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(b))


class OutDir:
    """One export's claim on ``out_dir`` (see the module docstring)."""

    def __init__(self, out_dir, overwrite: bool = False, overwrite_non_export: bool = False, inputs=()):
        self.out_dir = Path(out_dir).absolute()
        self.real = Path(os.path.realpath(self.out_dir))  # a symlinked out_dir: its target
        self.overwrite, self.non_export = overwrite or overwrite_non_export, overwrite_non_export
        self.inputs = [Path(p) for p in inputs]
        self.tmp: Path | None = None
        self._lock_fd: int | None = None
        self._lock_path = self.real.parent / f".{self.real.name}.lock"

    # ------------------------------------------------------------------ open

    def open(self) -> Path:
        """Check, lock, clean stale temporaries, create the temporary directory; return it."""
        self._check_inputs()
        parent = self.real.parent
        blocker = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise UserError(f"out_dir {self.out_dir} cannot be created: {blocker} is a file, not a directory")
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._lock()
            self._remove_stale()
            self._check()
            self.tmp = self._mkdir_tmp()
        except OSError as e:
            self.close()
            raise UserError(f"out_dir {self.out_dir} cannot be written ({e.strerror}); choose a writable "
                            f"location") from None
        except BaseException:
            self.close()
            raise
        return self.tmp

    def _check_inputs(self) -> None:
        for src in self.inputs:  # --overwrite would delete what is being exported
            s = Path(os.path.realpath(src))
            if self.real == s or self.real in s.parents:
                raise UserError(f"out_dir {self.out_dir} would replace {src}, an input of this export; pick "
                                f"another out_dir")

    def _check(self, recheck: bool = False) -> None:
        """Refuse an out_dir that this export may not replace (``recheck``: just before the move)."""
        out = self.out_dir
        if not os.path.lexists(self.real):
            return
        when = "changed during the export: it now " if recheck else ""
        tail = "; nothing was replaced" if recheck else ""
        if not self.real.is_dir():
            raise UserError(f"out_dir {out} {when}exists and is not a directory{tail}; pick another path")
        entries = sorted(e.name for e in os.scandir(self.real))
        if not entries:
            return
        if not self.overwrite:
            if recheck:
                raise UserError(f"out_dir {out} {when}holds {entries[0]}{tail}; move it away and export again")
            raise UserError(f"out_dir {out} is not empty; pass --overwrite to replace an earlier export")
        foreign = [] if self.non_export else foreign_entries(self.real)
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise UserError(
                f"out_dir {out} {when}holds {foreign[0]}{more}, which is not part of an export{tail}: --overwrite "
                f"replaces an earlier export only; move it away, or pass --overwrite-non-export {out} to delete it"
            )

    def _lock(self) -> None:
        while True:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise UserError(
                    f"another export into {self.out_dir} is running (pid {holder}); wait for it to finish or "
                    f"choose another out_dir"
                ) from None
            try:  # the holder before us unlinks the file on release: make sure ours is the live one
                same = os.path.samestat(os.fstat(fd), os.stat(self._lock_path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _remove_stale(self) -> None:
        """Temporaries of this out_dir left by a killed export (we hold the lock: none is live)."""
        name = self.real.name
        for p in self.real.parent.glob(f".{glob.escape(name)}.tmp-*"):
            if p.is_dir() and not p.is_symlink() and (p / PARTIAL_MARK).is_file():
                shutil.rmtree(p, ignore_errors=True)

    def _mkdir_tmp(self) -> Path:
        mode = stat.S_IMODE(os.stat(self.real).st_mode) if self.real.is_dir() else None
        while True:
            tmp = self.real.parent / f".{self.real.name}.tmp-{secrets.token_hex(4)}"
            try:
                os.mkdir(tmp, 0o777)  # the umask applies, as for any directory the user creates
                break
            except FileExistsError:
                continue
        (tmp / PARTIAL_MARK).write_text(f"{os.getpid()}\n")
        if mode is not None:
            os.chmod(tmp, mode)  # replacing a directory: keep its permissions
        return tmp

    # ------------------------------------------------------------------ commit / close

    def commit(self, manifest) -> None:
        """Write ``manifest`` into tmp and move tmp into place, re-checking out_dir under the lock."""
        tmp = self.tmp
        manifest.write(tmp)
        self._check(recheck=True)
        (tmp / PARTIAL_MARK).unlink()
        occupied = os.path.lexists(self.real) and self.real.is_dir() and any(os.scandir(self.real))
        if not occupied:
            try:  # rename(2) replaces an absent or empty directory, never a non-empty one
                os.rename(tmp, self.real)
            except OSError as e:
                raise UserError(f"out_dir {self.out_dir} changed during the export ({e.strerror}); nothing was "
                                f"replaced") from None
            self.tmp = None
            return
        try:
            _exchange(tmp, self.real)  # tmp now holds the previous contents
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
                raise
            self._swap_by_renames(tmp)
        self._discard_previous(tmp)
        self.tmp = None

    def _swap_by_renames(self, tmp: Path) -> None:
        """Without renameat2: out_dir -> backup, tmp -> out_dir, backup -> tmp (not atomic, but never lossy)."""
        backup = self.real.with_name(f".{self.real.name}.old-{secrets.token_hex(4)}")
        os.rename(self.real, backup)
        try:
            os.rename(tmp, self.real)
        except OSError:
            os.rename(backup, self.real)
            raise
        os.rename(backup, tmp)

    def _discard_previous(self, old: Path) -> None:
        """Delete the swapped-out tree unless something that is not an export appeared in it meanwhile."""
        if not self.non_export and foreign_entries(old):
            keep = self.real.with_name(f"{self.real.name}.previous-{secrets.token_hex(3)}")
            os.rename(old, keep)
            print(f"warning: files were added to {self.out_dir} during the export; the previous contents are "
                  f"kept in {keep}", flush=True)
            return
        shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._lock_path)  # before unlocking: a waiter then sees a stale inode and retries
            os.close(self._lock_fd)
            self._lock_fd = None
