"""ONNX Runtime sessions: provider choice (CUDA EP, else CPU EP), threads, optimization level."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

try:
    import onnxruntime as ort
except ImportError as e:  # one line that says what to install, not a traceback into our modules
    raise ImportError(
        "graphs needs ONNX Runtime: pip install 'specexport[cpu]' (or onnxruntime) for the CPU, or "
        "'specexport[gpu]' (onnxruntime-gpu) for CUDA -- one of the two, never both",
        name="onnxruntime",
    ) from e

import re

from graphs import contract as C
from graphs.errors import GraphMemoryError, InputError, InputTypeError
from graphs.sampling import check_finite

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def resolve_provider(provider: str = "auto") -> str:
    """"auto" -> "cuda" when onnxruntime-gpu sees a GPU, else "cpu"; "cuda" without one is an error."""
    available = ort.get_available_providers()
    if provider == "auto":
        return "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if provider == "cuda" and "CUDAExecutionProvider" not in available:
        raise InputError(
            "provider 'cuda' needs onnxruntime-gpu and a CUDA device (pip install 'specexport[gpu]'); "
            "use provider='cpu' or 'auto'"
        )
    if provider not in ("cuda", "cpu"):
        raise InputError(f"unknown provider {provider!r}; accepted: auto, cuda, cpu")
    return provider


_POOL_THREADS = 0  # intra-op threads of the process-wide pool, once use_shared_thread_pool() set it


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads) -> int | None:
    """``threads`` (None: ONNX Runtime's choice) as an int in 1..cores(), else a one-line error: more
    threads than cores only make them wait for each other (100,000 would create a thread storm)."""
    if threads is None:
        return None
    n = cores()
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise InputTypeError(f"threads must be an int between 1 and {n} (this machine's cores), got "
                             f"{type(threads).__name__} {threads!r}")
    if not 1 <= threads <= n:
        raise InputError(f"threads must be between 1 and {n} (this machine's cores), got {threads}")
    return threads


def use_shared_thread_pool(threads: int | None = None) -> bool:
    """Run every session of this process on one ORT thread pool. Call once, before any session.

    The decoder alternates between sessions (draft, verify); with a pool per session,
    either the idle pools' spinning threads steal the cores the running one needs, or (spinning off,
    the default here) every run pays to wake its threads. Measured on 2 cores, 19M-parameter Llama
    with Medusa (autoregressive / speculative tok/s): per-session pools with spinning 228 / 228,
    without spinning 162 / 353, one shared pool 214 / 440. The CLIs call this; a service should too,
    but then every ORT session in the process must be created with ``use_per_session_threads =
    False`` (as :func:`make_session` does), which is why the library does not do it behind your back.
    Returns False when the pool could not be set (an onnxruntime without the call).
    """
    global _POOL_THREADS
    want = check_threads(threads) or cores()
    if _POOL_THREADS:
        return want == _POOL_THREADS
    try:
        from onnxruntime.capi._pybind_state import set_global_thread_pool_sizes

        set_global_thread_pool_sizes(want, 1)
    except Exception:
        return False
    _POOL_THREADS = want
    return True


def make_session(
    path: Path,
    provider: str = "cpu",
    threads: int | None = None,
    optimization: str = "all",
    device_id: int = 0,
    session_options=None,
    provider_options: dict | None = None,
) -> Session:
    """One session for one graph file; built once per decoder, never per step.

    ``session_options``: an ``ort.SessionOptions`` used as given (the caller owns threads and
    optimization then), or a dict applied on top of ours: keys that are ``SessionOptions``
    attributes (``intra_op_num_threads``, ``enable_profiling``, ...) are set, any other key is a
    session config entry (``"session.intra_op.allow_spinning": "1"``). ``provider_options``: the
    execution provider's own options, merged over ``{"device_id": device_id}`` on CUDA.
    """
    if isinstance(session_options, ort.SessionOptions):
        opts = session_options
    else:
        opts = default_session_options(threads, optimization)
        apply_session_options(opts, session_options or {})
    providers = provider_list(resolve_provider(provider), device_id, provider_options)
    return Session(ort.InferenceSession(str(path), sess_options=opts, providers=providers), Path(path))


# ONNX Runtime's words when an allocation fails: its arena (CPU and CUDA), CUDA itself, the C++ runtime
_ALLOC_FAILED = re.compile(r"Failed to allocate memory|out of memory|bad_alloc", re.IGNORECASE)
_QUIET_RUN = None  # RunOptions at fatal-only logging: a failed run is raised, not also printed by ORT


def _quiet_run_options():
    global _QUIET_RUN
    if _QUIET_RUN is None:
        _QUIET_RUN = ort.RunOptions()
        _QUIET_RUN.log_severity_level = 4
    return _QUIET_RUN


class Session:
    """An ``ort.InferenceSession`` whose ``run`` turns an allocation failure into a one-line
    :class:`GraphMemoryError` (was: ONNX Runtime's raw "Failed to allocate memory for requested buffer of
    size 40000000000" from a ConstantOfShape, with its own log line on stderr). Everything else is the
    session's own (``get_inputs``, ``io_binding``, ...)."""

    __slots__ = ("_session", "path")

    def __init__(self, session, path: Path):
        self._session = session
        self.path = path

    def __getattr__(self, name):
        return getattr(self._session, name)

    def run(self, output_names, input_feed, run_options=None):
        return self._translated(self._session.run, output_names, input_feed, run_options or _quiet_run_options())

    def run_with_iobinding(self, iobinding, run_options=None):
        """As ``run`` (allocation failures as one line), for bound calls (:class:`InPlaceRun`)."""
        # ORT's Python wrapper reads run-option entries on every call (0.1-0.2 ms a step on the 19M
        # int4 model); the pybind session runs the same binding directly where it is there
        sess, inner = getattr(self._session, "_sess", None), getattr(iobinding, "_iobinding", None)
        if sess is not None and inner is not None:
            return self._translated(sess.run_with_iobinding, inner, run_options or _quiet_run_options())
        return self._translated(self._session.run_with_iobinding, iobinding, run_options or _quiet_run_options())

    def _translated(self, call, *args):
        try:
            return call(*args)
        except MemoryError as e:
            raise GraphMemoryError(self._memory_message(f"MemoryError {e}".strip())) from None
        except Exception as e:  # ONNX Runtime's pybind errors (Fail, RuntimeException) share no base class
            if not _ALLOC_FAILED.search(str(e)):
                raise
            raise GraphMemoryError(self._memory_message(str(e))) from None

    def _memory_message(self, text: str) -> str:
        size = re.search(r"buffer of size (\d+)", text)
        node = re.search(r"while running (\w+) node", text)
        asked = f" {int(size.group(1)) / 1e9:.1f} GB" if size else " more memory"
        where = f" in a {node.group(1)} node" if node else ""
        return (f"{self.path.name} asked ONNX Runtime for{asked}{where}, more than this machine could give; "
                f"use a shorter prompt, a smaller batch or tree (or more memory), and re-export the model if "
                f"its graphs were edited")


def default_session_options(threads: int | None = None, optimization: str = "all") -> ort.SessionOptions:
    threads = check_threads(threads)
    opts = ort.SessionOptions()
    if optimization not in _LEVELS:
        raise InputError(f"unknown optimization level {optimization!r}; accepted: {', '.join(_LEVELS)}")
    opts.graph_optimization_level = _LEVELS[optimization]
    if _POOL_THREADS:  # the process-wide pool of use_shared_thread_pool()
        opts.use_per_session_threads = False
    else:
        if threads:
            opts.intra_op_num_threads = threads
        # Separate pools whose threads spin after each run steal the cores the next session needs
        # (the decoder alternates draft and verify): don't spin.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return opts


def apply_session_options(opts: ort.SessionOptions, options: dict) -> ort.SessionOptions:
    if not isinstance(options, dict):
        raise InputTypeError(f"session_options must be an onnxruntime.SessionOptions or a dict, got "
                        f"{type(options).__name__}")
    for key, value in options.items():
        if hasattr(ort.SessionOptions, key):
            if key in ("intra_op_num_threads", "inter_op_num_threads", "use_per_session_threads") and _POOL_THREADS:
                # ORT refuses a session pool of its own once the process-wide one exists (a raw
                # "use_per_session_threads must be false when using a global thread pool")
                raise InputError(f"session option {key}: every session of this process runs on one shared "
                                 f"ONNX Runtime thread pool (size {_POOL_THREADS}: use_shared_thread_pool, "
                                 f"as the CLIs and the server set it); drop the option, or choose the pool's "
                                 f"size with threads / --threads")
            try:
                setattr(opts, key, value)
            except (TypeError, AttributeError) as e:
                raise InputError(f"session option {key}={value!r}: {e}") from None
        elif isinstance(key, str) and "." in key:  # a session config entry: "session.intra_op.allow_spinning"
            opts.add_session_config_entry(key, str(value))
        else:
            raise InputError(f"unknown session option {key!r}: not an onnxruntime.SessionOptions attribute "
                             f"(e.g. intra_op_num_threads) nor a dotted config entry (e.g. "
                             f"session.intra_op.allow_spinning); check its spelling")
    return opts


def provider_list(provider: str, device_id: int = 0, provider_options: dict | None = None) -> list:
    """The ``providers`` argument of ``ort.InferenceSession`` for a resolved provider name."""
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise InputError(f"device_id must be an int >= 0 (which GPU), got {device_id!r}")
    if provider_options is not None and not isinstance(provider_options, dict):
        raise InputTypeError(f"provider_options must be a dict, got {type(provider_options).__name__}")
    if provider == "cuda":
        return [("CUDAExecutionProvider", {"device_id": device_id, **(provider_options or {})}),
                "CPUExecutionProvider"]
    if provider_options:
        return [("CPUExecutionProvider", dict(provider_options))]
    return ["CPUExecutionProvider"]


_WARNED_TARGETS: set[tuple[str, str]] = set()


def warn_if_other_target(optimization: dict, provider: str, out_dir: str = "") -> bool:
    """Warn (once per target/provider pair) when graphs optimized for one provider run on another.

    ``optimization`` is the manifest's role -> record of ``python -m exporter.optimize``; a
    float16 CUDA build on the CPU EP, or int4 CPU graphs on CUDA, run but not at their best.
    Returns True when it warned.
    """
    import warnings

    targets = sorted({r.get("target") for r in optimization.values() if r.get("target")})
    key = (",".join(targets), provider)
    if not targets or provider in targets or key in _WARNED_TARGETS:
        return False
    _WARNED_TARGETS.add(key)
    warnings.warn(f"{out_dir or 'these graphs'} were optimized for {', '.join(targets)} but run on {provider}: "
                  f"expect lower speed; optimize a raw export with --target {provider} for this provider",
                  RuntimeWarning, stacklevel=3)
    return True


def base_precision(optimization: dict, source_dtype: str = "float32") -> dict:
    """The base graph's dtype, weight quantization and optimize passes (from the manifest)."""
    rec = optimization.get("base") or {}
    q = rec.get("quantization")
    return {"dtype": rec.get("dtype", source_dtype), "quantization": f"int{q['bits']}" if q else None,
            "passes": list(rec.get("passes", []))}


def _words(value) -> str:
    """A base_precision field as the warning says it: ``None`` / ``[]`` -> "none", passes joined by "+"."""
    if isinstance(value, (list, tuple)):
        return "+".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def warn_if_tree_stale(tree: dict, optimization: dict, source_dtype: str = "float32", out_dir: str = "") -> bool:
    """Warn when the default tree was tuned (``python -m exporter.tune``) on other base graphs.

    The best tree depends on how verification cost grows with tree size, and that differs between
    float32, fused, int8 and int4 graphs (exporter.optimize re-tunes by default); the tree still
    decodes exactly, only its speed may be off. Returns True when it warned.
    """
    import warnings

    tuned = tree.get("tuned") or {}
    if "graphs" not in tuned:  # hand-picked defaults, or tuned before this record existed
        return False
    now = base_precision(optimization, source_dtype)
    was = tuned["graphs"] if isinstance(tuned["graphs"], dict) else {}
    diffs = [f"{label}: {_words(was[key])}, now {_words(now[key])}"
             for key, label in (("dtype", "dtype"), ("quantization", "quantization"), ("passes", "optimize passes"))
             if key in was and _words(was[key]) != _words(now[key])]  # a field the record lacks proves nothing
    if not diffs:
        return False
    warnings.warn(f"{out_dir or 'this export'}: the default tree was tuned on other base graphs ({'; '.join(diffs)}): "
                  f"it decodes the same but may not be the fastest; re-tune with python -m exporter.tune "
                  f"{out_dir or 'OUT_DIR'}", RuntimeWarning, stacklevel=3)
    return True


@functools.cache
def _cpu_device():
    """ORT's C-level CPU device for direct IO-binding calls; None where this onnxruntime lacks it."""
    try:
        return ort.OrtDevice.make("cpu", 0)._get_c_device()
    except Exception:
        return None


def bind_in_place(io, buffers: dict) -> list:
    """Bind each ``past_key_values.*`` buffer as that input and as its ``present.*`` output, one
    OrtValue over the buffer's memory (CPU): ONNX Runtime writes the new rows where they belong.
    Returns the OrtValues (the binding holds them too)."""
    values = []
    for name, buf in buffers.items():
        if not buf.flags.c_contiguous:
            raise ValueError(f"{name}: the K/V buffer must be contiguous to be written in place")
        value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares the buffer's memory
        io.bind_ortvalue_input(name, value)
        io.bind_ortvalue_output("present." + name[len("past_key_values."):], value)
        values.append(value)
    return values


def bind_arrays(io, inputs: dict, outputs: dict) -> list:
    """Bind numpy arrays (name -> array) as ``io``'s inputs and outputs: OrtValues sharing their memory
    (CPU), so a call reads what is written into them and writes its outputs into them. Returns the
    OrtValues, which must stay alive as long as the binding."""
    values = []
    for bind, arrays in ((io.bind_ortvalue_input, inputs), (io.bind_ortvalue_output, outputs)):
        for name, arr in arrays.items():
            if not arr.flags.c_contiguous:
                raise ValueError(f"{name}: a bound array must be contiguous")
            value = ort.OrtValue.ortvalue_from_numpy(arr)
            values.append(value)
            bind(name, value)
    return values


class BoundCall:
    """A call of S new tokens per row over the first n rows of a cache, bound to the session once
    (:meth:`InPlaceRun.bound_on`): OrtValues made over numpy arrays share their memory (CPU), so a
    call writes its tokens, positions and mask into the arrays below and runs the same binding.

    ``ids``, ``pos`` (n, S) int64; ``write`` (n,) the column where row b's S new K/V rows go (its
    length); ``mask`` (n, 1, S, capacity) bool, each new row's columns: the row's past, then the S
    new columns at ``write[b]`` (the tree, :func:`graphs.kv.inplace_mask`); ``outputs`` (n, S, ...)
    by name, refilled by each call (copy what must outlive the next one)."""

    def __init__(self, session, outputs: list, buffers: dict, n: int, s: int, capacity: int):
        self.session = session
        self.ids = np.zeros((n, s), dtype=np.int64)
        self.pos = np.zeros((n, s), dtype=np.int64)
        # a plain step's position is its write column: one array bound twice, moved on by one add (again)
        self.write = self.pos.reshape(n) if s == 1 else np.zeros(n, dtype=np.int64)
        self.rows = np.arange(n)
        self._flat_ids = self.ids.reshape(-1)
        self.mask = np.zeros((n, 1, s, capacity), dtype=bool)
        self._flat_mask = self.mask.reshape(-1) if n == s == 1 else None  # one row's columns
        self.columns = np.arange(capacity)  # (capacity,)
        self.eye = np.eye(s, dtype=bool)  # (S, S): a padding row sees only itself
        self.outputs = {name: np.zeros((n, s, *dims), dtype=dtype) for name, dtype, dims in outputs}
        self._logit_rows = self.outputs[C.LOGITS].reshape(n * s, -1) if C.LOGITS in self.outputs else None
        self.io = session.io_binding()
        # the OrtValues over the arrays above and the K/V buffers: alive as long as the binding
        self.values = bind_arrays(self.io, {C.INPUT_IDS: self.ids, C.POSITION_IDS: self.pos, C.KV_WRITE: self.write,
                                            C.ATTENTION_MASK: self.mask}, self.outputs)
        self.values += bind_in_place(self.io, buffers)

    @property
    def nbytes(self) -> int:
        """Memory its own arrays hold (the K/V buffers it binds are the cache's)."""
        return sum(a.nbytes for a in (self.ids, self.pos, self.write, self.mask, *self.outputs.values()))

    def step(self, roots, lens: np.ndarray) -> dict:
        """A plain step (S == 1): ``roots`` (n,) each at its row's length ``lens`` (n,)."""
        self.ids[:, 0] = roots
        self.pos[:, 0] = lens  # (and the write columns: at S == 1 the same memory)
        np.less_equal(self.columns, lens[:, None], out=self.mask[:, 0, 0])  # the past and the token itself
        self.session.run_with_iobinding(self.io)
        return self.outputs

    def again(self) -> dict:
        """The plain step after this call's last one (S == 1), every row one position on, its token
        already in ``ids`` (:meth:`greedy` writes it there): the inputs move on in place (positions +1,
        the new column joins each row's mask) instead of being made anew. Between two calls every
        Python path is cold (each call streams the weights through the caches): an array operation
        costs ~10 us there, so one row, the common case, takes scalar writes."""
        if self._flat_mask is not None:
            w = self.write[0] + 1
            self.write[0] = w  # the position too: the same memory
            self._flat_mask[w] = True
        else:
            self.write += 1
            self.mask[self.rows, 0, 0, self.write] = True
        self.session.run_with_iobinding(self.io)
        return self.outputs

    def greedy(self) -> np.ndarray:
        """Each row's argmax of the last call's logits (S == 1; the first of equal logits, as
        :func:`graphs.sampling.greedy_accept`), written into ``ids`` for :meth:`again`: a view (n,).
        Raises NonFiniteLogitsError where a chosen logit is nan or +inf."""
        rows, ids = self._logit_rows, self._flat_ids
        rows.argmax(axis=1, out=ids)
        check_finite(float(rows[0, ids[0]]) if ids.shape[0] == 1 else rows[self.rows, ids])
        return ids

    def trees(self, trees: list, tokens: list, lens: np.ndarray, pad: int) -> dict:
        """Row b verifies ``trees[b]`` (a :class:`graphs.trees.Tree` of k <= S nodes) with ``tokens[b]``
        (k,) after its ``lens[b]`` columns; its other S - k rows are padding that sees only itself."""
        n, s = self.ids.shape
        self.ids.fill(pad)
        self.pos[:] = lens[:, None]
        self.write[:] = lens
        np.less(self.columns, lens[:, None, None], out=self.mask[:, 0])  # every new row sees its row's past
        for b in range(n):
            tree, k, w = trees[b], len(tokens[b]), int(lens[b])
            self.ids[b, :k] = tokens[b]
            block = self.mask[b, 0, :, w : w + s]  # (S, S): the new rows' own columns
            block[...] = self.eye
            if k > 1:  # (a one-node tree is the identity already)
                self.pos[b, :k] += tree.depth
                block[:k, :k] = tree.mask
        self.session.run_with_iobinding(self.io)
        return self.outputs


class BoundArrays:
    """A call of a small graph with fixed shapes, bound once: ``inputs`` and ``outputs`` are arrays
    (name -> array, made here from name -> (shape, dtype)) that OrtValues share memory with, so a call
    writes its inputs into ``inputs[name]`` and reads ``outputs[name]`` after :meth:`run` (refilled by
    each call: copy what must outlive the next one). Only the outputs named are computed.

    Why not ``session.run``: its Python wrapper checks the feed, wraps every input and allocates and
    converts every output on each call. Inside the engine the 19M int4 model's Medusa heads call (55-60
    us bare) took 0.106 ms per drafted step through ``run`` and 0.081 ms bound (the least of 10 runs)."""

    def __init__(self, session, inputs: dict, outputs: dict):
        self.session = session
        self.inputs = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in inputs.items()}
        self.outputs = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in outputs.items()}
        self.io = session.io_binding()
        self._values = bind_arrays(self.io, self.inputs, self.outputs)  # alive as long as the binding

    def run(self) -> dict:
        self.session.run_with_iobinding(self.io)
        return self.outputs


