"""One benchmarked system in its own process: ``python -m exporter.benchmark.worker``.

Reads one JSON request per line on stdin and answers one JSON line each (on the original stdout;
anything a library prints goes to stderr):

    {"setup": {"runner": "ours"|"genai"|"hf"|"optimum", ...}}  -> {"ok": true, "info": {...}}
                                                               or {"ok": false, "unavailable": bool, "reason": str}
    {"run": {"ids": [...], "max_new_tokens": n, "temperature": t, "top_p": p, "top_k": k, "seed": s, "tree": ...}}
                                                               -> {"ok": true, "tokens": [...], "prefill_s": ...}
    {"close": true}                                            -> {"ok": true, "peak_rss_bytes": n}

Every runner reports the same timings: ``prefill_s`` until the first new token is known,
``decode_s`` for the rest, ``forwards`` (base forwards after the prefill), ``draft_calls``, and
``accepted`` (tokens emitted per base forward, where the system exposes it). Imports here are the
standard library only: this file also runs under another interpreter (optimum's own venv).

``python -m exporter.benchmark.worker --prepare plain|optimum SRC DST`` writes a peer's model
(the base alone as a plain HF directory; optimum's ONNX export of it) and exits.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path


class UnavailableError(Exception):
    """The system's stack is not installed here: reported and skipped, never fatal."""


def _file_bytes(paths) -> int:
    return int(sum(Path(p).stat().st_size for p in paths if Path(p).is_file()))


# ---------------------------------------------------------------- our runtime


class OursRunner:
    def __init__(self, spec: dict):
        try:
            import inspect

            import graphs
            from graphs.sessions import use_shared_thread_pool
        except ImportError as e:
            raise UnavailableError(f"the runtime package `graphs` cannot be imported: {e}") from None
        threads = spec.get("threads")
        use_shared_thread_pool(threads)  # as the CLIs do: one ORT pool for every session
        options = dict(spec.get("load_options") or {})
        accepted = set(inspect.signature(graphs.load).parameters)
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise UnavailableError(f"graphs.load() of this checkout takes no {', '.join(unknown)}; drop that "
                                   f"--load-option (accepted: {', '.join(sorted(accepted - {'out_dir'}))})")
        self.decoder = graphs.load(spec["out_dir"], provider="cpu", threads=threads, **options)
        self.mode = spec["mode"]
        self.tree = spec.get("tree")
        self.draft_calls = 0
        if self.decoder.draft is not None:
            self.decoder.draft = _Counting(self.decoder.draft, self)
        out = Path(spec["out_dir"])
        m = self.decoder.manifest
        self.info = {
            "weight_bytes": _graph_bytes(out, m.graphs["base"].file),
            "draft_bytes": _graph_bytes(out, m.graphs["draft"].file) if "draft" in m.graphs else 0,
            "drafter": self.decoder.kind,
            "tree": self.tree or self.decoder.default_tree,
        }

    def run(self, req: dict) -> dict:
        self.draft_calls = 0
        res = self.decoder.generate(req["ids"], max_new_tokens=req["max_new_tokens"],
                                    temperature=req["temperature"], top_p=req["top_p"], top_k=req["top_k"],
                                    seed=req.get("seed"), mode=self.mode, tree=req.get("tree") or self.tree)
        s = res.stats
        return {"tokens": list(map(int, res.token_ids)), "prefill_s": s.time_prefill,
                "decode_s": s.time_total - s.time_prefill, "draft_s": s.time_draft, "verify_s": s.time_verify,
                "accepted": list(map(int, s.accepted)), "forwards": int(s.steps),
                "accepted_per_pos": list(map(int, getattr(s, "accepted_per_pos", None) or [])),
                "speculative_steps": int(getattr(s, "speculative_steps", 0) or 0),
                # the runtime's own count covers the one-call EAGLE tree graphs too; the proxy, older runtimes
                "draft_calls": int(getattr(s, "draft_calls", 0) or self.draft_calls)}


class _Counting:
    """A session proxy counting the drafter's calls (plain ``run`` and IO-bound runs alike)."""

    def __init__(self, session, owner):
        self._s, self._owner = session, owner

    def run(self, *a, **k):
        self._owner.draft_calls += 1
        return self._s.run(*a, **k)

    def run_with_iobinding(self, *a, **k):
        self._owner.draft_calls += 1
        return self._s.run_with_iobinding(*a, **k)

    def __getattr__(self, name):
        return getattr(self._s, name)


def _graph_bytes(out_dir: Path, file: str) -> int:
    """The graph and its external data (``base.onnx`` + ``base.onnx.data`` and the like)."""
    return _file_bytes([out_dir / file, *out_dir.glob(Path(file).name + ".*")])


