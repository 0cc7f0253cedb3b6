"""The benchmark: prompt files, bad CLI input, peers that are missing, the report, greedy checks.

Fast: tiny exports, 2 prompts x 8 tokens, the workers' own processes. No wall-clock asserts.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from conftest import run_module
from tokenizers import Tokenizer

from exporter.bench import BenchOptions, bench, main
from exporter.benchmark import report as R
from exporter.benchmark import systems as S
from exporter.benchmark.prompts import build_prompts, read_prompt_file
from exporter.loading import UserError

TINY = dict(repeats=1, prompts=2, max_new_tokens=8, threads=1)
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok(exported):
    return Tokenizer.from_file(str(exported("medusa") / "tokenizer.json"))


# ------------------------------------------------------------------------------------------ prompts


def test_text_prompt_file(tmp_path, exported, tok):
    f = tmp_path / "p.txt"
    f.write_text("def main(\n\n  \nclass A:\\n    pass\n")  # blank lines skipped, \n escapes a newline
    ps = build_prompts(exported("medusa"), tok, f)
    assert [p.text for p in ps] == ["def main(", "class A:\n    pass"]
    assert ps[1].ids == tok.encode("class A:\n    pass").ids
    five = build_prompts(exported("medusa"), tok, f, count=5)
    assert [p.text for p in five] == ["def main(", "class A:\n    pass"] * 2 + ["def main("]


def test_jsonl_prompt_and_messages_with_chat_template(tmp_path, exported, tok):
    out = tmp_path / "out"
    shutil.copytree(exported("medusa"), out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "x = 1"}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    a, b = build_prompts(out, tok, f)
    assert (a.source, a.text) == ("prompt", "x = 1")
    assert (b.source, b.text) == ("messages", "<|user|>hi\n<|assistant|>")
    assert b.ids == tok.encode("<|user|>hi\n<|assistant|>", add_special_tokens=False).ids
    (out / "chat_template.json").write_text(json.dumps({"chat_template": "({{ messages[0].content }})"}))
    assert build_prompts(out, tok, f)[1].text == "(hi)"
    (out / "chat_template.jinja").write_text("[{{ messages[0].content }}]")  # the file wins, as in transformers
    assert build_prompts(out, tok, f)[1].text == "[hi]"


def test_messages_without_a_chat_template(tmp_path, exported, tok):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match="has no chat template"):
        build_prompts(exported("medusa"), tok, f)


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "a"}\n{"prompt": \n', r"p\.jsonl:2: not valid JSON"),
    ('{"text": "a"}\n', r'p\.jsonl:1: each line needs a non-empty "prompt"'),
    ('{"messages": [{"role": "user"}]}\n', r'p\.jsonl:1: each line needs'),
    ("\n  \n", "holds no prompts"),
])
def test_bad_prompt_files(tmp_path, text, match):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(UserError, match=match):
        read_prompt_file(f)


def test_prompt_file_missing_or_binary(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_prompt_file(tmp_path / "nope.txt")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError, match="not UTF-8"):
        read_prompt_file(tmp_path / "b.txt")


# ------------------------------------------------------------------------------------------ CLI bad input


@pytest.mark.parametrize("args, match", [
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--top-p", "0"], "--top-p must be in"),
    (["--precisions", "int3"], "unknown precision or peer 'int3'"),
    (["--load-option", "nokey"], "expected KEY=VALUE"),
    (["--tune"], "--tune applies to the optimized copies"),  # fp32 alone: nothing to re-tune
    (["--no-tune"], "--no-tune applies to the optimized copies"),
    (["--tune", "--precisions", "fp32,int4", "--tree", "TREE"], "--tune and --tree"),
    (["--no-tune", "--precisions", "int4", "--tree", "TREE"], "--no-tune and --tree"),
])
def test_cli_bad_values(exported, capsys, tmp_path, args, match):
    """Regression (issue 10): --prompts 0 ended in IndexError, --repeats 0 wrote 'speedup 0.00x'. A --tune
    that could change nothing is refused, not ignored."""
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([[0]]))
    args = [str(tree) if a == "TREE" else a for a in args]
    assert main([str(exported("medusa")), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert match in err[-1] and err[-1].startswith("error:")
    assert not any("running" in ln for ln in err)  # refused before any system ran


def test_cli_json_into_a_directory_fails_before_the_run(exported, tmp_path, capsys):
    """Regression (issue 10): --json DIR failed only after the whole run."""
    assert main([str(exported("medusa")), "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --json {tmp_path} is a directory; give a file name"]
    assert main([str(exported("medusa")), "--png", str(tmp_path / "no" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_bad_flag_is_one_line(exported):
    """Regression (issue 10): a bad flag printed the whole usage block."""
    r = run_module("exporter.bench", exported("medusa"), "--no-such-flag", timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--no-such-flag" in lines[0] and "usage" not in r.stderr


# ------------------------------------------------------------------------------------------ runs


@pytest.fixture(scope="module")
def report(exported):
    """ours-ar + ours-spec on a tiny EAGLE export; every peer asked for but not available."""
    return bench(exported("eagle"), BenchOptions(**TINY, peers=("genai", "hf", "optimum")), log=lambda *a: None)


def test_report_schema(report, tmp_path):
    assert report["schema"] == R.SCHEMA
    assert set(report) >= {"out_dir", "machine", "settings", "anchor", "systems", "greedy", "greedy_mismatches"}
    assert report["machine"]["copy_bandwidth_bytes_per_s"] > 0
    by = {e["name"]: e for e in report["systems"]}
    for name in ("ours-ar", "ours-spec"):
        e = by[name]
        assert e["status"] == "ok", e["reason"]
        assert e["runs"] == 2 and e["new_tokens"] > 0
        for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "e2e_tokens_per_s", "bandwidth_fraction"):
            assert e[k] > 0, k
        assert e["peak_rss_bytes"] > 0 and e["weight_bytes"] > 0
        assert sum(e["accepted_histogram"]) == e["base_forwards"]
        assert abs(sum(e["time_split"].values()) - 1) < 1e-6
    assert by["ours-ar"]["mean_accepted_length"] == 1.0 and by["ours-ar"]["draft_calls"] == 0
    assert by["ours-spec"]["draft_calls"] > 0 and by["ours-spec"]["draft_bytes"] > 0
    assert report["anchor"] == "ours-ar"
    assert by["ours-spec"]["speedup_vs"]["ours-ar"] > 0
    assert report["greedy"] == [{"system": "ours-spec", "reference": "ours-ar", "must_equal": True,
                                 "prompts_equal": 2, "prompts_compared": 2, "first_mismatch": None}]
    assert report["greedy_mismatches"] == 0
    json.dumps(report)  # serialisable as it is
    R.draw(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_missing_peers_are_reported_and_skipped(report):
    by = {e["name"]: e for e in report["systems"]}
    for name in ("genai", "hf", "hf-pld", "optimum"):
        assert by[name]["status"] == "skipped" and "--model-dir" in by[name]["reason"]
    lines = [R.line(e) for e in report["systems"]]
    assert any(ln.strip().startswith("genai: SKIPPED: needs --model-dir") for ln in lines)


def test_peer_not_installed_is_skipped(tmp_path, tiny_model_dir):
    """A worker whose stack is missing answers 'unavailable': skipped with the reason, not fatal."""
    s = S.System("optimum", "optimum", {"runner": "optimum", "model": str(tiny_model_dir("base"))},
                 python=sys.executable)
    pytest.importorskip("torch")
    try:
        import optimum  # noqa: F401
        pytest.skip("optimum is installed here: nothing is missing")
    except ImportError:
        pass
    S.start(s, tmp_path)
    assert s.status == "skipped" and "optimum-onnx is not installed" in s.reason
    spec = {"runner": "ours", "out_dir": str(tmp_path / "nothing"), "mode": "autoregressive"}
    broken = S.System("broken", "ours", spec)
    S.start(broken, tmp_path)
    assert broken.status == "failed" and "not a directory" in broken.reason
    assert s.worker is None and broken.worker is None  # processes ended


def test_greedy_check_catches_a_mismatch():
    ar = S.System("ours-ar", "ours", {}, status="ok", runs=[{"_prompt": 0, "tokens": [5, 6, 7]},
                                                           {"_prompt": 1, "tokens": [1, 2]}])
    spec = S.System("ours-spec", "ours", {}, status="ok", must_equal="ours-ar",
                    runs=[{"_prompt": 0, "tokens": [5, 6, 7]}, {"_prompt": 1, "tokens": [1, 3]}])
    peer = S.System("genai", "genai", {}, status="ok", compare_to="ours-ar",
                    runs=[{"_prompt": 0, "tokens": [5, 6]}, {"_prompt": 1, "tokens": [1, 2]}])
    rows = R.greedy_check([ar, spec, peer], 2)
    assert rows[0] == {"system": "ours-spec", "reference": "ours-ar", "must_equal": True, "prompts_equal": 1,
                       "prompts_compared": 2, "first_mismatch": {"prompt": 1, "token_index": 1}}
    assert rows[1]["must_equal"] is False and rows[1]["first_mismatch"] == {"prompt": 0, "token_index": 2}


def test_bench_exits_1_on_a_greedy_mismatch(exported, monkeypatch, tmp_path, capsys):
    """A speculative run that emits one wrong token is caught end to end (exit 1, named on stdout)."""
    real = S.run

    def corrupt(system, request):
        reply = real(system, request)
        if reply and system.name == "ours-spec" and request["max_new_tokens"] > 8:
            reply["tokens"][-1] += 1
        return reply

    monkeypatch.setattr(S, "run", corrupt)
    rc = main([str(exported("medusa")), "--repeats", "1", "--prompts", "1", "--max-new-tokens", "9",
               "--threads", "1", "--peers", "", "--json", str(tmp_path / "r.json")])
    assert rc == 1
    assert "GREEDY MISMATCH: ours-spec vs ours-ar on 1/1 prompts" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["greedy_mismatches"] == 1


def test_hf_peers_run_and_agree_with_ours(exported, tiny_model_dir, tmp_path):
    """HF generate (plain and prompt lookup) on the same base: greedy tokens equal to ours-ar's."""
    rep = bench(exported("medusa"), BenchOptions(**TINY, peers=("hf",), model_dir=str(tiny_model_dir("medusa")),
                                                 work=str(tmp_path)), log=lambda *a: None)
    by = {e["name"]: e for e in rep["systems"]}
    for name in ("hf", "hf-pld"):
        assert by[name]["status"] == "ok", by[name]["reason"]
        assert by[name]["decode_tokens_per_s"] > 0 and by[name]["base_forwards"] > 0
    rows = {(g["system"], g["reference"]): g for g in rep["greedy"]}
    assert rows[("hf", "ours-ar")]["prompts_equal"] == 2
    assert rows[("hf-pld", "hf")]["prompts_equal"] == 2
    assert rep["greedy_mismatches"] == 0


