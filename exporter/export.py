"""Export a HF causal LM and its drafter to ONNX graphs with tree-attention inputs.

    python -m exporter.export model_dir out_dir [--drafter PATH] [--dtype float32] [--overwrite]

Writes ``base.onnx`` (and ``draft.onnx`` when there is a drafter), ``manifest.json`` and the
tokenizer files into ``out_dir``. The export is built in a temporary directory beside
``out_dir``, checked against PyTorch (:mod:`exporter.compare`) and moved into place only when
complete, under a lock on ``out_dir`` (:mod:`exporter.outdir`): a failed or terminated export leaves
nothing behind, and ``--overwrite`` replaces an earlier export only (``--overwrite-non-export OUT_DIR``
replaces anything). Without ``model_dir`` it builds the project's demo model first.
"""

from __future__ import annotations

import copy
import shutil
import sys
import time
from pathlib import Path

import torch

from exporter.cli import signals_as_interrupt
from exporter.eagle_tree import bake_eagle_trees, parse_tree
from exporter.inputs import check_export_inputs, check_opset, copy_model_files
from exporter.kvgraph import build_kv_update
from exporter.loading import UserError, load_model
from exporter.outdir import OutDir
from exporter.trace import (
    OPSET,
    TORCH_DTYPES,
    TRACED_ROLES,
    aux_layer_ids,
    export_graph,
    graph_specs,
    model_dims,
)
from graphs.manifest import Manifest

# Files copied from model_dir so that the runtime can tokenize and stop without transformers, and
# other tools (AutoTokenizer, AutoConfig, GenerationConfig, chat templates) read the export directory
# as they read the model's. config.json is written by copy_model_files (the base's, no drafter key).
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
COPIED_DIRS = ("additional_chat_templates",)  # transformers' extra named chat templates (*.jinja)
DRAFTER_CONFIG_KEYS = ("speculative_decoding",)  # ours, in config.json: the export's config is the base's
EXTERNAL_DATA_BYTES = 1 << 31  # protobuf's 2 GB limit: larger graphs keep weights in one .data file



class Steps:
    """Timed progress lines: ``[2/5] trace base graph ... 3.1 s``."""

    def __init__(self, total: int, log=print):
        self.total, self.n, self.log = total, 0, log

    def __call__(self, what: str):
        self.n += 1
        return _Step(f"[{self.n}/{self.total}] {what}", self.log)


class _Step:
    def __init__(self, label, log):
        self.label, self.log = label, log

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.log(f"{self.label} ...", flush=True)
        return self

    def __exit__(self, exc_type, *exc):
        dt = time.perf_counter() - self.t0
        self.log(f"{self.label} {'done' if exc_type is None else 'FAILED'} in {dt:.1f} s", flush=True)
        return False


def copy_export_files(model_dir: Path, dst: Path) -> None:
    """The tokenizer, chat template and generation files of ``model_dir``, and the base's config.json
    (without our drafter key), so that HF loaders read the export directory as they read a model's."""
    import json

    copy_model_files(model_dir, dst, COPIED_FILES)  # regular files only; links must stay in model_dir
    for name in COPIED_DIRS:
        src = model_dir / name
        if src.is_dir() and not src.is_symlink():
            (dst / name).mkdir()
            copy_model_files(src, dst / name, sorted(p.name for p in src.iterdir() if not p.is_dir()))
    config = json.loads((model_dir / "config.json").read_text())
    for key in DRAFTER_CONFIG_KEYS:
        config.pop(key, None)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _trace_one(model, role, spec, tmp: Path, opset: int) -> None:
    """Trace into a scratch dir, then store as one .onnx (+ one .onnx.data if over 2 GB)."""
    scratch = tmp / f"_trace_{role}"
    scratch.mkdir()
    path = export_graph(model, role, spec, scratch / spec.file, opset=opset)
    files = list(scratch.iterdir())
    size = sum(f.stat().st_size for f in files)
    if size < EXTERNAL_DATA_BYTES and len(files) == 1:
        path.rename(tmp / spec.file)
    else:
        consolidate_external_data(path, tmp / spec.file)
    shutil.rmtree(scratch)


