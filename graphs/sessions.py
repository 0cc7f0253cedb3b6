"""ONNX Runtime sessions: provider choice (CUDA EP, else CPU EP), threads, optimization level."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def resolve_provider(provider: str = "auto") -> str:
    """"auto" -> "cuda" when onnxruntime-gpu sees a GPU, else "cpu"; "cuda" without one is an error."""
    available = ort.get_available_providers()
    if provider == "auto":
        return "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if provider == "cuda" and "CUDAExecutionProvider" not in available:
        raise ValueError(
            "provider 'cuda' needs onnxruntime-gpu and a CUDA device (pip install 'specexport[gpu]'); "
            "use provider='cpu' or 'auto'"
        )
    if provider not in ("cuda", "cpu"):
        raise ValueError(f"unknown provider {provider!r}; accepted: auto, cuda, cpu")
    return provider


def make_session(
    path: Path,
    provider: str = "cpu",
    threads: int | None = None,
    optimization: str = "all",
    device_id: int = 0,
) -> ort.InferenceSession:
    """One session for one graph file; built once per decoder, never per step."""
    opts = ort.SessionOptions()
    if optimization not in _LEVELS:
        raise ValueError(f"unknown optimization level {optimization!r}; accepted: {', '.join(_LEVELS)}")
    opts.graph_optimization_level = _LEVELS[optimization]
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    provider = resolve_provider(provider)
    providers = (
        [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
        if provider == "cuda"
        else ["CPUExecutionProvider"]
    )
    return ort.InferenceSession(str(path), sess_options=opts, providers=providers)
