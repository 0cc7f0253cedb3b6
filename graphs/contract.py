"""The graph contract: every input and output name, dtype and symbolic dim, declared once.

The exporter builds its ``input_names``/``output_names``/``dynamic_axes`` from these specs and
writes them into ``manifest.json``; the runtime reads them back from the manifest. Nothing else in
the project spells a graph I/O name.

Symbolic dims::

    batch         B   sequences decoded together
    sequence      S   new positions in this call (prompt length, 1, or the tree size)
    past_sequence P   positions already in the K/V cache
    total_sequence    P + S (the attention mask's key axis)
    topk          K   candidates per position (draft graph), a runtime input

Base graph (one forward serves prefill, a one-token step and a whole tree)::

    input_ids        int64 [B, S]
    position_ids     int64 [B, S]          real positions (tree depth + cache length)
    attention_mask   bool  [B, 1, S, P+S]  True = query row may attend key column
    past_key_values.{i}.key / .value  float [B, kv_heads, P, head_dim]
    ->
    logits           float [B, S, vocab]
    hidden_states    float [B, S, hidden]  last layer, after the final norm (what Medusa/EAGLE-1 read)
    aux_hidden_states float [B, S, n_aux*hidden]  EAGLE-3 only: outputs of the chosen layers
    present.{i}.key / .value  float [B, kv_heads, S, head_dim]  K/V of the S new positions only

The base graph with K/V written in place (``python -m exporter.optimize``, CPU; :func:`kv_in_place`
tells, from the manifest's own spec): each past K/V input is the whole buffer of ``P`` columns and the
graph writes the S new rows of row b into it at columns ``[kv_write_index[b], +S)`` (ONNX
``TensorScatter``); the caller binds ``present.*`` to the same memory, so nothing is concatenated::

    attention_mask   bool  [B, 1, S, P]    over the buffer's columns, the new rows included
    kv_write_index   int64 [B]             (the last input) where each row's S new rows go
    past_key_values.{i}.* / present.{i}.*  float [B, P, kv_heads * head_dim] (layout ``bsh``, the
                     fused graphs) or [B, kv_heads, P, head_dim] (``bhsd``): the buffer, S rows written

Draft graph, Medusa::

    hidden_states float [B, S, hidden], topk int64 [1]
    -> logits float [B, S, heads, vocab], topk_ids int64 [B, S, heads, K],
       topk_logprobs float32 [B, S, heads, K]

Draft graph, EAGLE (the drafter's own K/V cache; the same tree-mask convention as the base)::

    hidden_states float [B, S1, hidden]        drafter's own output hidden (or, EAGLE-1, the base's)
    aux_hidden_states float [B, S0, n_aux*hidden]  EAGLE-3 only; fused by the drafter's fc. Exactly
                                               one of S0/S1 is non-zero in a call; S = S0 + S1.
    input_ids int64 [B, S]                     the *next* token of each position
    position_ids int64 [B, S], attention_mask bool [B, 1, S, P+S],
    past_key_values.{i}.key / .value (drafter layers), topk int64 [1]
    -> hidden_states_out float [B, S, hidden], logits float [B, S, draft_vocab],
       topk_ids int64 [B, S, K] (already mapped to the target vocabulary),
       topk_logprobs float32 [B, S, K], present.{i}.key / .value float [B, kv_heads, S, head_dim]

Draft graph, DFlash (one call: the new context rows into the drafter's cache, then one block)::

    aux_hidden_states float [B, A, n_aux*hidden]  the base's target layers of A new context rows
    context_position_ids int64 [B, A]             their positions
    input_ids int64 [B, S]                        the block: [anchor, mask x (S-1)]
    position_ids int64 [B, S]                     anchor position + 0..S-1
    attention_mask bool [B, 1, S, P+A+S]          cached context | new context | block columns
    past_key_values.{i}.key / .value [B, kv_heads, P, head_dim]  the context rows' K/V (drafter layer i)
    topk int64 [1]
    -> logits float [B, S-1, vocab]               slots 1..S-1: row k guesses the token at anchor + k + 1
       topk_ids int64 [B, S-1, K], topk_logprobs float32 [B, S-1, K]
       present.{i}.key / .value [B, kv_heads, A, head_dim]  K/V of the A new context rows only
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

FORMAT_VERSION = 1

# Symbolic dim names, used verbatim in the ONNX graphs and the manifest.
BATCH = "batch"
SEQ = "sequence"
PAST = "past_sequence"
TOTAL = "total_sequence"
TOPK = "topk"
AUX_SEQ = "aux_sequence"
DRAFT_SEQ = "draft_sequence"
BLOCK_DRAFTS = "block_drafts"  # DFlash: the S-1 drafted slots of a block

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
HIDDEN = "hidden_states"
AUX_HIDDEN = "aux_hidden_states"
HIDDEN_OUT = "hidden_states_out"
LOGITS = "logits"
TOPK_IN = "topk"
TOPK_IDS = "topk_ids"
TOPK_LOGPROBS = "topk_logprobs"
KV_WRITE = "kv_write_index"
CONTEXT_POSITION_IDS = "context_position_ids"


def past_key(i: int) -> str:
    return f"past_key_values.{i}.key"


def past_value(i: int) -> str:
    return f"past_key_values.{i}.value"


def present_key(i: int) -> str:
    return f"present.{i}.key"


def present_value(i: int) -> str:
    return f"present.{i}.value"


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. ``dims`` holds ints (fixed) or symbolic names (dynamic)."""

    name: str
    dtype: str  # numpy dtype name: "int64", "bool", "float32", "float16", "bfloat16"
    dims: tuple[int | str, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}

    @classmethod
    def from_json(cls, d: dict) -> TensorSpec:
        return cls(name=d["name"], dtype=d["dtype"], dims=tuple(d["dims"]))


