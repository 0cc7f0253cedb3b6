"""The pipeline: the one module that chains the stages. Every ``python -m exporter.<verb>`` calls here.

    export           load -> plan -> trace -> validate -> write [-> optimize_export]
    optimize_export  read -> optimize -> check parity -> write [-> tune_export]
    tune_export      read -> tune (measure, choose) [-> load -> plan -> trace -> validate: bake] -> write
    compare          load -> plan check -> validate (the report, nothing written)
    prepare_variants copy -> optimize_export [-> tune_export], per variant (``bench --variants``)

The stages are modules of their own (:mod:`exporter.loading`, :mod:`exporter.plan`,
:mod:`exporter.trace`, :mod:`exporter.optimizing`, :mod:`exporter.validate`, :mod:`exporter.tuning`,
:mod:`exporter.outdir` the writer); none of them imports this module, a CLI or the benchmark
(``tests/test_layers.py``). Every change to an export directory goes through one writer
(:class:`exporter.outdir.OutDir`): the lock, a temporary copy, validation, rehashing, the atomic
swap, so a failure, a signal or a kill at any point leaves the export as it was.

The path of ``model_dir`` through :func:`export`::

    OutDir(out_dir, inputs=[model_dir]).open()      lock, check out_dir, temporary directory
    loading.load(model_dir)                          -> model (float32, drafter attached)
    plan.build_plan(model, model_dir)                -> ExportPlan (specs, manifest parts, trees)
    trace.trace_graphs(model, plan, tmp)             graph files in tmp
    inputs.copy_export_files(model_dir, tmp)         tokenizer, configs, chat templates
    validate.validate_export(model, tmp, manifest, plan)   -> the manifest's validation record
    OutDir.commit(manifest)                          rehash, manifest, swap into place
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from exporter.cli import signals_as_interrupt
from exporter.errors import UserError
from exporter.outdir import OutDir, write_manifest
from exporter.plan import DTYPES, OPSET, build_plan, versions
from exporter.progress import heartbeat
from graphs import contract as C
from graphs.manifest import MANIFEST, ArtifactError, Manifest

# ----------------------------------------------------------------------------- progress


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
        self._beat = heartbeat(self.label, self.log)  # a line every 10 s while the step runs
        self._beat.__enter__()
        return self

    def __exit__(self, exc_type, *exc):
        self._beat.__exit__(exc_type, *exc)
        dt = time.perf_counter() - self.t0
        self.log(f"{self.label} {'done' if exc_type is None else 'FAILED'} in {dt:.1f} s", flush=True)
        return False


def _quiet(*_a, **_k) -> None:
    pass


# ----------------------------------------------------------------------------- export


@dataclass(frozen=True)
class ExportOptions:
    """How to export (``python -m exporter.export``'s flags); checked before anything is locked or loaded."""

    drafter: str | None = None  # a drafter trained elsewhere; None: the one saved in model_dir, if any
    dtype: str = "float32"  # precision of the graphs
    opset: int = OPSET
    validate: bool = True  # the PyTorch-vs-ONNX gate before the move (not advised to skip)
    trust_remote_code: bool = False  # run the model's own Python code
    eagle_trees: tuple | None = None  # one-call EAGLE trees to bake; None: the default tree
    external_data_bytes: int | None = None  # graphs over this keep weights in one .data file (None: 2 GB)

    def __post_init__(self):
        from exporter.inputs import check_opset

        if self.dtype not in DTYPES:
            raise UserError(f"unknown --dtype {self.dtype!r}; accepted: {', '.join(DTYPES)}")
        check_opset(self.opset)


def check_dtype(dtype) -> None:
    """``--dtype`` must be one the runtime can feed: bfloat16 graphs traced, hashed and validated (on a
    GPU) would then be refused by ``graphs.load``, so they are refused here, before any work."""
    from exporter import plan

    if dtype in plan.DTYPES and dtype not in plan.RUNTIME_DTYPES:  # unknown ones: ExportOptions says so
        raise UserError(f"--dtype {dtype}: the runtime (graphs.load) cannot feed {dtype} graphs (numpy has no "
                        f"{dtype}); export with --dtype float16 (GPUs) or float32")


def export(model_dir, out_dir, *, drafter=None, dtype: str = "float32", overwrite: bool = False, opset: int = OPSET,
           validate: bool = True, trust_remote_code: bool = False, eagle_trees=None, log=print,
           overwrite_non_export: bool = False, external_data_bytes: int | None = None,
           optimize: dict | None = None) -> Manifest:
    """Export ``model_dir`` into ``out_dir``; returns the manifest written there.

    ``overwrite`` replaces an earlier export in ``out_dir``; ``overwrite_non_export`` replaces whatever
    is there (see :mod:`exporter.outdir` for what is locked, re-checked and moved atomically).
    ``optimize``: then :func:`optimize_export` with these keywords, a step of its own (the export is
    complete and valid whatever happens there).
    """
    check_dtype(dtype)
    opts = ExportOptions(drafter=drafter, dtype=dtype, opset=opset, validate=validate,
                         trust_remote_code=trust_remote_code,
                         eagle_trees=None if eagle_trees is None else tuple(map(tuple, eagle_trees)),
                         external_data_bytes=external_data_bytes)
    model_dir, out_dir = Path(model_dir), Path(out_dir).absolute()
    target = OutDir(out_dir, overwrite=overwrite, overwrite_non_export=overwrite_non_export,
                    inputs=[model_dir] + ([Path(drafter)] if drafter else []))
    t0 = time.perf_counter()
    with signals_as_interrupt():  # SIGTERM cleans up as Ctrl-C does
        manifest = _export(target, model_dir, out_dir, opts, log)
    graphs = ", ".join(g.file for g in manifest.graphs.values())  # every graph file, tree graphs included
    log(f"exported {graphs} to {out_dir} in {time.perf_counter() - t0:.1f} s")
    if optimize is not None:  # a step of its own: the export above is complete and valid whatever happens here
        optimize_export(out_dir, **optimize)
    return manifest


def _export(target: OutDir, model_dir: Path, out_dir: Path, opts: ExportOptions, log) -> Manifest:
    from exporter.inputs import copy_export_files
    from exporter.loading import load
    from exporter.trace import trace_graphs
    from exporter.validate import validate_export

    had_export = (Path(os.path.realpath(out_dir)) / MANIFEST).is_file()
    tmp = target.open()
    steps = Steps(5, log)
    try:
        with steps(f"load {model_dir}"):
            model = load(model_dir, drafter=opts.drafter, trust_remote_code=opts.trust_remote_code)
        plan = build_plan(model, model_dir, dtype=opts.dtype, opset=opts.opset, eagle_trees=opts.eagle_trees)
        check_export_space(model, opts.dtype, tmp.parent, out_dir)
        if plan.drafter is None:
            log("note: no drafter in this model: exporting the base graph alone (autoregressive decoding)")
        trace_graphs(model, plan, tmp, external_data_bytes=opts.external_data_bytes, steps=steps)
        manifest = plan.manifest()
        copy_export_files(model_dir, tmp)
        manifest.tokenizer = "tokenizer.json" if (tmp / "tokenizer.json").is_file() else None
        with steps("check ONNX Runtime against PyTorch"):
            manifest.validation = (validate_export(model, tmp, manifest, plan, log) if opts.validate
                                   else {"ok": None, "skipped": "--no-validate"})
        with steps(f"write {out_dir}"):
            target.commit(manifest)  # rehashes, writes the manifest, re-checks out_dir under the lock, moves
        return manifest
    except Exception as e:
        if not disk_full(e):
            raise
        kept = f"the earlier export in {out_dir} is untouched" if had_export else f"{out_dir} was not created"
        where = f" (writing {Path(e.filename).name})" if isinstance(e, OSError) and e.filename else ""
        raise UserError(f"disk full while writing the export beside {out_dir}{where}; nothing was written and {kept}: "
                        f"free some space and export again") from None
    finally:
        target.close()  # removes tmp unless it was moved into place; releases the lock


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(e: BaseException) -> bool:
    """An out-of-space failure: an OSError with ENOSPC / EDQUOT, or a wrapped one (torch's C++ writer
    reports it as a RuntimeError holding the system's words)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return True
        if any(os.strerror(n) in str(e) for n in _DISK_FULL):
            return True
        e = e.__cause__ or e.__context__
    return False


def check_export_space(model, dtype: str, where: Path, out_dir: Path) -> None:
    """Fail before tracing when the disk cannot hold even the weights once (the graphs store every
    parameter at least once, at the export's dtype): the trace would fill it and fail minutes later."""
    need = sum(p.numel() for p in model.parameters()) * {"float16": 2, "bfloat16": 2}.get(dtype, 4)
    free = shutil.disk_usage(where).free
    if free < need:
        raise UserError(f"not enough disk space for the export beside {out_dir}: its weights alone take "
                        f"{need / 1e9:.2f} GB, {free / 1e9:.2f} GB are free; free some space or pick another out_dir")


# ----------------------------------------------------------------------------- updates of an export


def _check_updatable(out_dir: Path) -> None:
    """optimize and tune rewrite the export beside itself and swap it in: both directories must be
    writable, checked before any work (a read-only file system failed with a raw error, tune only at
    the end of its run)."""
    for d in (out_dir, out_dir.parent):
        if not os.access(d, os.W_OK | os.X_OK):
            raise UserError(f"{d} is not writable (read-only file system or permissions), and {out_dir} is "
                            f"rewritten beside itself; copy the export to a writable place and run there")


def _read_export(out_dir: Path) -> Manifest:
    try:
        return Manifest.read(out_dir)
    except ArtifactError as e:
        raise UserError(str(e)) from None


def _preview(tmp: Path, manifest: Manifest) -> Path:
    """A loadable snapshot of the writer's ``tmp`` (hard links, beside it, named as a stale temporary
    so a kill leaves nothing behind): ``graphs.load`` refuses the writer's marker file in tmp itself."""
    from graphs.manifest import PARTIAL_MARK

    view = Path(tempfile.mkdtemp(prefix=tmp.name.split(".tmp-")[0] + ".tmp-", dir=tmp.parent))
    for p in sorted(tmp.rglob("*")):
        rel = p.relative_to(tmp)
        if p.is_dir():
            (view / rel).mkdir(exist_ok=True)
        elif p.name != PARTIAL_MARK:
            try:
                (view / rel).hardlink_to(p)
            except OSError:
                shutil.copy2(p, view / rel)
    write_manifest(manifest, view)
    return view


def roles_done(records: dict) -> str:
    """What optimize did to each graph, for its messages: "base: attention+rotary+norms+int4; draft: unchanged"
    (a role with no pass is "unchanged": the final line ended in "draft " and the already-optimized one
    in "draft: )")."""
    parts = [f"{role}: {'+'.join(map(str, rec.get('passes') or [])) or 'unchanged'}"
             for role, rec in records.items() if isinstance(rec, dict) and not C.is_device_role(role)]
    return "; ".join(parts) or "nothing changed"


def optimize_export(out_dir, *, target: str = "cpu", quantize: str = "none", progress=print, tune: bool = False,
                    tune_budget_s: float | None = None, tune_prompts: list[str] | None = None,
                    tune_threads: int | None = None, **opts) -> dict:
    """Optimize the export in ``out_dir`` in place; returns the summary (JSON-able).

    ``opts``: the other fields of :class:`exporter.optimizing.OptimizeOptions` (fuse, float16,
    block_size, accuracy_level, validate, time_gain). Raises :class:`UserError` on bad input; the
    export is then untouched.

    ``tune``: then re-tune the default tree for the optimized graphs on this machine
    (:func:`tune_export`; the CLI's default). Fusion and above all int4 change how a step's cost
    grows with tree size (measured on a 71M base: 8 tokens cost 1.65x one in float32, 2.4x in int4),
    so a tree tuned on the raw graphs is not the best one for these. Skipped, with a line saying so,
    for exports without a drafter and for a target whose provider this machine lacks.
    """
    from exporter import optimizing as O

    unknown = set(opts) - {f.name for f in dataclasses.fields(O.OptimizeOptions)}
    if unknown:
        raise UserError(f"unknown option(s) {sorted(unknown)}; accepted: "
                        f"{', '.join(f.name for f in dataclasses.fields(O.OptimizeOptions))}")
    options = O.OptimizeOptions(target=target, quantize=quantize, **opts)
    log = progress or _quiet
    out_dir = Path(out_dir).absolute()
    manifest = _read_export(out_dir)
    if manifest.optimization:
        raise UserError(f"{out_dir} is already optimized ({roles_done(manifest.optimization)}); passes apply to "
                        f"the raw trace only: "
                        f"re-export it (python -m exporter.export) and optimize that")
    if manifest.source.get("dtype", "float32") != "float32":
        raise UserError(f"{out_dir} holds {manifest.source.get('dtype')} graphs; optimize a float32 export "
                        f"(float16 for CUDA is --target cuda)")
    O.check_space(out_dir, manifest)
    t_start = time.perf_counter()
    draft_q = options.quant_for("draft")
    log(f"optimize {out_dir}: target {options.target}, quantize {options.quantize}"
        f"{'' if draft_q == options.quantize else f' (drafter: {draft_q})'}, "
        f"fuse {options.fuse}, dtype {'float16' if options.use_float16 else 'float32'}", flush=True)
    _check_updatable(out_dir)
    writer = OutDir(out_dir, update=True)
    with signals_as_interrupt():
        tmp = writer.open()
        try:
            manifest = _read_export(out_dir)  # under the lock: what this update changes
            writer.carry(skip=O.rewritten_files(out_dir, manifest, options))
            specs, records = O.optimize_graphs(out_dir, tmp, manifest, options, log)
            writer.checkpoint("optimized")
            validation = (O.check_parity(out_dir, tmp, manifest, specs, options, log) if options.validate
                          else {"skipped": True})
            gain = O.time_gain(out_dir, tmp, manifest, specs, log) if options.time_gain else {}
            if "rows" in validation:  # what the runtime must do for rows to agree (graphs.runtime reads it)
                records["base"]["min_rows"] = validation["rows"]["min_rows"]
                rows = validation["rows"]
                records["base"]["rows_max_abs"] = O.rows_bound(rows["single_max_abs"],
                                                               [rows["multi_max_abs"], rows["tree_max_abs"]],
                                                               rows["min_rows"])
            if options.validate:
                one = O.check_one_sequence(out_dir, tmp, manifest, specs, records, options, log,
                                           rows_record=validation.get("rows"))
                if one is not None:
                    validation["one_sequence"] = {k: v for k, v in one.items() if k != "file"}
            if options.target == "cuda":
                records["base"]["attention_forms"] = _attention_forms(tmp, manifest, specs, records, options,
                                                                      out_dir, log)
            manifest.graphs = specs
            manifest.optimization = records
            manifest.opset = max([manifest.opset] + [r.get("opset") or 0 for r in records.values()])
            manifest.versions = {**manifest.versions, **versions("optimize")}
            manifest.validation = {**manifest.validation, "optimize": {k: v for k, v in validation.items()
                                                                       if k != "graphs"}
                                   | {"graphs": {r: {k: v for k, v in g.items() if k != "rows"}
                                                 for r, g in validation.get("graphs", {}).items()}}}
            writer.commit(manifest)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UserError(f"disk full while writing the optimized graphs beside {out_dir}; the export is "
                                f"untouched: free some space and retry") from None
            raise
        finally:
            writer.close()
    summary = {
        "out_dir": str(out_dir),
        "options": dataclasses.asdict(options),
        "graphs": records,
        "validation": validation,
        "gain": gain,
        "seconds": time.perf_counter() - t_start,
    }
    log(f"optimized {out_dir} in {summary['seconds']:.1f} s: {roles_done(records)}", flush=True)
    if tune:
        budget = O.TUNE_BUDGET_S if tune_budget_s is None else tune_budget_s
        summary["tune"] = _retune(out_dir, options, manifest, budget, tune_prompts, tune_threads, log)
    return summary


def _attention_forms(tmp: Path, manifest: Manifest, specs: dict, records: dict, options, out_dir: Path, log) -> dict:
    """The ``--target cuda`` base's attention forms (:mod:`exporter.attention_forms`): measured and
    chosen here where this machine has the target's provider, else the Attention form by default."""
    from exporter import attention_forms as F
    from exporter.optimizing import rows_provider

    forms = F.forms_record(records["base"], specs["base"].file, out_hint=str(out_dir))
    if "gqa" not in forms["candidates"]:
        log("  [base] forms     one attention form (Attention): the GroupQueryAttention form was not built", flush=True)
        return forms
    provider = rows_provider(options)
    if provider == "cpu":
        log(f"  [base] forms     Attention and GroupQueryAttention built; Attention until measured on the GPU: "
            f"{forms['measure']}", flush=True)
        return forms
    try:
        measured = F.measure(tmp, forms, specs["base"], manifest.source["vocab_size"], provider=provider, log=log)
    except Exception as e:  # a kernel that refuses these shapes: the default form stays, and the reason is recorded
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        log(f"  [base] forms     not measured ({why}); Attention stays the default", flush=True)
        forms["measured"] = {"provider": provider, "error": why}
        return forms
    return F.choose(forms, measured, log)


def measure_attention_forms(out_dir, provider: str = "cuda", repeats: int | None = None, progress=print) -> dict:
    """Time both attention forms of an export optimized with ``--target cuda`` on ``provider`` and record
    the faster in its manifest (``optimization.base.attention_forms``); returns that record. The step
    ``optimize --target cuda`` runs itself on a machine with the GPU; this is it for an export
    optimized elsewhere (``python -m exporter.optimize OUT --measure-forms``)."""
    import onnxruntime as ort

    from exporter import attention_forms as F
    from exporter.optimizing import TARGETS

    log = progress or _quiet
    out_dir = Path(out_dir).absolute()
    first = _read_export(out_dir)
    if not ((first.optimization or {}).get("base") or {}).get("attention_forms"):
        raise UserError(f"{out_dir} has no attention forms to choose between; optimize a raw export with "
                        f"--target cuda first")
    if provider not in TARGETS:
        raise UserError(f"unknown provider {provider!r}; accepted: {', '.join(TARGETS)}")
    if TARGETS[provider] not in ort.get_available_providers():
        raise UserError(f"this machine has no {TARGETS[provider]} (onnxruntime {ort.__version__} offers "
                        f"{', '.join(ort.get_available_providers())}); measure on the GPU machine "
                        f"(docs/gpu.md installs onnxruntime-gpu there)")
    _check_updatable(out_dir)
    writer = OutDir(out_dir, update=True)
    with signals_as_interrupt():
        writer.open()
        try:
            manifest = _read_export(out_dir)
            writer.carry()
            forms = manifest.optimization["base"]["attention_forms"]
            try:
                measured = F.measure(out_dir, forms, manifest.graphs["base"], manifest.source["vocab_size"],
                                     provider=provider, repeats=repeats or F.REPEATS, log=log)
            except UserError:
                raise
            except Exception as e:
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise UserError(f"timing the attention forms on {provider} failed ({why}); the export is "
                                f"untouched and keeps its default form") from None
            F.choose(forms, measured, log)
            writer.commit(manifest)
        finally:
            writer.close()
    return forms


def _retune(out_dir: Path, options, manifest: Manifest, budget_s: float, prompts, threads, log) -> dict:
    """Re-tune the default tree on the optimized graphs (a step after the swap: the optimized export is
    complete and valid whatever happens here)."""
    import onnxruntime as ort

    from exporter.optimizing import TARGETS

    if not manifest.drafter:
        log("tune: no drafter in this export, no tree to tune", flush=True)
        return {"skipped": "no drafter"}
    from exporter.tuning import untunable

    why = untunable(manifest.drafter)
    if why:  # the optimized export stands; its default tree is the untuned one
        log(f"tune: skipped, {why}", flush=True)
        return {"skipped": why}
    provider = options.target
    if TARGETS[provider] not in ort.get_available_providers():
        log(f"tune: skipped, this machine has no {TARGETS[provider]}; on the {provider} machine run "
            f"python -m exporter.tune {out_dir} --provider {provider}", flush=True)
        return {"skipped": f"no {TARGETS[provider]} here"}
    log(f"tune: the default tree for these graphs on this machine (budget {budget_s:.0f} s; --no-tune skips)",
        flush=True)
    try:
        report = tune_export(out_dir, prompts=prompts, provider=provider, threads=threads, budget_s=budget_s,
                             log=lambda *a, **k: log("  " + " ".join(map(str, a)), **k))
    except UserError as e:
        raise UserError(f"{out_dir} is optimized, but tuning its tree failed ({e}); the default tree is the "
                        f"untuned one: retry with python -m exporter.tune {out_dir}") from None
    return report["confirmed"] | {"tree": report["tree"]}


def tune_export(out_dir, prompts: list[str] | None = None, provider: str = "cpu", threads: int | None = None,
                budget_s: float = 300.0, model_dir=None, max_new_tokens: int = 48, log=print) -> dict:
    """Measure, pick and record the fastest tree for ``out_dir`` on this machine; returns the report.

    ``model_dir``: EAGLE, the model the export came from: a winning tree that is not baked yet is
    traced, checked against PyTorch and added as a one-call graph (else such trees compete as
    step-wise drafts)."""
    import graphs
    from exporter import tuning
    from exporter.prompts import TUNE_PROMPTS

    out_dir = Path(out_dir).absolute()
    t_start = time.perf_counter()
    first = _read_export(out_dir)
    why = tuning.untunable(first.drafter)
    if why:
        raise UserError(f"{out_dir}: {why}")
    if prompts is not None:
        prompts = list(prompts)
        if not any(isinstance(p, str) and p.strip() for p in prompts):
            raise UserError("the tune prompts are all empty; give at least one non-empty prompt (or none, for the "
                            "built-in set)")
    if model_dir is not None:
        _check_bake_source(first, out_dir, Path(model_dir))
    _check_updatable(out_dir)
    writer = OutDir(out_dir, update=True)
    with signals_as_interrupt():
        tmp = writer.open()
        view = None
        try:
            manifest = _read_export(out_dir)
            writer.carry()
            dec = graphs.load(out_dir, provider=provider, threads=threads, adaptive=False)
            if not dec.kind:
                raise UserError(f"{out_dir} has no drafter: there is no tree to tune")
            ids = [dec.encode(p) for p in (TUNE_PROMPTS if prompts is None else prompts) if p.strip()]
            report = tuning.choose_tree(dec, ids, out_dir=out_dir, threads=threads, budget_s=budget_s,
                                        can_bake=model_dir is not None, max_new_tokens=max_new_tokens, log=log)
            writer.checkpoint("measured")
            if report["bake"] is not None:
                _bake_tree(tmp, manifest, out_dir, model_dir, report["bake"], log)
                writer.checkpoint("baked")
                view = _preview(tmp, manifest)
                dec = graphs.load(view, provider=provider, threads=threads, adaptive=False)  # the baked tree
            elif dec.kind != "medusa":
                dec = graphs.load(out_dir, provider=provider, threads=threads, adaptive=False)
            tuning.confirm(dec, ids, report, threads=threads, max_new_tokens=max_new_tokens, t_start=t_start,
                           log=log)
            del dec
            tuning.record_tree(manifest, report)
            writer.commit(manifest)
        finally:
            if view is not None:
                from graphs.integrity import forget

                forget(view)  # the proof record graphs.load kept for the snapshot
                shutil.rmtree(view, ignore_errors=True)
            writer.close()
    tuned = report["confirmed"]
    log(f"default tree: {report['tree']}; predicted {tuned['predicted_tokens_per_s']:.0f} tok/s, measured "
        f"{tuned['measured_tokens_per_s']:.0f} tok/s (autoregressive {report['autoregressive']['tokens_per_s']:.0f});"
        f" written to {out_dir / MANIFEST}", flush=True)
    return report


def _check_bake_source(manifest: Manifest, out_dir: Path, model_dir: Path) -> None:
    """``tune --model-dir``, checked before the tuning run (it used to fail after it): the export must have
    an EAGLE drafter (only EAGLE trees are baked) and ``model_dir`` must hold the same kind of drafter
    and base sizes as the export's manifest records."""
    import json

    kind = (manifest.drafter or {}).get("kind")
    if kind != "eagle":
        raise UserError(f"--model-dir bakes EAGLE trees, but {out_dir} has {'a ' + kind if kind else 'no'} drafter; "
                        f"drop --model-dir")
    cfg_path = model_dir / "config.json"
    try:
        cfg = json.loads(cfg_path.read_bytes())
    except FileNotFoundError:
        raise UserError(f"--model-dir {model_dir} has no config.json; pass the model directory {out_dir} was "
                        f"exported from") from None
    except (OSError, ValueError) as e:
        raise UserError(f"--model-dir {model_dir}: cannot read config.json ({e}); pass the model directory "
                        f"{out_dir} was exported from") from None
    spec = cfg.get("speculative_decoding") if isinstance(cfg, dict) else None
    mode = spec.get("mode") if isinstance(spec, dict) else None
    if mode != kind:
        raise UserError(f"--model-dir {model_dir} holds {'a ' + mode if mode else 'no'} drafter, but {out_dir} has "
                        f"an {kind} drafter; pass the model directory {out_dir} was exported from")
    src = manifest.source or {}
    for key, cfg_key in (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                         ("vocab_size", "vocab_size")):
        if key in src and cfg_key in cfg and cfg[cfg_key] != src[key]:
            raise UserError(f"--model-dir {model_dir} is not the model exported to {out_dir} ({cfg_key} "
                            f"{cfg[cfg_key]} vs {src[key]}); pass the model directory it was exported from")


def _bake_tree(tmp: Path, manifest: Manifest, out_dir: Path, model_dir, cfg: tuple[int, int, int], log) -> str:
    """load -> plan -> trace -> validate of one new one-call tree graph, into the writer's ``tmp``; the
    manifest lists it (written by the caller's commit)."""
    from exporter.loading import load_model
    from exporter.trace import trace_one
    from exporter.validate import check_tree_graph
    from graphs.contract import eagle_tree_role
    from graphs.sessions import make_session

    dtype = manifest.source["dtype"]
    if dtype != "float32":
        raise UserError(f"tune bakes new trees into float32 exports only ({out_dir} is {dtype}); re-export with "
                        f"--eagle-trees {','.join(map(str, cfg))}")
    model = load_model(model_dir)
    plan = build_plan(model, model_dir, dtype=dtype, eagle_trees=[cfg])
    role = eagle_tree_role(*cfg)
    spec = plan.specs[role]

    def past(g):
        return [t for t in g.inputs if t.name.startswith("past_key_values.")]

    if "draft" not in manifest.graphs or past(spec) != past(manifest.graphs["draft"]):
        raise UserError(f"--model-dir {model_dir} is not the model exported to {out_dir}")
    trace_one(model, role, spec, tmp, plan.opset)
    session = make_session(tmp / spec.file, provider="cpu")
    check_tree_graph(model, session, role, spec, dtype)
    del session
    manifest.graphs[role] = spec
    manifest.tree.setdefault("eagle_trees", []).append(
        {"topk": cfg[0], "depth": cfg[1], "total_tokens": cfg[2], "graph": role})
    log(f"baked {role} into {out_dir}")
    return role


# ----------------------------------------------------------------------------- compare


def compare(model_dir, out_dir, provider: str = "cpu", drafter=None, text: str | None = None,
            distance: bool = False):
    """Load the PyTorch model from ``model_dir`` and compare it with the export in ``out_dir``
    (:func:`exporter.validate.compare_model`; the model's plan must be the export's)."""
    from exporter.loading import load_model
    from exporter.validate import compare_model

    manifest = Manifest.read(out_dir)  # bad out_dir: one line before the model loads
    return compare_model(load_model(model_dir, drafter=drafter), out_dir, provider=provider, manifest=manifest,
                         text=text, distance=distance)


def compare_end_to_end(model_dir, out_dir, *, drafter=None, provider: str = "cpu", prompts=None,
                       max_new_tokens: int = 32) -> list:
    """Greedy tokens of PyTorch vs the runtime (speculative and autoregressive): :mod:`exporter.e2e` rows."""
    import graphs
    from exporter import e2e
    from exporter.distance import graph_quantization
    from exporter.loading import load_model

    e2e.check_prompts(prompts)  # before anything loads
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 for --e2e, got {max_new_tokens}; there is nothing to compare "
                        f"without new tokens")
    model = load_model(model_dir, drafter=drafter)
    decoder = graphs.load(out_dir, provider=provider)
    categories = None
    if not prompts:
        from exporter.chat_prompts import rendered_heldout

        chat = rendered_heldout(out_dir) if decoder.tokenizer is not None else None
        prompts, categories = ([t for _, t in chat], [c for c, _ in chat]) if chat else (
            e2e.default_prompts(decoder), None)
    quant = graph_quantization(Path(out_dir), decoder.manifest)
    return e2e.compare_tokens(model, decoder, prompts, max_new_tokens=max_new_tokens,
                              quantized=quant.get("base", "none") != "none", categories=categories)


# ----------------------------------------------------------------------------- variants (bench --variants)


def prepare_variants(out_dir, variants: dict[str, dict], work: Path, log=print, tune: bool = False,
                     threads: int | None = None) -> dict[str, Path]:
    """One copy of the raw export ``out_dir`` per variant under ``work``, optimized with that variant's
    :func:`optimize_export` keywords (``{}``: left raw); ``tune``: each copy's default tree re-tuned
    for its own graphs on this machine, as ``python -m exporter.optimize`` does."""
    from exporter.optimizing import TUNE_BUDGET_S

    manifest = Manifest.read(out_dir, verify=False)
    if manifest.optimization:
        raise UserError(f"{out_dir} is already optimized; --variants needs the raw export (re-export it)")
    tune = tune and bool(manifest.drafter)
    dirs = {}
    for name, opts in variants.items():
        d = Path(work) / name
        shutil.copytree(out_dir, d)
        tree = None
        if opts:
            log(f"variant {name}:", flush=True)
            summary = optimize_export(d, progress=_quiet, time_gain=False, tune=tune, tune_threads=threads, **opts)
            tree = summary.get("tune", {}).get("tree")
        elif tune:  # the raw copy is not optimized: tuned as optimize tunes the others
            tree = tune_export(d, threads=threads, budget_s=TUNE_BUDGET_S, log=_quiet)["tree"]
        if tune:
            log(f"variant {name}: tuned tree {tree}", flush=True)
        dirs[name] = d
    return dirs
