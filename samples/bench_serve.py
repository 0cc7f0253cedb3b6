"""The server under load, speculation adaptive vs off side by side: the issue's "must show" run.

    python samples/bench_serve.py M19_ONNX --json runs/serve.json --png runs/serve.png
    python samples/bench_serve.py spec-demo/onnx --requests 32 --max-tokens 64

Starts ``python -m graphs.serve OUT_DIR --threads 2`` on a free loopback port, runs the load
generator (graphs.serve.loadgen: closed loop at concurrency 1, 4 and 16, then Poisson arrivals at
0.9x the highest closed loop's request rate, adaptive and off per request, greedy, ``ignore_eos``),
runs the same requests on an in-process engine for the server's overhead, stops the server, and
checks the goals:

    TPOT at concurrency 1, adaptive / off            <= 0.67   (1.5x faster per token)
    output tokens/s at concurrency 16, adaptive / off >= 0.97
    server tokens/s / engine tokens/s at concurrency 1 >= 0.95 (speculation off: the server's own cost)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from graphs.serve import loadgen  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the server was not ready in {timeout} s")


def goals(result: dict) -> dict:
    runs = {(r["load"], r["speculation"]): r for r in result["runs"]}
    out = {}
    a, o = runs.get(("concurrency=1", "adaptive")), runs.get(("concurrency=1", "off"))
    if a and o:
        out["tpot_c1_adaptive_over_off"] = {"value": a["tpot_ms"]["median"] / o["tpot_ms"]["median"], "goal": "<= 0.67"}
    a, o = runs.get(("concurrency=16", "adaptive")), runs.get(("concurrency=16", "off"))
    if a and o:
        out["tok_s_c16_adaptive_over_off"] = {"value": a["output_throughput"] / o["output_throughput"],
                                              "goal": ">= 0.97"}
    base = result.get("engine_baseline", {}).get("off", {})
    if "server_overhead_ratio" in base:
        out["server_over_engine_c1_off"] = {"value": base["server_overhead_ratio"], "goal": ">= 0.95"}
    for g in out.values():
        op, x = g["goal"].split()
        g["met"] = g["value"] <= float(x) if op == "<=" else g["value"] >= float(x)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out_dir", help="an export directory")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads of the server (and the baseline)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="closed-loop levels")
    ap.add_argument("--rate-fraction", type=float, nargs="*", default=[0.9], help="Poisson rates (x saturation)")
    ap.add_argument("--requests", type=int, default=48, help="requests per load")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--max-running", type=int, default=16, help="the server's --max-running")
    ap.add_argument("--json", help="the report (default: printed only)")
    ap.add_argument("--png", help="the chart (default: not drawn)")
    a = ap.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.devnull, "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "graphs.serve", a.out_dir, "--port", str(port), "--threads",
                             str(a.threads), "--max-running", str(a.max_running), "--max-queue", "256",
                             "--log-level", "warning"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        result = loadgen.run(url, ["adaptive", "off"], a.concurrency, [], a.rate_fraction, a.requests, a.max_tokens,
                             slo={"ttft": 1000, "tpot": 50}, engine_out_dir=a.out_dir, threads=a.threads)
    finally:
        proc.terminate()
        proc.wait(30)
    result["out_dir"], result["threads"] = str(a.out_dir), a.threads
    result["goals"] = goals(result)
    print(loadgen._table(result["runs"]))
    for name, g in result["goals"].items():
        print(f"{name}: {g['value']:.3f} (goal {g['goal']}: {'met' if g['met'] else 'NOT met'})")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    if a.png:
        Path(a.png).parent.mkdir(parents=True, exist_ok=True)
        loadgen.draw(result, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
