"""The write stage: the one writer of every change to an export directory.

A lock on ``out_dir``, a temporary directory beside it, validation before the move, every file
rehashed, one atomic swap. Export writes a new directory; optimize, tune and the baking of a tree
change an existing one (``update=True``): the export is carried into the temporary directory first
(hard links where the filesystem allows, copies otherwise: files are never rewritten in place), the
stage writes its new files there, and the swap replaces the whole directory at once::

    target = OutDir(out_dir, overwrite=False, inputs=[model_dir])   # or OutDir(out_dir, update=True)
    tmp = target.open()          # lock, remove stale temporaries of this out_dir, check, mkdir tmp
    try:                         # (update: target.carry(skip=files the stage rewrites))
        ...write the export into tmp...
        target.commit(manifest)  # hash, write the manifest (temp file + fsync + rename), fsync,
    finally:                     # re-check under the lock, swap into place
        target.close()           # tmp removed if still there, lock released

A crash, a signal or a kill at any point leaves ``out_dir`` as it was before the swap, or as the
stage left it after: never half of each (``tests/test_writer.py`` kills optimize and tune at every
:meth:`OutDir.checkpoint` and loads and verifies what is left).

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
- An update keeps the export's own modes: a rewritten file gets the mode of the file it replaces, a
  new one the mode of the export's ``manifest.json``.
- Temporaries left by a killed writer (``.NAME.tmp-*`` holding our marker file, or the previous export
  swapped out just before a kill) are removed by the next writer of the same ``out_dir``.
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

from exporter.errors import UserError
from graphs.manifest import MANIFEST, PARTIAL_MARK

_WATCHERS: list = []  # callbacks of checkpoints(): tests stop or kill a writer at a named point


@contextlib.contextmanager
def checkpoints(callback):
    """Call ``callback(name)`` at every :meth:`OutDir.checkpoint` while inside (tests only: a kill there
    must leave the export loadable). Reversible: removed on exit."""
    _WATCHERS.append(callback)
    try:
        yield
    finally:
        _WATCHERS.remove(callback)


def write_manifest(manifest, d: Path) -> Path:
    """Hash every file in ``d`` into ``manifest.files`` and write ``d/manifest.json`` atomically
    (:meth:`graphs.manifest.Manifest.write`: temporary file, fsync, rename): a reader never sees half a
    manifest."""
    return manifest.write(Path(d))


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(d: Path) -> None:
    """Every regular file and directory under ``d`` on disk before the swap makes them the export."""
    for root, _dirs, files in os.walk(d):
        for name in files:
            p = Path(root) / name
            if stat.S_ISREG(os.lstat(p).st_mode):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(Path(root))


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
    """One writer's claim on ``out_dir`` (see the module docstring).

    ``update``: change the export already in ``out_dir`` (optimize, tune, baking) instead of writing a
    new one; ``out_dir`` must then hold an export, and must not change under the lock until the swap.
    """

    def __init__(self, out_dir, overwrite: bool = False, overwrite_non_export: bool = False, inputs=(),
                 update: bool = False):
        self.out_dir = Path(out_dir).absolute()
        self.real = Path(os.path.realpath(self.out_dir))  # a symlinked out_dir: its target
        self.overwrite, self.non_export = overwrite or overwrite_non_export or update, overwrite_non_export
        self.update = update
        self.inputs = [Path(p) for p in inputs]
        self.tmp: Path | None = None
        self._lock_fd: int | None = None
        self._lock_path = self.real.parent / f".{self.real.name}.lock"
        self._manifest_bytes: bytes | None = None  # update: out_dir's manifest when the claim began
        self._carried: set[str] = set()  # update: what was in out_dir when carried into tmp

    def __enter__(self) -> Path:
        return self.open()

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def checkpoint(self, name: str) -> None:
        """A named point of this writer's work (tests stop or kill it there: :func:`checkpoints`)."""
        for callback in list(_WATCHERS):
            callback(name)

    # ------------------------------------------------------------------ open

    def open(self) -> Path:
        """Check, lock, clean stale temporaries, create the temporary directory; return it."""
        self._check_inputs()
        if self.update and not (self.real / MANIFEST).is_file():
            raise UserError(f"{self.out_dir} is not an export (no {MANIFEST}); pass the out_dir written by "
                            f"python -m exporter.export")
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
        except UserError:
            self.close()
            raise
        except OSError as e:
            self.close()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UserError(f"disk full: out_dir {self.out_dir} cannot be written ({e.strerror}); nothing was "
                                f"changed: free some space and retry") from None
            raise UserError(f"out_dir {self.out_dir} cannot be written ({e.strerror}); choose a writable "
                            f"location") from None
        except BaseException:
            self.close()
            raise
        self.checkpoint("opened")
        return self.tmp

    def carry(self, skip=()) -> None:
        """Update: the export's files into tmp, but ``skip`` (paths relative to out_dir that the stage
        writes anew). Files the manifest lists are hard-linked where possible (they are never written
        in place: every stage writes new files and renames them), anything else is copied."""
        listed = set(json.loads(self._manifest_bytes).get("files", {})) if self._manifest_bytes else set()
        skip = {Path(x).as_posix() for x in skip}
        for root, dirs, files in os.walk(self.real):
            rel_root = Path(root).relative_to(self.real)
            for name in dirs:
                src, dst = Path(root) / name, self.tmp / rel_root / name
                if src.is_symlink():  # not walked into: carried as the link it is
                    self._carried.add((rel_root / name).as_posix())
                    os.symlink(os.readlink(src), dst)
                    continue
                dst.mkdir(exist_ok=True)
                shutil.copymode(src, dst)
            for name in files:
                rel = (rel_root / name).as_posix()
                self._carried.add(rel)
                if rel in skip or rel in (MANIFEST, PARTIAL_MARK):
                    continue
                src, dst = Path(root) / name, self.tmp / rel
                if rel in listed and stat.S_ISREG(os.lstat(src).st_mode):
                    try:
                        os.link(src, dst)
                        continue
                    except OSError:
                        pass
                shutil.copy2(src, dst, follow_symlinks=False)
        self.checkpoint("carried")

    def _check_inputs(self) -> None:
        for src in self.inputs:  # --overwrite would delete what is being exported
            s = Path(os.path.realpath(src))
            if self.real == s or self.real in s.parents:
                raise UserError(f"out_dir {self.out_dir} would replace {src}, an input of this export; pick "
                                f"another out_dir")

    def _check(self, recheck: bool = False) -> None:
        """Refuse an out_dir that this export may not replace (``recheck``: just before the move)."""
        out = self.out_dir
        if self.update:
            try:
                now = (self.real / MANIFEST).read_bytes()
            except OSError:
                now = None
            if now is None:
                raise UserError(f"{out} {'lost its manifest.json during the update' if recheck else 'is not an export'}"
                                f"; nothing was changed")
            if recheck and now != self._manifest_bytes:
                raise UserError(f"{out} was changed by someone else during the update; nothing was changed: run "
                                f"it again")
            self._manifest_bytes = now
            return
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
                what = "an update of" if self.update else "another export into"
                raise UserError(
                    f"{what} {self.out_dir} is running (pid {holder}); wait for it to finish or "
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
        """Temporaries of this out_dir left by a killed writer (we hold the lock: none is live): ours
        (the marker file), or a previous export swapped out just before the kill (nothing but its files)."""
        name = self.real.name
        for p in self.real.parent.glob(f".{glob.escape(name)}.tmp-*"):
            if not p.is_dir() or p.is_symlink():
                continue
            if (p / PARTIAL_MARK).is_file() or ((p / MANIFEST).is_file() and not foreign_entries(p)):
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
        try:
            (tmp / PARTIAL_MARK).write_text(f"{os.getpid()}\n")
            if mode is not None:
                os.chmod(tmp, mode)  # replacing a directory: keep its permissions
        except BaseException:  # a full disk: no unmarked temporary left (a later run would not remove it)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp

    # ------------------------------------------------------------------ commit / close

    def commit(self, manifest) -> None:
        """Write ``manifest`` into tmp (every file rehashed) and move tmp into place, re-checking out_dir
        under the lock."""
        tmp = self.tmp
        self.checkpoint("staged")
        write_manifest(manifest, tmp)
        if self.update:
            self._keep_modes(tmp)
        _fsync_tree(tmp)
        self.checkpoint("manifest")
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
        _fsync_dir(self.real.parent)
        self.checkpoint("swapped")
        self._discard_previous(tmp)
        self.tmp = None

    def _keep_modes(self, tmp: Path) -> None:
        """Update: a file written anew gets the mode of the one it replaces, else the manifest's."""
        default = stat.S_IMODE(os.stat(self.real / MANIFEST).st_mode)
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                p = Path(root) / name
                rel = p.relative_to(tmp)
                if name == PARTIAL_MARK or p.is_symlink():
                    continue
                old = self.real / rel
                try:
                    if os.path.samestat(os.stat(p), os.stat(old)):
                        continue  # carried as a hard link: the same file
                    mode = stat.S_IMODE(os.stat(old).st_mode)
                except FileNotFoundError:
                    mode = default
                os.chmod(p, mode)

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
        if self.update:
            added = self._added_since_carry(old)
            if not added:
                shutil.rmtree(old, ignore_errors=True)
                return
        if self.update or (not self.non_export and foreign_entries(old)):
            keep = self.real.with_name(f"{self.real.name}.previous-{secrets.token_hex(3)}")
            os.rename(old, keep)
            print(f"warning: files were added to {self.out_dir} during the export; the previous contents are "
                  f"kept in {keep}", flush=True)
            return
        shutil.rmtree(old, ignore_errors=True)

    def _added_since_carry(self, old: Path) -> list[str]:
        out = []
        for root, _dirs, files in os.walk(old):
            for name in files:
                rel = (Path(root).relative_to(old) / name).as_posix()
                if rel not in self._carried and rel != PARTIAL_MARK:
                    out.append(rel)
        return out

    def close(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._lock_path)  # before unlocking: a waiter then sees a stale inode and retries
            os.close(self._lock_fd)
            self._lock_fd = None