def test_also_runs_another_drafter_of_the_same_base_beside_ours(exported, tmp_path):
    """--also: an EAGLE-3 export of the same tiny base runs as ours-spec-eagle beside the Medusa export's
    systems, its greedy tokens held to ours-ar's."""
    rep = bench(exported("medusa"), BenchOptions(**TINY, peers=(), also=(str(exported("eagle3")),),
                                                 work=str(tmp_path)), log=lambda *a: None)
    by = {e["name"]: e for e in rep["systems"]}
    assert set(by) == {"ours-ar", "ours-spec", "ours-spec-eagle"}
    assert by["ours-spec-eagle"]["status"] == "ok", by["ours-spec-eagle"]["reason"]
    rows = {(g["system"], g["reference"]): g for g in rep["greedy"]}
    assert rows[("ours-spec-eagle", "ours-ar")]["must_equal"] and rep["greedy_mismatches"] == 0


def test_also_refuses_what_is_not_an_export(tmp_path):
    with pytest.raises(UserError, match=r"--also .* is not an export directory"):
        BenchOptions(also=(str(tmp_path),))


@pytest.mark.slow
def test_genai_and_optimum_peers(exported, tiny_model_dir, tmp_path):
    """onnxruntime-genai's build of the same base decodes the same greedy tokens as ours-ar; optimum
    runs when an environment with it is given (BENCH_OPTIMUM_PYTHON), else it is reported skipped."""
    import os

    pytest.importorskip("onnxruntime_genai")
    opt_py = os.environ.get("BENCH_OPTIMUM_PYTHON")
    rep = bench(exported("medusa"), BenchOptions(**TINY, peers=("genai", "optimum"), optimum_python=opt_py,
                                                 model_dir=str(tiny_model_dir("medusa")), work=str(tmp_path)),
                log=lambda *a: None)
    by = {e["name"]: e for e in rep["systems"]}
    assert by["genai"]["status"] == "ok", by["genai"]["reason"]
    rows = {(g["system"], g["reference"]): g for g in rep["greedy"]}
    assert rows[("genai", "ours-ar")]["prompts_equal"] == 2
    if opt_py:
        assert by["optimum"]["status"] == "ok", by["optimum"]["reason"]
    else:
        assert by["optimum"]["status"] == "skipped" and "--optimum-python" in by["optimum"]["reason"]


