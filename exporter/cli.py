"""Shared CLI plumbing: one clear line on stderr and a non-zero exit for every failure."""

from __future__ import annotations

import argparse
import sys
import traceback

from exporter.loading import UserError
from graphs.manifest import ArtifactError


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the CLIs' error style: one ``error:`` line on stderr (no usage block), exit 2."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


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
        if debug:
            traceback.print_exc()
        print(f"error: unexpected {type(e).__name__}: {_line(e)} (re-run with --debug for a traceback)",
              file=sys.stderr)
        return 1


def _line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
