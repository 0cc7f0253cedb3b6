"""Host time of the engine's decode steps: wall time of ``Engine.step`` less the time inside ONNX
Runtime's calls (the Python around the graphs: the policy, bookkeeping, acceptance, text).

    python samples/bench_host.py OUT [--speculation off|on|adaptive] [--tokens 300] [--runs 5]
        [--plain-run-s 0,0.01]

One request at a time (prefill excluded); per run and per ``--plain-run-s`` value (the engine's
``EngineConfig.plain_run_s``: autoregressive steps run in a row within one ``Engine.step``; the
values take turns within each run, so that the machine's slow phases fall on each alike): the host
time per token and its share of the decode time, tokens/s, and the tokens each ``Engine.step``
emitted. Compare two checkouts by running each in turn, alternating (PYTHONPATH=that checkout):
the machine's noise is larger than one run.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="an export directory (python -m exporter.export / optimize)")
    ap.add_argument("--speculation", default="off", choices=["off", "on", "adaptive"])
    ap.add_argument("--tokens", type=int, default=300, help="new tokens per request")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plain-run-s", default=None,
                    help="comma-separated EngineConfig.plain_run_s values to compare (default: the engine's)")
    args = ap.parse_args(argv)

    import graphs
    from graphs.engine import EngineConfig
    from graphs.sessions import Session, use_shared_thread_pool

    inside = [0.0]
    for name in ("run", "run_with_iobinding"):  # every graph call of the runtime goes through Session
        setattr(Session, name, _timed(getattr(Session, name), inside))
    use_shared_thread_pool(args.threads)
    dec = graphs.load(args.out, provider="cpu", threads=args.threads)
    dec.eos = set()  # every request runs its full length
    runs = [None] if args.plain_run_s is None else [float(x) for x in args.plain_run_s.split(",")]
    max_len = min(args.tokens + 64, dec.max_positions)
    engines = {r: dec.engine(EngineConfig(max_batch=1, max_len=max_len,
                                          **({} if r is None else {"plain_run_s": r}))) for r in runs}
    prompt = list(range(3, 40))
    for r in range(args.runs + 1):  # the first run warms up
        for run_s, engine in engines.items():
            engine.add_request(prompt, max_new_tokens=args.tokens - 40, speculation=args.speculation)
            engine.step()  # prefill
            host, calls, tokens, wall = 0.0, 0, 0, 0.0
            while engine.has_pending_requests():
                inside[0] = 0.0
                t = time.perf_counter()
                events = engine.step()
                dt = time.perf_counter() - t
                wall += dt
                host += dt - inside[0]
                calls += 1
                tokens += sum(len(e.token_ids) for e in events)
            if r:
                label = "" if run_s is None else f" plain_run_s={run_s:g}"
                print(f"run {r}{label}: host {host / tokens * 1e6:.1f} us a token ({host / wall:.1%} of decode), "
                      f"{tokens / wall:.0f} tok/s, {tokens / calls:.2f} tokens a step")


def _timed(call, inside: list):
    def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return call(self, *a, **k)
        finally:
            inside[0] += time.perf_counter() - t
    return timed


if __name__ == "__main__":
    main()
