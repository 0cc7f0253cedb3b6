"""Chat templates rendered without transformers: jinja2's sandbox, as ``apply_chat_template`` does it.

    template = ChatTemplate.from_export(out_dir)          # None when the export has no template
    text = template.render([{"role": "user", "content": "hi"}])   # with the generation prompt

The template comes from the export directory, where transformers saves it: ``chat_template.jinja``
(5.x), ``chat_template.json``, or ``tokenizer_config.json``'s ``chat_template`` (a string, or named
templates of which "default" is taken). The environment is transformers': an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block (rendered as its body), ``raise_exception``, ``strftime_now``
and a ``tojson`` filter; special tokens (``bos_token``, ``eos_token``, ...) are variables.

A hostile template can neither reach Python objects (the sandbox: no attributes starting with ``_``,
no mutation of its arguments) nor run for ever or fill memory: rendering is traced and stopped
after ``time_limit`` seconds, ``*`` and ``**`` refuse results over ``max_chars``, the widths of
``center``/``indent``/``wordwrap``/``truncate``/``tojson(indent)`` are capped at 1024, ``range`` is
the sandbox's (at most 100,000 items), and the output is cut off at ``max_chars`` (a
:class:`TemplateLimitError`). Not covered: ``str.format``/``%`` with a huge field width, one C-level
call that allocates before any check (a template file is the operator's choice; message text is
never template code). Errors are :class:`graphs.errors.InputError` (one line).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path

from graphs.errors import InputError


class TemplateLimitError(InputError):
    """The chat template ran past its time or output-size limit."""


class ChatTemplate:
    def __init__(self, source: str, specials: dict | None = None, time_limit: float = 1.0,
                 max_chars: int = 1 << 20):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source, self.specials = source, dict(specials or {})
        self.time_limit, self.max_chars = float(time_limit), int(max_chars)
        limit = self.max_chars

        class Generation(Extension):  # transformers' AssistantTracker, without the tracking
            tags = frozenset({"generation"})

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.Scope(body, lineno=lineno)

        class Env(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset(["*", "**"])

            def call_binop(self, context, operator, left, right):
                if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                    raise TemplateLimitError(f"chat template: exponent {right} over the limit of 64")
                if operator == "*":
                    for seq, n in ((left, right), (right, left)):
                        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > limit:
                            raise TemplateLimitError(f"chat template: a repetition of {len(seq) * n} items is over "
                                                     f"the output limit of {limit}")
                return super().call_binop(context, operator, left, right)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def width(name, n):  # C-level string builders allocate before any output check: cap their widths
            if isinstance(n, int) and n > 1024:
                raise TemplateLimitError(f"chat template: {name} width {n} is over the limit of 1024")
            return n

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=width("tojson indent", indent),
                              separators=separators, sort_keys=sort_keys)

        env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        for name, arg in (("center", 1), ("indent", 1), ("wordwrap", 1), ("truncate", 1)):
            env.filters[name] = _capped(env.filters[name], name, arg, width)
        self._errors = (jinja2.exceptions.TemplateError, ArithmeticError, TypeError, ValueError, RecursionError)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"the export's chat template does not compile: {e}") from None

    @classmethod
    def from_export(cls, out_dir, **limits) -> ChatTemplate | None:
        """The export's template (see the module doc), or None if it has none."""
        out_dir = Path(out_dir)
        cfg = _read_json(out_dir / "tokenizer_config.json") or {}
        template = cfg.get("chat_template")
        jinja, as_json = out_dir / "chat_template.jinja", out_dir / "chat_template.json"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        elif as_json.is_file():
            template = (_read_json(as_json) or {}).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
        if not isinstance(template, str) or not template:
            return None
        specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(template, specials, **limits)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text of ``messages`` (checked by the caller: role/content dicts). Any thread."""
        deadline = time.perf_counter() + self.time_limit
        out: list[str] = []
        size = 0

        def trace(frame, event, arg):  # stop a template that loops for ever (it is Python code)
            if time.perf_counter() > deadline:
                raise TemplateLimitError(f"chat template ran past its time limit of {self.time_limit:g} s")
            return trace

        context = {**self.specials, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "tools": None, "documents": None, **variables}
        old = sys.gettrace()
        sys.settrace(trace)
        try:
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > self.max_chars:
                    raise TemplateLimitError(f"chat template output is over its limit of {self.max_chars} characters")
                out.append(piece)
        except TemplateLimitError:
            raise
        except self._errors as e:
            raise InputError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        finally:
            sys.settrace(old)
        return "".join(out)


def _capped(f, name: str, index: int, check):
    """Filter ``f`` with its width argument (positional ``index`` after the value, or ``width``) checked."""
    import functools

    @functools.wraps(f)
    def g(*args, **kwargs):
        pos = index + (1 if args and hasattr(args[0], "environment") else 0)  # pass_environment/pass_eval_context
        if len(args) > pos:
            check(name, args[pos])
        if "width" in kwargs:
            check(name, kwargs["width"])
        if name == "truncate" and "length" in kwargs:
            check(name, kwargs["length"])
        return f(*args, **kwargs)

    return g


def _read_json(path: Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON ({e}); re-export the model") from None


def _token_text(tok) -> str:
    if isinstance(tok, dict):  # AddedToken serialised
        return tok.get("content", "")
    return tok if isinstance(tok, str) else ""


__all__ = ["ChatTemplate", "TemplateLimitError"]
