"""One decode step, graph against graph: our exported graph vs onnxruntime-genai's ``model.onnx``,
each run bare under ONNX Runtime (no decoder loop around either).

    python samples/bench_graphs.py --ours OUT_DIR --genai GENAI_DIR [--past 128] [--threads 2]
        [--rounds 7] [--steps 200] [--graph one-sequence|base] [--json F]

Both sessions get the same options (``--threads`` intra-op threads, spinning on, level-all
optimization), their K/V buffers bound in place as inputs and outputs (ours: ``past_key_values.*``
shared with ``present.*`` at ``kv_write_index``; genai: its ``past_present_share_buffer`` layout),
and a one-token step at ``--past`` tokens of context, batch 1. The two are interleaved round by
round (the same machine state for both) and the median per step is reported, with the ratio.
What the end-to-end bench (``python -m exporter.bench``) adds on top of this is each system's loop:
for us the Python around a step (acceptance, K/V bookkeeping, emitting text), for genai its C++.

Needs only onnxruntime (not genai itself): genai's graph is read from its directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _session(path: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")  # genai's default
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _bind_buffers(io, layers: int, shape: tuple, rng) -> None:
    import onnxruntime as ort

    for i in range(layers):
        for kv in ("key", "value"):
            value = ort.OrtValue.ortvalue_from_numpy(rng.random(shape, dtype=np.float32) * 0.1)
            io.bind_ortvalue_input(f"past_key_values.{i}.{kv}", value)
            io.bind_ortvalue_output(f"present.{i}.{kv}", value)


def ours(out_dir: Path, graph: str, past: int, threads: int, rng):
    """A one-token step of our export's one-sequence graph (or base), past ``past``."""
    from graphs.manifest import Manifest

    m = Manifest.read(out_dir)
    src = m.source
    name = m.one_sequence_file if graph == "one-sequence" else None
    if graph == "one-sequence" and name is None:
        raise SystemExit(f"error: {out_dir} has no one-sequence graph (optimize it, or pass --graph base)")
    path = out_dir / (name or m.graphs["base"].file)
    s = _session(path, threads)
    cap = past + 64
    io = s.io_binding()
    _bind_buffers(io, src["num_layers"], (1, src["num_kv_heads"], cap, src["head_dim"]), rng)
    mask = np.zeros((1, 1, 1, cap), dtype=bool)
    mask[..., : past + 1] = True
    small = [o.name for o in s.get_outputs() if not o.name.startswith("present.")]

    def step():
        io.bind_cpu_input("input_ids", np.array([[5]], dtype=np.int64))
        io.bind_cpu_input("position_ids", np.array([[past]], dtype=np.int64))
        io.bind_cpu_input("attention_mask", mask)
        io.bind_cpu_input("kv_write_index", np.array([past], dtype=np.int64))
        for n in small:
            io.bind_output(n, "cpu")
        s.run_with_iobinding(io)

    return step, path


def genai(model_dir: Path, past: int, threads: int, rng):
    """A one-token step of genai's graph, its buffer shared between past and present."""
    cfg = json.loads((model_dir / "genai_config.json").read_text())["model"]
    dec = cfg["decoder"]
    path = model_dir / dec.get("filename", "model.onnx")
    s = _session(path, threads)
    cap = past + 64
    io = s.io_binding()
    _bind_buffers(io, dec["num_hidden_layers"], (1, dec["num_key_value_heads"], cap, dec["head_size"]), rng)

    def step():
        io.bind_cpu_input("input_ids", np.array([[5]], dtype=np.int64))
        io.bind_cpu_input("attention_mask", np.ones((1, past + 1), dtype=np.int64))
        io.bind_output("logits", "cpu")
        s.run_with_iobinding(io)

    return step, path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ours", required=True, help="our export directory (optimized)")
    ap.add_argument("--genai", required=True, help="an onnxruntime-genai model directory (genai_config.json)")
    ap.add_argument("--graph", choices=("one-sequence", "base"), default="one-sequence",
                    help="which of our graphs (default: the one-sequence graph, what a one-token step runs)")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per round and system")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    systems = {"ours": ours(Path(args.ours), args.graph, args.past, args.threads, rng),
               "genai": genai(Path(args.genai), args.past, args.threads, rng)}
    times: dict = {n: [] for n in systems}
    for r in range(args.rounds):
        for name, (step, _) in systems.items():
            for _ in range(10):  # warm: the arena, the spinning pool
                step()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1]:.3f} ms" for n in systems),
              file=sys.stderr, flush=True)
    med = {n: float(np.median(v)) for n, v in times.items()}
    report = {"past": args.past, "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
              "graphs": {n: str(p) for n, (_, p) in systems.items()},
              "ms_per_step": med, "rounds_ms": times, "ours_vs_genai_time": med["ours"] / med["genai"]}
    print(f"ours {med['ours']:.3f} ms, genai {med['genai']:.3f} ms per step: ours takes "
          f"{report['ours_vs_genai_time']:.2f}x genai's time")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
