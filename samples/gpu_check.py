"""The model part of the GPU check (samples/gpu_check.sh runs it after ``pytest -m gpu``).

    python samples/gpu_check.py --out RESULT.json [--model DIR] [--work DIR] [--budget-s 150]

On a machine whose ``onnxruntime`` is onnxruntime-gpu with a CUDA device:

1. model     ``--model DIR``: a model dir (HF + drafter, e.g. the SmolLM2 main job's) or a raw export
             (holds manifest.json); else the 19M recipe of docs/benchmarks.md trained for ``--budget-s``
2. export    ``python -m exporter.export`` (float32, validated against PyTorch)
3. optimize  ``optimize --target cuda``: float16, both attention forms timed on the GPU and the faster
             recorded, the rows gate on the CUDA EP (exporter.attention_forms, exporter.optimizing)
4. greedy    speculative vs autoregressive, prompt by prompt: equal, or parted at a near tie within
             the recorded rows bound (the contract ``exporter.benchmark.report.rows_contract`` reads)
5. speed     tokens/s of float16 autoregressive and speculative decoding by tree size (batch 1)
6. genai     onnxruntime-genai's CUDA build of the same model (float16), where it is installed

Each step's record (or its error) goes into the JSON as soon as it ends, so a step that fails or a
run cut short still leaves what came before. Exit status: 0 when every step that ran passed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# docs/benchmarks.md's 19M model (Medusa), its steps cut to a seconds budget
M19 = ["--mode", "medusa", "--hidden-size", "512", "--num-hidden-layers", "6", "--num-attention-heads", "8",
       "--num-key-value-heads", "4", "--intermediate-size", "1536", "--base-steps", "150", "--drafter-steps", "150",
       "--distill-prompts", "48"]
TREE_SIZES = (2, 4, 8, 16, 32)
N_PROMPTS = 8


class Report:
    """The JSON written after every step."""

    def __init__(self, path: Path):
        self.path, self.data, self.failed = path, {"steps": {}}, 0

    def step(self, name: str, fn, *args):
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            rec = fn(*args) or {}
            ok = rec.pop("ok", True)
        except Exception as e:
            rec, ok = {"error": f"{type(e).__name__}: {str(e).strip()[:2000]}",
                       "traceback": traceback.format_exc()[-4000:]}, False
            print(rec["traceback"], flush=True)
        rec.update(ok=ok, seconds=round(time.perf_counter() - t0, 1))
        self.failed += not ok
        self.data["steps"][name] = rec
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        print(f"   {name}: {'ok' if ok else 'FAILED'} ({rec['seconds']} s)", flush=True)
        return rec if ok else None


def run(cmd: list[str], timeout: float) -> None:
    print("  $", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, timeout=timeout, cwd=REPO)


def model_step(args, work: Path) -> dict:
    if args.model:
        return {"model": str(Path(args.model).absolute()), "source": "given"}
    model = work / "m19"
    run([sys.executable, "samples/train_drafter.py", "--out", model, *M19, "--seconds-budget", args.budget_s],
        timeout=args.budget_s * 2 + 90)
    return {"model": str(model), "source": f"19M recipe (docs/benchmarks.md), {args.budget_s:.0f} s budget"}


def export_step(model: Path, work: Path) -> dict:
    out = work / "onnx"
    shutil.rmtree(out, ignore_errors=True)
    if (model / "manifest.json").exists():  # a raw export given
        shutil.copytree(model, out)
    else:
        run([sys.executable, "-m", "exporter.export", model, out], timeout=900)
    return {"out_dir": str(out)}


def optimize_step(out: Path, provider: str) -> dict:
    from exporter.optimize import optimize_export
    from graphs.manifest import Manifest

    summary = optimize_export(out, target="cuda", progress=print, tune=False)
    m = Manifest.read(out)
    base = m.optimization["base"]
    rows = (m.validation.get("optimize") or {}).get("rows") or {}
    return {"dtype": base["dtype"], "attention_forms": base.get("attention_forms"), "rows": rows,
            "rows_max_abs": base.get("rows_max_abs"), "gain": summary.get("gain"),
            "ok": provider != "cuda" or (rows.get("provider") == "cuda"
                                         and (base.get("attention_forms") or {}).get("decided") == "measured")}


def _prompts(dec) -> list[list[int]]:
    from exporter.prompts import TUNE_PROMPTS

    return [dec.encode(p) for p in TUNE_PROMPTS[:N_PROMPTS]]


def greedy_step(out: Path, max_new: int, provider: str) -> dict:
    import graphs
    from exporter.benchmark.report import base_margin, rows_contract
    from exporter.optimizing import within_bound

    dec = graphs.load(out, provider=provider, adaptive=False)
    contract = rows_contract(out)
    prompts = _prompts(dec)
    rows, violations = [], 0
    for i, ids in enumerate(prompts):
        ar = dec.generate(ids, max_new_tokens=max_new, mode="autoregressive").token_ids
        sp = dec.generate(ids, max_new_tokens=max_new, mode="speculative").token_ids
        at = next((k for k in range(min(len(ar), len(sp))) if ar[k] != sp[k]), None)
        row = {"prompt": i, "equal": ar == sp}
        if at is not None:
            margin = base_margin(dec, list(ids) + list(ar[:at]))
            ok = within_bound(margin["margin"], contract["bound"])
            violations += not ok
            row.update(token_index=at, ar=ar[at], speculative=sp[at], margin=margin["margin"], within_bound=ok)
        elif len(ar) != len(sp):
            violations += 1
            row["error"] = "one stopped early with no divergence"
        rows.append(row)
    # one batch of every prompt: a batch of trees runs the Attention form whichever form was chosen
    batch_ar = [r.token_ids for r in dec.generate(prompts, max_new_tokens=max_new, mode="autoregressive")]
    batch_sp = [r.token_ids for r in dec.generate(prompts, max_new_tokens=max_new, mode="speculative")]
    return {"contract": contract, "prompts": rows, "equal": sum(r["equal"] for r in rows), "violations": violations,
            "batch_equal": sum(a == b for a, b in zip(batch_ar, batch_sp)), "batch_prompts": len(prompts),
            "ok": violations == 0}


def _tree(dec, size: int):
    from graphs.trees import default_medusa_paths

    if dec.kind == "medusa":
        return default_medusa_paths(dec.manifest.drafter["num_heads"], size)
    return {"topk": min(4, size), "depth": max(1, min(6, size // 2)), "total_tokens": size}


def _timed(dec, prompts, max_new: int, **kw) -> dict:
    dec.generate(prompts[0], max_new_tokens=8, **kw)  # warm-up: sessions, kernels, arenas
    t0, tokens, accepted = time.perf_counter(), 0, []
    for ids in prompts:
        r = dec.generate(ids, max_new_tokens=max_new, **kw)
        tokens += len(r.token_ids)
        accepted += list(getattr(r.stats, "accepted", []) or [])
    dt = time.perf_counter() - t0
    return {"tokens_per_s": tokens / dt, "tokens": tokens, "seconds": dt,
            "tau": sum(accepted) / len(accepted) if accepted else None}


def speed_step(out: Path, max_new: int, provider: str) -> dict:
    import graphs

    dec = graphs.load(out, provider=provider, adaptive=False)
    prompts = _prompts(dec)
    rec = {"autoregressive": _timed(dec, prompts, max_new, mode="autoregressive"), "speculative": {}}
    print(f"  autoregressive: {rec['autoregressive']['tokens_per_s']:.1f} tok/s", flush=True)
    for size in TREE_SIZES:
        try:
            r = _timed(dec, prompts, max_new, mode="speculative", tree=_tree(dec, size))
        except Exception as e:  # a tree this drafter or export cannot take: that size only
            r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        rec["speculative"][str(size)] = r
        if "tokens_per_s" in r:
            r["vs_autoregressive"] = r["tokens_per_s"] / rec["autoregressive"]["tokens_per_s"]
            print(f"  tree {size:3d}: {r['tokens_per_s']:.1f} tok/s ({r['vs_autoregressive']:.2f}x AR, "
                  f"tau {r['tau']})", flush=True)
    return rec


def genai_step(model: Path, work: Path, max_new: int) -> dict:
    try:
        import onnxruntime_genai as og
    except ImportError:
        return {"skipped": "onnxruntime-genai-cuda is not installed (carry the part samples/gpu_wheels.sh made)"}
    if (model / "manifest.json").exists():
        return {"skipped": "given a raw export, not a model dir: genai builds from the HF model"}
    from exporter.benchmark.systems import plain_base

    plain, why = plain_base(model, work, print)  # the base alone: our model dirs also carry the drafter
    if plain is None:
        raise RuntimeError(why)
    built = work / "genai"
    shutil.rmtree(built, ignore_errors=True)
    run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", plain, "-o", built, "-p", "fp16",
         "-e", "cuda", "-c", work / "genai-hf-cache"], timeout=900)
    gm = og.Model(str(built))
    tok = og.Tokenizer(gm)
    from exporter.prompts import TUNE_PROMPTS

    def gen(text: str, n: int) -> int:
        params = og.GeneratorParams(gm)
        params.set_search_options(max_length=len(tok.encode(text)) + n, do_sample=False)
        g = og.Generator(gm, params)
        g.append_tokens(tok.encode(text))
        k = 0
        while not g.is_done():
            g.generate_next_token()
            k += 1
        return k

    gen(TUNE_PROMPTS[0], 8)
    t0 = time.perf_counter()
    tokens = sum(gen(p, max_new) for p in TUNE_PROMPTS[:N_PROMPTS])
    dt = time.perf_counter() - t0
    return {"version": og.__version__, "tokens_per_s": tokens / dt, "tokens": tokens, "seconds": dt}


def goals(steps: dict) -> dict:
    """Issue 37's two GPU goals from the steps' figures: the best speculative tree >= 1.5x our float16
    autoregressive, our float16 autoregressive >= 1.0x onnxruntime-genai's CUDA build."""
    speed, genai = steps.get("speed") or {}, steps.get("genai") or {}
    ar = (speed.get("autoregressive") or {}).get("tokens_per_s")
    trees = {k: v["vs_autoregressive"] for k, v in (speed.get("speculative") or {}).items() if "vs_autoregressive" in v}
    best = max(trees.items(), key=lambda kv: kv[1]) if trees else None
    rec = {"best_tree": best and {"size": int(best[0]), "vs_autoregressive": best[1],
                                  "goal_1.5x": best[1] >= 1.5}}
    if ar and genai.get("tokens_per_s"):
        rec["autoregressive_vs_genai"] = ar / genai["tokens_per_s"]
        rec["goal_1.0x_genai"] = rec["autoregressive_vs_genai"] >= 1.0
    print(f"  goals: {rec}", flush=True)
    return rec  # reported, not failed: a goal missed is a finding, not a broken check


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="the JSON report")
    ap.add_argument("--model", help="a model dir or a raw export (default: train the 19M recipe)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-check"), help="scratch directory")
    ap.add_argument("--budget-s", type=float, default=45.0, help="the 19M recipe's training budget")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--provider", default="cuda", choices=["cuda", "cpu"],
                    help="where the graphs run (cpu: a dry run of this script's own logic, no GPU)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    rep = Report(args.out)
    m = rep.step("model", model_step, args, args.work)
    e = m and rep.step("export", export_step, Path(m["model"]), args.work)
    if e:
        out = Path(e["out_dir"])
        rep.step("optimize", optimize_step, out, args.provider)  # a failure leaves the raw export, decoded below
        rep.step("greedy", greedy_step, out, args.max_new_tokens, args.provider)
        rep.step("speed", speed_step, out, args.max_new_tokens, args.provider)
    if m:
        rep.step("genai", genai_step, Path(m["model"]), args.work, args.max_new_tokens)
    rep.step("goals", goals, rep.data["steps"])
    print(f"gpu check: {rep.failed} step(s) failed; report {args.out}", flush=True)
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
