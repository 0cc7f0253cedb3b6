"""A load generator for the server (or any OpenAI-compatible one), loopback only, bounded.

    python -m graphs.serve.loadgen --url http://127.0.0.1:8000 --concurrency 1 4 16 --rate-fraction 0.9 \\
        --speculation adaptive off --requests 64 --max-tokens 64 --json load.json --png load.png

For each speculation setting (sent per request, in the body, so one server serves both) and each
load -- closed loop at ``c`` requests in flight (a finished one is replaced at once), Poisson arrivals
at ``--rate`` req/s, or at ``--rate-fraction`` of the request throughput the highest closed loop
reached -- it streams ``--requests`` completions (greedy, ``ignore_eos``, ``stream_options.include_usage``)
and reports vLLM's serving metrics (``vllm bench serve``'s names):

    TTFT      send -> first streamed text (ms)
    TPOT      (latency - TTFT) / (output tokens - 1), per request (ms)
    ITL       gaps between a request's successive chunks (ms; a chunk may carry several tokens)
    E2EL      send -> [DONE] (ms)
    request_throughput (req/s), output_throughput (tok/s), total_token_throughput (tok/s)
    goodput   requests/s that met every SLO of ``--goodput ttft:MS tpot:MS e2el:MS``

each as mean, median, std and p99, plus the acceptance the server reported (``spec_decode``).
``--engine-baseline OUT_DIR`` also runs the same requests on an in-process engine (no HTTP) at
concurrency 1, so the server's overhead is ``server tok/s / engine tok/s`` (the median over
``--overhead-repeats`` back-to-back pairs of a server run and an engine run).

Bounded: at most ``--requests`` per load and ``--max-duration`` seconds per load (then it stops
sending and waits for the requests in flight, at most ``--timeout`` each). It refuses any host but
127.0.0.1, ::1 and localhost.

``--mixed`` runs the mixed load of :mod:`graphs.serve.soak` instead (its own flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from graphs.serve.clients import LOOPBACK, check_loopback, code_prompts, write_report  # noqa: F401 (loadgen's API)

# ---------------------------------------------------------------------- prompts


def file_prompts(path: str, n: int) -> list[str]:
    """Text prompts, one per line, or JSONL with a "prompt" string per line; cycled to ``n``."""
    prompts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompts.append(json.loads(line)["prompt"])
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise SystemExit(f"error: {path} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(n)]


# ---------------------------------------------------------------------- one request


async def one_request(client, endpoint: str, model: str, prompt: str, max_tokens: int, speculation: str | None,
                      ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if speculation:
        body["speculation"] = speculation
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    rec = {"ok": False, "ttft": None, "itl": [], "output_tokens": 0, "prompt_tokens": 0, "error": None,
           "spec_decode": None}
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    rec["ok"] = rec["error"] is None
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = obj["error"].get("message")
                    continue
                now = time.perf_counter()
                choices = obj.get("choices") or []
                text = ""
                if choices:
                    c = choices[0]
                    text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if text:
                    if rec["ttft"] is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["itl"].append(now - last)
                    last = now
                if obj.get("usage"):
                    rec["output_tokens"] = obj["usage"]["completion_tokens"]
                    rec["prompt_tokens"] = obj["usage"]["prompt_tokens"]
                if obj.get("spec_decode"):
                    rec["spec_decode"] = obj["spec_decode"]
    except Exception as e:  # a load tool reports failures, it does not stop at the first
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["e2el"] = time.perf_counter() - t0
    return rec


# ---------------------------------------------------------------------- loads


async def run_load(url: str, endpoint: str, model: str, prompts: list[str], max_tokens: int, speculation,
                   concurrency: int | None = None, rate: float | None = None, max_duration: float = 300,
                   timeout: float = 300, ignore_eos: bool = True, seed: int = 0) -> dict:
    import httpx

    n = len(prompts)
    limits = httpx.Limits(max_connections=max(concurrency or 0, 256), max_keepalive_connections=max(concurrency or 0,
                                                                                                    64))
    records: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        stop_at = t0 + max_duration

        def go(i):
            return one_request(client, endpoint, model, prompts[i], max_tokens, speculation, ignore_eos)

        if concurrency is not None:
            it = iter(range(n))

            async def loop():
                for i in it:
                    if time.perf_counter() > stop_at:
                        return
                    records.append(await go(i))

            await asyncio.gather(*[loop() for _ in range(concurrency)])
        else:
            gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
            arrivals = np.cumsum(gaps) - gaps[0]
            tasks = []
            for i in range(n):
                delay = t0 + arrivals[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() > stop_at:
                    break
                tasks.append(asyncio.create_task(go(i)))
            records = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - t0
    return summarize(records, wall)


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "median": None, "std": None, "p99": None}
    a = np.asarray(xs) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p99": float(np.percentile(a, 99))}


def summarize(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r["ok"]]
    out_tok = sum(r["output_tokens"] for r in ok)
    in_tok = sum(r["prompt_tokens"] for r in ok)
    tpots = [(r["e2el"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok
             if r["output_tokens"] > 1 and r["ttft"] is not None]
    spec = [r["spec_decode"] for r in ok if r["spec_decode"]]
    drafted = sum(s["num_draft_tokens"] for s in spec)
    res = {
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "duration_s": wall, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / wall if wall > 0 else 0.0,
        "output_throughput": out_tok / wall if wall > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / wall if wall > 0 else 0.0,
        "ttft_ms": _dist([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_ms": _dist(tpots),
        "itl_ms": _dist([x for r in ok for x in r["itl"]]),
        "e2el_ms": _dist([r["e2el"] for r in ok]),
        "spec_decode": {
            "num_drafts": sum(s["num_drafts"] for s in spec), "num_draft_tokens": drafted,
            "num_accepted_tokens": sum(s["num_accepted_tokens"] for s in spec),
            "acceptance_rate": sum(s["num_accepted_tokens"] for s in spec) / drafted if drafted else 0.0,
            "mean_accepted_length": (sum(s["mean_accepted_length"] * s["steps"] for s in spec)
                                     / max(1, sum(s["steps"] for s in spec))),
            "plain_steps": sum(s["plain_steps"] for s in spec), "steps": sum(s["steps"] for s in spec)},
        "_records": records,
    }
    return res


def goodput(records: list[dict], wall: float, slo: dict) -> float | None:
    """Requests/s that met every SLO (ms): vLLM's ``--goodput ttft:.. tpot:.. e2el:..``."""
    if not slo:
        return None
    good = 0
    for r in records:
        if not r["ok"] or r["ttft"] is None:
            continue
        vals = {"ttft": r["ttft"] * 1000, "e2el": r["e2el"] * 1000,
                "tpot": (r["e2el"] - r["ttft"]) * 1000 / (r["output_tokens"] - 1) if r["output_tokens"] > 1 else 0.0}
        good += all(vals[k] <= v for k, v in slo.items())
    return good / wall if wall > 0 else 0.0


