"""A model given as a local directory or as a hub id (``org/name``) found in the local HF cache.

    resolve_model("path/to/model_dir")        -> Path("path/to/model_dir")
    resolve_model("meta-llama/Llama-3.2-1B")  -> ~/.cache/huggingface/hub/models--meta-llama--.../snapshots/<sha>
    resolve_model("model.Q4_1.gguf")          -> ~/.cache/specexport/gguf/<sha256>  (exporter.gguf, converted once)

Like ``optimum-cli export onnx -m``, but never downloads: the cache is read with
``huggingface_hub.snapshot_download(..., local_files_only=True)`` (``HF_HUB_CACHE`` / ``HF_HOME``
choose the cache, as for every HF tool). Fetch a model first with ``hf download org/name``.
"""

from __future__ import annotations

import re
from pathlib import Path

from exporter.errors import UserError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub spells repo ids


def resolve_model(name_or_path, revision: str | None = None, cache_dir=None, log=print) -> Path:
    """A local directory as it is; else ``org/name`` from the local HF cache; else one clear error.

    A ``.gguf`` file, or a directory holding one and no config.json, becomes the model directory
    converted from it (:func:`exporter.gguf.resolve_gguf`).
    """
    from exporter.gguf import find_gguf, resolve_gguf

    path = Path(name_or_path)
    if (gguf := find_gguf(path)) is not None:
        return resolve_gguf(gguf, log=log)
    if path.exists() or not HUB_ID.match(str(name_or_path)):
        return path  # a local path (exporter.loading checks it and says what is wrong with it)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(str(name_or_path), revision=revision, cache_dir=cache_dir,
                                          local_files_only=True))
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        where = cache_dir or constants.HF_HUB_CACHE
        raise UserError(
            f"{name_or_path} is neither a directory nor a model in the local Hugging Face cache ({where}); "
            f"download it first (hf download {name_or_path}) or pass a model directory"
        ) from None
    gguf = find_gguf(snapshot)  # a GGUF repo: one .gguf and no config.json
    return snapshot if gguf is None else resolve_gguf(gguf)