def test_sweep_runs_the_default_tree_beside_the_hand_picked_ones(exported, tmp_path):
    """--sweep: the export's default (tuned) tree is measured first under the same protocol, and its
    speed relative to the best hand-picked tree is reported (issue 8: tuned >= every hand-picked)."""
    from exporter.tune import tune

    out = tmp_path / "out"
    shutil.copytree(exported("medusa"), out)
    tune(out, prompts=["abc"], threads=1, max_new_tokens=8, log=lambda *a, **k: None)
    rep = bench(out, BenchOptions(**{**TINY, "repeats": 2}, sweep=True), log=lambda *a: None)
    rows = rep["sweep"]
    m = json.loads((out / "manifest.json").read_text())
    assert rows[0]["default"] and rows[0]["tuned"] and rows[0]["tree"] == m["tree"]["medusa_paths"]
    assert len(rows) > 2 and not any(r.get("default") for r in rows[1:])
    best = max(r["speedup"] for r in rows[1:])
    assert rows[0]["vs_best_hand_picked"] == pytest.approx(rows[0]["speedup"] / best)
    R.draw(rep, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000


@pytest.mark.parametrize("flags, tuned", [([], True), (["--no-tune"], False), (["--tree", "TREE"], False)])
def test_bench_precisions_measure_the_tree_optimize_ships(exported, tmp_path, monkeypatch, flags, tuned):
    """ours-spec-int4 ran the float32 export's 7-node tree while `exporter.optimize --quantize int4` ships a
    tree re-tuned for int4 (3 nodes on the 19M model: 1.39x autoregressive where the 7-node tree gave 0.99x):
    the optimized copies are tuned as optimize makes them, unless --no-tune, or --tree fixes the tree."""
    import exporter.bench as b
    from exporter.benchmark import systems as S

    out = exported("medusa")
    calls = []
    monkeypatch.setattr(S, "ours_variant", lambda *a, **k: calls.append(k) or (out, ""))
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([[0]]))
    report = tmp_path / "r.json"
    flags = [str(tree) if f == "TREE" else f for f in flags]
    rc = b.main([str(out), "--repeats", "1", "--prompts", "1", "--max-new-tokens", "4", "--threads", "1",
                 "--peers", "", "--precisions", "int4", "--json", str(report), *flags])
    assert rc == 0
    assert [c["tune"] for c in calls] == [tuned] and calls[0]["threads"] == 1
    assert json.loads(report.read_text())["settings"]["tune"] is tuned