@dataclass(frozen=True)
class GraphSpec:
    """Inputs and outputs of one graph, in order."""

    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """torch.onnx.export's ``dynamic_axes`` for every symbolic dim."""
        axes: dict[str, dict[int, str]] = {}
        for t in (*self.inputs, *self.outputs):
            sym = {i: d for i, d in enumerate(t.dims) if isinstance(d, str)}
            if sym:
                axes[t.name] = sym
        return axes

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> TensorSpec:
        return next(t for t in self.outputs if t.name == name)

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }

    @classmethod
    def from_json(cls, d: dict) -> GraphSpec:
        return cls(
            file=d["file"],
            inputs=tuple(TensorSpec.from_json(t) for t in d["inputs"]),
            outputs=tuple(TensorSpec.from_json(t) for t in d["outputs"]),
        )


@dataclass(frozen=True)
class ModelDims:
    """The sizes a graph contract depends on (written to the manifest as ``model``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: str = "float32"

    def to_json(self) -> dict:
        return asdict(self)


def _kv_specs(prefix_in: bool, num_layers: int, kv_heads: int, head_dim: int, dtype: str, seq: str):
    specs = []
    for i in range(num_layers):
        k, v = (past_key(i), past_value(i)) if prefix_in else (present_key(i), present_value(i))
        specs.append(TensorSpec(k, dtype, (BATCH, kv_heads, seq, head_dim)))
        specs.append(TensorSpec(v, dtype, (BATCH, kv_heads, seq, head_dim)))
    return specs


def base_graph_spec(dims: ModelDims, n_aux: int = 0, file: str = "base.onnx") -> GraphSpec:
    """The base model: tokens + tree mask + past K/V -> logits, hidden states, new K/V."""
    inputs = [
        TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ)),
        TensorSpec(POSITION_IDS, "int64", (BATCH, SEQ)),
        TensorSpec(ATTENTION_MASK, "bool", (BATCH, 1, SEQ, TOTAL)),
        *_kv_specs(True, dims.num_layers, dims.num_kv_heads, dims.head_dim, dims.dtype, PAST),
    ]
    outputs = [
        TensorSpec(LOGITS, dims.dtype, (BATCH, SEQ, dims.vocab_size)),
        TensorSpec(HIDDEN, dims.dtype, (BATCH, SEQ, dims.hidden_size)),
    ]
    if n_aux:
        outputs.append(TensorSpec(AUX_HIDDEN, dims.dtype, (BATCH, SEQ, n_aux * dims.hidden_size)))
    outputs += _kv_specs(False, dims.num_layers, dims.num_kv_heads, dims.head_dim, dims.dtype, SEQ)
    return GraphSpec(file=file, inputs=tuple(inputs), outputs=tuple(outputs))


KV_LAYOUTS = ("bhsd", "bsh")  # (B, kv_heads, P, head_dim) as traced | (B, P, kv_heads * head_dim)


def inplace_base_spec(spec: GraphSpec, layout: str = "bhsd") -> GraphSpec:
    """``spec`` (a base graph) with its K/V written in place: the mask spans the buffer's columns
    (``past_sequence``), ``kv_write_index`` is appended, each ``present.*`` is the whole buffer, in
    ``layout`` (``bsh``: the K/V of a position is one row of ``kv_heads * head_dim``, genai's layout)."""
    if kv_in_place(spec) or layout not in KV_LAYOUTS:
        raise ValueError(f"inplace_base_spec: {spec.file} is in place already, or layout {layout!r} is unknown")
    if CONTEXT_POSITION_IDS in spec.input_names and layout == "bhsd":  # a DFlash draft graph (same pass)
        return inplace_dflash_spec(spec)

    def kv(t: TensorSpec) -> TensorSpec:
        b, h, _, d = t.dims
        return TensorSpec(t.name, t.dtype, (b, h, PAST, d) if layout == "bhsd" else (b, PAST, h * d))

    inputs = [TensorSpec(t.name, t.dtype, (BATCH, 1, SEQ, PAST)) if t.name == ATTENTION_MASK
              else kv(t) if t.name.startswith("past_key_values.") else t for t in spec.inputs]
    inputs.append(TensorSpec(KV_WRITE, "int64", (BATCH,)))
    outputs = [kv(t) if t.name.startswith("present.") else t for t in spec.outputs]
    return GraphSpec(file=spec.file, inputs=tuple(inputs), outputs=tuple(outputs))


def concat_base_spec(spec: GraphSpec, kv_heads: int, head_dim: int) -> GraphSpec:
    """The inverse of :func:`inplace_base_spec`: the traced contract of an in-place base graph (what
    its feeds are built for before :func:`graphs.kv.as_inplace_feed` adapts them)."""
    if not kv_in_place(spec):
        return spec
    dflash = CONTEXT_POSITION_IDS in spec.input_names  # its mask keeps P+A+S columns, its new rows are A

    def kv(t: TensorSpec, seq: str) -> TensorSpec:
        return TensorSpec(t.name, t.dtype, (BATCH, kv_heads, seq, head_dim))

    inputs = tuple(TensorSpec(t.name, t.dtype, (BATCH, 1, SEQ, TOTAL)) if t.name == ATTENTION_MASK
                   else kv(t, PAST) if t.name.startswith("past_key_values.") else t
                   for t in spec.inputs if t.name != KV_WRITE)
    outputs = tuple(kv(t, AUX_SEQ if dflash else SEQ) if t.name.startswith("present.") else t for t in spec.outputs)
    return GraphSpec(file=spec.file, inputs=inputs, outputs=outputs)


def kv_in_place(spec: GraphSpec) -> bool:
    """Whether the graph writes its new K/V into the past buffers (see the module docstring)."""
    return KV_WRITE in spec.input_names


def kv_layout(spec: GraphSpec) -> str:
    """The K/V buffers' layout the graph reads: ``bhsd`` (B, kv_heads, P, head_dim) or ``bsh``."""
    return "bsh" if len(spec.input(past_key(0)).dims) == 3 else "bhsd"


def medusa_graph_spec(dims: ModelDims, num_heads: int, file: str = "draft.onnx") -> GraphSpec:
    """Medusa heads: hidden -> per-head logits and top-k."""
    inputs = (
        TensorSpec(HIDDEN, dims.dtype, (BATCH, SEQ, dims.hidden_size)),
        TensorSpec(TOPK_IN, "int64", (1,)),
    )
    outputs = (
        TensorSpec(LOGITS, dims.dtype, (BATCH, SEQ, num_heads, dims.vocab_size)),
        TensorSpec(TOPK_IDS, "int64", (BATCH, SEQ, num_heads, TOPK)),
        TensorSpec(TOPK_LOGPROBS, "float32", (BATCH, SEQ, num_heads, TOPK)),
    )
    return GraphSpec(file=file, inputs=inputs, outputs=outputs)


def eagle_graph_spec(
    dims: ModelDims,
    draft_layers: int,
    draft_vocab_size: int,
    n_aux: int = 0,
    file: str = "draft.onnx",
) -> GraphSpec:
    """EAGLE drafter: one autoregressive step over S positions with its own K/V cache.

    ``dims`` are the drafter's attention dims (kv heads and head dim of its layers), with the
    base's hidden size.
    """
    hidden_seq = DRAFT_SEQ if n_aux else SEQ  # EAGLE-3: S = aux_sequence + draft_sequence
    inputs = [TensorSpec(HIDDEN, dims.dtype, (BATCH, hidden_seq, dims.hidden_size))]
    if n_aux:
        inputs.append(TensorSpec(AUX_HIDDEN, dims.dtype, (BATCH, AUX_SEQ, n_aux * dims.hidden_size)))
    inputs += [
        TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ)),
        TensorSpec(POSITION_IDS, "int64", (BATCH, SEQ)),
        TensorSpec(ATTENTION_MASK, "bool", (BATCH, 1, SEQ, TOTAL)),
        *_kv_specs(True, draft_layers, dims.num_kv_heads, dims.head_dim, dims.dtype, PAST),
        TensorSpec(TOPK_IN, "int64", (1,)),
    ]
    outputs = [
        TensorSpec(HIDDEN_OUT, dims.dtype, (BATCH, SEQ, dims.hidden_size)),
        TensorSpec(LOGITS, dims.dtype, (BATCH, SEQ, draft_vocab_size)),
        TensorSpec(TOPK_IDS, "int64", (BATCH, SEQ, TOPK)),
        TensorSpec(TOPK_LOGPROBS, "float32", (BATCH, SEQ, TOPK)),
        *_kv_specs(False, draft_layers, dims.num_kv_heads, dims.head_dim, dims.dtype, SEQ),
    ]
    return GraphSpec(file=file, inputs=tuple(inputs), outputs=tuple(outputs))


