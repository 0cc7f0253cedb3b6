"""Benchmark prompts: a file of the user's own (read by :mod:`exporter.prompts`), or the built-in set.

Chat ``messages`` go through the export's chat template (``chat_template.jinja`` or
``tokenizer_config.json``'s ``chat_template``), rendered with jinja2's sandbox exactly as
``transformers``' ``apply_chat_template`` does, so the runtime side needs no transformers.

Every system is fed the same token ids: the prompts are tokenized here, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporter.errors import UserError
from exporter.prompts import DEFAULT_PROMPTS, read_prompt_file


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # None for random-id prompts (an export without a tokenizer)
    source: str  # "builtin" | "chat" | "prompt" | "messages" | "random"
    category: str = ""  # what reports group by (the built-in chat set's categories, a file's "category")


def load_chat_template(out_dir) -> tuple[str, dict]:
    """(template source, special tokens) from the export, or a UserError naming what is missing."""
    out_dir = Path(out_dir)
    cfg = {}
    tc = out_dir / "tokenizer_config.json"
    if tc.is_file():
        try:
            cfg = json.loads(tc.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{tc} is not valid JSON ({e}); re-export the model") from None
    # where transformers saves it: chat_template.jinja (5.x), chat_template.json, tokenizer_config.json
    jinja, as_json = out_dir / "chat_template.jinja", out_dir / "chat_template.json"
    template = cfg.get("chat_template")
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    elif as_json.is_file():
        try:
            template = json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise UserError(f"{as_json} is not valid JSON ({e}); re-export the model") from None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise UserError(f"the prompts file has chat messages but {out_dir} has no chat template "
                        f"(chat_template.jinja/.json or tokenizer_config.json's chat_template); export a model whose "
                        f"tokenizer has one, or use plain prompts")
    specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return template, specials


def has_chat_template(out_dir) -> bool:
    try:
        load_chat_template(out_dir)
    except UserError:
        return False
    return True


def _token_text(tok) -> str:
    if isinstance(tok, dict):  # AddedToken serialised
        return tok.get("content", "")
    return tok if isinstance(tok, str) else ""


def render_chat(template: str, messages: list[dict], specials: dict) -> str:
    """The chat template rendered with a generation prompt, as transformers renders it.

    Hand-written on jinja2 because transformers (which owns ``apply_chat_template``) is not a
    runtime dependency; the environment matches transformers': sandboxed, trim_blocks,
    lstrip_blocks, ``raise_exception`` and ``tojson`` helpers."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **specials)
    except TemplateError as e:
        raise UserError(f"the export's chat template failed on a prompt's messages: {e}") from None


def build_prompts(out_dir, tokenizer, prompts_file=None, count: int | None = None, seed: int = 0,
                  vocab_size: int | None = None, banned=frozenset()) -> list[Prompt]:
    """The prompts of one benchmark run, tokenized once for every system.

    Without a file: the held-out chat prompts (:mod:`exporter.chat_prompts`, 2 per category) where
    the export has a chat template, else 8 built-in Python snippets. ``count``: how many (cycling
    through the file or the built-in set); default: all of the file, or the built-in set's."""
    if count is not None and count < 1:
        raise UserError(f"--prompts must be >= 1, got {count}")
    if prompts_file is not None:
        entries = read_prompt_file(prompts_file)
        if tokenizer is None:
            raise UserError(f"{out_dir} has no tokenizer.json, so text prompts cannot be tokenized; "
                            f"export the model with its tokenizer")
        chat = None
        out = []
        for e in entries:
            if "messages" in e:
                chat = chat or load_chat_template(out_dir)
                text = render_chat(chat[0], e["messages"], chat[1])
                ids = tokenizer.encode(text, add_special_tokens=False).ids  # the template holds the specials
                out.append(Prompt(ids, text, "messages", e.get("category", "")))
            else:
                out.append(Prompt(tokenizer.encode(e["prompt"]).ids, e["prompt"], "prompt", e.get("category", "")))
        empty = [i for i, p in enumerate(out) if not p.ids]
        if empty:
            raise UserError(f"prompt {empty[0] + 1} of {prompts_file} is empty after tokenization")
        n = len(out) if count is None else count
        return [out[i % len(out)] for i in range(n)]
    if tokenizer is not None and has_chat_template(out_dir):  # a chat model: the held-out chat prompts
        from exporter.chat_prompts import CATEGORIES, heldout

        template, specials = load_chat_template(out_dir)
        chats = heldout(2 if count is None else -(-count // len(CATEGORIES)))
        chats = chats if count is None else [chats[i % len(chats)] for i in range(count)]
        out = []
        for c in chats:
            text = render_chat(template, c.messages(), specials)
            out.append(Prompt(tokenizer.encode(text, add_special_tokens=False).ids, text, "chat", c.category))
        return out
    n = 8 if count is None else count
    if tokenizer is not None:
        texts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(n)]
        return [Prompt(tokenizer.encode(t).ids, t, "builtin") for t in texts]
    rng = np.random.default_rng(seed)  # no tokenizer: random ids, as the graphs see any prompt
    out = []
    for _ in range(n):
        ids = [int(t) for t in rng.integers(0, vocab_size, size=int(rng.integers(4, 16))) if int(t) not in banned]
        out.append(Prompt(ids or [3], None, "random"))
    return out
