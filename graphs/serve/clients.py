"""What the load generators share (:mod:`graphs.serve.loadgen`, :mod:`graphs.serve.soak`): the
loopback-only check and the built-in prompts."""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def code_prompts(n: int, seed: int = 0, max_chars: int = 400) -> list[str]:
    """Slices of 2-12 lines of the standard library's source (what the demo and 19M models learned)."""
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size > 20000)[:40]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        lines = files[rng.randrange(len(files))].read_text(errors="replace").splitlines()
        i = rng.randrange(max(1, len(lines) - 12))
        text = "\n".join(lines[i : i + rng.randint(2, 12)])
        if text.strip():
            out.append(text[:max_chars] + "\n")
    return out


def check_loopback(url: str) -> str:
    p = urlparse(url)
    if p.scheme not in ("http", "https") or p.hostname not in LOOPBACK:
        raise SystemExit(f"error: the load generator only targets loopback (127.0.0.1, ::1, localhost); got {url}")
    return url.rstrip("/")


def write_report(report: dict, json_path: str | None, png_path: str | None, draw, indent: int = 2) -> None:
    """The run's JSON and PNG where asked (their directories made)."""
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=indent) + "\n")
    if png_path:
        Path(png_path).parent.mkdir(parents=True, exist_ok=True)
        draw(report, png_path)