def dflash_graph_spec(dims: ModelDims, draft_layers: int, n_aux: int, file: str = "draft.onnx") -> GraphSpec:
    """DFlash drafter: A new context rows (the base's ``n_aux`` target layers) join the drafter's K/V
    cache and one block of S slots is drafted, in one call (see the module docstring).

    ``dims`` are the drafter's attention dims (kv heads and head dim of its layers) with the base's
    hidden and vocabulary sizes. The mask's key axis (``total_sequence``) is P + A + S here."""
    inputs = (
        TensorSpec(AUX_HIDDEN, dims.dtype, (BATCH, AUX_SEQ, n_aux * dims.hidden_size)),
        TensorSpec(CONTEXT_POSITION_IDS, "int64", (BATCH, AUX_SEQ)),
        TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ)),
        TensorSpec(POSITION_IDS, "int64", (BATCH, SEQ)),
        TensorSpec(ATTENTION_MASK, "bool", (BATCH, 1, SEQ, TOTAL)),
        *_kv_specs(True, draft_layers, dims.num_kv_heads, dims.head_dim, dims.dtype, PAST),
        TensorSpec(TOPK_IN, "int64", (1,)),
    )
    outputs = (
        TensorSpec(LOGITS, dims.dtype, (BATCH, BLOCK_DRAFTS, dims.vocab_size)),
        TensorSpec(TOPK_IDS, "int64", (BATCH, BLOCK_DRAFTS, TOPK)),
        TensorSpec(TOPK_LOGPROBS, "float32", (BATCH, BLOCK_DRAFTS, TOPK)),
        *_kv_specs(False, draft_layers, dims.num_kv_heads, dims.head_dim, dims.dtype, AUX_SEQ),
    )
    return GraphSpec(file=file, inputs=inputs, outputs=outputs)


