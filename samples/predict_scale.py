"""Predict speculative decoding's speedup at a realistic size from measured terms, and check the method.

    # measure a TinyLlama-1.1B-shaped base (random weights) at 2 and 4 layers, extrapolate to 22, and
    # combine with a trained drafter's acceptance (a bench report of that drafter, with --sweep):
    python samples/predict_scale.py --acceptance bench-eagle.json --json scale.json --png scale.png
    # check the method on a trained model: measure its own export, predict, compare with the bench run
    python samples/predict_scale.py --export runs/medium_eagle/onnx --acceptance bench-eagle.json

Cost model (docs/DESIGN.md, "Per-step cost model"), per decode step of our runtime::

    autoregressive  t_ar   = verify(1) + host_ar                     tokens/s = 1 / t_ar
    speculative     t_spec = verify(T) + calls x draft(k) + host_spec   tokens/s = tau(T) / t_spec

With ``--export`` the speeds to check against are measured again right after the graph terms (the
same machine load), and the host time per step is that run's: the check tests the graph terms and
tau, not a model of host time.

``verify(T)``: one base forward over T new tokens after ``--past`` cached ones; ``draft(k)``: one
drafter call over k rows (EAGLE: 1 + depth calls per step, the first over the accepted tokens,
then ``topk`` rows; Medusa: one call); ``tau(T)``, the calls per step and the host time per step
come from the acceptance report (the trained drafter on its prompts). The graph terms are timed on
ONNX Runtime directly (mean of ``--repeats``), each graph fed as the runtime feeds it. Layers are
identical, so a base of L layers costs a + b*L: two layer counts give a and b, and the prediction
for 22 layers needs no 4.4 GB export (``--layers 22`` measures the full size on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from graphs import contract as C  # noqa: E402
from graphs.manifest import Manifest  # noqa: E402
from graphs.sessions import make_session, use_shared_thread_pool  # noqa: E402


def _feed(session, s: int, past: int, rows_dtype=np.float32, topk: int = 4, rng=None) -> dict:
    """Inputs for one call over ``s`` new rows after ``past`` cached ones (values do not change timing)."""
    rng = rng or np.random.default_rng(0)
    feed = {}
    for i in session.get_inputs():
        shape = i.shape
        if i.name.startswith("past_key_values"):
            feed[i.name] = np.zeros((1, shape[1], past, shape[3]), rows_dtype)
        elif i.name == C.ATTENTION_MASK:
            feed[i.name] = np.ones((1, 1, s, past + s), bool)
        elif i.name == C.INPUT_IDS:
            feed[i.name] = rng.integers(3, 100, (1, s)).astype(np.int64)
        elif i.name == C.POSITION_IDS:
            feed[i.name] = (past + np.arange(s, dtype=np.int64))[None]
        elif i.name == C.TOPK_IN:
            feed[i.name] = np.array([topk], np.int64)
        elif i.name == C.AUX_HIDDEN:  # EAGLE-3: the drafter's own rows come as hidden states
            feed[i.name] = np.zeros((1, 0, shape[2]), rows_dtype)
        else:  # hidden states (B, S, H)
            feed[i.name] = rng.standard_normal((1, s, shape[2])).astype(rows_dtype)
    return feed


def _time(session, feed: dict, repeats: int) -> float:
    session.run(None, feed)  # warm-up: allocations
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, feed)
        ts.append(time.perf_counter() - t0)
    # the mean, as the decode loop's own totals are: on a busy machine, preempted calls are part of the cost
    return statistics.fmean(ts)


def measure(out_dir: Path, trees: list[int], past: int, prompt: int, draft_rows: list[int], repeats: int,
            threads: int | None) -> dict:
    """Seconds per call: verify(T) for each tree size, prefill(prompt), draft(k) for each row count."""
    m = Manifest.read(out_dir, verify=False)
    base = make_session(out_dir / m.graphs["base"].file, "cpu", threads, "all")
    out = {"verify": {}, "draft": {}, "num_layers": m.source["num_layers"],
           "base_bytes": sum(p.stat().st_size for p in out_dir.glob(m.graphs["base"].file + "*"))}
    spec = m.graphs["base"]
    if C.kv_in_place(spec):  # optimized: the buffers bound as the runtime binds them (graphs.sessions)
        from exporter.passes.parity import Case, random_feed
        from graphs.sessions import InPlaceRun

        call = InPlaceRun.caller(base, spec)
        base = SimpleNamespace(run=lambda _names, feed: call(feed))

        def base_feed(s, p):
            return random_feed(spec, Case("t", 1, s, p), vocab=m.source["vocab_size"])
    else:
        session = base

        def base_feed(s, p):
            return _feed(session, s, p)
    for t in trees:
        out["verify"][t] = _time(base, base_feed(t, past), repeats)
        print(f"  {out_dir.name}: verify({t:3d}) {out['verify'][t] * 1e3:8.2f} ms", flush=True)
    out["prefill"] = _time(base, base_feed(prompt, 0), max(3, repeats // 3))
    print(f"  {out_dir.name}: prefill({prompt}) {out['prefill'] * 1e3:.1f} ms", flush=True)
    del base
    if "draft" in m.graphs:
        draft = make_session(out_dir / m.graphs["draft"].file, "cpu", threads, "all")
        for k in draft_rows:
            out["draft"][k] = _time(draft, _feed(draft, k, past if m.drafter["kind"] == "eagle" else 0), repeats)
            print(f"  {out_dir.name}: draft({k:2d} rows) {out['draft'][k] * 1e3:8.2f} ms", flush=True)
    return out


def cached_measure(out_dir: Path, trees, past, prompt, draft_rows, repeats, threads) -> dict:
    """:func:`measure`, kept beside the export for the next run with the same settings."""
    key = f"terms-p{past}-s{prompt}-t{threads}-r{repeats}.json"
    f = out_dir.parent / key
    if f.is_file():
        terms = json.loads(f.read_text())
        terms["verify"] = {int(k): v for k, v in terms["verify"].items()}
        terms["draft"] = {int(k): v for k, v in terms["draft"].items()}
        if set(trees) <= set(terms["verify"]) and set(draft_rows) <= set(terms["draft"]):
            print(f"  {out_dir.parent.name}: terms from {f}")
            return terms
    terms = measure(out_dir, trees, past, prompt, draft_rows, repeats, threads)
    f.write_text(json.dumps(terms, indent=2) + "\n")
    return terms


def extrapolate(a: dict, b: dict, layers: int) -> dict:
    """Per-term linear fit in the number of layers through two measurements, evaluated at ``layers``."""
    la, lb = a["num_layers"], b["num_layers"]

    def lin(x, y):
        return x + (y - x) * (layers - la) / (lb - la)

    bad = sorted(t for t in a["verify"] if b["verify"][t] <= a["verify"][t])
    if bad:  # more layers cannot cost less: the machine was busy, and the fit means nothing
        print(f"WARNING: verify(T) with {lb} layers was not slower than with {la} layers for T in {bad}: the "
              f"measurements are noise (a busy machine?); rerun on a quiet one", file=sys.stderr)
    return {"num_layers": layers, "verify": {t: lin(a["verify"][t], b["verify"][t]) for t in a["verify"]},
            "inconsistent_tree_sizes": bad,
            "prefill": lin(a["prefill"], b["prefill"]), "draft": b["draft"],
            "base_bytes": lin(a["base_bytes"], b["base_bytes"]), "extrapolated_from": [la, lb]}


def acceptance(report: dict) -> dict:
    """What the trained drafter's bench run says per step: tau per tree, calls, host time."""
    by = {e["name"]: e for e in report["systems"]}
    spec, ar = by.get("ours-spec"), by.get("ours-ar")
    if not spec or spec.get("status") != "ok" or not ar or ar.get("status") != "ok":
        raise SystemExit("the acceptance report needs ours-spec and ours-ar that ran (python -m exporter.bench ...)")
    steps = spec["base_forwards"]
    decode_s = (spec["new_tokens"] - spec["runs"]) / spec["decode_tokens_per_s"]
    ar_decode_s = (ar["new_tokens"] - ar["runs"]) / ar["decode_tokens_per_s"]
    kind = report["settings"]["drafter"]
    tree = report["settings"]["tree"]
    main_size = _tree_size(tree, kind)
    rows = {main_size: {"tau": spec["mean_accepted_length"], "calls": spec["draft_calls"] / steps,
                        "tree": tree}}
    for r in report.get("sweep") or []:
        calls = 1 + r["tree"]["depth"] if isinstance(r["tree"], dict) else 1
        rows.setdefault(r["tree_size"], {"tau": r["mean_accepted_length"], "calls": calls, "tree": r["tree"]})
    settings = report["settings"]
    context = settings.get("mean_prompt_tokens", 16) + settings["max_new_tokens"] / 2
    paths = tree.get("medusa_paths") if isinstance(tree, dict) else tree if isinstance(tree, list) else None
    return {"kind": kind, "trees": rows, "main_tree_size": main_size,
            "medusa_heads": max(map(len, paths)) if paths else 2, "mean_context": int(context),
            "host_spec_s": spec["time_split"]["host"] * decode_s / steps,
            "host_ar_s": ar["time_split"]["host"] * ar_decode_s / ar["base_forwards"],
            "topk": (tree.get("eagle") or {}).get("topk", 1) if isinstance(tree, dict) else 1,
            "measured": {"ours-ar": ar["decode_tokens_per_s"], "ours-spec": spec["decode_tokens_per_s"],
                         "speedup": spec["decode_tokens_per_s"] / ar["decode_tokens_per_s"]}}


