"""Load and save graphs for the passes, with their external-data weight files (``base.onnx.data``).

Passes that only rewire nodes (version conversion, attention, norms) run on the graph with its
weights left on disk (``load_external_data=False``), so a 4.4 GB base is not copied while it is
rewired; passes that read or rewrite weights (quantization, float16) call :func:`load_weights`.
A graph is saved with one ``<file>.data`` beside it when the source had one or when it would not
fit protobuf's 2 GB limit.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx.external_data_helper import uses_external_data

PROTOBUF_LIMIT = 1 << 31
_INLINE_MAX = 1_800_000_000  # save with external data above this many bytes of weights


def load_graph(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


def has_external_data(proto: onnx.ModelProto) -> bool:
    return any(uses_external_data(t) for t in proto.graph.initializer)


def load_weights(proto: onnx.ModelProto, base_dir: Path) -> None:
    """Read every external tensor of ``proto`` into memory (from ``base_dir``)."""
    if has_external_data(proto):
        onnx.load_external_data_for_model(proto, str(base_dir))


def weight_bytes(proto: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in proto.graph.initializer)


def save_graph(proto: onnx.ModelProto, path: Path, external: bool) -> list[Path]:
    """Write ``proto`` (weights in memory) to ``path``; returns the files written."""
    path = Path(path)
    if external or weight_bytes(proto) > _INLINE_MAX:
        data = path.with_name(path.name + ".data")
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024, convert_attribute=False)
        return [path, data]
    onnx.save_model(proto, str(path))
    return [path]


def count_ops(proto: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in proto.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