def inplace_dflash_spec(spec: GraphSpec) -> GraphSpec:
    """``spec`` (a DFlash draft graph) with its context K/V written in place, as :func:`inplace_base_spec`
    does for the base (the same pass: each ``Concat(past, new)`` -> ``TensorScatter``): each past K/V
    input is the drafter's cache buffer of ``past_sequence`` columns, row b's A new context rows are
    written at columns ``[kv_write_index[b], +A)``, ``present.*`` is the buffer; the mask spans the
    buffer's columns (the new rows marked at their write positions) then the S block columns, so its key
    axis ``total_sequence`` is P + S here."""
    if kv_in_place(spec) or CONTEXT_POSITION_IDS not in spec.input_names:
        raise ValueError(f"inplace_dflash_spec: {spec.file} is in place already, or not a DFlash draft graph")

    def kv(t: TensorSpec) -> TensorSpec:
        b, h, _, d = t.dims
        return TensorSpec(t.name, t.dtype, (b, h, PAST, d))

    inputs = [kv(t) if t.name.startswith("past_key_values.") else t for t in spec.inputs]
    inputs.append(TensorSpec(KV_WRITE, "int64", (BATCH,)))
    outputs = [kv(t) if t.name.startswith("present.") else t for t in spec.outputs]
    return GraphSpec(file=spec.file, inputs=tuple(inputs), outputs=tuple(outputs))


