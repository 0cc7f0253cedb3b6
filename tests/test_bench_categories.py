"""Acceptance by prompt category: bench's built-in chat prompts, its per-category report, compare --e2e's."""

from __future__ import annotations

import json

from exporter import chat_prompts
from exporter.benchmark import report as R
from exporter.benchmark.prompts import build_prompts


class System:
    def __init__(self, runs):
        self.name, self.family, self.precision, self.status, self.reason = "ours-spec", "ours", "fp32", "ok", ""
        self.peak_rss_bytes, self.info, self.settle_s, self.runs = None, {}, [], runs


def test_chat_prompts_split_holds_out_whole_subjects():
    train, held = chat_prompts.split("train"), chat_prompts.split("heldout")
    assert len(chat_prompts.CATEGORIES) >= 8 and {p.category for p in held} == set(chat_prompts.CATEGORIES)
    assert not {p.text for p in train} & {p.text for p in held}
    for cat, (_, subjects) in chat_prompts._SETS.items():
        for subject in subjects[-chat_prompts.HELDOUT:]:
            assert not any(subject in p.text for p in train if p.category == cat)


def test_bench_uses_the_held_out_chat_prompts_on_a_chat_export(tmp_path):
    from conftest import write_tiny_tokenizer
    from tokenizers import Tokenizer

    write_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert build_prompts(tmp_path, tok)[0].source == "builtin"  # no template: the Python snippets
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    prompts = build_prompts(tmp_path, tok)
    assert len(prompts) == 2 * len(chat_prompts.CATEGORIES)
    assert {p.category for p in prompts} == set(chat_prompts.CATEGORIES) and {p.source for p in prompts} == {"chat"}
    assert len(build_prompts(tmp_path, tok, count=3)) == 3
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "a", "category": "mine"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    assert [p.category for p in build_prompts(tmp_path, tok, prompts_file=f)] == ["mine", ""]


def test_report_gives_tau_and_acceptance_per_position_by_category():
    runs = [  # prompt 0 ("a"): 2 drafted steps accepting 2 and 0 drafts; prompt 1 ("b"): one accepting 1
        {"_prompt": 0, "tokens": [1, 2, 3, 4, 5], "prefill_s": 0.1, "decode_s": 1.0, "accepted": [3, 1],
         "speculative_steps": 2, "accepted_per_pos": [1, 1]},
        {"_prompt": 1, "tokens": [1, 2, 3], "prefill_s": 0.1, "decode_s": 1.0, "accepted": [2],
         "speculative_steps": 1, "accepted_per_pos": [1]},
    ]
    e = R.summarize(System(runs), [4, 4], None, ["a", "b"])
    assert e["by_category"]["a"]["mean_accepted_length"] == 2.0
    assert e["by_category"]["a"]["acceptance_per_position"] == [0.5, 0.5]
    assert e["by_category"]["b"]["acceptance_per_position"] == [1.0]
    assert e["acceptance_per_position"] == [2 / 3, 1 / 3]
    lines = R.category_lines({"systems": [e]})
    assert len(lines) == 2 and "tau 2.00" in lines[0] and "0.50 0.50" in lines[0]


def test_e2e_acceptance_by_category():
    from exporter.e2e import TokenRow, by_category

    def row(cat, n, tau, per_pos, steps):
        return TokenRow("p", [1] * n, [1] * n, [1] * n, None, tau, category=cat, speculative_steps=steps,
                        accepted_per_pos=per_pos)

    out = by_category([row("qa", 6, 2.0, [2, 1], 3), row("math", 4, 1.0, [0, 0], 4)])
    assert out["qa"]["tau"] == 2.0 and out["qa"]["acceptance_per_position"] == [2 / 3, 1 / 3]
    assert out["all"]["tau"] == 10 / 7 and out["all"]["acceptance_per_position"] == [2 / 7, 1 / 7]


def test_variants_of_an_optimized_export_come_from_a_raw_re_export(tmp_path, tiny_model_dir):
    """The main job's export is optimized already: int4 / opt variants are optimized from a raw export of
    --model-dir made by the bench; without --model-dir, one line saying so before any work."""
    from types import SimpleNamespace

    import pytest

    from exporter.benchmark.run import BenchOptions, raw_source
    from exporter.errors import UserError

    raw = SimpleNamespace(optimization={})
    done = SimpleNamespace(optimization={"base": {"passes": ["attention"]}})
    assert raw_source(tmp_path, raw, BenchOptions(precisions=("fp32", "int4")), tmp_path) == tmp_path
    assert raw_source(tmp_path, done, BenchOptions(precisions=("fp32",)), tmp_path) == tmp_path
    with pytest.raises(UserError, match=r"optimized already.*pass --model-dir"):
        raw_source(tmp_path, done, BenchOptions(precisions=("fp32", "int4")), tmp_path)
    src = raw_source(tmp_path, done, BenchOptions(model_dir=str(tiny_model_dir("medusa")), precisions=("int4",)),
                     tmp_path / "work", log=lambda *a: None)
    assert (src / "manifest.json").is_file() and src == tmp_path / "work" / "raw-export"
