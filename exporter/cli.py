"""Shared CLI plumbing: every CLI parses with :class:`ArgumentParser` and runs through :func:`run_cli`.

Bad input (:class:`exporter.loading.UserError` raised by the exporter's checks,
:class:`graphs.errors.InputError` and its ``ArtifactError`` raised by the runtime, a missing or
unreadable file) is one ``error:`` line on stderr and exit 2. Anything else is a bug: its traceback,
then one line saying so, exit 1. SIGTERM and SIGHUP end a run the way Ctrl-C does (``finally``
blocks and temporary-file cleanup run), exit 128 + signal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import traceback

from exporter.errors import UserError
from graphs.errors import InputError

USER_ERRORS = (UserError, InputError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help text already says it (``default``)
    or there is none to say (``None``, or an off switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the CLIs' error style: one ``error:`` line on stderr (no usage block), exit 2;
    ``--help`` shows every option's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def require_module(module: str, what: str, install: str) -> None:
    """Fail before a run, not after it, when an optional package ``what`` needs is missing."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise UserError(f"{what} needs {module}: pip install {install}") from None


def check_output(path, flag: str, *reads) -> None:
    """Fail before any work, not after it, when a report cannot be written where asked: a directory, a
    missing or read-only parent, or a path inside a directory the command reads (``reads``: the export,
    the model directory; ``None`` entries are skipped). Writing there would destroy or taint what is read:
    ``generate OUT --json OUT/manifest.json`` replaced the manifest, and any extra file makes an export
    refused."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {p} is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{flag} {p}: directory {parent} does not exist; create it or give another path")
    target = Path(os.path.realpath(parent)) / p.name  # a symlinked file or parent is followed, as open() will
    if p.is_symlink():
        target = Path(os.path.realpath(p))
    for d in reads:
        if d is None:
            continue
        root = Path(os.path.realpath(d))
        if target == root or root in target.parents:
            raise UserError(f"{flag} {p} is inside {d}, which this command reads; write the report "
                            f"outside it")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UserError(f"{flag} {p} is not writable; check its permissions")


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, raised in the main thread so that cleanup runs as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_as_interrupt():
    """Inside: SIGTERM and SIGHUP raise :class:`Terminated` (a KeyboardInterrupt). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    # only where nobody else handles the signal (a service's own handler is left alone)
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)
           if signal.getsignal(s) == signal.SIG_DFL}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_cli(body, debug: bool = False) -> int:
    """Run ``body()``: bad input is one line and exit 2, a bug its traceback and exit 1."""
    try:
        with signals_as_interrupt():
            return int(body() or 0)
    except Terminated as e:
        print(f"error: terminated by {e}; temporary files removed", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        print(f"error: {_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if isinstance(e, ImportError) and e.name == "onnxruntime":  # graphs/sessions.py: what to install
            print(f"error: {_line(e)}", file=sys.stderr)
            return 2
        traceback.print_exc()  # not bad input: a bug, and its traceback is what a report needs
        print(f"error: internal error {type(e).__name__}: {_line(e)} (this is a bug; please report it with the "
              f"traceback above)", file=sys.stderr)
        return 1


def _line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename and e.strerror:  # "[Errno 2] ..." -> "file: No such file"
        return f"{e.filename}: {e.strerror}"
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