CAPACITY = "capacity"
ACCEPTED = "accepted"


def cache_in(j: int) -> str:
    return f"cache.{j}"


def cache_out(j: int) -> str:
    return f"cache_out.{j}"


# --------------------------------------------------------------------------------------------
# The device path's small graphs (graphs.device): built by ``exporter.optimize`` beside a base that
# writes its K/V in place, listed in the manifest under these roles (hashed like every graph)

DEVICE_PREFIX = "device."
SELECT_ROLE = "device.select"  # the verify's logits -> each node's argmax and whether its row is finite
COMPACT_ROLE = "device.kv_compact"  # accepted nodes moved down in every K/V buffer, one call a step
COPY_ROLE = "device.kv_copy"  # a K/V buffer copied (zero-padded): growth, a row moved into a freed one
ROWS_ROLE = "device.rows"  # a few rows of an output brought back (features, a prefill's last logits)
SAMPLE_ROLE = "device.sample"  # sampled rows: each node's probabilities of the tree's tokens, draws from it
DEVICE_ROLES = (SELECT_ROLE, COMPACT_ROLE, COPY_ROLE, ROWS_ROLE, SAMPLE_ROLE)
# the EAGLE / DFlash drafter's K/V buffers copied (growth, a row moved): built beside a drafter that
# writes its K/V in place (its commits are in place already: no compaction graph)
DRAFT_COPY_ROLE = "device.draft_kv_copy"
SAMPLE_DRAWS = 4  # draws per node from its distribution (the host takes the first one not rejected)
ARGMAX = "argmax"
NONFINITE = "nonfinite"
SRC_COLUMNS = "src_columns"
PADS = "pads"
ROWS_IN, ROW_INDEX, ROWS_OUT = "x", "row_index", "rows"
FEATURES = "features"
NODE_TOKENS = "node_tokens"
TEMPERATURE, TOP_K, TOP_P, UNIFORMS = "temperature", "top_k", "top_p", "uniforms"
NODE_PROBS, DRAWS = "node_probs", "draws"


def is_device_role(role: str) -> bool:
    return role.startswith(DEVICE_PREFIX)


def select_graph_spec(dtype: str, file: str = "device_select.onnx") -> GraphSpec:
    """``logits`` [B, S, vocab] -> ``argmax`` int64 [B, S] (the first of equal logits, as numpy's) and
    ``nonfinite`` bool [B, S] (a nan or +inf in that node's logits: the host's greedy walk refuses it)."""
    return GraphSpec(file=file, inputs=(TensorSpec(LOGITS, dtype, (BATCH, SEQ, "vocab")),),
                     outputs=(TensorSpec(ARGMAX, "int64", (BATCH, SEQ)), TensorSpec(NONFINITE, "bool", (BATCH, SEQ))))


def _kv_buffer_dims(base: GraphSpec) -> tuple:
    dims = base.input(past_key(0)).dims
    return (BATCH, CAPACITY, dims[2]) if len(dims) == 3 else (BATCH, dims[1], CAPACITY, dims[3])


