"""Generate text from an export directory with the ONNX Runtime decoder (streams as it goes).

    python -m exporter.generate out_dir --prompt "def main(" [--max-new-tokens 64] [--temperature 0]
    python -m exporter.generate out_dir --chat "What is DNA?" [--system "Answer briefly."]

Runs :func:`graphs.load` (no torch needed at run time). Unset options take the export's
``generation_config.json`` values (as HF's ``generate`` does), else the defaults; the first line on
stderr says what was used and where it came from. Prints the text as tokens are accepted, then one
stats line (mean accepted length, tokens/s, time in draft / verify / host code).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

FROM_CONFIG = "default: generation_config.json's, else"


def main(argv=None) -> int:
    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="an export directory (holds manifest.json)")
    given = ap.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="prompt text, as it is (one of --prompt and --chat is required; default: none)")
    given.add_argument("--chat", help="a user message, rendered with the export's chat template (default: none)")
    ap.add_argument("--system", help="with --chat: a system message (default: the template's own, if any)")
    ap.add_argument("--max-new-tokens", type=int, help=f"new tokens at most ({FROM_CONFIG} 64)")
    ap.add_argument("--do-sample", action=argparse.BooleanOptionalAction,
                    help=f"sample (--do-sample) or decode greedily (--no-do-sample) ({FROM_CONFIG} greedy, "
                         f"or sampling when --temperature > 0 is given)")
    ap.add_argument("--temperature", type=float,
                    help=f"sampling temperature; 0 = greedy (lossless, exact) ({FROM_CONFIG} 1.0 when sampling)")
    ap.add_argument("--top-p", type=float, help=f"nucleus sampling mass ({FROM_CONFIG} 1.0 = off)")
    ap.add_argument("--top-k", type=int, help=f"sample among the k most likely tokens ({FROM_CONFIG} 0 = off)")
    ap.add_argument("--stop", "--stop-strings", dest="stop_strings", action="append",
                    help=f"stop string, repeatable ({FROM_CONFIG} none)")
    ap.add_argument("--eos-token-id", type=int, action="append",
                    help="end-of-sequence id, repeatable (default: the manifest's, from generation_config.json)")
    ap.add_argument("--seed", type=int, help="sampling seed (default: none, fresh entropy)")
    ap.add_argument("--mode", choices=["auto", "speculative", "autoregressive"], default="auto",
                    help="auto = speculative when the export has a drafter")
    ap.add_argument("--tree", help="tree JSON: Medusa paths, or EAGLE {topk, depth, total_tokens} "
                                   "(default: the manifest's)")
    ap.add_argument("--acceptance", choices=["lossless", "typical"], default="lossless",
                    help="when sampling: lossless rejection sampling, or Medusa's typical acceptance")
    ap.add_argument("--provider", choices=["auto", "cuda", "cpu"], default="auto",
                    help="ONNX Runtime execution provider (auto: CUDA when onnxruntime-gpu sees a GPU)")
    ap.add_argument("--device-id", type=int, default=0, help="which GPU, with the CUDA provider (default: 0)")
    ap.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")
    ap.add_argument("--json", help="write the result and stats as JSON to this file (default: none)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)

    def body():
        from exporter.cli import check_output
        from exporter.errors import UserError

        if args.json:
            check_output(args.json, "--json", args.out_dir)
        if args.system is not None and args.chat is None:
            raise UserError("--system needs --chat (a system message goes through the chat template)")
        from graphs.params import GenerationParams
        from graphs.sessions import use_shared_thread_pool

        names = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "stop_strings", "eos_token_id",
                 "seed", "mode", "tree", "acceptance")
        params = GenerationParams(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})
        use_shared_thread_pool(args.threads)  # one ORT pool for base, draft and K/V sessions
        import graphs

        decoder = graphs.load(args.out_dir, provider=args.provider, threads=args.threads, device_id=args.device_id)
        if decoder.tokenizer is None:
            raise UserError(f"{args.out_dir} has no tokenizer.json; use graphs.load(...).generate(token_ids)")
        used = decoder.resolve(params)
        prompt = args.prompt if args.chat is None else chat_prompt(args.out_dir, args.chat, args.system)
        events = decoder.stream(prompt, params)
        first = next(events)  # the run checks prompt, tree, ... here: an error is the only line printed
        print(f"[generation: {used.describe()}]", file=sys.stderr, flush=True)
        if args.chat is None:  # a chat answer prints alone, without the rendered template
            sys.stdout.write(args.prompt)
        tokens, text, stats, finish = [], [], None, None
        for event in itertools.chain([first], events):
            tokens += event.token_ids
            text.append(event.text)
            sys.stdout.write(event.text)
            sys.stdout.flush()
            finish = event.finish_reason or finish
            stats = event.stats or stats
        sys.stdout.write("\n")
        print(
            f"[{len(tokens)} tokens ({finish}), {stats.tokens_per_s:.1f} tok/s, mean accepted length "
            f"{stats.mean_accepted_length:.2f}; draft {stats.time_draft:.3f} s, verify {stats.time_verify:.3f} s, "
            f"host {stats.time_host:.3f} s, prefill {stats.time_prefill:.3f} s]",
            file=sys.stderr,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"prompt": prompt, "token_ids": tokens, "text": "".join(text), "finish_reason": finish,
                           "generation": {k: v for k, v in vars(used).items() if k not in ("tree", "sources")},
                           "stats": stats.to_json()}, f, indent=2)
        return 0

    return run_cli(body, debug=args.debug)


def chat_prompt(out_dir, message: str, system: str | None = None) -> str:
    """``message`` (and ``system``) rendered with the export's chat template, ready to generate from."""
    from exporter.errors import UserError
    from graphs.chat import ChatTemplate

    template = ChatTemplate.from_export(out_dir)
    if template is None:
        raise UserError(f"{out_dir} has no chat template (chat_template.jinja or tokenizer_config.json's "
                        f"chat_template); use --prompt with the text as the model expects it")
    pre = [{"role": "system", "content": system}] if system is not None else []
    return template.render([*pre, {"role": "user", "content": message}], add_generation_prompt=True)


if __name__ == "__main__":
    sys.exit(main())
