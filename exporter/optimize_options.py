"""What the optimize stage does to each graph: :class:`OptimizeOptions` (the CLI's flags, checked), the
targets and quantizations it knows. Shared by the passes (:mod:`exporter.optimizing`) and the gates
(:mod:`exporter.optimize_gates`)."""

from __future__ import annotations

from dataclasses import dataclass

from exporter.errors import UserError
from graphs import contract as C

TARGETS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
QUANTIZE = {"none": 0, "int8": 8, "int4": 4}
TUNE_BUDGET_S = 60.0  # the re-tuning after optimize: its EAGLE sweep's time (Medusa needs less)


@dataclass(frozen=True)
class OptimizeOptions:
    """What to do to each traced graph. Defaults: measured on a 2-core x86 CPU (README, "Optimize")."""

    target: str = "cpu"  # the provider the graphs are tuned for: "cpu" | "cuda"
    quantize: str = "none"  # weight-only: "none" | "int8" | "int4" (MatMulNBits)
    # the drafter's graphs (draft, draft_tree.*) on their own; None: as ``quantize``. A quantized drafter
    # beside a float base keeps the output exactly the float model's (drafts are only proposals) and
    # makes drafting cheaper: what EAGLE, whose drafter is a decoder layer and an lm_head, needs most.
    quantize_draft: str | None = None
    fuse: bool = True  # attention + norms; exact under tree masks, 1.1-1.5x per step on CPU
    float16: bool | None = None  # None: float16 for cuda, float32 for cpu
    block_size: int = 32  # quantization block along K: 32 keeps int4 error small
    # MatMulNBits compute type of the base. None: 4 (int8 activations, MLAS's fast kernels), kept only
    # where the rows check below finds every row's logits the same whatever the call's row count; where
    # only a one-row call differs (MLAS's separate M == 1 kernel on VNNI CPUs: up to 1.2e-2 measured),
    # the manifest says so and the runtime calls one token as two rows (graphs.runtime); where calls of
    # several rows differ too, optimize refuses level 4. 0: float32 compute (row-consistent everywhere).
    accuracy_level: int | None = None
    # The drafter's graphs (draft, draft_tree.*) at level 4 by default: drafts are deterministic
    # tokens that the base verifies (graphs.sampling), so the drafter's rounding can change which
    # tokens are proposed, never what is emitted; measured on the 19M EAGLE drafter, level 0 made the
    # one-call draft 1.0x float32 (int4) and 7x slower (int8), level 4 1.8x faster.
    draft_accuracy_level: int = 4
    # the base writes its new K/V into the caller's buffers (exporter.passes.kv_inplace) instead of
    # concatenating the whole cache in every layer; None: on for both targets (ORT's CPU TensorScatter
    # writes in place; CUDA has the kernel since ONNX Runtime PR #27446, and the device path binds its
    # buffers as OrtValues on the GPU). The GroupQueryAttention form (one_sequence_graph) needs it.
    kv_in_place: bool | None = None
    # the base's K/V buffers where it writes them in place (its fused layers, exporter.passes.kv_inplace):
    # "bhsd" (B, kv_heads, P, head_dim), which ONNX Attention's CPU kernel reads per head contiguously,
    # or "bsh" (B, P, kv_heads * head_dim), genai's compact 3-D form, 4 nodes a layer fewer but a
    # strided read per head: measured on the 19M model, 2 threads, the step's slope against context
    # 1.5-2x genai's with "bsh", 1.0-1.3x with "bhsd" (docs/benchmarks.md)
    kv_layout: str = "bhsd"
    # beside the base, a graph of the same contract with each layer's attention as one
    # com.microsoft.GroupQueryAttention (rotary, cache write and attention in one kernel that reads
    # each row's own length; exporter.passes.kv_inplace.group_query_graph), which the runtime runs for
    # the calls that kernel takes (one token per row, or one sequence): on the 19M model 74 ORT nodes
    # to the base's 120 and a third less step time at 2048 tokens of context (docs/benchmarks.md).
    # Checked as the base is (parity with the raw trace, rows), and against the base row for row.
    one_sequence_graph: bool = True
    validate: bool = True  # raw-vs-optimized parity on tree/batch/past cases before the swap
    time_gain: bool = True  # time raw vs optimized base at 1 and 8 tokens for the summary

    def __post_init__(self):
        if self.target not in TARGETS:
            raise UserError(f"unknown --target {self.target!r}; accepted: {', '.join(TARGETS)}")
        for flag, q in (("--quantize", self.quantize), ("--quantize-draft", self.quantize_draft)):
            if q is not None and q not in QUANTIZE:
                raise UserError(f"unknown {flag} {q!r}; accepted: {', '.join(QUANTIZE)}")
        for flag, level in (("--accuracy-level", self.accuracy_level),
                            ("--draft-accuracy-level", self.draft_accuracy_level)):
            if level is not None and level not in (0, 1, 2, 3, 4):
                raise UserError(f"{flag} {level} must be 0-4 (0: float32 compute, 4: int8)")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise UserError(f"--block-size {self.block_size} must be a power of two >= 16 (32 advised)")
        if self.kv_layout not in C.KV_LAYOUTS:
            raise UserError(f"unknown --kv-layout {self.kv_layout!r}; accepted: {', '.join(C.KV_LAYOUTS)}")
        if not (self.fuse or self.quantize != "none" or self.quant_for("draft") != "none" or self.use_float16):
            raise UserError("nothing to do: --no-fuse without --quantize or float16; drop --no-fuse")

    @property
    def writes_kv_in_place(self) -> bool:
        return True if self.kv_in_place is None else bool(self.kv_in_place)

    @property
    def use_float16(self) -> bool:
        return self.target == "cuda" if self.float16 is None else bool(self.float16)

    def quant_for(self, role: str) -> str:
        """The weight quantization of ``role``'s graph: the base's is ``quantize``, the drafter's
        ``quantize_draft`` when given."""
        return self.quantize if role == "base" or self.quantize_draft is None else self.quantize_draft

    def level(self, role: str) -> int:
        """MatMulNBits accuracy level of ``role``'s graph: the base's decides what is emitted."""
        if role != "base":
            return self.draft_accuracy_level
        return 4 if self.accuracy_level is None else self.accuracy_level
