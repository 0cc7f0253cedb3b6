"""One benchmarked system in its own process: ``python -m exporter.benchmark.worker``.

Reads one JSON request per line on stdin and answers one JSON line each (on the original stdout;
anything a library prints goes to stderr):

    {"setup": {"runner": "ours"|"genai"|"hf"|"optimum"|"llamacpp", ...}}  -> {"ok": true, "info": {...}}
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


# ---------------------------------------------------------------- llama.cpp: llama-server on the GGUF


class LlamaCppRunner:
    """llama.cpp's ``llama-server`` on the GGUF itself (its own quantization, e.g. Q4_1), one slot, fed
    the prompt's token ids (``/completion`` takes a list of ids as they are: no BOS added, no
    re-tokenizing), greedy (the ``top_k`` sampler alone at k = 1), no prompt cache between requests.

    ``spec``: ``binary`` (the llama-server executable), ``gguf``, ``threads``, ``ctx`` (its context),
    ``spec_type`` (llama.cpp's ``--spec-type``: ``ngram-simple`` is its prompt-lookup decoding;
    ``draft-simple`` needs ``draft_gguf``, a draft model's GGUF) and ``spec_args`` (more server flags).
    The timings are the server's own (``timings.prompt_ms``: the prefill, ``predicted_ms``: the
    decode, first token included, as llama.cpp counts it), so HTTP and JSON cost no time here; the
    client's wall time is returned beside them (``wall_s``). The server dies with this worker
    (``PR_SET_PDEATHSIG``)."""

    def __init__(self, spec: dict):
        import socket
        import subprocess
        import urllib.request

        binary = spec.get("binary")
        if not binary or not Path(binary).is_file() or not os.access(binary, os.X_OK):
            raise UnavailableError(f"llama.cpp's llama-server is not installed ({binary or 'not found'}): "
                                   "see docs/benchmarks.md (llama.cpp), or set LLAMA_SERVER to the executable")
        gguf = spec.get("gguf")
        if not gguf or not Path(gguf).is_file():
            raise UnavailableError(f"no GGUF to serve ({gguf})")
        self.urllib = urllib.request
        with socket.socket() as s:  # a free port for this server alone
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        threads = str(int(spec.get("threads") or os.cpu_count() or 1))
        cmd = [binary, "--model", gguf, "--host", "127.0.0.1", "--port", str(port), "--threads", threads,
               "--threads-batch", threads, "--ctx-size", str(int(spec.get("ctx") or 4096)), "--parallel", "1",
               "--no-webui", "--seed", "0"]
        if spec.get("spec_type"):
            cmd += ["--spec-type", spec["spec_type"]]
            if spec.get("draft_gguf"):
                cmd += ["--model-draft", spec["draft_gguf"], "--threads-draft", threads]
        cmd += [str(a) for a in spec.get("spec_args") or []]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr,
                                     preexec_fn=_die_with_parent)
        deadline = time.perf_counter() + float(spec.get("start_timeout_s", 120))
        while True:  # /health answers 503 while the model loads, 200 once it serves
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}) while starting: {' '.join(cmd)}")
            try:
                with self.urllib.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not answer /health within {spec.get('start_timeout_s', 120)} s")
            time.sleep(0.1)
        props = self._get("/props")
        self.info = {"weight_bytes": _file_bytes([gguf]),
                     "draft_bytes": _file_bytes([spec["draft_gguf"]]) if spec.get("draft_gguf") else 0,
                     "version": str(props.get("build_info") or "?"), "gguf": gguf,
                     "spec_type": spec.get("spec_type") or "none"}

    def _get(self, path: str) -> dict:
        with self.urllib.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def _post(self, path: str, body: dict) -> dict:
        req = self.urllib.Request(self.url + path, data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
        with self.urllib.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())

    def tokenize(self, text: str) -> list:
        """llama.cpp's own tokenizer of the GGUF (for checking it gives the ids the bench feeds)."""
        return list(self._post("/tokenize", {"content": text, "add_special": False})["tokens"])

    def run(self, req: dict) -> dict:
        body = {"prompt": list(map(int, req["ids"])), "n_predict": int(req["max_new_tokens"]),
                "cache_prompt": False, "return_tokens": True, "stream": False}
        if req["temperature"] > 0:
            body.update(temperature=req["temperature"], top_p=req["top_p"], top_k=req["top_k"],
                        min_p=0.0, samplers=["top_k", "top_p", "temperature"])
            if req.get("seed") is not None:
                body["seed"] = int(req["seed"])
        else:  # greedy: the argmax, whatever the server's default samplers
            body.update(temperature=0.0, top_k=1, samplers=["top_k"])
        t0 = time.perf_counter()
        res = self._post("/completion", body)
        wall = time.perf_counter() - t0
        t = res["timings"]
        tokens = list(map(int, res.get("tokens") or []))
        drafted, accepted = int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))
        # each verify step emits its accepted drafts and one token of its own: the base's forwards after
        # the prefill are the emitted tokens less the accepted drafts (no per-step counts are returned)
        forwards = max(len(tokens) - 1 - accepted, 0)
        return {"tokens": tokens, "prefill_s": t["prompt_ms"] / 1e3, "decode_s": t["predicted_ms"] / 1e3,
                "wall_s": wall, "forwards": forwards, "draft_calls": 0, "draft_n": drafted,
                "draft_n_accepted": accepted,
                "accepted": [1] * max(len(tokens) - 1, 0) if not drafted else [],
                "prompt_n": int(t.get("prompt_n", len(req["ids"])))}

    def close(self) -> int:
        """Stop the server; its peak RSS (Linux), which the worker's own does not include."""
        peak = 0
        try:
            for ln in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if ln.startswith("VmHWM:"):
                    peak = int(ln.split()[1]) * 1024
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        return peak


def _die_with_parent() -> None:
    """In the server's child process before exec: SIGTERM when the worker dies, however it dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:
        pass


RUNNERS = {"ours": OursRunner, "genai": GenaiRunner, "hf": HFRunner, "optimum": OptimumRunner,
           "llamacpp": LlamaCppRunner}


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
                # a runner with a server of its own (llama.cpp) adds that process's peak to the worker's
                extra = runner.close() if runner is not None and hasattr(runner, "close") else 0
                reply({"ok": True, "peak_rss_bytes": peak_rss_bytes() + (extra or 0)})
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
