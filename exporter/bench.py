"""Speculative vs autoregressive decoding on the same ONNX Runtime session, side by side.

    python -m exporter.bench out_dir [--max-new-tokens 96] [--repeats 3] [--json FILE] [--png FILE]
                                     [--sweep]

For each prompt, both modes run back to back (alternating order each repeat, so neither always
runs on a warm or cold cache) on the same decoder: tokens/s of each, their ratio, the mean
accepted length, and where the speculative time goes (draft, verify, host code). Greedy outputs of
the two modes are checked equal (lossless). ``--sweep`` also measures speed against tree size.
Results are printed, written as JSON and drawn as PNG (acceptance histogram, speed vs tree size).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(",
    "class Config:\n    def __init__(self, ",
    "    for name, value in ",
    "def _parse(self, text):\n    ",
    "        if not isinstance(",
    "    return ",
    "# Copyright",
    "from collections import ",
]


def _prompts(decoder, n: int, seed: int = 0) -> list:
    if decoder.tokenizer is not None:
        return [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(n)]
    rng = np.random.default_rng(seed)
    vocab = decoder.manifest.source["vocab_size"]
    banned = decoder.eos | {decoder.pad}
    out = []
    for _ in range(n):
        ids = [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(4, 16))) if int(t) not in banned]
        out.append(ids or [3])
    return out


def _tree_sizes(decoder) -> list:
    """Trees of growing size for ``--sweep``: Medusa paths or EAGLE settings."""
    from graphs.trees import default_medusa_paths

    if decoder.kind == "medusa":
        heads = decoder.drafter["num_heads"]
        trees = {}
        for s in (2, 4, 8, 12, 16, 24, 32):
            paths = default_medusa_paths(heads, size=s)
            trees.setdefault(len(paths), paths)  # the heuristic stops growing where paths get unlikely
        return list(trees.values())
    return [{"topk": k, "depth": d, "total_tokens": t}
            for k, d, t in [(1, 2, 3), (2, 3, 6), (4, 4, 8), (4, 4, 12), (6, 5, 16), (8, 5, 24), (8, 6, 32)]]


def _tree_size(tree) -> int:
    return tree["total_tokens"] if isinstance(tree, dict) else 1 + len(tree)


def run_bench(decoder, prompts, max_new_tokens: int = 96, repeats: int = 3, tree=None) -> dict:
    """Alternate autoregressive and speculative runs of every prompt; aggregate by mode."""
    agg = {m: {"tokens": 0, "time": 0.0, "draft": 0.0, "verify": 0.0, "host": 0.0, "prefill": 0.0,
               "accepted": []} for m in ("autoregressive", "speculative")}
    mismatches = 0
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            order = ["autoregressive", "speculative"] if (r + i) % 2 == 0 else ["speculative", "autoregressive"]
            tokens = {}
            for mode in order:
                res = decoder.generate(prompt, max_new_tokens=max_new_tokens, mode=mode,
                                       tree=tree if mode == "speculative" else None)
                s = res.stats
                a = agg[mode]
                a["tokens"] += s.new_tokens
                a["time"] += s.time_total - s.time_prefill
                a["draft"] += s.time_draft
                a["verify"] += s.time_verify
                a["host"] += s.time_host
                a["prefill"] += s.time_prefill
                a["accepted"] += s.accepted
                tokens[mode] = res.token_ids
            mismatches += tokens["autoregressive"] != tokens["speculative"]
    out = {}
    for mode, a in agg.items():
        t = max(a["time"], 1e-9)
        out[mode] = {
            "tokens": a["tokens"],
            "decode_seconds": a["time"],
            "tokens_per_s": a["tokens"] / t,
            "mean_accepted_length": float(np.mean(a["accepted"])) if a["accepted"] else 0.0,
            "accepted_histogram": np.bincount(a["accepted"]).tolist() if a["accepted"] else [],
            "time_split": {k: a[k] / t for k in ("draft", "verify", "host")},
        }
    out["speedup"] = out["speculative"]["tokens_per_s"] / max(out["autoregressive"]["tokens_per_s"], 1e-9)
    out["greedy_mismatches"] = int(mismatches)
    return out


def draw(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = report.get("sweep")
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(11 if sweep else 5.5, 4))
    axes = np.atleast_1d(axes)
    hist = report["main"]["speculative"]["accepted_histogram"]
    axes[0].bar(range(len(hist)), hist, color="#4477aa")
    axes[0].set_xlabel("tokens accepted per verify step (incl. bonus)")
    axes[0].set_ylabel("steps")
    tau = report["main"]["speculative"]["mean_accepted_length"]
    axes[0].set_title(f"acceptance (mean {tau:.2f}), speedup {report['main']['speedup']:.2f}x")
    if sweep:
        sizes = [row["tree_size"] for row in sweep]
        axes[1].plot(sizes, [row["speculative_tokens_per_s"] for row in sweep], "o-", label="speculative")
        axes[1].axhline(report["main"]["autoregressive"]["tokens_per_s"], color="gray", ls="--",
                        label="autoregressive")
        ax2 = axes[1].twinx()
        ax2.plot(sizes, [row["mean_accepted_length"] for row in sweep], "s:", color="#cc6677", label="tau")
        ax2.set_ylabel("mean accepted length", color="#cc6677")
        axes[1].set_xlabel("tree size (tokens verified per step)")
        axes[1].set_ylabel("tokens/s")
        axes[1].legend(loc="lower right")
        axes[1].set_title("speed vs tree size")
    fig.suptitle(report["out_dir"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench(out_dir, max_new_tokens=96, repeats=3, prompts=8, provider="auto", threads=None, sweep=False,
          tree=None, log=print) -> dict:
    import graphs

    decoder = graphs.load(out_dir, provider=provider, threads=threads)
    if decoder.kind is None:
        raise ValueError(f"{out_dir} has no draft graph: nothing to compare against autoregressive decoding")
    ps = _prompts(decoder, prompts)
    decoder.generate(ps[0], max_new_tokens=8)  # warm-up: first runs allocate
    decoder.generate(ps[0], max_new_tokens=8, mode="autoregressive")
    t0 = time.perf_counter()
    main = run_bench(decoder, ps, max_new_tokens, repeats, tree=tree)
    log(_line("default tree", main))
    report = {"out_dir": str(out_dir), "provider": decoder.provider, "threads": threads,
              "drafter": decoder.kind, "tree": tree or decoder.default_tree, "prompts": len(ps),
              "max_new_tokens": max_new_tokens, "repeats": repeats,
              "machine": platform.processor() or platform.machine(),
              "main": main}
    if sweep:
        rows = []
        for tr in _tree_sizes(decoder):
            r = run_bench(decoder, ps, max_new_tokens, max(1, repeats // 2), tree=tr)
            rows.append({"tree": tr, "tree_size": _tree_size(tr), "speedup": r["speedup"],
                         "speculative_tokens_per_s": r["speculative"]["tokens_per_s"],
                         "autoregressive_tokens_per_s": r["autoregressive"]["tokens_per_s"],
                         "mean_accepted_length": r["speculative"]["mean_accepted_length"]})
            log(_line(f"tree size {_tree_size(tr):3d}", r))
        report["sweep"] = rows
    report["seconds"] = time.perf_counter() - t0
    return report


def _line(label: str, r: dict) -> str:
    s, a = r["speculative"], r["autoregressive"]
    split = s["time_split"]
    return (f"{label}: autoregressive {a['tokens_per_s']:.1f} tok/s | speculative {s['tokens_per_s']:.1f} tok/s "
            f"| speedup {r['speedup']:.2f}x | mean accepted length {s['mean_accepted_length']:.2f} | "
            f"draft {split['draft']:.0%} verify {split['verify']:.0%} host {split['host']:.0%}"
            + (f" | {r['greedy_mismatches']} GREEDY MISMATCHES" if r["greedy_mismatches"] else ""))


def main(argv=None) -> int:
    from exporter.cli import run_cli

    ap = argparse.ArgumentParser(prog="python -m exporter.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="an export directory with a draft graph")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--provider", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tree", help="tree JSON file for the main run (default: the manifest's)")
    ap.add_argument("--sweep", action="store_true", help="also measure speed against tree size")
    ap.add_argument("--json", help="write the report as JSON here")
    ap.add_argument("--png", help="draw the acceptance histogram (and the sweep) here")
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)

    def body():
        from exporter.cli import require_module
        from graphs.sessions import use_shared_thread_pool

        if args.png:  # say so before the run, not after it
            require_module("matplotlib", "--png", "'specexport[plot]' (or matplotlib)")
        use_shared_thread_pool(args.threads)  # one ORT pool for base, draft and K/V sessions
        tree = None
        if args.tree:
            tree = json.loads(Path(args.tree).read_text())
            tree = tree.get("paths", tree) if isinstance(tree, dict) and "paths" in tree else tree
        report = bench(args.out_dir, args.max_new_tokens, args.repeats, args.prompts, args.provider,
                       args.threads, args.sweep, tree)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if args.png:
            draw(report, Path(args.png))
        return 1 if report["main"]["greedy_mismatches"] else 0

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