def rerun(out_dir: Path, report: dict, threads: int | None) -> dict:
    """ours-ar and ours-spec on the acceptance report's prompts and settings (built-in prompts or its file)."""
    from exporter.bench import BenchOptions, bench

    s = report["settings"]
    opts = BenchOptions(prompts_file=s.get("prompts_file"), prompts=s["prompts"], max_new_tokens=s["max_new_tokens"],
                        repeats=1, temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], seed=s["seed"],
                        threads=threads, peers=())
    print(f"  rerunning ours-ar and ours-spec on {out_dir} ({s['prompts']} prompts) for the check", flush=True)
    return bench(out_dir, opts, log=lambda *a, **k: None)


def _tree_size(tree, kind: str) -> int:
    if isinstance(tree, dict) and "eagle" in tree:
        return tree["eagle"]["total_tokens"]
    if isinstance(tree, dict) and "medusa_paths" in tree:
        return 1 + len(tree["medusa_paths"])
    return tree["total_tokens"] if isinstance(tree, dict) else 1 + len(tree)


def _interp(table: dict, x: int) -> float:
    xs = sorted(table)
    return float(np.interp(x, xs, [table[k] for k in xs]))


def predict(terms: dict, acc: dict) -> list[dict]:
    """Predicted decode tokens/s and speedup per tree of the acceptance report."""
    t_ar = terms["verify"][1] + acc["host_ar_s"]
    rows = []
    for size, a in sorted(acc["trees"].items()):
        if acc["kind"] == "eagle":  # first call over the accepted tokens (~tau rows), then topk rows per level
            draft = _interp(terms["draft"], round(a["tau"])) + (a["calls"] - 1) * _interp(terms["draft"], acc["topk"])
        else:
            draft = a["calls"] * _interp(terms["draft"], 1)
        step = _interp(terms["verify"], size) + draft + acc["host_spec_s"]
        rows.append({"tree_size": size, "tree": a["tree"], "tau": a["tau"], "verify_s": _interp(terms["verify"], size),
                     "draft_s": draft, "host_s": acc["host_spec_s"], "ar_tokens_per_s": 1 / t_ar,
                     "spec_tokens_per_s": a["tau"] / step, "speedup": a["tau"] / step * t_ar})
    return rows