def engine_baseline(out_dir: str, prompts: list[str], max_tokens: int, speculation, threads: int,
                    ignore_eos: bool, shared_pool: bool = True) -> dict:
    """The same requests one at a time on an in-process engine (what the server adds nothing to)."""
    import graphs
    from graphs.engine import EngineConfig
    from graphs.sessions import use_shared_thread_pool

    if shared_pool:
        use_shared_thread_pool(threads)  # as the server does (process-wide: every later session of this process)
    dec = graphs.load(out_dir, provider="cpu", threads=threads)
    engine = dec.engine(EngineConfig(max_batch=1))
    kw = {"max_new_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        kw["eos_token_id"] = []
    if speculation:
        kw["speculation"] = speculation
    ids = [dec.encode(p) for p in prompts]
    for p in ids[:2]:  # warm up
        engine.add_request(p, **kw)
        while engine.has_pending_requests():
            engine.step()
    t0 = time.perf_counter()
    tokens = 0
    for p in ids:
        engine.add_request(p, **kw)
        while engine.has_pending_requests():
            tokens += sum(len(e.token_ids) for e in engine.step())
    wall = time.perf_counter() - t0
    return {"requests": len(ids), "output_tokens": tokens, "duration_s": wall, "output_throughput": tokens / wall}


# ---------------------------------------------------------------------- report


def draw(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    loads = list(dict.fromkeys(r["load"] for r in runs))
    modes = list(dict.fromkeys(str(r["speculation"]) for r in runs))
    panels = [("output_throughput", "output tokens/s", None), ("tpot_ms", "TPOT median (ms)", "median"),
              ("ttft_ms", "TTFT median (ms)", "median"), ("e2el_ms", "E2E latency p99 (ms)", "p99")]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    x = np.arange(len(loads))
    w = 0.8 / max(1, len(modes))
    for k, mode in enumerate(modes):
        by = {r["load"]: r for r in runs if str(r["speculation"]) == mode}
        for ax, (key, label, stat) in zip(axes, panels):
            vals = [(by[ld][key] if stat is None else by[ld][key][stat]) if ld in by else 0 for ld in loads]
            ax.bar(x + (k - (len(modes) - 1) / 2) * w, [v or 0 for v in vals], w, label=f"speculation {mode}")
            ax.set_title(label, fontsize=10)
            ax.set_xticks(x, loads, rotation=20, fontsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['model']} at {result['url']}: {result['max_tokens']} tokens per request, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(runs: list[dict]) -> str:
    head = (f"{'load':<16}{'speculation':<12}{'ok':>5}{'fail':>5}{'req/s':>8}{'out tok/s':>10}{'TTFT p50':>10}"
            f"{'TPOT p50':>10}{'ITL p50':>9}{'E2E p50':>9}{'E2E p99':>9}{'tau':>6}{'goodput':>9}")
    lines = [head]
    f = lambda v: "-" if v is None else f"{v:.1f}"
    for r in runs:
        lines.append(f"{r['load']:<16}{r['speculation']!s:<12}{r['completed']:>5}{r['failed']:>5}"
                     f"{r['request_throughput']:>8.2f}{r['output_throughput']:>10.1f}{f(r['ttft_ms']['median']):>10}"
                     f"{f(r['tpot_ms']['median']):>10}{f(r['itl_ms']['median']):>9}{f(r['e2el_ms']['median']):>9}"
                     f"{f(r['e2el_ms']['p99']):>9}{r['spec_decode']['mean_accepted_length']:>6.2f}"
                     f"{'-' if r['goodput'] is None else format(r['goodput'], '.2f'):>9}")
    return "\n".join(lines)


def parse_slo(items) -> dict:
    slo = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"error: --goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slo[key] = float(value)
    return slo


async def _model(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def run(url: str, speculations: list, concurrency: list[int], rates: list[float], rate_fraction: list[float],
        requests: int, max_tokens: int, endpoint: str = "completions", prompts_file: str | None = None,
        max_duration: float = 300, timeout: float = 300, slo: dict | None = None, ignore_eos: bool = True,
        engine_out_dir: str | None = None, threads: int = 2, warmup: int = 2, seed: int = 0, prompt_chars: int = 400,
        overhead_repeats: int = 3, shared_pool: bool = True, log=print) -> dict:
    """Every load for every speculation setting; the report (see the module doc)."""
    url = check_loopback(url)
    model = asyncio.run(_model(url))
    prompts = file_prompts(prompts_file, requests) if prompts_file else code_prompts(requests, seed, prompt_chars)
    result = {"url": url, "model": model, "endpoint": endpoint, "requests": requests, "max_tokens": max_tokens,
              "ignore_eos": ignore_eos, "slo_ms": slo or {}, "runs": []}

    def record(load, spec, m):
        m["goodput"] = goodput(m.pop("_records"), m["duration_s"], slo or {})
        m.update(load=load, speculation=spec)
        result["runs"].append(m)
        log(f"{load:<16} speculation {spec}: {m['output_throughput']:.1f} tok/s, TPOT p50 "
            f"{m['tpot_ms']['median'] or 0:.2f} ms, TTFT p50 {m['ttft_ms']['median'] or 0:.1f} ms, "
            f"{m['completed']} ok / {m['failed']} failed" + (f" ({m['errors'][0]})" if m["errors"] else ""))

    common = dict(max_duration=max_duration, timeout=timeout, ignore_eos=ignore_eos, seed=seed)
    for spec in speculations:  # warm the server for every setting (sessions, the adaptive policy's costs)
        asyncio.run(run_load(url, endpoint, model, prompts[:warmup], max_tokens, spec, concurrency=1, **common))
    top: dict = {}
    for c in concurrency:
        for spec in speculations:
            m = asyncio.run(run_load(url, endpoint, model, prompts, max_tokens, spec, concurrency=c, **common))
            top[spec] = m["request_throughput"]
            record(f"concurrency={c}", spec, m)
    for rate in list(rates) + [f * min(top.values()) for f in rate_fraction if top]:
        for spec in speculations:
            m = asyncio.run(run_load(url, endpoint, model, prompts, max_tokens, spec, rate=rate, **common))
            record(f"poisson={rate:.2f}/s", spec, m)
    if engine_out_dir:
        # the server's overhead: server and in-process engine at concurrency 1, in back-to-back pairs (a
        # busy machine drifts; a pair sees the same drift), the median of the pairs' ratios
        base = {}
        for spec in speculations:
            pairs = []
            for rep in range(overhead_repeats):
                served = next((r for r in result["runs"] if r["load"] == "concurrency=1" and r["speculation"] == spec),
                              None) if rep == 0 else None
                if served is None:
                    served = asyncio.run(run_load(url, endpoint, model, prompts, max_tokens, spec, concurrency=1,
                                                  **common))
                e = engine_baseline(engine_out_dir, prompts, max_tokens, spec, threads, ignore_eos, shared_pool)
                pairs.append({"server_tok_s": served["output_throughput"], "engine_tok_s": e["output_throughput"],
                              "ratio": served["output_throughput"] / e["output_throughput"]})
            e["pairs"] = pairs
            e["server_overhead_ratio"] = float(np.median([p_["ratio"] for p_ in pairs]))
            base[str(spec)] = e
            log(f"engine alone, speculation {spec}: {e['output_throughput']:.1f} tok/s; server / engine = "
                f"{e['server_overhead_ratio']:.3f} (median of {len(pairs)} back-to-back pairs)")
        result["engine_baseline"] = base
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--mixed" in argv:  # the mixed load (greedy checked, sampled, cancelled, bad, slow): graphs/serve/soak.py
        from graphs.serve.soak import main as mixed

        return mixed([a for a in argv if a != "--mixed"])
    ap = argparse.ArgumentParser(prog="python -m graphs.serve.loadgen", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                    help="/v1/completions, or /v1/chat/completions with the prompt as one user message")
    ap.add_argument("--speculation", nargs="+", default=["adaptive", "off"],
                    help="settings side by side (sent per request; 'default': the server's)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16], help="closed-loop levels")
    ap.add_argument("--rate", type=float, nargs="*", default=[], help="Poisson rates (req/s)")
    ap.add_argument("--rate-fraction", type=float, nargs="*", default=[0.9],
                    help="Poisson rates as fractions of the highest closed loop's request throughput")
    ap.add_argument("--requests", type=int, default=64, help="requests per load")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--prompts", help="text prompts (one per line) or JSONL with 'prompt'; default: stdlib code")
    ap.add_argument("--prompt-chars", type=int, default=400, help="characters of each built-in prompt at most")
    ap.add_argument("--keep-eos", action="store_true", help="stop at eos (default: ignore_eos, fixed lengths)")
    ap.add_argument("--goodput", nargs="*", default=["ttft:1000", "tpot:50"], help="SLOs in ms: ttft: tpot: e2el:")
    ap.add_argument("--max-duration", type=float, default=300, help="seconds per load at most")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per request at most")
    ap.add_argument("--engine-baseline", metavar="OUT_DIR",
                    help="also run the export on an in-process engine (default: not run)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads of --engine-baseline")
    ap.add_argument("--baseline-pool", choices=["shared", "per-session"], default="shared",
                    help="ONNX Runtime pools of --engine-baseline: shared, as the server's, or one per session")
    ap.add_argument("--overhead-repeats", type=int, default=3,
                    help="server/engine pairs at concurrency 1 for --engine-baseline (their median ratio)")
    ap.add_argument("--seed", type=int, default=0, help="prompts and Poisson arrivals")
    ap.add_argument("--json", help="write the report here (default: printed only)")
    ap.add_argument("--png", help="draw the report here, with matplotlib (default: not drawn)")
    a = ap.parse_args(argv)
    if a.requests < 1 or a.max_tokens < 1 or any(c < 1 for c in a.concurrency):
        raise SystemExit("error: --requests, --max-tokens and --concurrency must be >= 1")
    specs = [None if s == "default" else s for s in a.speculation]
    result = run(a.url, specs, a.concurrency, a.rate, a.rate_fraction, a.requests, a.max_tokens, a.endpoint,
                 a.prompts, a.max_duration, a.timeout, parse_slo(a.goodput), not a.keep_eos, a.engine_baseline,
                 a.threads, seed=a.seed, prompt_chars=a.prompt_chars, overhead_repeats=a.overhead_repeats,
                 shared_pool=a.baseline_pool == "shared")
    print(_table(result["runs"]))
    write_report(result, a.json, a.png, draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
