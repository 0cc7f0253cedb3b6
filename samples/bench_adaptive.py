"""Adaptive speculation against plain decoding on one export, as a caller of ``generate`` sees it.

    python samples/bench_adaptive.py OUT [--repeats 3] [--max-new-tokens 96] [--rounds 2] [--json F]

Greedy, ``decoder.generate`` once per prompt (each call a new engine and planner: what a script or a
batch job pays), ``speculation="off"`` and ``"adaptive"`` taking turns ``--rounds`` times in one
process so that drift hits both. Prints tokens/s per mode and round and adaptive / off per round;
checks that both modes decode the same tokens (greedy speculation is the base's greedy) and says so.
The docs' "adaptive policy on the demo" figures (docs/benchmarks.md) come from it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPTS = ["def main(", "import os\n", "class Foo:", "for i in range(", "return self.", "if __name__"]


def measure(out: str, repeats: int, max_new_tokens: int, rounds: int, threads: int, log=print) -> dict:
    import graphs

    dec = graphs.load(out, provider="cpu", threads=threads)
    report: dict = {"export": out, "repeats": repeats, "max_new_tokens": max_new_tokens, "prompts": PROMPTS,
                    "tok_s": {"off": [], "adaptive": []}, "mean_accepted_length": {"off": [], "adaptive": []}}
    tokens: dict[str, list] = {}
    for rnd in range(rounds):
        for mode in ("off", "adaptive"):
            for p in PROMPTS[:2]:  # warm this mode's calls
                dec.generate(p, max_new_tokens=8, speculation=mode)
            t0, n, acc, toks = time.perf_counter(), 0, [], []
            for _ in range(repeats):
                for p in PROMPTS:
                    r = dec.generate(p, max_new_tokens=max_new_tokens, speculation=mode)
                    n += len(r.token_ids)
                    acc.append(r.stats.mean_accepted_length)
                    toks.append(list(r.token_ids))
            rate, tau = n / (time.perf_counter() - t0), sum(acc) / len(acc)
            report["tok_s"][mode].append(rate)
            report["mean_accepted_length"][mode].append(tau)
            tokens.setdefault(mode, toks)
            log(f"round {rnd + 1} {mode}: {rate:.0f} tok/s, tau {tau:.2f}", flush=True)
    report["adaptive_over_off"] = [a / o for a, o in zip(report["tok_s"]["adaptive"], report["tok_s"]["off"])]
    report["same_tokens"] = tokens["off"] == tokens["adaptive"]
    log("adaptive / off: " + ", ".join(f"{x:.2f}x" for x in report["adaptive_over_off"])
        + ("; same tokens" if report["same_tokens"] else "; TOKENS DIFFER"))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="an export directory")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the prompts per mode and round")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2, help="times the two modes take turns")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args(argv)
    for name in ("repeats", "max_new_tokens", "rounds", "threads"):
        if getattr(a, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}", file=sys.stderr)
            return 2
    try:
        report = measure(a.out, a.repeats, a.max_new_tokens, a.rounds, a.threads)
    except Exception as e:  # a bad directory: the loader's own one-line message
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