def kv_compact_graph_spec(base: GraphSpec, file: str = "device_kv_compact.onnx") -> GraphSpec:
    """Every K/V buffer of ``base`` (its layout) at once: row b keeps ``src_columns[b, j]`` at column
    ``kv_write_index[b] + j`` (GatherElements, then TensorScatter at each row's own column); each
    ``cache_out.j`` is bound to the buffer of ``cache.j``, so the move happens in place::

        cache.{j} [B, capacity, kv*hd] (or [B, kv, capacity, hd]), src_columns int64 [B, A],
        kv_write_index int64 [B] -> cache_out.{j}
    """
    n = sum(1 for t in base.inputs if t.name.startswith("past_key_values."))
    dt = base.input(past_key(0)).dtype
    dims = _kv_buffer_dims(base)
    inputs = [TensorSpec(cache_in(j), dt, dims) for j in range(n)]
    inputs += [TensorSpec(SRC_COLUMNS, "int64", (BATCH, ACCEPTED)), TensorSpec(KV_WRITE, "int64", (BATCH,))]
    return GraphSpec(file=file, inputs=tuple(inputs), outputs=tuple(TensorSpec(cache_out(j), dt, dims)
                                                                     for j in range(n)))


def kv_copy_graph_spec(base: GraphSpec, file: str = "device_kv_copy.onnx") -> GraphSpec:
    """Every K/V buffer copied into another, zero-padded by ``pads`` (ONNX Pad's, one for all): a
    growth (the old buffers into larger ones) or a row moved (pads 0, bound to two rows' memory)."""
    n = sum(1 for t in base.inputs if t.name.startswith("past_key_values."))
    dt = base.input(past_key(0)).dtype
    dims = _kv_buffer_dims(base)
    out_dims = tuple("out_" + d if isinstance(d, str) else d for d in dims)
    inputs = [TensorSpec(cache_in(j), dt, dims) for j in range(n)] + [TensorSpec(PADS, "int64", (2 * len(dims),))]
    return GraphSpec(file=file, inputs=tuple(inputs), outputs=tuple(TensorSpec(cache_out(j), dt, out_dims)
                                                                     for j in range(n)))


def rows_graph_spec(dtype: str, file: str = "device_rows.onnx") -> GraphSpec:
    """``x`` [M, features] (an output's rows, flattened), ``row_index`` int64 [K] -> ``rows`` [K, features]."""
    return GraphSpec(file=file, inputs=(TensorSpec(ROWS_IN, dtype, ("rows_in", FEATURES)),
                                        TensorSpec(ROW_INDEX, "int64", ("rows_out",))),
                     outputs=(TensorSpec(ROWS_OUT, dtype, ("rows_out", FEATURES)),))


def sample_graph_spec(dtype: str, file: str = "device_sample.onnx") -> GraphSpec:
    """Sampled rows (graphs.sampling.process_logits on the device, float32: temperature, then top-k with
    ties at the k-th kept, then top-p by rank)::

        logits [B, S, vocab], node_tokens int64 [B, S] (the tree's tokens), temperature float [B],
        top_k int64 [B] (1..vocab: the host maps 0 to vocab), top_p float [B], uniforms float [B, S, R]
        -> node_probs float [B, S, S]  [b, n, m] = p_n(node_tokens[b, m]) (what the rejection rule reads)
           draws int64 [B, S, R]       from p_n by the uniforms (inverse CDF: the first index whose
                                       cumulative mass exceeds u * total; vocab where rounding ran out)
    """
    b, s, r = BATCH, SEQ, "draws"
    inputs = (TensorSpec(LOGITS, dtype, (b, s, "vocab")), TensorSpec(NODE_TOKENS, "int64", (b, s)),
              TensorSpec(TEMPERATURE, "float32", (b,)), TensorSpec(TOP_K, "int64", (b,)),
              TensorSpec(TOP_P, "float32", (b,)), TensorSpec(UNIFORMS, "float32", (b, s, r)))
    outputs = (TensorSpec(NODE_PROBS, "float32", (b, s, s)), TensorSpec(DRAWS, "int64", (b, s, r)))
    return GraphSpec(file=file, inputs=inputs, outputs=outputs)


def device_graph_specs(base: GraphSpec, draft: GraphSpec | None = None) -> dict:
    """The device path's graphs for ``base`` (K/V in place), by manifest role; ``draft``: the drafter's
    graph, whose K/V buffers get their own copy graph where it writes them in place (EAGLE, DFlash)."""
    dt = base.output(LOGITS).dtype
    specs = {SELECT_ROLE: select_graph_spec(dt), COMPACT_ROLE: kv_compact_graph_spec(base),
             COPY_ROLE: kv_copy_graph_spec(base), ROWS_ROLE: rows_graph_spec(dt), SAMPLE_ROLE: sample_graph_spec(dt)}
    if draft is not None and kv_in_place(draft):
        specs[DRAFT_COPY_ROLE] = kv_copy_graph_spec(draft, file="device_draft_kv_copy.onnx")
    return specs


