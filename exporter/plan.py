"""The plan stage: everything an export will hold, computed once from the loaded model.

    plan = build_plan(model, model_dir, dtype="float32", opset=17, eagle_trees=None)
    plan.specs          {role: GraphSpec}: base, draft, draft_tree.K-D-T
    plan.manifest()     the Manifest the write stage completes (files, validation)

:class:`ExportPlan` is built once by the pipeline (:mod:`exporter.pipeline`) and read by trace
(:mod:`exporter.trace`), validate (:mod:`exporter.validate`), compare and the tree baking of tune:
nothing re-derives dims, specs, the drafter entry or the default tree. The module also holds the
export's small tables, one of each: the graph dtypes and their ONNX element types, which roles are
traced, the one-call tree roles (``draft_tree.K-D-T``, built by :func:`graphs.contract.eagle_tree_role`,
parsed here), the EAGLE tree check and the tool versions record.

torch-free: the model is only read through its attributes.
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from exporter.errors import UserError
from graphs import contract as C
from graphs.limits import max_eagle_nodes
from graphs.manifest import Manifest
from graphs.trees import DEFAULT_EAGLE_TREE

OPSET = 17
DTYPES = ("float32", "float16", "bfloat16")  # what the tracer can write
# what graphs.load can feed (numpy has no bfloat16): export refuses the others at once, naming the fix
RUNTIME_DTYPES = ("float32", "float16")
# graph dtype -> ONNX TensorProto element type (onnx.TensorProto.FLOAT = 1, ...): the one map
ONNX_DTYPES = {"float32": 1, "uint8": 2, "int8": 3, "int32": 6, "int64": 7, "bool": 9, "float16": 10, "bfloat16": 16}

TRACED_ROLES = ("base", "draft")  # graphs traced from the model (the device graphs: exporter.kvgraph)


def is_traced(role: str) -> bool:
    """A graph traced from the model (weights, attention): base, draft and the one-call tree graphs."""
    return role in TRACED_ROLES or is_tree_role(role)


def is_tree_role(role: str) -> bool:
    return role.startswith(C.TREE_ROLE_PREFIX)


def parse_tree_role(role: str) -> tuple[int, int, int]:
    """``"draft_tree.2-3-6"`` -> (2, 3, 6): the inverse of :func:`graphs.contract.eagle_tree_role`."""
    k, d, t = (int(x) for x in role[len(C.TREE_ROLE_PREFIX):].split("-"))
    return k, d, t


# ----------------------------------------------------------------------------- EAGLE trees


# The most nodes a baked tree may have: its graph carries total_tokens x total_tokens masks and
# total_tokens-row K/V per layer (4096: a 64 MiB float mask; 100000 tried to allocate 20 GB).
MAX_TREE_TOKENS = 4096


def check_tree(topk: int, depth: int, total_tokens: int, max_positions: int | None = None) -> None:
    """A tree the one-call graph can be built for, checked before anything is allocated: sizes >= 1, at
    most :data:`MAX_TREE_TOKENS` nodes, within what ``topk`` and ``depth`` draft and (``max_positions``,
    the model's context) within the context."""
    if min(topk, depth, total_tokens) < 1:
        raise UserError(f"EAGLE tree {topk},{depth},{total_tokens}: topk, depth and total_tokens must be >= 1")
    if total_tokens > MAX_TREE_TOKENS:
        raise UserError(f"EAGLE tree {topk},{depth},{total_tokens}: total_tokens {total_tokens} is over the "
                        f"{MAX_TREE_TOKENS}-node bound of a baked tree (its masks grow with its square); use a "
                        f"smaller tree, e.g. 8,6,60")
    if max_positions is not None and max(total_tokens, depth) >= max_positions:
        raise UserError(f"EAGLE tree {topk},{depth},{total_tokens}: does not fit the model's context of "
                        f"{max_positions} positions; use total_tokens and depth below {max_positions}")
    cap = max_eagle_nodes(topk, depth)  # the root and every drafted node (graphs.limits)
    if total_tokens > cap:
        raise UserError(
            f"EAGLE tree {topk},{depth},{total_tokens}: only {cap - 1} nodes are drafted, so total_tokens "
            f"can be at most {cap}; lower total_tokens or raise topk/depth"
        )


def parse_tree(text: str) -> tuple[int, int, int]:
    """``"2,3,6"`` -> (topk, depth, total_tokens); an argparse ``type`` (its error is one line)."""
    try:
        k, d, t = (int(x) for x in text.split(","))
        check_tree(k, d, t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not topk,depth,total_tokens (e.g. 2,3,6)") from None
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return k, d, t


def default_trees() -> list[tuple[int, int, int]]:
    d = DEFAULT_EAGLE_TREE
    return [(d["topk"], d["depth"], d["total_tokens"])]


# ----------------------------------------------------------------------------- the model's facts


def model_dims(model, dtype: str) -> C.ModelDims:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return C.ModelDims(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        dtype=dtype,
    )


def aux_layer_ids(model) -> tuple[int, ...]:
    """The base layers whose outputs the base graph emits as ``aux_hidden_states`` (EAGLE-3, DFlash)."""
    mode = getattr(model, "spec_mode", None)
    if mode == "eagle" and model.eagle_module.eagle3:
        return tuple(model.spec_config.eagle_aux_hidden_state_layer_ids)
    if mode == "dflash":
        return tuple(model.dflash_module.target_layer_ids)
    return ()


def draft_dims(model, dtype: str) -> C.ModelDims:
    mod = model.drafter  # an EAGLE or DFlash module: its layers' K/V dims
    base = model_dims(model, dtype)
    return C.ModelDims(
        num_layers=len(mod.layers),
        num_kv_heads=mod.num_kv_heads,
        head_dim=mod.head_dim,
        hidden_size=base.hidden_size,
        vocab_size=base.vocab_size,
        dtype=dtype,
    )


def graph_specs(model, dtype: str) -> dict[str, C.GraphSpec]:
    """The contract of every graph this model exports to, one-call trees aside: base, draft."""
    dims = model_dims(model, dtype)
    n_aux = len(aux_layer_ids(model))
    specs = {"base": C.base_graph_spec(dims, n_aux=n_aux)}
    mode = getattr(model, "spec_mode", None)
    if mode == "medusa":
        specs["draft"] = C.medusa_graph_spec(dims, num_heads=len(model.medusa_heads))
    elif mode == "eagle":
        mod = model.eagle_module
        vocab = mod.lm_head.out_features if mod.eagle3 else dims.vocab_size
        specs["draft"] = C.eagle_graph_spec(draft_dims(model, dtype), len(mod.layers), vocab, n_aux=n_aux)
    elif mode == "dflash":
        specs["draft"] = C.dflash_graph_spec(draft_dims(model, dtype), len(model.dflash_module.layers), n_aux)
    # (the device path's small graphs are built by exporter.optimize beside a base that writes its
    # K/V in place: exporter.kvgraph, graphs.device)
    return specs


def tree_graph_specs(model, dtype: str, trees) -> dict[str, C.GraphSpec]:
    """{role: spec} of the one-call tree graphs for ``trees`` [(topk, depth, total_tokens), ...]."""
    dims = draft_dims(model, dtype)
    n_aux = len(aux_layer_ids(model))
    layers = len(model.eagle_module.layers)
    return {C.eagle_tree_role(*cfg): C.eagle_tree_graph_spec(dims, layers, *cfg, n_aux=n_aux) for cfg in trees}


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
        "parameters": sum(p.numel() for n, p in model.named_parameters()
                          if not n.startswith(("medusa", "eagle", "dflash"))),
    }


def describe_drafter(model) -> tuple[dict | None, dict]:
    """(manifest ``drafter`` entry, default ``tree``)."""
    from graphs.trees import default_medusa_paths

    mode = getattr(model, "spec_mode", None)
    if mode is None:
        return None, {}
    cfg = model.config.speculative_decoding["config"]
    n_params = sum(p.numel() for p in model.drafter.parameters())
    if mode == "medusa":
        n = len(model.medusa_heads)
        return ({"kind": "medusa", "num_heads": n, "parameters": n_params, "config": cfg},
                {"medusa_paths": default_medusa_paths(n)})
    if mode == "dflash":
        mod = model.dflash_module
        return ({"kind": "dflash", "block_size": mod.block_size, "mask_token_id": mod.mask_token_id,
                 "target_layer_ids": list(mod.target_layer_ids), "num_layers": len(mod.layers),
                 "num_kv_heads": mod.num_kv_heads, "head_dim": mod.head_dim, "parameters": n_params, "config": cfg,
                 "draft_vocab_size": model.config.vocab_size if mod.draft_vocab is None else len(mod.draft_vocab)},
                {"dflash": {"topk": 1, "total_tokens": mod.block_size}})  # the chain, until trees are measured
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


def generation_defaults(model_dir: Path | None, model) -> dict:
    """eos/bos/pad ids: ``generation_config.json``'s, else the model config's."""
    cfg = model.config
    gen = {}
    f = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if f is not None and f.is_file():
        gen = json.loads(f.read_text())
    eos = gen.get("eos_token_id", cfg.eos_token_id)
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return {
        "eos_token_ids": eos,
        "bos_token_id": gen.get("bos_token_id", cfg.bos_token_id),
        "pad_token_id": gen.get("pad_token_id", cfg.pad_token_id),
    }


# manifest ``versions`` key -> the module whose __version__ it records, per stage that writes them
VERSIONS = {
    "export": {"torch": "torch", "transformers": "transformers", "onnx": "onnx", "onnxruntime": "onnxruntime"},
    "optimize": {"onnxscript": "onnxscript", "onnx_ir": "onnx_ir", "onnxruntime_optimize": "onnxruntime"},
}


def versions(stage: str) -> dict:
    """The tool versions ``stage`` ("export" | "optimize") records in the manifest."""
    return {key: importlib.import_module(mod).__version__ for key, mod in VERSIONS[stage].items()}


# ----------------------------------------------------------------------------- the plan


@dataclass
class ExportPlan:
    """What one export writes: the graphs' contracts, the manifest's parts, the trees to bake."""

    dtype: str
    opset: int
    source: dict
    specs: dict[str, C.GraphSpec]  # every graph: base, draft, draft_tree.*
    drafter: dict | None
    tree: dict  # the default tree, and ``eagle_trees`` listing the baked one-call graphs
    generation: dict
    model_dir: Path | None = None
    eagle_trees: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def traced_roles(self) -> list[str]:
        return [r for r in self.specs if is_traced(r)]

    def manifest(self) -> Manifest:
        """The manifest of this plan; the write stage adds ``files`` (sha256), validate ``validation``."""
        return Manifest(source=self.source, graphs=dict(self.specs), drafter=self.drafter, tree=self.tree,
                        generation=self.generation, opset=self.opset, versions=versions("export"))


def build_plan(model, model_dir=None, *, dtype: str = "float32", opset: int = OPSET, eagle_trees=None) -> ExportPlan:
    """The plan of exporting ``model``: ``eagle_trees`` [(topk, depth, total_tokens)] (None: the default
    tree) are the one-call EAGLE tree graphs to bake; a model without an EAGLE drafter takes none."""
    if dtype not in DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    specs = graph_specs(model, dtype)
    drafter, tree = describe_drafter(model)
    trees: list[tuple[int, int, int]] = []
    if getattr(model, "spec_mode", None) == "eagle":
        trees = list(dict.fromkeys(tuple(t) for t in (default_trees() if eagle_trees is None else eagle_trees)))
        ctx = getattr(model.config, "max_position_embeddings", None)
        for cfg in trees:
            check_tree(*cfg, max_positions=ctx if isinstance(ctx, int) and ctx > 0 else None)
        specs |= tree_graph_specs(model, dtype, trees)  # listed after the base and draft, as always
        tree["eagle_trees"] = [{"topk": k, "depth": d, "total_tokens": t, "graph": C.eagle_tree_role(k, d, t)}
                               for k, d, t in trees]
    elif eagle_trees:
        raise UserError("--eagle-trees needs a model with an EAGLE drafter")
    return ExportPlan(dtype=dtype, opset=opset, source=describe_source(model, dtype), specs=specs, drafter=drafter,
                      tree=tree, generation=generation_defaults(model_dir, model),
                      model_dir=Path(model_dir) if model_dir is not None else None, eagle_trees=trees)
