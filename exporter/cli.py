"""Shared CLI plumbing: one clear line on stderr and a non-zero exit for every failure."""

from __future__ import annotations

import argparse
import sys
import traceback

from exporter.loading import UserError
from graphs.manifest import ArtifactError


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


def run_cli(body, debug: bool = False) -> int:
    """Run ``body()``; map bad input to exit 2 and anything unexpected to exit 1, one line each."""
    try:
        return int(body() or 0)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (UserError, ArtifactError, ValueError, TypeError, FileNotFoundError, PermissionError) as e:
        if debug:
            traceback.print_exc()
        print(f"error: {_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if isinstance(e, ImportError) and e.name == "onnxruntime":  # graphs/sessions.py: what to install
            print(f"error: {_line(e)}", file=sys.stderr)
            return 2
        if debug:
            traceback.print_exc()
        print(f"error: unexpected {type(e).__name__}: {_line(e)} (re-run with --debug for a traceback)",
              file=sys.stderr)
        return 1


def _line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
