"""An innocent request's latency beside hostile ones (issue 39: "within 2x of its unloaded latency").

    python samples/bench_hostile.py OUT --rounds 5 --json runs/hostile.json

Starts ``python -m graphs.serve OUT`` on a free 127.0.0.1 port, then, ``--rounds`` times each and
alternating: a 32-token greedy completion alone, and the same completion sent while 8 clients post
1 MB prompts, 4 post 2 MiB bodies, 4 post 30,000-message chats and 8 post long chats (as
tests/test_serve_hostile.py does). Reports the median latency of each and their ratio. A benchmark,
not a test: the ratio depends on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(argv=None) -> dict:
    import httpx
    from serve_helpers import Server

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    hostile = ([("/v1/completions", {"prompt": "x" * 1_000_000, "max_tokens": 4})] * 8
               + [("/v1/completions", {"prompt": "x" * (2 << 20), "max_tokens": 4})] * 4
               + [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 30_000})] * 4
               + [("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 1000}] * 60})] * 8)
    innocent = {"prompt": args.prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    alone, beside, statuses = [], [], []
    with tempfile.TemporaryDirectory() as tmp, Server(Path(args.out_dir), Path(tmp)) as s:
        def post(path, body):
            return httpx.post(s.url + path, content=json.dumps(body).encode(), timeout=120,
                              headers={"Content-Type": "application/json"}).status_code

        post("/v1/completions", innocent)  # warm-up
        for r in range(args.rounds):
            for loaded in ((False, True) if r % 2 == 0 else (True, False)):
                with ThreadPoolExecutor(len(hostile) + 1) as pool:
                    refused = [pool.submit(post, *item) for item in hostile] if loaded else []
                    t0 = time.perf_counter()
                    status = post("/v1/completions", innocent)
                    dt = time.perf_counter() - t0
                    statuses += [f.result() for f in refused]
                assert status == 200
                (beside if loaded else alone).append(dt)
    report = {"alone_s": alone, "beside_hostile_s": beside, "median_alone_s": statistics.median(alone),
              "median_beside_s": statistics.median(beside),
              "ratio": statistics.median(beside) / statistics.median(alone),
              "hostile_statuses": {str(k): statuses.count(k) for k in sorted(set(statuses))}}
    print(f"innocent request: {report['median_alone_s'] * 1e3:.0f} ms alone, {report['median_beside_s'] * 1e3:.0f} ms "
          f"beside {len(hostile)} hostile requests ({report['ratio']:.2f}x); hostile: {report['hostile_statuses']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
