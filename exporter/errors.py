"""The exporter's one error type for bad input (a leaf module: every layer may import it)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: printed as one line on stderr by the CLIs, exit code 2."""