# ---------------------------------------------------------------- onnxruntime-genai


class GenaiRunner:
    def __init__(self, spec: dict):
        try:
            import onnxruntime_genai as og
        except ImportError as e:
            raise UnavailableError(f"onnxruntime-genai is not installed for {sys.executable} ({e})") from None
        self.og = og
        config = og.Config(spec["model"])
        if spec.get("threads"):
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                "intra_op_num_threads": int(spec["threads"])}}}}))
        self.model = og.Model(config)
        cfg = json.loads((Path(spec["model"]) / "genai_config.json").read_text())
        self.vocab_size = int(cfg["model"]["vocab_size"])
        d = Path(spec["model"])
        self.info = {"weight_bytes": _file_bytes([p for p in d.iterdir() if ".onnx" in p.name]), "draft_bytes": 0,
                     "version": getattr(og, "__version__", "?")}

    def run(self, req: dict) -> dict:
        og = self.og
        ids = req["ids"]
        params = og.GeneratorParams(self.model)
        opts = {"max_length": len(ids) + req["max_new_tokens"], "do_sample": req["temperature"] > 0}
        if req["temperature"] > 0:
            # genai's default top_k is 50; 0 here means no top-k, as in our runtime: the whole vocabulary
            opts.update(temperature=req["temperature"], top_p=req["top_p"], top_k=req["top_k"] or self.vocab_size)
            if req.get("seed") is not None:
                opts["random_seed"] = int(req["seed"])
        params.set_search_options(**opts)
        t0 = time.perf_counter()
        gen = og.Generator(self.model, params)
        gen.append_tokens(ids)  # the prefill forward
        gen.generate_next_token()  # picks the first token from the prefill's logits
        t1 = time.perf_counter()
        n = 1
        while not gen.is_done():
            gen.generate_next_token()  # one forward of the last token, then pick
            n += 1
        t2 = time.perf_counter()
        tokens = list(map(int, gen.get_sequence(0)))[len(ids):]
        return {"tokens": tokens, "prefill_s": t1 - t0, "decode_s": t2 - t1, "accepted": [1] * (len(tokens) - 1),
                "forwards": len(tokens) - 1, "draft_calls": 0}


# ---------------------------------------------------------------- PyTorch / optimum: HF generate


class HFRunner:
    """``model.generate``: greedy or sampled, plain, prompt lookup or assisted by a draft model."""

    def __init__(self, spec: dict):
        try:
            import torch
            import transformers
        except ImportError as e:
            raise UnavailableError(f"torch/transformers are not installed for {sys.executable} ({e})") from None
        self.torch = torch
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        self.model = self._load(spec)
        self.extra = {}
        if spec.get("prompt_lookup"):
            self.extra["prompt_lookup_num_tokens"] = int(spec["prompt_lookup"])
        self.assistant = None
        if spec.get("assistant"):
            from transformers import AutoModelForCausalLM

            self.assistant = AutoModelForCausalLM.from_pretrained(spec["assistant"], dtype=torch.float32).eval()
            self.extra["assistant_model"] = self.assistant
        self.forwards = self.draft_calls = 0
        self._hook(self.model, "forwards")
        if self.assistant is not None:
            self._hook(self.assistant, "draft_calls")
        self.info = {"weight_bytes": self._weight_bytes(), "transformers": transformers.__version__,
                     "draft_bytes": _param_bytes(self.assistant) if self.assistant is not None else 0}

    def _load(self, spec):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=self.torch.float32).eval()

    def _weight_bytes(self) -> int:
        return _param_bytes(self.model)

    def _hook(self, module, counter: str) -> None:
        def pre(*_a, **_k):
            setattr(self, counter, getattr(self, counter) + 1)

        module.register_forward_pre_hook(pre)

    def run(self, req: dict) -> dict:
        torch = self.torch
        ids = torch.tensor([req["ids"]], dtype=torch.long)
        streamer = _TimingStreamer()
        kw = dict(self.extra)
        if req["temperature"] > 0:
            # top_k=0 disables HF's top-k (its generation_config default is 50), as in our runtime
            kw.update(do_sample=True, temperature=req["temperature"], top_p=req["top_p"], top_k=req["top_k"])
            if req.get("seed") is not None:
                torch.manual_seed(int(req["seed"]))
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        cfg = self.model.generation_config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.model.config.eos_token_id
        self.forwards = self.draft_calls = 0
        with torch.inference_mode():
            streamer.start()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req["max_new_tokens"],
                                      streamer=streamer, pad_token_id=eos if isinstance(eos, int) else None, **kw)
            t_end = time.perf_counter()
        tokens = [int(t) for t in out[0, ids.shape[1]:]]
        t_first = streamer.first or t_end
        return {"tokens": tokens, "prefill_s": t_first - streamer.t0, "decode_s": t_end - t_first,
                "accepted": streamer.chunks[1:], "forwards": max(self.forwards - 1, 0),
                "draft_calls": self.draft_calls}