_STEP_INPUTS = {C.INPUT_IDS, C.POSITION_IDS, C.ATTENTION_MASK, C.KV_WRITE}
BOUND_WIDTHS = 4  # bound calls kept per graph and cache (the widths used last; the adaptive policy's few)


class LazySession:
    """A session made on first use (then shared; creation under a lock): the base graph of an export
    whose one-sequence graph runs every call of one sequence, so a decoder that never verifies a
    batch of trees never holds the base's weights twice. Everything else is the session's."""

    __slots__ = ("_lock", "_make", "_session")

    def __init__(self, make):
        import threading

        self._make, self._session, self._lock = make, None, threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def get(self):
        if self._session is None:
            with self._lock:
                if self._session is None:
                    self._session = self._make()
        return self._session

    def __getattr__(self, name):
        return getattr(self.get(), name)


class InPlaceRun:
    """Calls of a graph that writes its K/V into the caller's buffers (``graphs.contract.kv_in_place``).

    Each ``past_key_values.*`` input and its ``present.*`` output are bound to the same host buffer
    (IO binding), so ONNX Runtime's ``TensorScatter`` writes the new rows in place and nothing is
    copied back; the other outputs come back as arrays. One IO binding per call: calls from several
    threads (engines of one decoder) never share one.
    """

    def __init__(self, session: ort.InferenceSession, spec):
        self.session = session
        self.outputs = [n for n in spec.output_names if not n.startswith("present.")]
        # what a bound call binds once (bound_on): the outputs' dtypes and per-token dims, where every
        # non-K/V input is one of the step's four and every output is (batch, sequence, fixed dims...)
        small = {t.name for t in spec.inputs if not t.name.startswith("past_key_values.")}
        outs = [t for t in spec.outputs if not t.name.startswith("present.")]
        steppable = small == _STEP_INPUTS and all(all(isinstance(d, int) for d in t.dims[2:]) for t in outs)
        self._step_outputs = [(t.name, np.dtype(t.dtype), tuple(t.dims[2:])) for t in outs] if steppable else None

    @staticmethod
    def split(feed: dict) -> tuple[dict, dict]:
        """A whole feed as (the small inputs, the K/V buffers) for :meth:`run`."""
        buffers = {k: v for k, v in feed.items() if k.startswith("past_key_values.")}
        return {k: v for k, v in feed.items() if k not in buffers}, buffers

    @staticmethod
    def caller(session, spec):
        """``feed -> outputs`` for a whole feed of ``spec``'s graph, called as the runtime calls it: its
        buffers bound where it writes K/V in place, a plain run otherwise (timings, parity tools)."""
        if C.kv_in_place(spec):
            bound = InPlaceRun(session, spec)
            return lambda feed: bound.run(*InPlaceRun.split(feed))
        return lambda feed: session.run(spec.output_names, feed)

    def run_on(self, kv, feed: dict, rows: slice | None = None) -> dict:
        """:meth:`run` against a cache's buffers (a :class:`graphs.slots.SlotCache`'s ``rows``). The binding
        is kept in ``kv.bindings``, one per graph, while the buffers stay the same memory: the cache's
        allocation generation, the rows, the occupied rows."""
        cache = kv.bindings.setdefault(self, {})
        key = (kv.generation, (None, None) if rows is None else (rows.start, rows.stop), getattr(kv, "n", None))
        buffers = None if key in cache else (kv.feed() if rows is None else kv.feed(rows))
        return self.run(feed, buffers, cache, key)

    @staticmethod
    def keep_bound_only(kv) -> int:
        """Drop the per-call bindings :meth:`run_on` kept on ``kv`` for every graph (each holds its last
        outputs: a prefill's are prompt x vocabulary logits, 262 MB for 2048 tokens of a 32k vocabulary),
        keep the bound calls; returns the bytes those hold. For a cache kept idle between requests."""
        held = 0
        for cache in kv.bindings.values():
            for key in [k for k in cache if k[0] != "bound"]:
                del cache[key]
            held += sum(bound.nbytes for bound in cache.values())
        return held

    def bound_on(self, kv, s: int) -> BoundCall | None:
        """The :class:`BoundCall` of ``s`` new tokens for every occupied row of ``kv`` (a
        :class:`graphs.slots.SlotCache`), made once per (buffers, occupied rows, s) and kept in
        ``kv.bindings``; None where this graph takes other inputs than such a call's (then use
        :meth:`run_on`). ``run`` binds the small inputs and wraps each output on every call, which
        was most of the Python time around an autoregressive step (~0.1 ms, a fifth of a 19M int4
        step): a bound call is refilled in place instead."""
        if self._step_outputs is None:
            return None
        cache = kv.bindings.setdefault(self, {})
        key = ("bound", kv.generation, kv.n, s)
        bound = cache.pop(key, None)
        if bound is None:
            stale = [k for k in cache if k[0] == "bound" and (k[1], k[2]) != (kv.generation, kv.n)]
            bound_keys = [k for k in cache if k[0] == "bound" and k not in stale]
            # bindings of buffers or rows that are gone, and past the last few widths (each holds its
            # outputs: rows x width x vocabulary floats); made again in ~0.1 ms when needed
            for k in stale + bound_keys[: max(len(bound_keys) - BOUND_WIDTHS + 1, 0)]:
                del cache[k]
            bound = BoundCall(self.session, self._step_outputs, kv.feed(), kv.n, s, kv.capacity)
        cache[key] = bound  # the most recently used last
        return bound

    def run(self, feed: dict, buffers: dict, cache: dict | None = None, cache_key=None) -> dict:
        """``feed``: the small inputs (arrays), ``buffers``: ``past_key_values.*`` -> contiguous buffers.

        ``cache``: a dict owned by the caller's K/V (one engine, one thread) that keeps the binding of
        the buffers between calls while they stay the same memory (24 bindings a step on a 12-layer
        model otherwise: ~0.3 ms of Python per step measured on the 19M int4 model). ``cache_key``:
        what identifies that memory (default: every buffer's address and shape); the caches pass
        their allocation generation and the rows."""
        key = tuple((b.ctypes.data, b.shape) for b in buffers.values()) if cache_key is None else cache_key
        io = cache.get(key) if cache is not None else None
        if io is None:
            if buffers is None:
                raise ValueError("InPlaceRun.run: no binding cached for this key and no buffers given")
            io = self.session.io_binding()
            for name in self.outputs:  # first: the outputs are listed in the order first bound
                io.bind_output(name, "cpu")
            bind_in_place(io, buffers)
            if cache is not None:
                # the buffers moved (or other rows): older per-call bindings go; the bound calls stay
                # (their keys name their buffers and rows; a cache drops every binding when it
                # reallocates)
                for k in [k for k in cache if k[0] != "bound"]:
                    del cache[k]
                cache[key] = io
        # The small inputs and the outputs are rebound on every call (new arrays, new shapes). ORT's
        # Python IOBinding wraps each bind and every output (the 2L bound K/V buffers included) in
        # Python objects: ~0.15 ms a step on a 6-layer model, a tenth of an int4 step. The pybind
        # binding underneath takes the same calls directly where this onnxruntime has it.
        inner = getattr(io, "_iobinding", None)
        device = _cpu_device() if inner is not None else None
        if device is None:
            for name, x in feed.items():
                io.bind_cpu_input(name, np.ascontiguousarray(x))
            for name in self.outputs:
                io.bind_output(name, "cpu")
            self.session.run_with_iobinding(io)
            got = io.get_outputs()
            return {name: got[i].numpy() for i, name in enumerate(self.outputs)}
        held = [np.ascontiguousarray(x) for x in feed.values()]  # alive until the run has read them
        for name, x in zip(feed, held):
            inner.bind_input(name, x)
        for name in self.outputs:
            inner.bind_output(name, device)
        self.session.run_with_iobinding(io)
        got = inner.get_outputs()
        return {name: got[i].numpy() for i, name in enumerate(self.outputs)}
