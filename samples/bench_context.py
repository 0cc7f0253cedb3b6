"""Step cost against context length: ours (K/V written in place, or concatenated) vs onnxruntime-genai.

    python samples/bench_context.py --ours in-place=OUT_A --ours concat=OUT_B --genai fp32=GENAI_DIR \
        [--pasts 128,512,2048] [--batches 1,8] [--steps 16] [--rounds 3] [--threads 2] [--json F] [--png F]

For every (past, batch): B sequences are prefilled with ``past`` tokens, then ``--steps`` one-token
steps are timed; a step is what each system does per token: ours, the engine's plain step
(``Decoder.plain_step``: the one-token call on arrays bound once to an engine's K/V rows; before, a
``Decoder.base_forward`` with a binding per call) plus the K/V commit (graphs.slots); genai, one
``generate_next_token`` (its forward, its in-place cache, its greedy pick). Systems are interleaved
within each round (the same machine state for all), and the median per step is reported. The slope
is the extra milliseconds per 1000 tokens of context, fitted over the pasts (least squares).

Needs onnxruntime-genai in this Python for ``--genai`` (pip install 'specexport[bench]'); the model's
``max_position_embeddings`` must cover the longest past (a config edit is enough for timing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


class Ours:
    def __init__(self, out_dir: str, threads: int):
        import graphs

        self.dec = graphs.load(out_dir, provider="cpu", threads=threads, adaptive=False)
        self.vocab = self.dec.manifest.source["vocab_size"]

    def nodes(self) -> int | None:
        """Of the graph a step runs: the one-sequence graph where the export has one."""
        m = self.dec.manifest
        return count_nodes(self.dec.out_dir / (m.one_sequence_file or self.dec.base_spec.file))

    def prepare(self, batch: int, past: int, rng) -> None:
        from graphs.slots import SlotCache

        src = self.dec.manifest.source
        self.kv = SlotCache(src["num_layers"], batch, src["num_kv_heads"], src["head_dim"], self.dec.dtype,
                            past + 256, headroom=16, layout=self.dec.kv_layout)
        for _ in range(batch):
            self.kv.add_row()
        ids = rng.integers(0, self.vocab, (batch, past))
        chunk = 256
        for lo in range(0, past, chunk):  # the engine's chunked prefill
            s = min(chunk, past - lo)
            out = self.dec.base_forward(self.kv, ids[:, lo : lo + s], np.broadcast_to(lo + np.arange(s), (batch, s)),
                                        np.broadcast_to(np.tril(np.ones((s, s), dtype=bool)), (batch, s, s)))
            self.kv.commit(self.dec.presents(out), np.broadcast_to(np.arange(s), (batch, s)), np.full(batch, s))
        self.next = out["logits"][:, -1].argmax(-1)
        self.batch = batch

    def step(self) -> None:
        b = self.batch
        out = self.dec.plain_step(self.kv, self.next)  # the engine's plain step: arrays bound once
        if out is None:  # graphs without bound calls (K/V not written in place): the engine's general verify
            from graphs.adaptive import root_only

            out = self.dec.verify(self.kv, [root_only()] * b, [self.next[i : i + 1] for i in range(b)])
        self.kv.commit(self.dec.presents(out), np.zeros((b, 1), dtype=np.int64), np.ones(b, dtype=np.int64))
        self.next = out["logits"][:, -1].argmax(-1)


class Genai:
    def __init__(self, model_dir: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        cfg = og.Config(model_dir)
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(cfg)
        self.dir = Path(model_dir)
        self.vocab = json.loads((self.dir / "genai_config.json").read_text())["model"]["vocab_size"]

    def nodes(self) -> int | None:
        return count_nodes(self.dir / "model.onnx")

    def prepare(self, batch: int, past: int, rng) -> None:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=past + 256, batch_size=batch, do_sample=False)
        self.gen = og.Generator(self.model, params)
        self.gen.append_tokens(rng.integers(0, self.vocab, (batch, past)).astype(np.int32))
        self.gen.generate_next_token()

    def step(self) -> None:
        self.gen.generate_next_token()


def count_nodes(path: Path) -> int | None:
    """ORT nodes after session optimization (level all, CPU EP): what a call actually runs."""
    import os
    import tempfile

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as d:
        from graphs.sessions import default_session_options  # honours the process-wide pool

        so = default_session_options(1)
        so.optimized_model_filepath = os.path.join(d, "m.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "m.onnx.data")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return len(onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ours", action="append", default=[], help="NAME=EXPORT_DIR (repeatable)")
    ap.add_argument("--genai", action="append", default=[], help="NAME=GENAI_MODEL_DIR (repeatable)")
    ap.add_argument("--pasts", default="128,512,2048")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    from graphs.sessions import use_shared_thread_pool

    use_shared_thread_pool(args.threads)  # as our CLIs and bench's workers run: one ORT pool for all sessions
    systems = {}
    for spec, cls, prefix in [(s, Ours, "ours-") for s in args.ours] + [(s, Genai, "genai-") for s in args.genai]:
        name, _, path = spec.partition("=")
        systems[prefix + name] = cls(path, args.threads)
    if not systems:
        ap.error("give at least one --ours or --genai system")
    pasts = [int(x) for x in args.pasts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    times: dict = {n: {} for n in systems}
    for batch in batches:
        for past in pasts:
            for r in range(args.rounds):
                for name, sys_ in systems.items():
                    sys_.prepare(batch, past, np.random.default_rng(r))
                    ts = []
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        sys_.step()
                        ts.append(time.perf_counter() - t0)
                    times[name].setdefault(f"{batch}x{past}", []).append(float(np.median(ts)) * 1e3)
            print(f"batch {batch} past {past}: " + ", ".join(
                f"{n} {np.median(times[n][f'{batch}x{past}']):.2f} ms" for n in systems), flush=True)
    report = {"threads": args.threads, "steps": args.steps, "rounds": args.rounds, "pasts": pasts,
              "batches": batches, "systems": {}}
    for name, sys_ in systems.items():
        ms = {k: float(np.median(v)) for k, v in times[name].items()}
        slopes = {}
        for batch in batches:
            ys = [ms[f"{batch}x{p}"] for p in pasts]
            slopes[str(batch)] = float(np.polyfit(pasts, ys, 1)[0] * 1000) if len(pasts) > 1 else None
        report["systems"][name] = {"ms_per_step": ms, "slope_ms_per_1k_tokens": slopes, "ort_nodes": sys_.nodes()}
        print(f"{name}: nodes {report['systems'][name]['ort_nodes']}, slope ms/1k context: "
              + ", ".join(f"batch {b} {s:.2f}" for b, s in slopes.items() if s is not None))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.8), squeeze=False)
        for ax, batch in zip(axes[0], batches):
            for name in systems:
                ax.plot(pasts, [report["systems"][name]["ms_per_step"][f"{batch}x{p}"] for p in pasts], "o-",
                        label=name)
            ax.set_xlabel("past tokens")
            ax.set_ylabel("ms per step")
            ax.set_title(f"batch {batch}, {args.threads} threads")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
