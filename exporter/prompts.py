"""Prompts: the one reader of a prompts file, and the built-in sets.

A prompts file is read here for every command that takes one (``bench --prompts-file``, ``tune
--prompts``): a text file holds one prompt per line (``\\n`` inside a line stands for a newline); a
JSONL file (``.jsonl``, or every line a JSON object) holds ``{"prompt": "..."}`` or
``{"messages": [...]}`` per line, with an optional ``"category"`` (reports group by it); a JSON list
of strings holds one prompt per entry. Chat
``messages`` are rendered by the benchmark (:mod:`exporter.benchmark.prompts`), which has the chat
template.
"""

from __future__ import annotations

import json
from pathlib import Path

from exporter.errors import UserError

# Python snippets: the demo model is trained on the standard library's source (bench, compare --e2e)
DEFAULT_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(",
    "class Config:\n    def __init__(self, ",
    "    for name, value in ",
    "def _parse(self, text):\n    ",
    "        if not isinstance(",
    "    return ",
    "# Copyright",
    "from collections import ",
]
# The tuner's calibration set (python -m exporter.tune without --prompts)
TUNE_PROMPTS = [
    "def main(",
    "import os\nimport sys\n\n",
    "class Config:\n    def __init__(self",
    "    for i in range(",
    "The quick brown fox",
    "if __name__ == \"__main__\":\n",
]


def read_prompt_file(path, flag: str = "--prompts-file") -> list[dict]:
    """Entries of a prompts file: ``{"prompt": str}`` or ``{"messages": list}``, in file order.

    ``flag``: the option that named the file, for the one-line errors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{flag} {path} does not exist (or is not a regular file); pass a text file (one prompt "
                        f"per line), JSONL or a JSON list")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, list) and all(isinstance(x, str) for x in data):
            entries = [{"prompt": x} for x in data if x]
            if not entries:
                raise UserError(f"{flag} {path} holds no prompts")
            for n, e in enumerate(entries, 1):
                _check_text(e["prompt"], path, n)
            return entries
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise UserError(f"{flag} {path} holds no prompts; put one prompt per line (or JSONL)")
    jsonl = path.suffix == ".jsonl" or all(ln.lstrip().startswith("{") for ln in lines)
    if not jsonl:
        return [{"prompt": ln.replace("\\n", "\n")} for ln in lines]
    entries = []
    for n, ln in enumerate(lines, 1):
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg}); JSONL needs one object per line") from None
        cat = {"category": obj["category"]} if isinstance(obj, dict) and isinstance(obj.get("category"), str) else {}
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]:
            entries.append({"prompt": obj["prompt"], **cat})
        elif isinstance(obj, dict) and valid_messages(obj.get("messages")):
            entries.append({"messages": obj["messages"], **cat})
        else:
            raise UserError(f'{path}:{n}: each line needs a non-empty "prompt" string or a "messages" list of '
                            f'{{"role", "content"}} objects')
    for n, e in enumerate(entries, 1):
        _check_text(e.get("prompt") or " ".join(m["content"] for m in e["messages"]), path, n)
    return entries


def _check_text(text: str, path, n: int) -> None:
    """JSON may escape a lone surrogate (``"\\ud800"``): not text a tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{path}:{n}: holds an unpaired surrogate {text[e.start]!r} (an escape such as \\ud800 "
                        f"without its pair); fix the escape or drop the character") from None


def valid_messages(m) -> bool:
    return (isinstance(m, list) and bool(m)
            and all(isinstance(x, dict) and isinstance(x.get("role"), str) and isinstance(x.get("content"), str)
                    for x in m))


def read_prompt_texts(path, flag: str = "--prompts") -> list[str]:
    """Plain text prompts of a prompts file (no chat ``messages``: those need the benchmark's template)."""
    entries = read_prompt_file(path, flag)
    if any("prompt" not in e for e in entries):
        raise UserError(f"{flag} {path}: chat messages are not taken here; give plain prompts")
    return [e["prompt"] for e in entries]