def test_our_optimized_copy_is_keyed_by_what_its_tree_depends_on(exported, tmp_path, monkeypatch):
    """ours_variant: a tuned copy is keyed by the threads it was tuned with and the tuner's code (a copy
    tuned with 1 thread was reused for 2, and after the tuner changed), an untuned one by neither; a reuse
    says so."""
    import exporter.pipeline

    out = exported("medusa")
    made = []

    def fake_optimize(d, **kw):  # stands in for the optimize stage: records its keywords, writes a manifest
        made.append(kw)
        shutil.copy(out / "manifest.json", d / "manifest.json")

    monkeypatch.setattr(exporter.pipeline, "optimize_export", fake_optimize)
    logs = []
    work = tmp_path / "work"
    work.mkdir()
    a, _ = S.ours_variant(out, "int4", work, logs.append, tune=True, threads=1)
    b, _ = S.ours_variant(out, "int4", work, logs.append, tune=True, threads=2)
    c, _ = S.ours_variant(out, "int4", work, logs.append, tune=False, threads=2)
    again, _ = S.ours_variant(out, "int4", work, logs.append, tune=True, threads=1)
    assert len({a, b, c}) == 3 and again == a
    assert [(k["tune"], k["tune_threads"], k["quantize"]) for k in made] == [(True, 1, "int4"), (True, 2, "int4"),
                                                                              (False, 2, "int4")]
    assert any(line.startswith("  reusing our int4 variant") for line in logs)
    monkeypatch.setattr(S, "_tuner_stamp", lambda: "other code")
    assert S.ours_variant(out, "int4", work, logs.append, tune=True, threads=1)[0] != a
    assert S.ours_variant(out, "int4", work, logs.append, tune=False, threads=2)[0] == c


