"""The runtime's user-error types: bad input that a caller can fix, as opposed to a bug.

``InputError`` (a ``ValueError``) is raised for arguments that do not fit the export (a bad prompt,
tree or option); ``ArtifactError`` for an export directory that cannot be used (missing, tampered,
wrong format); ``NonFiniteLogitsError`` when a graph returns nan/inf logits. The command lines
print these as one line and exit 2; any other exception is a bug and surfaces with its traceback.
"""

from __future__ import annotations

import contextlib


class InputError(ValueError):
    """Bad input to the runtime: one line that names the problem and the fix."""


class InputTypeError(InputError, TypeError):
    """Bad input of the wrong type (also a ``TypeError``, as Python's own argument errors are)."""


class ArtifactError(InputError):
    """An export directory that cannot be used (missing, tampered, wrong format)."""


class NonFiniteLogitsError(ArtifactError):
    """A graph returned nan or +inf logits (float16 overflow, or damaged weights)."""


class GraphMemoryError(InputError, MemoryError):
    """A graph run asked ONNX Runtime for more memory than it could get (translated at the session-run
    boundary, :class:`graphs.sessions.Session`): one line with the size, the node and what to do."""


class CapacityError(RuntimeError):
    """The engine is full (its queue of waiting requests is at its bound): try again later."""


@contextlib.contextmanager
def as_input_error():
    """Re-raise ValueError/TypeError of a validating function (a tree parser, ...) as InputError.

    Only for code whose whole job is to check user data: elsewhere a ValueError is a bug.
    """
    try:
        yield
    except InputError:
        raise
    except TypeError as e:
        raise InputTypeError(str(e)) from e
    except ValueError as e:
        raise InputError(str(e)) from e