def _tensors(graph):
    """Every TensorProto stored in ``graph``: initializers and constant attributes, subgraphs too."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for g in attr.graphs:
                yield from _tensors(g)


def consolidate_external_data(src: Path, dst: Path, min_bytes: int = 1024, align: int = 4096) -> Path:
    """Rewrite ``src`` (weights inline or in per-tensor files beside it) as ``dst`` + ``dst.data``.

    Streams tensor by tensor, so the weights never sit in memory all at once (``onnx.load`` of a
    1.1B-parameter graph would hold all 4.4 GB, and ``onnx.save`` a second copy). Tensors under
    ``min_bytes`` stay inline; offsets are page-aligned so ONNX Runtime can mmap them.
    """
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    proto = onnx.load(str(src), load_external_data=False)
    data_name = f"{dst.name}.data"
    with open(dst.parent / data_name, "wb") as out:
        for t in _tensors(proto.graph):
            if uses_external_data(t):
                info = ExternalDataInfo(t)
                with open(src.parent / info.location, "rb") as f:
                    f.seek(info.offset or 0)
                    data = f.read(info.length) if info.length else f.read()
                del t.external_data[:]
            elif t.HasField("raw_data") and len(t.raw_data) >= min_bytes:
                data = t.raw_data
                t.ClearField("raw_data")
            else:
                continue
            offset = -(-out.tell() // align) * align
            out.seek(offset)
            out.write(data)
            for key, value in (("location", data_name), ("offset", offset), ("length", len(data))):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            t.data_location = onnx.TensorProto.EXTERNAL
            del data
    onnx.save(proto, str(dst))
    return dst


def describe_source(model, dtype: str) -> dict:
    cfg = model.config
    dims = model_dims(model, dtype)
    return {
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_kv_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        # the graphs attend every unmasked column: exact only while a sequence fits the window
        "sliding_window": getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None,
        "dtype": dtype,
        "parameters": sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("medusa", "eagle"))),
    }


def describe_drafter(model) -> tuple[dict | None, dict]:
    """(manifest ``drafter`` entry, default ``tree``)."""
    from graphs.trees import DEFAULT_EAGLE_TREE, default_medusa_paths

    mode = getattr(model, "spec_mode", None)
    if mode is None:
        return None, {}
    cfg = model.config.speculative_decoding["config"]
    n_params = sum(p.numel() for p in model.drafter.parameters())
    if mode == "medusa":
        n = len(model.medusa_heads)
        return ({"kind": "medusa", "num_heads": n, "parameters": n_params, "config": cfg},
                {"medusa_paths": default_medusa_paths(n)})
    mod = model.eagle_module
    entry = {
        "kind": "eagle",
        "eagle3": mod.eagle3,
        "num_layers": len(mod.layers),
        "num_kv_heads": mod.num_kv_heads,
        "head_dim": mod.head_dim,
        "draft_vocab_size": mod.lm_head.out_features if mod.eagle3 else model.config.vocab_size,
        "aux_layer_ids": list(aux_layer_ids(model)),
        "parameters": n_params,
        "config": cfg,
    }
    return entry, {"eagle": dict(DEFAULT_EAGLE_TREE)}


def _generation(model_dir: Path, model) -> dict:
    import json

    cfg = model.config
    gen = {}
    f = model_dir / "generation_config.json"
    if f.is_file():
        gen = json.loads(f.read_text())
    eos = gen.get("eos_token_id", cfg.eos_token_id)
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return {
        "eos_token_ids": eos,
        "bos_token_id": gen.get("bos_token_id", cfg.bos_token_id),
        "pad_token_id": gen.get("pad_token_id", cfg.pad_token_id),
    }


def _versions() -> dict:
    import onnx
    import onnxruntime
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__}


def export(
    model_dir,
    out_dir,
    *,
    drafter=None,
    dtype: str = "float32",
    overwrite: bool = False,
    opset: int = OPSET,
    validate: bool = True,
    trust_remote_code: bool = False,
    eagle_trees=None,
    log=print,
    overwrite_non_export: bool = False,
) -> Manifest:
    """Export ``model_dir`` into ``out_dir``; returns the manifest written there.

    ``overwrite`` replaces an earlier export in ``out_dir``; ``overwrite_non_export`` replaces whatever
    is there (see :mod:`exporter.outdir` for what is locked, re-checked and moved atomically).
    """
    if dtype not in TORCH_DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; accepted: {', '.join(TORCH_DTYPES)}")
    check_opset(opset)
    model_dir, out_dir = Path(model_dir), Path(out_dir).absolute()
    target = OutDir(out_dir, overwrite=overwrite, overwrite_non_export=overwrite_non_export,
                    inputs=[model_dir] + ([Path(drafter)] if drafter else []))
    with signals_as_interrupt():  # SIGTERM cleans up as Ctrl-C does
        return _export(target, model_dir, out_dir, drafter, dtype, opset, validate, trust_remote_code, eagle_trees,
                       log)


def _export(target: OutDir, model_dir: Path, out_dir: Path, drafter, dtype, opset, validate, trust_remote_code,
            eagle_trees, log) -> Manifest:
    tmp = target.open()
    steps = Steps(5, log)
    try:
        with steps(f"load {model_dir}"):
            check_export_inputs(model_dir, COPIED_FILES)  # generation_config.json, tokenizer.json: before any tracing
            model = load_model(model_dir, drafter=drafter, trust_remote_code=trust_remote_code)
        traced = model if dtype == "float32" else copy.deepcopy(model).to(TORCH_DTYPES[dtype])
        specs = graph_specs(model, dtype)
        drafter_entry, tree = describe_drafter(model)
        if drafter_entry is None:
            log("note: no drafter in this model: exporting the base graph alone (autoregressive decoding)")
        with steps("trace base graph"):
            _trace_one(traced, "base", specs["base"], tmp, opset)
        with steps("trace draft graph" if "draft" in specs else "trace draft graph (none: base only)"):
            if "draft" in specs:
                _trace_one(traced, "draft", specs["draft"], tmp, opset)
            # one-call EAGLE-2 trees (None: the default tree), added to specs and tree["eagle_trees"]
            bake_eagle_trees(traced, specs, tree, eagle_trees,
                             lambda r, m=traced: _trace_one(m, r, specs[r], tmp, opset))
            for role in ("kv_update", "draft_kv_update"):
                if role in specs:
                    build_kv_update(specs[role], tmp / specs[role].file, opset=opset)
        del traced
        manifest = Manifest(
            source=describe_source(model, dtype),
            graphs=specs,
            drafter=drafter_entry,
            tree=tree,
            generation=_generation(model_dir, model),
            opset=opset,
            versions=_versions(),
        )
        copy_export_files(model_dir, tmp)
        manifest.tokenizer = "tokenizer.json" if (tmp / "tokenizer.json").is_file() else None
        with steps("check ONNX Runtime against PyTorch"):
            if validate:
                _validate(model, tmp, manifest, dtype, log)
            else:
                manifest.validation = {"ok": None, "skipped": "--no-validate"}
        with steps(f"write {out_dir}"):
            target.commit(manifest)  # writes the manifest, re-checks out_dir under the lock, moves
        return manifest
    finally:
        target.close()  # removes tmp unless it was moved into place; releases the lock


def _validate(model, tmp: Path, manifest: Manifest, dtype: str, log) -> None:
    """Compare the graphs in ``tmp`` with ``model``; raise UserError if they disagree.

    A reduced-precision graph that ONNX Runtime's CPU provider cannot run at all (bfloat16: no CPU
    kernels for several ops) is checked structurally with ``onnx.checker`` instead, and the manifest
    and the log say that the numerical check was skipped.
    """
    import onnx

    from exporter.compare import UnsupportedProviderError, compare_model

    try:
        report = compare_model(model, tmp, manifest=manifest)
    except UnsupportedProviderError as e:
        if dtype == "float32":
            raise
        for spec in manifest.graphs.values():
            onnx.checker.check_model(str(tmp / spec.file))
        reason = str(e)
        manifest.validation = {"ok": None, "dtype": dtype, "device": "cpu", "skipped": reason}
        log(f"note: numerical check skipped: {reason}; the graphs passed onnx.checker")
        if dtype == "bfloat16":
            log("note: bfloat16 graphs are for other ONNX runtimes; graphs.load runs float32 and float16 exports")
        return
    manifest.validation = {"ok": report.ok, "dtype": report.dtype, "device": report.device,
                           "max_abs": {f"{r.graph}/{r.case}/{r.output}": r.max_abs for r in report.rows}}
    if not report.ok:
        log(report.table())
        bad = report.failures()[0]
        raise UserError(
            f"exported {bad.graph} graph disagrees with PyTorch: {bad.output} in case {bad.case} "
            f"max abs error {bad.max_abs:.3g} > {bad.limit:.3g}; nothing was written"
        )


def main(argv=None) -> int:
    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", nargs="?",
                    help="HF model directory, or a hub id (org/name) in the local HF cache; never downloads "
                         "(default: build the demo model in spec-demo/model)")
    ap.add_argument("out_dir", nargs="?",
                    help="where to write the export, empty or absent (default with no model_dir: spec-demo/onnx)")
    ap.add_argument("--drafter", help="a drafter trained elsewhere (ModelOpt, Medusa, EAGLE, EAGLE-3 files) "
                                      "(default: the drafter saved in model_dir, if any)")
    ap.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES), help="precision of the graphs")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier export in out_dir")
    ap.add_argument("--overwrite-non-export", metavar="OUT_DIR",
                    help="replace out_dir whatever it holds (deletes it); must repeat out_dir (default: never)")
    ap.add_argument("--opset", type=int, default=OPSET, help="ONNX opset of the graphs")
    ap.add_argument("--eagle-trees", nargs="+", type=parse_tree, metavar="K,D,T",
                    help="EAGLE: bake one-call draft graphs for these (topk, depth, total_tokens) trees "
                         "(default: the default tree 2,3,6)")
    ap.add_argument("--no-validate", action="store_true", help="skip the PyTorch-vs-ONNX check (not advised)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run the model's own Python code from its directory (off: only transformers' code runs)")
    ap.add_argument("--optimize", action="store_true", help="then run python -m exporter.optimize on the export")
    from exporter.optimize import add_arguments, options_from_args

    add_arguments(ap)  # --target, --quantize, ... (used with --optimize)
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_intermixed_args(argv)  # options may come between model_dir and out_dir

    def body():
        from exporter.hub import resolve_model

        model_dir, out_dir, overwrite = args.model_dir, args.out_dir, args.overwrite
        if model_dir is None:
            from exporter.demo import default_paths, prepare_demo

            model_dir, default_out = default_paths()
            out_dir = Path(out_dir or default_out)
            overwrite = prepare_demo(model_dir, out_dir) or overwrite  # a rerun replaces its own export
        elif out_dir is None:
            raise UserError("missing out_dir: python -m exporter.export model_dir out_dir")
        force = args.overwrite_non_export
        if force is not None and Path(force).absolute() != Path(out_dir).absolute():
            raise UserError(f"--overwrite-non-export must repeat out_dir ({out_dir}), got {force}")
        model_dir = resolve_model(model_dir)  # a directory, or org/name from the local HF cache
        t0 = time.perf_counter()
        manifest = export(model_dir, out_dir, drafter=args.drafter, dtype=args.dtype, overwrite=overwrite,
                          opset=args.opset, validate=not args.no_validate, trust_remote_code=args.trust_remote_code,
                          eagle_trees=args.eagle_trees, overwrite_non_export=force is not None)
        graphs = ", ".join(manifest.graphs[r].file for r in TRACED_ROLES if r in manifest.graphs)
        print(f"exported {graphs} to {out_dir} in {time.perf_counter() - t0:.1f} s")
        if args.optimize:  # a step of its own: the export above is complete and valid whatever happens here
            from exporter.optimize import optimize_export

            optimize_export(out_dir, **options_from_args(args))
        return 0

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