# --------------------------------------------------------------------------------------------
# The one-call EAGLE-2 tree graph: context rows in, the whole drafted tree out (exporter.eagle_tree)

ROOT_INDEX = "root_index"
TREE_TOKENS = "tree_tokens"
TREE_PARENTS = "tree_parents"
TREE_DEPTH = "tree_depth"
TREE_SCORES = "tree_scores"
TREE_MASK = "tree_mask"
TREE_ROLE_PREFIX = "draft_tree."


def eagle_tree_role(topk: int, depth: int, total_tokens: int) -> str:
    """Manifest role of the tree graph baked for (topk, depth, total_tokens): ``draft_tree.2-3-6``."""
    return f"{TREE_ROLE_PREFIX}{topk}-{depth}-{total_tokens}"


def eagle_tree_graph_spec(
    dims: ModelDims,
    draft_layers: int,
    topk: int,
    depth: int,
    total_tokens: int,
    n_aux: int = 0,
) -> GraphSpec:
    """The whole EAGLE-2 tree of one decode step in one call, for a (topk, depth, total_tokens) fixed here.

    Inputs are the drafter's context rows, as for the step-wise draft graph (the features of the
    newly accepted tokens, their next tokens, positions, mask over the drafter's cache + these rows)
    plus ``root_index`` (B,): the row of each sequence whose output drafts the tree (its last real
    row; the root token is that row's input id). Outputs: the ``T = total_tokens`` tree nodes in
    verify order (node 0 the root; then by depth, score descending), the drafter K/V of the S context
    rows (the tree rows' K/V never leave the graph)::

        hidden_states float [B, S, hidden]            EAGLE-1 (base features); EAGLE-3 instead:
        aux_hidden_states float [B, S, n_aux*hidden]
        input_ids, position_ids int64 [B, S], attention_mask bool [B, 1, S, P+S], root_index int64 [B],
        past_key_values.{i}.key / .value (drafter layers)
        -> tree_tokens int64 [B, T]    target vocabulary (after d2t); [:, 0] = the root token
           tree_parents int64 [B, T]   index into the T nodes, -1 for the root; parents[i] < i
           tree_depth int64 [B, T]     root 0; verify position = root position + depth
           tree_scores float32 [B, T]  cumulative draft log-prob, root 0
           tree_mask bool [B, T, T]    [b, i, j]: node j is node i or one of its ancestors
           present.{i}.key / .value [B, kv_heads, S, head_dim]
    """
    feat = (TensorSpec(AUX_HIDDEN, dims.dtype, (BATCH, SEQ, n_aux * dims.hidden_size)) if n_aux
            else TensorSpec(HIDDEN, dims.dtype, (BATCH, SEQ, dims.hidden_size)))
    inputs = [
        feat,
        TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ)),
        TensorSpec(POSITION_IDS, "int64", (BATCH, SEQ)),
        TensorSpec(ATTENTION_MASK, "bool", (BATCH, 1, SEQ, TOTAL)),
        TensorSpec(ROOT_INDEX, "int64", (BATCH,)),
        *_kv_specs(True, draft_layers, dims.num_kv_heads, dims.head_dim, dims.dtype, PAST),
    ]
    t = total_tokens
    outputs = [
        TensorSpec(TREE_TOKENS, "int64", (BATCH, t)),
        TensorSpec(TREE_PARENTS, "int64", (BATCH, t)),
        TensorSpec(TREE_DEPTH, "int64", (BATCH, t)),
        TensorSpec(TREE_SCORES, "float32", (BATCH, t)),
        TensorSpec(TREE_MASK, "bool", (BATCH, t, t)),
        *_kv_specs(False, draft_layers, dims.num_kv_heads, dims.head_dim, dims.dtype, SEQ),
    ]
    file = f"draft_tree_{topk}_{depth}_{total_tokens}.onnx"
    return GraphSpec(file=file, inputs=tuple(inputs), outputs=tuple(outputs))
