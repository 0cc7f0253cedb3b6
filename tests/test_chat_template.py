"""graphs.chat: chat templates rendered as transformers renders them, and hostile ones contained.

Equality with transformers' own ``apply_chat_template`` on real template features (loop controls,
``tojson``, ``raise_exception``, the ``{% generation %}`` block, special tokens); then templates that
try to reach Python objects, loop for ever, or blow up their output: each is one InputError, in
bounded time.
"""

from __future__ import annotations

import json

import pytest

from graphs.chat import ChatTemplate, TemplateLimitError
from graphs.errors import InputError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \"there\" é"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]

TEMPLATES = {
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "loopcontrols": ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                     "[{{ m.role }}] {{ m.content | tojson }}\n{% if loop.index > 3 %}{% break %}{% endif %}"
                     "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"),
    "generation": ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                   "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ eos_token }}{% endfor %}"),
    "strict": ("{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
               "{% for m in messages %}{{ m.content }}{% endfor %}"),
}
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": ""}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_transformers(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<pad>": 2}, unk_token="<pad>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": TEMPLATES[name],
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = ChatTemplate.from_export(tmp_path)
    assert ours.specials["bos_token"] == "<s>"
    want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.render(MESSAGES) == want
    if name == "strict":
        with pytest.raises(InputError, match="a system message first"):
            ours.render(MESSAGES[1:])


def test_where_the_template_comes_from(tmp_path):
    assert ChatTemplate.from_export(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
        "eos_token": {"content": "</s>"}}))
    assert ChatTemplate.from_export(tmp_path).render(MESSAGES) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert ChatTemplate.from_export(tmp_path).render(MESSAGES) == "J"
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(InputError, match="not valid JSON"):
        ChatTemplate.from_export(tmp_path)


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ self._TemplateReference__context }}",
    "{% set x = messages.append(1) %}",
    "{{ raise_exception.__globals__ }}",
])
def test_no_python_objects(source):
    try:
        out = ChatTemplate(source).render(MESSAGES)
    except InputError as e:
        assert "unsafe" in str(e) or "undefined" in str(e)
    else:
        assert out == ""  # the sandbox answers an unsafe attribute with Undefined, as transformers' does


@pytest.mark.parametrize(("source", "what"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}", "limit"),
    ("{{ 'x' * 1000000000 }}", "over the output limit"),
    ("{{ [1] * 1000000000 }}", "over the output limit"),
    ("{{ 9 ** 99999999 }}", "exponent"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError|time limit"),
    ("{{ 'x' | center(1000000000) }}", "width"),
    ("{{ messages | tojson(indent=1000000000) }}", "width"),
    ("{{ 'a b' | wordwrap(width=1000000000) }}", "width"),
    ("{{ 'a\nb' | indent(1000000000) }}", "width"),
])
def test_hostile_templates_stop_in_bounded_time(source, what, monkeypatch):
    """Each hostile template stops with its own limit's error. The render's clock is scripted (1 µs
    a reading), so the time limit is reached after a fixed number of checks: no wall-clock bound."""
    import itertools
    from types import SimpleNamespace

    import graphs.chat as chat

    ticks = itertools.count()
    monkeypatch.setattr(chat, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-6))
    with pytest.raises(InputError, match=what):
        ChatTemplate(source, time_limit=0.5, max_chars=100_000).render(MESSAGES)


def test_limits_are_exact_errors():
    with pytest.raises(TemplateLimitError):
        ChatTemplate("{{ 'ab' * 60 }}", max_chars=100).render(MESSAGES)
    assert ChatTemplate("{{ 'ab' * 50 }}", max_chars=100).render(MESSAGES) == "ab" * 50
    assert ChatTemplate("{{ 'ab' | center(6) }}|{{ 'a\nb' | indent(2) }}|{{ 'aaa bbb' | wordwrap(4) }}").render(
        MESSAGES) == "  ab  |a\n  b|aaa\nbbb"  # capped filters still work below their cap
    with pytest.raises(InputError, match="does not compile"):
        ChatTemplate("{% for %}")
