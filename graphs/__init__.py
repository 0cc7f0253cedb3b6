"""Everything that lives after export, without torch or transformers.

The graph contract (:mod:`graphs.contract`), ``manifest.json`` (:mod:`graphs.manifest`), tree
buffers (:mod:`graphs.trees`), acceptance rules (:mod:`graphs.sampling`) and the ONNX Runtime
runtime (:mod:`graphs.runtime`). A service that loads exported graphs needs numpy, onnxruntime
and tokenizers, nothing more.

The runtime's names are imported on first use, so the parts that need no ONNX Runtime (the
contract, the manifest, the trees) import without it, and a missing runtime is one clear error
from :mod:`graphs.sessions` when the runtime is first touched.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Decoder": "graphs.runtime",
    "GenerationResult": "graphs.runtime",
    "Stats": "graphs.runtime",
    "load": "graphs.runtime",
    "GenerationParams": "graphs.params",
    "use_shared_thread_pool": "graphs.sessions",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'graphs' has no attribute {name!r}")
