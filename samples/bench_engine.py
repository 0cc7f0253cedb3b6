"""Benchmark of the serving engine itself (no HTTP): requests arriving at a closed-loop concurrency and
at a Poisson rate, speculation off / on / adaptive side by side in one run.

    python samples/bench_engine.py spec-demo/onnx --threads 2 --json runs/engine.json --png runs/engine.png
    python samples/bench_engine.py M19_ONNX M19W_ONNX --concurrency 1 2 4 8 16 --requests 32

For every export, prompt set (``code``: snippets of the standard library's source, what the demo and
19M models were trained on; ``ood``: made-up words, which the drafters barely predict) and load, the
three speculation settings run one after the other on the same requests (the same prompts, greedy,
the same lengths) and report vLLM's serving metrics measured in-process:

    output tokens/s    every request's new tokens / the wall time of the whole load
    TTFT               arrival -> first token (closed loop: arrival = when the client sent it)
    TPOT               (latency - TTFT) / (output tokens - 1), per request
    mean accepted len  tokens per (request, base forward)
    host share         wall time outside graph calls / wall time

Greedy output is the same in every setting (asserted per request): only speed differs. A set
sampled at a temperature (``code@0.8``) is where drafts are rarely accepted: the floor that
adaptive speculation must hold against speculation off. The closed
loop keeps ``c`` requests in flight (a finished one is replaced at once) until ``--requests`` are
done; the Poisson load sends ``--requests`` at exponential gaps whose mean rate is a fraction
(``--poisson``) of what speculation off sustained at the highest concurrency.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import graphs
from graphs.engine import EngineConfig
from graphs.serve.loadgen import code_prompts as loadgen_code_prompts

MODES = ("off", "on", "adaptive")


def code_prompts(n: int, seed: int = 0) -> list[str]:
    """Slices of 2-12 lines from the standard library's source (the load generator's, uncut)."""
    return loadgen_code_prompts(n, seed, max_chars=1 << 30)


def ood_prompts(n: int, seed: int = 0) -> list[str]:
    """Made-up words: nothing a drafter trained on Python source predicts."""
    rng = random.Random(seed)
    return [" ".join("".join(rng.choice("bdfghklmnprstvwz" if k % 2 else "aeiou") for k in range(rng.randint(2, 7)))
                     for _ in range(rng.randint(4, 30))) for _ in range(n)]


def run_load(dec, prompts: list[list[int]], mode: str, max_new: int, concurrency: int | None = None,
             rate: float | None = None, batch: int = 16, temperature: float = 0.0) -> dict:
    """One load: closed loop at ``concurrency`` or Poisson arrivals at ``rate`` req/s. Returns metrics."""
    engine = dec.engine(EngineConfig(max_batch=batch, prefill_chunk=64, step_tokens=256,
                                     max_len=min(1024, dec.max_positions)))
    n = len(prompts)
    arrivals = None
    if rate is not None:
        gaps = np.random.default_rng(1).exponential(1.0 / rate, size=n)
        arrivals = np.cumsum(gaps) - gaps[0]
    t0 = time.perf_counter()
    sent, inflight, arrive_at, first_at, done_at, tokens = 0, 0, {}, {}, {}, {}
    index = {}
    while len(done_at) < n:
        now = time.perf_counter() - t0
        if arrivals is None:
            while sent < n and inflight < concurrency:
                rid = engine.add_request(prompts[sent], max_new_tokens=max_new, speculation=mode,
                                         temperature=temperature, eos_token_id=[] if temperature else None)
                index[rid], arrive_at[rid] = sent, time.perf_counter() - t0
                sent, inflight = sent + 1, inflight + 1
        else:
            while sent < n and arrivals[sent] <= now:
                rid = engine.add_request(prompts[sent], max_new_tokens=max_new, speculation=mode,
                                         temperature=temperature, eos_token_id=[] if temperature else None)
                index[rid], arrive_at[rid] = sent, float(arrivals[sent])
                sent += 1
            if not engine.has_pending_requests():
                time.sleep(max(0.0, float(arrivals[sent]) - now))
                continue
        for e in engine.step():
            t = time.perf_counter() - t0
            if e.token_ids and e.request_id not in first_at:
                first_at[e.request_id] = t
            tokens.setdefault(e.request_id, []).extend(e.token_ids)
            if e.finish_reason:
                done_at[e.request_id] = t
                inflight -= 1
    wall = time.perf_counter() - t0
    tot = engine.totals
    ttft = np.array([first_at[r] - arrive_at[r] for r in done_at])
    lat = np.array([done_at[r] - arrive_at[r] for r in done_at])
    outs = np.array([len(tokens[r]) for r in done_at])
    tpot = np.array([(lat[i] - ttft[i]) / (outs[i] - 1) for i in range(len(outs)) if outs[i] > 1])
    graph = tot.time_prefill + tot.time_draft + tot.time_verify

    return {"n": n, "wall": wall, "ttft": ttft, "lat": lat, "outs": outs, "tpot": tpot, "graph": graph,
            "accepted": list(tot.accepted), "steps": tot.steps, "plain_steps": tot.plain_steps,
            "tokens": {int(index[r]): tokens[r] for r in done_at}}


def _stats(x):
    return {"mean": float(np.mean(x)), "median": float(np.median(x)), "p99": float(np.percentile(x, 99))}


def summarize(parts: list[dict], offset: list[int]) -> dict:
    """The metrics of one setting over its rounds (each round a part of the requests)."""
    cat = lambda k: np.concatenate([p[k] for p in parts])
    wall = sum(p["wall"] for p in parts)
    outs, acc = cat("outs"), [a for p in parts for a in p["accepted"]]
    return {
        "requests": sum(p["n"] for p in parts), "wall_s": wall, "output_tokens": int(outs.sum()),
        "output_tokens_per_s": float(outs.sum() / wall), "request_throughput": sum(p["n"] for p in parts) / wall,
        "ttft_s": _stats(cat("ttft")), "tpot_s": _stats(cat("tpot")), "e2e_latency_s": _stats(cat("lat")),
        "mean_accepted_length": float(np.mean(acc)) if acc else 0.0,
        "steps": sum(p["steps"] for p in parts), "plain_steps": sum(p["plain_steps"] for p in parts),
        "host_share": max(0.0, 1 - sum(p["graph"] for p in parts) / wall),
        "tokens": {o + i: t for p, o in zip(parts, offset) for i, t in p["tokens"].items()},
    }


def run_cell(dec, prompts, max_new: int, rounds: int, **load) -> dict:
    """Every setting on the same requests, in ``rounds`` interleaved rounds (off, on, adaptive, off,
    ...: a machine whose load drifts hits all three alike)."""
    chunks = [list(range(len(prompts)))[k::rounds] for k in range(rounds)]
    parts: dict[str, list] = {m: [] for m in MODES}
    for chunk in chunks:
        for mode in MODES:
            parts[mode].append(run_load(dec, [prompts[i] for i in chunk], mode, max_new, **load))
    out = {}
    for mode in MODES:  # request i of a chunk is prompt chunk[i]: re-key the tokens by prompt index
        s = summarize(parts[mode], [0] * rounds)
        s["tokens"] = {chunk[i]: t for chunk, p in zip(chunks, parts[mode]) for i, t in p["tokens"].items()}
        out[mode] = s
    return out


def bench_export(path: str, args) -> dict:
    dec = graphs.load(path, provider="cpu", threads=args.threads)
    sets = {"code": code_prompts(args.requests, 0), "ood": ood_prompts(args.requests, 0)}
    out = {"path": path, "drafter": dec.kind, "sets": {}}
    for name in args.sets:
        source, _, temp = name.partition("@")
        temperature = float(temp or 0.0)
        prompts = [dec.encode(p)[: min(400, dec.max_positions - args.max_new_tokens - 2)] for p in sets[source]]
        # warm up every mode (sessions, the adaptive policy's measured costs)
        for mode in MODES:
            run_load(dec, prompts[:4], mode, 16, concurrency=2)
        res = {"closed": {}, "poisson": {}}
        for c in args.concurrency:
            cell = run_cell(dec, prompts, args.max_new_tokens, args.rounds, concurrency=c, temperature=temperature)
            for mode in MODES:
                m = cell[mode]
                print(f"{Path(path).name} {name} c={c} {mode}: {m['output_tokens_per_s']:.0f} tok/s, "
                      f"TPOT {1000 * m['tpot_s']['median']:.2f} ms, tau {m['mean_accepted_length']:.2f}", flush=True)
            if not temperature:
                _check_same(cell)
            res["closed"][c] = cell
        top = res["closed"][max(args.concurrency)]["off"]["request_throughput"]
        for frac in args.poisson:
            cell = run_cell(dec, prompts, args.max_new_tokens, args.rounds, rate=frac * top, temperature=temperature)
            for mode in MODES:
                print(f"{Path(path).name} {name} poisson {frac:g}x ({frac * top:.2f} req/s) {mode}: "
                      f"{cell[mode]['output_tokens_per_s']:.0f} tok/s, TTFT {cell[mode]['ttft_s']['median']:.3f} s",
                      flush=True)
            if not temperature:
                _check_same(cell)
            res["poisson"][f"{frac:g}x"] = cell
        for cells in (res["closed"], res["poisson"]):
            for cell in cells.values():
                off = cell["off"]["output_tokens_per_s"]
                cell["ratios"] = {m: cell[m]["output_tokens_per_s"] / off for m in ("on", "adaptive")}
                for m in MODES:
                    cell[m].pop("tokens")
        out["sets"][name] = res
    return out


def _check_same(cell: dict) -> None:
    """Greedy: every setting must emit the same tokens for every request (lossless)."""
    ref = cell["off"]["tokens"]
    for m in ("on", "adaptive"):
        bad = [i for i in ref if cell[m]["tokens"][i] != ref[i]]
        if bad:
            raise SystemExit(f"speculation {m} changed the greedy tokens of request {bad[0]}: a bug")


def draw(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(e, s) for e in result["exports"] for s in e["sets"]]
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7), squeeze=False)
    for j, (e, s) in enumerate(panels):
        closed = e["sets"][s]["closed"]
        cs = sorted(closed, key=int)
        for m, style in zip(MODES, ("k-o", "b-s", "g-^")):
            axes[0, j].plot([int(c) for c in cs], [closed[c][m]["output_tokens_per_s"] for c in cs], style, label=m)
            axes[1, j].plot([int(c) for c in cs], [1000 * closed[c][m]["tpot_s"]["median"] for c in cs], style, label=m)
        axes[0, j].set_title(f"{Path(e['path']).name} ({e['drafter']}), {s} prompts", fontsize=9)
        axes[0, j].set_xscale("log", base=2)
        axes[1, j].set_xscale("log", base=2)
        axes[0, j].set_ylabel("output tokens/s")
        axes[1, j].set_ylabel("median TPOT (ms)")
        axes[1, j].set_xlabel("concurrency (closed loop)")
        axes[0, j].legend(title="speculation", fontsize=8)
    fig.suptitle(f"graphs.engine, {result['threads']} threads, greedy (sets @T: sampled), "
                 f"{result['max_new_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict) -> str:
    """One table per export and prompt set: throughput by load, speculation off / on / adaptive."""
    out = []
    for e in result["exports"]:
        for name, res in e["sets"].items():
            out.append(f"\n{Path(e['path']).name} ({e['drafter']}), {name} prompts, {result['max_new_tokens']} new "
                       f"tokens, {result['requests']} requests per load\n")
            out.append("| load | off tok/s | on | adaptive | TPOT ms off / on / adaptive | TTFT ms off / adaptive "
                       "| τ on / adaptive | host share adaptive |")
            out.append("|---|---|---|---|---|---|---|---|")
            loads = [(f"c={c}", cell) for c, cell in res["closed"].items()] + [
                (f"Poisson {k}", cell) for k, cell in res["poisson"].items()]
            for label, cell in loads:
                off, on, ad = cell["off"], cell["on"], cell["adaptive"]
                out.append(
                    f"| {label} | {off['output_tokens_per_s']:.0f} | {on['output_tokens_per_s']:.0f} "
                    f"({cell['ratios']['on']:.2f}x) | {ad['output_tokens_per_s']:.0f} "
                    f"({cell['ratios']['adaptive']:.2f}x) "
                    f"| {1000 * off['tpot_s']['median']:.1f} / {1000 * on['tpot_s']['median']:.1f} / "
                    f"{1000 * ad['tpot_s']['median']:.1f} | {1000 * off['ttft_s']['median']:.0f} / "
                    f"{1000 * ad['ttft_s']['median']:.0f} | {on['mean_accepted_length']:.2f} / "
                    f"{ad['mean_accepted_length']:.2f} | {100 * ad['host_share']:.0f}% |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("exports", nargs="+", help="export directories (python -m exporter.export ...)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="closed-loop levels")
    ap.add_argument("--poisson", type=float, nargs="*", default=[0.7],
                    help="Poisson rates as fractions of speculation-off's request throughput at the top concurrency")
    ap.add_argument("--requests", type=int, default=32, help="requests per load")
    ap.add_argument("--rounds", type=int, default=2,
                    help="interleaved rounds per load (the requests split between them; settings alternate)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--sets", nargs="+", default=["code", "ood", "code@0.8"],
                    help="prompt sets: code or ood, greedy, or sampled at a temperature with @T (code@0.8)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--png", help="draw throughput and TPOT by concurrency here")
    ap.add_argument("--markdown", help="re-render an earlier --json as tables and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if max(args.concurrency) > 16:
        ap.error("--concurrency above 16 needs a larger engine (max_batch 16 here)")
    result = {"threads": args.threads, "max_new_tokens": args.max_new_tokens, "requests": args.requests,
              "rounds": args.rounds,
              "concurrency": args.concurrency, "exports": [bench_export(p, args) for p in args.exports]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.png:
        draw(result, args.png)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
