"""Long chat prompts for ``exporter.bench --prompts-file``: a question over ~N tokens of text.

    python samples/long_prompts.py --tokens 2048 --count 4 --out runs/long-2k.jsonl

The text is the Python standard library's own module documentation (every machine has it), cut to
about ``--tokens`` tokens at ~4 characters a token; each prompt asks to summarize or answer about a
different module's documentation (category ``long``), so a bench can measure decoding at that context.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

MODULES = ["argparse", "collections", "json", "pathlib", "subprocess", "threading", "logging", "datetime",
           "unittest", "asyncio", "functools", "itertools"]
ASKS = ["Summarize the documentation above in a few sentences.",
        "What is this module for? Answer briefly.",
        "List the three most important things this documentation says."]


def long_text(first: int, chars: int) -> str:
    """Module documentation from ``MODULES[first]`` on (the next modules where one runs short)."""
    parts: list[str] = []
    for k in range(len(MODULES)):
        mod = importlib.import_module(MODULES[(first + k) % len(MODULES)])
        parts.append(mod.__doc__ or "")
        for name in sorted(dir(mod)):
            doc = getattr(getattr(mod, name, None), "__doc__", None)
            if isinstance(doc, str) and not name.startswith("_"):
                parts.append(f"{name}: {doc.strip()}")
            if sum(map(len, parts)) > chars:
                return "\n\n".join(parts)[:chars]
    return "\n\n".join(parts)[:chars]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="about this many tokens of text per prompt")
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = []
    for i in range(args.count):
        text = long_text(i, 4 * args.tokens)
        rows.append({"messages": [{"role": "user", "content": f"{text}\n\n{ASKS[i % len(ASKS)]}"}],
                     "category": "long"})
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


if __name__ == "__main__":
    main()