def build_export(layers: int, kind: str, work: Path, medusa_heads: int = 2) -> Path:
    """A TinyLlama-shaped model of ``layers`` layers with a random drafter, exported (cached in work)."""
    out = work / (f"tinyllama-{kind}-{layers}L" + (f"-{medusa_heads}h" if kind == "medusa" else ""))
    if (out / "onnx" / "manifest.json").is_file():
        return out / "onnx"
    from exporter.export import export
    from exporter.speculative import convert, enable_huggingface_checkpointing
    from samples.scale_export import MEDUSA, build_model

    print(f"building and exporting a {layers}-layer TinyLlama-shaped base with a {kind} drafter", flush=True)
    model = build_model(layers)
    medusa = {**MEDUSA, "medusa_num_heads": medusa_heads}  # one lm_head per head: heads cost what they read
    convert(model, [("medusa", medusa)] if kind == "medusa" else [("eagle", {"eagle_num_layers": 1})])
    enable_huggingface_checkpointing()
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out / "model")
    del model
    export(out / "model", out / "onnx", log=lambda *a, **k: None)
    shutil.rmtree(out / "model")
    return out / "onnx"


def draw(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    v = result["terms"]["verify"]
    xs = sorted(int(k) for k in v)
    axes[0].plot(xs, [v[k] / v[1] for k in xs], "o-")
    axes[0].set_xlabel("tree size T (tokens verified per forward)")
    axes[0].set_ylabel("verify(T) / verify(1)")
    axes[0].set_title(f"{result['label']}: cost of a tree")
    for name, rows in (("predicted", result["prediction"]),):
        axes[1].plot([r["tree_size"] for r in rows], [r["speedup"] for r in rows], "o-", label=name)
    if result.get("check"):
        c = result["check"]
        axes[1].plot([c["tree_size"]], [c["measured_speedup"]], "r*", ms=12, label="measured (bench)")
    axes[1].axhline(1, color="gray", ls="--")
    axes[1].set_xlabel("tree size T")
    axes[1].set_ylabel("speculative / autoregressive")
    axes[1].set_title("speedup")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--acceptance", required=True, help="bench JSON of a trained drafter (python -m exporter.bench "
                                                        "... --sweep --json F)")
    ap.add_argument("--export", help="measure this export instead of the TinyLlama shape (checks the method)")
    ap.add_argument("--layers", default="2,4", help="layer counts to measure (two: extrapolate to --target-layers)")
    ap.add_argument("--target-layers", type=int, default=22)
    ap.add_argument("--trees", default="1,2,4,6,8,12,16,24,32")
    ap.add_argument("--past", type=int, default=None,
                    help="cached tokens before each step (default: 256; with --export the bench run's mean context)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt length for the prefill term")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", default=str(REPO / "runs" / "predict-scale"), help="exports are cached here")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)

    use_shared_thread_pool(args.threads)
    acc = acceptance(json.loads(Path(args.acceptance).read_text()))
    if args.past is None:
        args.past = acc["mean_context"] if args.export else 256
    trees = sorted({1, *(int(x) for x in args.trees.split(",")), *acc["trees"]})
    draft_rows = sorted({1, 2, 3, 4, acc["topk"], 8})
    if args.export:
        terms = measure(Path(args.export), trees, args.past, args.prompt, draft_rows, args.repeats, args.threads)
        label = Path(args.export).parent.name or args.export
        # the run to check against, now: graph terms and decode speeds under the same machine load
        fresh = acceptance(rerun(Path(args.export), json.loads(Path(args.acceptance).read_text()), args.threads))
        acc.update(host_spec_s=fresh["host_spec_s"], host_ar_s=fresh["host_ar_s"], measured=fresh["measured"])
    else:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        layers = [int(x) for x in args.layers.split(",")]
        exports = [build_export(n, acc["kind"], work, acc["medusa_heads"]) for n in layers]
        measured = [cached_measure(e, trees, args.past, args.prompt, draft_rows, args.repeats, args.threads)
                    for e in exports]
        terms = measured[0] if len(measured) == 1 else extrapolate(measured[0], measured[-1], args.target_layers)
        terms["measured_layers"] = measured
        label = f"TinyLlama-1.1B shape, {terms['num_layers']} layers"
    prediction = predict(terms, acc)
    result = {"label": label, "acceptance_source": args.acceptance, "past": args.past, "threads": args.threads,
              "terms": terms, "acceptance": acc, "prediction": prediction}
    if args.export:  # the method against the measured run of the same export
        size = acc["main_tree_size"]
        row = next(r for r in prediction if r["tree_size"] == size)
        result["check"] = {"tree_size": size, "predicted_speedup": row["speedup"],
                           "measured_speedup": acc["measured"]["speedup"],
                           "predicted_spec_tokens_per_s": row["spec_tokens_per_s"],
                           "measured_spec_tokens_per_s": acc["measured"]["ours-spec"],
                           "predicted_ar_tokens_per_s": row["ar_tokens_per_s"],
                           "measured_ar_tokens_per_s": acc["measured"]["ours-ar"]}
    print(f"{label}: verify(1) {terms['verify'][1] * 1e3:.1f} ms, prefill({args.prompt}) "
          f"{terms['prefill'] * 1e3:.0f} ms, draft(1) {terms['draft'].get(1, 0) * 1e3:.2f} ms")
    for r in prediction:
        print(f"  tree {r['tree_size']:3d}: tau {r['tau']:.2f}, verify {r['verify_s'] * 1e3:7.1f} ms, draft "
              f"{r['draft_s'] * 1e3:6.1f} ms, host {r['host_s'] * 1e3:5.1f} ms -> {r['spec_tokens_per_s']:7.1f} tok/s "
              f"vs {r['ar_tokens_per_s']:7.1f} autoregressive: {r['speedup']:.2f}x "
              f"{'(pays)' if r['speedup'] > 1.05 else '(does not pay)'}")
    if result.get("check"):
        c = result["check"]
        print(f"check: predicted speedup {c['predicted_speedup']:.2f}x vs measured {c['measured_speedup']:.2f}x "
              f"(speculative {c['predicted_spec_tokens_per_s']:.0f} vs {c['measured_spec_tokens_per_s']:.0f} tok/s; "
              f"autoregressive {c['predicted_ar_tokens_per_s']:.0f} vs {c['measured_ar_tokens_per_s']:.0f} tok/s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.png:
        draw(result, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
