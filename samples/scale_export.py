"""Export a model of TinyLlama-1.1B's configuration with a Medusa drafter; measure time and memory.

    python samples/scale_export.py [--json scale.json] [--work DIR] [--layers N] [--keep]

Builds a LlamaForCausalLM with TinyLlama-1.1B's configuration and random weights (nothing is
downloaded), converts it with Medusa (2 heads, 1 layer), saves it with ``save_pretrained``
(safetensors), then runs ``python -m exporter.export`` in a subprocess and reports its wall time,
its peak resident memory (``/usr/bin/time -v`` when available, else ``getrusage``), the size of
every file written, and the export's own PyTorch-vs-ONNX check (max logits error). The weights are
over protobuf's 2 GB limit, so ``base.onnx.data`` must exist. Exits non-zero if the export fails,
the check fails, external data is missing, or the peak exceeds ``--max-rss-gib`` (24).

Not part of the test suite (tests/test_export.py runs it under ``-m slow``). Needs ~15 GB of disk
under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# TinyLlama/TinyLlama-1.1B-Chat-v1.0 config.json
TINYLLAMA = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
MEDUSA = {"medusa_num_heads": 2, "medusa_num_layers": 1}


def build_model(num_layers: int | None = None, seed: int = 0):
    """Random TinyLlama-shaped model in seconds: allocate on meta, materialize, fill in place."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(**{**TINYLLAMA, **({"num_hidden_layers": num_layers} if num_layers else {})})
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)  # its inv_freq buffer was left on meta
    return model.eval()


def peak_rss_kib_from_time_v(stderr: str) -> int | None:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    return int(m.group(1)) if m else None


def run_export(model_dir: Path, out_dir: Path, extra: list[str]) -> dict:
    """The export CLI in a subprocess, stdout streamed through; wall time and peak RSS of the child."""
    cmd = [sys.executable, "-m", "exporter.export", str(model_dir), str(out_dir), *extra]
    time_v = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists() else None)
    stats_file = None
    if time_v:
        stats_file = Path(tempfile.mkstemp(prefix="time-v-", suffix=".txt")[1])
        cmd = [time_v, "-v", "-o", str(stats_file), *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        print(f"  | {line}", end="", flush=True)
        lines.append(line)
    stderr = proc.stderr.read()
    rc = proc.wait()
    wall = time.perf_counter() - t0
    if stderr.strip():
        print(stderr, file=sys.stderr)
    peak_kib = None
    if stats_file is not None:
        peak_kib = peak_rss_kib_from_time_v(stats_file.read_text())
        stats_file.unlink()
    if peak_kib is None:  # Linux reports ru_maxrss in KiB
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    steps = {m.group(2): float(m.group(3)) for m in re.finditer(r"^\[(\d)/\d\] (.+) done in ([\d.]+) s$",
                                                                 "".join(lines), re.M)}
    return {"returncode": rc, "wall_s": wall, "peak_rss_kib": peak_kib, "steps_s": steps, "stderr": stderr.strip()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--work", help="directory for the model and the export (default: a temp dir, removed)")
    ap.add_argument("--layers", type=int, help="fewer decoder layers, for a quick dry run")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--max-rss-gib", type=float, default=24.0, help="fail above this peak (the machine's RAM)")
    ap.add_argument("--keep", action="store_true", help="keep the model and export in --work")
    args = ap.parse_args(argv)

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="scale-export-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir, out_dir = work / "tinyllama-medusa", work / "onnx"
    for d in (model_dir, out_dir):
        shutil.rmtree(d, ignore_errors=True)
    try:
        import torch

        from exporter.speculative import convert, enable_huggingface_checkpointing

        t0 = time.perf_counter()
        model = build_model(args.layers)
        convert(model, [("medusa", dict(MEDUSA))])
        n_base = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("medusa"))
        n_drafter = sum(p.numel() for p in model.medusa_heads.parameters())
        t_build = time.perf_counter() - t0
        print(f"built TinyLlama-1.1B-shaped model: {n_base / 1e9:.3f}B base + {n_drafter / 1e6:.1f}M Medusa "
              f"parameters in {t_build:.1f} s", flush=True)
        t0 = time.perf_counter()
        enable_huggingface_checkpointing()
        model.save_pretrained(model_dir, safe_serialization=True)
        t_save = time.perf_counter() - t0
        print(f"saved to {model_dir} in {t_save:.1f} s", flush=True)
        del model

        print(f"exporting (python -m exporter.export --dtype {args.dtype}) ...", flush=True)
        run = run_export(model_dir, out_dir, ["--dtype", args.dtype])
        files = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir())} if out_dir.is_dir() else {}
        validation = {}
        if (out_dir / "manifest.json").is_file():
            validation = json.loads((out_dir / "manifest.json").read_text()).get("validation", {})
        max_abs = validation.get("max_abs", {})
        logits_err = max((v for k, v in max_abs.items() if k.endswith("/logits")), default=None)
        peak_gib = run["peak_rss_kib"] / 2**20
        problems = []
        if run["returncode"] != 0:
            problems.append(f"export exited {run['returncode']}: {run['stderr'][-500:]}")
        if validation.get("ok") is not True:
            problems.append(f"the export's PyTorch-vs-ONNX check did not pass: {validation}")
        if files.get("base.onnx.data", 0) <= 2 * 10**9 and not args.layers:
            problems.append(f"base.onnx.data missing or not over 2 GB: {files}")
        if peak_gib > args.max_rss_gib:
            problems.append(f"peak RSS {peak_gib:.1f} GiB over {args.max_rss_gib} GiB")
        result = {
            "ok": not problems,
            "problems": problems,
            "config": {**TINYLLAMA, **({"num_hidden_layers": args.layers} if args.layers else {}), "medusa": MEDUSA},
            "dtype": args.dtype,
            "parameters": {"base": n_base, "medusa": n_drafter},
            "build_s": round(t_build, 1),
            "save_s": round(t_save, 1),
            "export_wall_s": round(run["wall_s"], 1),
            "export_steps_s": run["steps_s"],
            "peak_rss_gib": round(peak_gib, 2),
            "files": files,
            "model_dir_bytes": sum(p.stat().st_size for p in model_dir.iterdir()),
            "max_logits_abs_error": logits_err,
            "max_abs_error_any_output": max(max_abs.values(), default=None),
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__},
        }
        print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 0 if not problems else 1
    finally:
        if not args.keep:
            shutil.rmtree(model_dir, ignore_errors=True)
            shutil.rmtree(out_dir, ignore_errors=True)
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
