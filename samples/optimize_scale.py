"""Raw vs fused vs int4 (and int8) verify latency on a TinyLlama-1.1B-shaped base (random weights).

    python samples/optimize_scale.py [--layers N] [--variants raw,fused,int4] [--tree-tokens 1,8,16,32]
                                     [--json F] [--png F]
                                     [--shape tinyllama|medium] [--work DIR] [--keep]

Builds the base with TinyLlama-1.1B's configuration (samples/scale_export.py; nothing downloaded),
exports it without a drafter (``--no-validate``: samples/scale_export.py is the export's own check
at this size), and runs :func:`exporter.benchmark.variants.run_variants` on it: base-graph latency at 1, 8,
16 and 32 tree tokens over a 256-token past, variants interleaved. ``--layers N`` keeps the real
layer shape with fewer layers (per-layer cost; the lm_head and embeddings stay full size) when
time or memory is short: the report says how many layers were measured. ``--shape medium`` uses
the 19M-parameter shape of the trained benchmark model (hidden 512, 6 layers, vocab 512) instead.

Needs about 3x the float32 weights in free disk under ``--work`` (22 layers: ~15 GB) and ~10 GB of
memory at 22 layers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MEDIUM = dict(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=1024)


def build(shape: str, layers: int | None):
    if shape == "tinyllama":
        from samples.scale_export import build_model

        return build_model(layers)
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{**MEDIUM, **({"num_hidden_layers": layers} if layers else {})},
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["tinyllama", "medium"], default="tinyllama")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the real shape")
    ap.add_argument("--variants", default="raw,fused,int4")
    ap.add_argument("--medusa", action="store_true", help="add an (untrained) 2-head Medusa drafter and measure "
                    "end-to-end tokens/s too; its acceptance is not a trained drafter's")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--tree-tokens", default="1,8,16,32",
                    help="tree sizes (tokens per verify call) whose base-graph latency is measured")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--reuse", action="store_true", help="reuse the export already under --work (from an earlier "
                    "run with --keep) instead of building and exporting the model again")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    args = ap.parse_args(argv)

    from exporter.benchmark import variants
    from exporter.export import export
    from exporter.speculative import enable_huggingface_checkpointing
    from graphs.sessions import use_shared_thread_pool

    use_shared_thread_pool(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="optimize-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        if args.reuse and (work / "onnx" / "manifest.json").is_file():
            n_layers, params = _saved_shape(work)
            print(f"reusing {work / 'onnx'}: {n_layers} layers, {params / 1e6:.0f}M parameters", flush=True)
        else:
            model = build(args.shape, args.layers)
            n_layers = model.config.num_hidden_layers
            params = sum(p.numel() for p in model.parameters())
            print(f"{args.shape} base, {n_layers} layers, {params / 1e6:.0f}M parameters", flush=True)
            if args.medusa:
                from exporter.speculative import convert

                convert(model, [("medusa", {"medusa_num_heads": 2, "medusa_num_layers": 1})])
            enable_huggingface_checkpointing()
            model.save_pretrained(work / "model")
            del model
            export(work / "model", work / "onnx", validate=False, overwrite=True)
        tree_tokens = tuple(int(t) for t in args.tree_tokens.split(","))
        report = variants.run_variants(work / "onnx", args.variants.split(","), e2e=args.medusa, threads=args.threads,
                                       tree_tokens=tree_tokens,
                                       repeats=1, prompts=3, max_new_tokens=args.max_new_tokens)
        report.update(shape=args.shape, layers=n_layers, parameters=params, seconds_total=time.perf_counter() - t0)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        if args.png:
            variants.draw(report, args.png)
        return 0
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)


def _saved_shape(work: Path) -> tuple[int, int]:
    """Layers and base parameters of the model saved under ``work`` (safetensors headers only)."""
    from safetensors import safe_open

    n_layers = json.loads((work / "model" / "config.json").read_text())["num_hidden_layers"]
    params = 0
    for f in (work / "model").glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            for k in st.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if not k.startswith(("medusa", "eagle")):
                    n = 1
                    for d in st.get_slice(k).get_shape():
                        n *= d
                    params += n
    return n_layers, params


if __name__ == "__main__":
    sys.exit(main())
