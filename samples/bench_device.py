"""The device path (graphs.device) against the host path (graphs.host) on one export, interleaved.

    python samples/bench_device.py OUT [--tokens 200] [--runs 5] [--threads 1] [--batch 1]
        [--speculation off,on] [--json docs/device-bench.json]

Both decoders load the same optimized export on the CPU EP (``device_resident=True`` for the device
path: OrtValue K/V, the selection and compaction graphs); each round runs one request batch on each
path in turn (the order alternating round by round), so the machine's slow phases fall on both
alike. Per setting: tokens/s of the decode (prefill excluded) per path, the device / host ratio per
round (the median reported), and the bytes each path brings to the host per engine step:

    host path    every output of every base call lands in host memory (logits rows x width x vocab,
                 features), counted from the verify / plain-step outputs, plus Medusa's top-k ids
    device path  DeviceExecutor.host_bytes: the selection's argmax + flags, the rows fetched
                 (features at the accepted node, a sampled row's logits), the heads' top-k ids
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _count_host(dec, box: list) -> None:
    """Count what the host path's base calls bring back (their outputs, host arrays)."""
    from graphs import host

    def outs(out):
        return sum(v.nbytes for k, v in out.items() if not k.startswith("present."))

    def wrap(cls, name, fn):
        orig = getattr(cls, name)

        def f(self, *a, **k):
            got = orig(self, *a, **k)
            box[0] += fn(got)
            return got

        setattr(cls, name, f)

    wrap(host.HostExecutor, "verify", outs)
    wrap(host.HostExecutor, "draft_heads", lambda ids: ids.nbytes)
    wrap(host._BoundRun, "step", outs)
    orig_again = host._BoundRun.__init__

    def init(self, *a, **k):  # (`again` is the bound call's own, set per run)
        orig_again(self, *a, **k)
        again = self.again

        def counted():
            got = again()
            box[0] += outs(got)
            return got

        self.again = counted

    host._BoundRun.__init__ = init


def run_once(dec, prompts, tokens: int, speculation: str, host_box=None) -> dict:
    from graphs.engine import EngineConfig

    eng = dec.engine(EngineConfig(max_batch=len(prompts), max_len=max(len(p) for p in prompts) + tokens + 8))
    for p in prompts:
        eng.add_request(p, max_new_tokens=tokens, speculation=speculation)
    eng.step()  # the prefills
    ex = eng.ex
    b0 = ex.host_bytes if host_box is None else host_box[0]
    steps, new, t = 0, 0, time.perf_counter()
    while eng.has_pending_requests():
        events = eng.step()
        steps += 1
        new += sum(len(e.token_ids) for e in events)
    wall = time.perf_counter() - t
    b1 = ex.host_bytes if host_box is None else host_box[0]
    return {"tokens_per_s": new / wall, "bytes_per_step": (b1 - b0) / max(steps, 1), "steps": steps, "tokens": new}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--speculation", default="off,on")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import graphs
    from graphs.sessions import use_shared_thread_pool

    use_shared_thread_pool(args.threads)
    host = graphs.load(args.out, provider="cpu", threads=args.threads)
    dev = graphs.load(args.out, provider="cpu", threads=args.threads, device_resident=True)
    for d in (host, dev):
        d.eos = set()
    box = [0]
    _count_host(host, box)
    prompts = [list(range(3 + b, 40 + b)) for b in range(args.batch)]
    result = {"out": str(args.out), "tokens": args.tokens, "runs": args.runs, "threads": args.threads,
              "batch": args.batch, "vocab": host.manifest.source["vocab_size"], "settings": {}}
    for spec in args.speculation.split(","):
        rows = {"host": [], "device": [], "ratio": []}
        for r in range(args.runs + 1):  # the first round warms up
            order = [("host", host), ("device", dev)] if r % 2 == 0 else [("device", dev), ("host", host)]
            got = {}
            for name, d in order:
                got[name] = run_once(d, prompts, args.tokens, spec, box if name == "host" else None)
            if r == 0:
                continue
            rows["host"].append(got["host"])
            rows["device"].append(got["device"])
            rows["ratio"].append(got["device"]["tokens_per_s"] / got["host"]["tokens_per_s"])
        summary = {
            "ratio_median": statistics.median(rows["ratio"]),
            "ratios": rows["ratio"],
            "host_tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in rows["host"]),
            "device_tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in rows["device"]),
            "host_bytes_per_step": statistics.median(x["bytes_per_step"] for x in rows["host"]),
            "device_bytes_per_step": statistics.median(x["bytes_per_step"] for x in rows["device"]),
            "steps": rows["device"][0]["steps"],
        }
        result["settings"][spec] = summary
        rounds = ", ".join(f"{x:.2f}" for x in rows["ratio"])
        print(f"speculation {spec}: device/host tokens/s median {summary['ratio_median']:.3f} (rounds {rounds}); "
              f"host {summary['host_tokens_per_s_median']:.0f} tok/s, device "
              f"{summary['device_tokens_per_s_median']:.0f} tok/s; bytes/step host "
              f"{summary['host_bytes_per_step']:.0f}, device {summary['device_bytes_per_step']:.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
