"""Generate text from an export directory with the ONNX Runtime decoder (streams as it goes).

    python -m exporter.generate out_dir --prompt "def main(" [--max-new-tokens 64] [--temperature 0]

Runs :func:`graphs.load` (no torch needed at run time); prints the text as tokens are accepted,
then one stats line (mean accepted length, tokens/s, time in draft / verify / host code).
"""

from __future__ import annotations

import json
import sys


def main(argv=None) -> int:
    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="an export directory (holds manifest.json)")
    ap.add_argument("--prompt", required=True, help="prompt text")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless, exact)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--stop", action="append", help="stop string (repeatable)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--mode", choices=["auto", "speculative", "autoregressive"], default="auto")
    ap.add_argument("--tree", help="tree JSON: Medusa paths, or EAGLE {topk, depth, total_tokens}")
    ap.add_argument("--acceptance", choices=["lossless", "typical"], default="lossless")
    ap.add_argument("--provider", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the result and stats as JSON to this file")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)

    def body():
        from exporter.loading import UserError
        from graphs.sessions import use_shared_thread_pool

        use_shared_thread_pool(args.threads)  # one ORT pool for base, draft and K/V sessions
        import graphs

        decoder = graphs.load(args.out_dir, provider=args.provider, threads=args.threads)
        kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, stop=args.stop, seed=args.seed, mode=args.mode, tree=args.tree,
                      acceptance=args.acceptance)
        if decoder.tokenizer is None:
            raise UserError(f"{args.out_dir} has no tokenizer.json; use graphs.load(...).generate(token_ids)")
        sys.stdout.write(args.prompt)
        tokens, text = [], []
        for event in decoder.stream(args.prompt, **kwargs):
            tokens += event.token_ids
            text.append(event.text)
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        # the stats of a streamed run: generate() again would double the work, so keep the last
        stats = decoder.last_stats
        print(
            f"[{len(tokens)} tokens, {stats.tokens_per_s:.1f} tok/s, mean accepted length "
            f"{stats.mean_accepted_length:.2f}; draft {stats.time_draft:.3f} s, verify {stats.time_verify:.3f} s, "
            f"host {stats.time_host:.3f} s, prefill {stats.time_prefill:.3f} s]",
            file=sys.stderr,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"prompt": args.prompt, "token_ids": tokens, "text": "".join(text),
                           "stats": stats.to_json()}, f, indent=2)
        return 0

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