def test_bench_tune_on_an_export_without_a_drafter_is_refused(exported, capsys, monkeypatch):
    """--tune with no drafter re-tuned nothing and said 'tree re-tuned'; the report's settings.tune said true."""
    monkeypatch.setattr(S, "ours_variant", _no_work)
    assert main([str(exported("base")), "--tune", "--precisions", "int4", "--peers", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --tune: ") and "has no drafter" in err[-1] and "drop --tune" in err[-1]


def _no_work(*a, **k):
    raise AssertionError("refused input must be refused before any copy is made")


def test_bench_settings_say_whether_trees_were_re_tuned(exported, tmp_path, monkeypatch):
    """settings.tune: true only where an optimized copy with a drafter was re-tuned (it said true for fp32
    alone and for exports without a drafter)."""
    monkeypatch.setattr(S, "ours_variant", lambda out, *a, **k: (out, ""))
    for kind, precisions, tuned in (("medusa", "fp32", False), ("base", "int4", False), ("medusa", "int4", True)):
        report = tmp_path / f"{kind}-{precisions}.json"
        assert main([str(exported(kind)), "--precisions", precisions, "--peers", "", "--repeats", "1",
                     "--prompts", "1", "--max-new-tokens", "2", "--threads", "1", "--json", str(report)]) == 0
        assert json.loads(report.read_text())["settings"]["tune"] is tuned, (kind, precisions)


class _PolledWorker(S.Worker):
    """A Worker whose thread-state looks are recorded (``polls``): what ended a settle shows in them."""

    def running_threads(self):
        n = super().running_threads()
        self.polls.append(n)
        return n


def _worker_on(code: str):
    """A process that says it is ready, then runs ``code`` (Worker.settle needs only the process)."""
    import subprocess

    w = object.__new__(_PolledWorker)
    w.polls = []
    w.proc = subprocess.Popen([sys.executable, "-c", "import sys, time\nprint('ready', flush=True)\n" + code],
                              stdout=subprocess.PIPE, text=True)
    assert w.proc.stdout.readline().strip() == "ready"  # its start-up is over
    return w


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread states: Linux's /proc")
def test_a_run_waits_for_the_last_workers_threads_to_go_idle():
    """Worker.settle: a worker still burning a core (as ORT's spinning pools do after a run) is waited
    for; an idle one is not; one that exited returns at once. No timing races: the busy worker spins
    until it is killed (settle waits its whole limit), the idle one sleeps until then (settle ends at two
    quiet looks, well inside a limit no machine reaches), the exited one is never looked at."""
    idle = _worker_on("time.sleep(600)")
    busy = _worker_on("while True: pass")
    try:
        if S.Worker.running_threads(busy) is None:  # no thread states here: the fixed pause after one look
            busy.polls.clear()
            assert S.Worker.settle(busy) >= S.SETTLE_FALLBACK_S and busy.polls == [None]
            return
        assert S.Worker.settle(busy) >= S.SETTLE_LIMIT_S  # waited for it to its limit
        assert busy.proc.poll() is None  # (still spinning: the limit ended the wait, not an exit)
        idle.polls.clear()
        S.Worker.settle(idle, limit_s=300)
        assert idle.polls[-2:] == [0, 0]  # ended by two quiet looks (not by the limit)
    finally:
        for w in (busy, idle):
            w.proc.kill()
            w.proc.wait()
    idle.polls.clear()
    S.Worker.settle(idle)
    assert idle.polls == []  # exited: not looked at, no wait