class OptimumRunner(HFRunner):
    """optimum's ``ORTModelForCausalLM`` (ONNX Runtime under HF ``generate``), from a prepared export."""

    def _load(self, spec):
        try:
            import onnxruntime as ort
            from optimum.onnxruntime import ORTModelForCausalLM
        except ImportError as e:
            raise UnavailableError(f"optimum-onnx is not installed for {sys.executable} ({e})") from None
        so = ort.SessionOptions()
        if spec.get("threads"):
            so.intra_op_num_threads = int(spec["threads"])
        self.dir = Path(spec["model"])
        return ORTModelForCausalLM.from_pretrained(self.dir, session_options=so, provider="CPUExecutionProvider")

    def _weight_bytes(self) -> int:
        return _file_bytes([p for p in self.dir.iterdir() if ".onnx" in p.name])

    def _hook(self, module, counter: str) -> None:
        if hasattr(module, "register_forward_pre_hook"):
            return super()._hook(module, counter)
        import functools

        forward = module.forward

        @functools.wraps(forward)  # generate() validates its kwargs against forward's signature
        def counted(*a, **k):
            setattr(self, counter, getattr(self, counter) + 1)
            return forward(*a, **k)

        module.forward = counted


class _TimingStreamer:
    """An HF streamer that records when the first new token arrives and the size of every chunk."""

    def start(self):
        self.t0, self.first, self.chunks, self._prompt_seen = time.perf_counter(), None, [], False

    def put(self, value):
        if not self._prompt_seen:  # generate() hands the prompt over first
            self._prompt_seen = True
            return
        if self.first is None:
            self.first = time.perf_counter()
        self.chunks.append(int(value.numel()))

    def end(self):
        pass


def _param_bytes(model) -> int:
    return int(sum(p.numel() * p.element_size() for p in model.parameters()))


RUNNERS = {"ours": OursRunner, "genai": GenaiRunner, "hf": HFRunner, "optimum": OptimumRunner}


# ---------------------------------------------------------------- preparing peers' models


def prepare(kind: str, src: str, dst: str) -> None:
    """``plain``: the base of ``src`` alone (drafter dropped) as a HF directory with its tokenizer;
    ``optimum``: optimum's ONNX export of a plain HF directory."""
    import shutil

    if kind == "plain":
        import torch
        from transformers import AutoModelForCausalLM

        # without exporter's checkpointing hooks, from_pretrained loads the base and ignores the drafter
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        if hasattr(model.config, "speculative_decoding"):
            del model.config.speculative_decoding
        model.save_pretrained(dst)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                     "generation_config.json", "chat_template.jinja"):
            if (Path(src) / name).is_file() and not (Path(dst) / name).exists():
                shutil.copy2(Path(src) / name, Path(dst) / name)
    elif kind == "optimum":
        from optimum.onnxruntime import ORTModelForCausalLM

        ORTModelForCausalLM.from_pretrained(src, export=True).save_pretrained(dst)
    else:
        raise SystemExit(f"unknown --prepare kind {kind!r}")


# ---------------------------------------------------------------- the loop


def peak_rss_bytes() -> int:
    """This process's peak resident set size. Linux's VmHWM belongs to this program's own memory
    map; ``getrusage``'s ru_maxrss would carry over the parent's peak through fork + exec."""
    try:
        for ln in Path("/proc/self/status").read_text().splitlines():
            if ln.startswith("VmHWM:"):
                return int(ln.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def serve(stdin, out) -> None:
    runner = None

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    for line in stdin:
        req = json.loads(line)
        try:
            if "setup" in req:
                runner = RUNNERS[req["setup"]["runner"]](req["setup"])
                reply({"ok": True, "info": runner.info})
            elif "run" in req:
                reply({"ok": True, **runner.run(req["run"])})
            elif "close" in req:
                reply({"ok": True, "peak_rss_bytes": peak_rss_bytes()})
                return
        except UnavailableError as e:
            reply({"ok": False, "unavailable": True, "reason": str(e)})
        except Exception as e:
            traceback.print_exc()
            text = str(e).strip().splitlines()
            reply({"ok": False, "unavailable": False, "reason": f"{type(e).__name__}: {text[0] if text else ''}"})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--prepare"] and len(argv) == 4:
        prepare(*argv[1:])
        return 0
    out = os.fdopen(os.dup(1), "w")  # the protocol channel
    os.dup2(2, 1)  # whatever libraries print goes to stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
