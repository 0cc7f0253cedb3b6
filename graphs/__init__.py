"""Everything that lives after export, without torch or transformers.

The graph contract (:mod:`graphs.contract`), ``manifest.json`` (:mod:`graphs.manifest`), tree
buffers (:mod:`graphs.trees`), acceptance rules (:mod:`graphs.sampling`) and the ONNX Runtime
runtime (:mod:`graphs.runtime`). A service that loads exported graphs needs numpy, onnxruntime
and tokenizers, nothing more.
"""

from graphs.runtime import Decoder, GenerationResult, Stats, load
from graphs.sessions import use_shared_thread_pool

__all__ = ["Decoder", "GenerationResult", "Stats", "load", "use_shared_thread_pool"]
