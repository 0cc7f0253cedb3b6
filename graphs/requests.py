"""Requests: the state of one (:class:`Request`) and the checks that make it (:class:`RequestMaker`).

The engine holds requests, never the decoder: what making one needs (the tokenizer, the export's
defaults, its trees and the drafter's limits, the mean gains earlier requests measured) is here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from graphs import contract as C
from graphs.adaptive import AdaptiveConfig, Priors, RowGains, chain_ceiling, tree_ceiling
from graphs.eagle_draft import choose_graph
from graphs.errors import ArtifactError, InputError, as_input_error
from graphs.limits import check_eagle_tree, check_medusa_tree
from graphs.params import GenerationParams, Resolved, check_prompt
from graphs.proposers import DraftState
from graphs.results import Sampler, Stats
from graphs.trees import DEFAULT_EAGLE_TREE, Tree, default_medusa_paths, load_tree_file, medusa_tree

WAITING, PREFILL, DECODING, DONE = "waiting", "prefill", "decoding", "done"


@dataclass
class Request:
    """Everything about one request; the engine's thread is the only one that changes it."""

    id: int
    prompt: list[int]
    params: Resolved
    max_new: int
    eos: set
    speculation: str  # "on" | "off" | "adaptive"
    sampler: Sampler
    tree: Tree | dict | None = None  # Medusa: a Tree; EAGLE: {topk, depth, total_tokens}; DFlash: {topk, total_tokens}
    tree_role: str | None = None  # EAGLE: the baked tree graph drafting it in one call, if any
    tree_size: int = 1
    prior_key: tuple = ()
    deadline: float | None = None
    stats: Stats = field(default_factory=Stats)
    state: str = WAITING
    slot: int | None = None
    prefilled: int = 0  # prompt tokens in the cache
    position: int = 0  # cached positions (the root's position)
    root: int = 0  # the last emitted token, not yet cached
    draft: DraftState | None = None  # the proposer's state (graphs.proposers)
    gains: RowGains | None = None
    tokens: list[int] = field(default_factory=list)
    done: str | None = None
    text: str = ""
    streamed: str = ""
    detok: object = None  # tokenizers' DecodeStream
    text_per_token: bool = True  # the text follows each token (streams, stop strings); else decoded at the end
    t_added: float = 0.0
    error: BaseException | None = None  # what ended it with finish_reason "error"


class RequestMaker:
    """Checked requests for one export (its manifest, tokenizer and generation defaults)."""

    def __init__(self, out_dir: Path, manifest, max_positions: int, adaptive: bool = True, eagle_draft: str = "auto"):
        self.out_dir, self.manifest, self.max_positions = out_dir, manifest, max_positions
        m = manifest
        self.drafter = m.drafter
        self.kind = m.drafter["kind"] if m.drafter else None
        self.eos = set(m.generation.get("eos_token_ids") or [])
        if not isinstance(adaptive, (bool, np.bool_)):
            raise InputError(f"adaptive must be True or False, got {adaptive!r}")
        self.adaptive = bool(adaptive)
        self.adaptive_config: AdaptiveConfig | None = None  # the policy's settings (None: defaults)
        self.priors = Priors()  # mean gains per setting, shared by every engine (bounded: PRIORS_MAX)
        self.eagle_draft = eagle_draft  # which graph drafts an EAGLE tree (graphs.eagle_draft.choose_graph)
        self.tokenizer = None
        if m.tokenizer:
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_file(str(out_dir / m.tokenizer))
            except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
                raise ArtifactError(f"{out_dir / m.tokenizer} is not a tokenizer tokenizers can read "
                                    f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); "
                                    f"re-export the model") from None
        self.default_tree = m.tree
        # generation_config.json (copied at export): its sampling defaults are this decoder's defaults
        gen_file = out_dir / "generation_config.json"
        self.generation_defaults = (GenerationParams.from_generation_config(gen_file) if gen_file.is_file()
                                    else GenerationParams())
        # its eos list is already the manifest's (export reads it there): self.eos is the one default
        self.generation_defaults.eos_token_id = None

    def resolve(self, params: GenerationParams | None = None, **overrides) -> Resolved:
        """The values a run with these arguments uses: explicit ones, else generation_config.json's,
        else the defaults (``.describe()`` says which came from where)."""
        r = GenerationParams.build(params, **overrides).resolve(self.generation_defaults)
        if r.eos_token_ids is None:  # the manifest's (from generation_config.json or config.json at export)
            r.eos_token_ids, r.sources["eos_token_id"] = sorted(self.eos), "manifest"
        return r

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError(f"{self.out_dir} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def new_request(self, prompt, p: Resolved, max_len: int, stream: int = 0) -> Request:
        """A checked :class:`Request` for one prompt (a string or token ids). ``stream``: which random
        stream of ``p.seed`` its sampler draws from (stream 0 is ``default_rng(seed)`` itself)."""
        toks = self._prompt(prompt, max_len)
        spec = self._speculation(p)
        seed = p.seed if stream == 0 or p.seed is None else [p.seed, stream]
        sampler = Sampler(p.temperature, p.top_p, p.top_k, np.random.default_rng(seed), p.acceptance)
        req = Request(id=-1, prompt=list(toks), params=p, max_new=p.new_tokens_for(len(toks)),
                      eos=set(self.eos if p.eos_token_ids is None else p.eos_token_ids), speculation=spec,
                      sampler=sampler)
        if spec != "off":
            self._tree(req, p)
        if self.tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            req.detok = DecodeStream(skip_special_tokens=True)
        return req

    def _prompt(self, prompt, max_len: int) -> list[int]:
        (toks,) = check_prompt(prompt) if not is_batch(prompt) else (None,)
        if toks is None:
            raise InputError("a request takes one prompt (a string or a list of token ids), not a batch")
        if isinstance(toks, str):
            toks = self.encode(toks)
        if not toks:
            raise InputError("empty prompt: pass at least one token of text")
        if len(toks) >= self.max_positions:
            raise InputError(f"prompt of {len(toks)} tokens exceeds the model's context limit of "
                             f"{self.max_positions}; shorten the prompt")
        if len(toks) >= max_len:
            raise InputError(f"prompt of {len(toks)} tokens does not fit the engine's max_len of {max_len} "
                             f"positions (prompt + new tokens); shorten the prompt or raise EngineConfig.max_len")
        vocab = self.manifest.source["vocab_size"]
        bad = [t for t in toks if not 0 <= t < vocab]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return toks

    def _speculation(self, p: Resolved) -> str:
        mode = p.mode
        if mode == "auto":
            mode = "speculative" if self.kind else "autoregressive"
        if mode == "speculative" and not self.kind:
            raise InputError(f"{self.out_dir} has no draft graph: use mode='autoregressive' or export a drafter")
        if p.acceptance == "typical" and self.kind != "medusa":
            name = {"eagle": "EAGLE", "dflash": "DFlash"}.get(self.kind, self.kind)
            raise InputError(f"typical acceptance is Medusa's; {name} drafts use lossless acceptance" if self.kind else
                             f"typical acceptance needs a Medusa drafter; {self.out_dir} has none (base only, "
                             f"autoregressive): drop acceptance='typical'")
        if p.stop_strings and self.tokenizer is None:
            raise InputError(f"{self.out_dir} has no tokenizer.json, so stop strings cannot be matched; "
                             f"drop stop_strings or use eos_token_id")
        spec = p.speculation
        if spec in ("on", "adaptive") and not self.kind:
            raise InputError(f"speculation={spec!r} needs a drafter; {self.out_dir} has none: use speculation='off'")
        if mode == "autoregressive" or spec == "off":
            return "off"
        if spec is None:
            spec = "adaptive" if self.adaptive else "on"
        # a seeded sampling request stays reproducible: its trees must not follow measured times
        if spec == "adaptive" and p.seed is not None and p.temperature > 0:
            spec = "on"
        return spec

    def _tree(self, req: Request, p: Resolved) -> None:
        """The request's tree, its size, the key of its setting and its gains (from the setting's prior)."""
        if self.kind == "medusa":
            req.tree = self.medusa_tree(p.tree)
            req.tree_size = req.tree.size
            key = ("medusa", req.tree.parents.tobytes(), req.tree.rank.tobytes())
        elif self.kind == "dflash":
            req.tree = self.dflash_tree(p.tree)
            req.tree_size = req.tree["total_tokens"]
            key = ("dflash", req.tree["topk"], req.tree["total_tokens"])
        else:
            req.tree = self.eagle_tree(p.tree)
            req.tree_role = choose_graph(self.manifest, req.tree, self.eagle_draft)
            req.tree_size = (self.manifest.graphs[req.tree_role].output(C.TREE_TOKENS).dims[1]
                             if req.tree_role else req.tree["total_tokens"])
            key = ("eagle", req.tree_role, req.tree["topk"], req.tree["depth"], req.tree["total_tokens"])
        # sampling settings rounded: 0.7 and 0.7000001 accept the same drafts
        req.prior_key = (*key, round(p.temperature, 2), round(p.top_p, 2), p.top_k, p.acceptance)
        # on rows too: their expected tokens weigh in the batch's choice of width
        prior = self.priors.get(req.prior_key)
        ceiling = (tree_ceiling(req.tree) if self.kind == "medusa"
                   else chain_ceiling(req.tree_size, req.tree.get("depth", self.drafter.get("block_size", 1) - 1)))
        req.gains = RowGains(req.tree_size, None if prior is None else prior[0].copy(),
                             (self.adaptive_config or AdaptiveConfig()).ema, ceiling)

    def medusa_tree(self, tree) -> Tree:
        """The Medusa tree a request asks for (paths, a JSON file, or None: the manifest's), checked."""
        if tree is None:
            paths = self.default_tree.get("medusa_paths") or default_medusa_paths(self.drafter["num_heads"])
        elif isinstance(tree, (str, Path)):
            with as_input_error():
                paths = load_tree_file(tree)
        else:
            paths = tree
        with as_input_error():
            t = medusa_tree(paths)
        if t.max_depth > self.drafter["num_heads"]:
            raise InputError(
                f"tree is {t.max_depth} deep but the drafter has {self.drafter['num_heads']} Medusa heads"
            )
        check_medusa_tree(t, self.manifest.source["vocab_size"], self.max_positions)
        return t

    def dflash_tree(self, tree) -> dict:
        """The DFlash tree a request asks for ({"topk", "total_tokens"}: topk 1 the chain of the block's
        top-1 drafts, more a tree of its per-slot top-k; a JSON file; None: the manifest's), checked."""
        block = int(self.drafter["block_size"])
        cfg = dict(self.default_tree.get("dflash") or {"topk": 1, "total_tokens": block})
        if isinstance(tree, (str, Path)):
            try:
                tree = json.loads(Path(tree).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise InputError(f"cannot read DFlash tree file {tree}: {e}") from None
        if tree is not None:
            if not isinstance(tree, dict) or set(tree) - {"topk", "total_tokens"}:
                raise InputError('a DFlash tree is {"topk": k, "total_tokens": n} (topk 1: the chain)')
            cfg.update(tree)
        for k in ("topk", "total_tokens"):
            if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1:
                raise InputError(f"DFlash tree {k} must be an int >= 1, got {cfg[k]!r}")
        if cfg["topk"] == 1 and cfg["total_tokens"] > block:
            raise InputError(f"a DFlash chain has at most {block} nodes (the block), got total_tokens "
                             f"{cfg['total_tokens']}; use total_tokens <= {block} or topk > 1 (a tree)")
        vocab = self.manifest.source["vocab_size"]
        if cfg["topk"] > vocab:
            raise InputError(f"DFlash tree topk {cfg['topk']} exceeds the vocabulary of {vocab}")
        return cfg

    def eagle_tree(self, tree) -> dict:
        """The EAGLE tree a request asks for ({"topk", "depth", "total_tokens"}, a JSON file, or None:
        the manifest's), checked."""
        cfg = dict(self.default_tree.get("eagle") or DEFAULT_EAGLE_TREE)
        if isinstance(tree, (str, Path)):
            try:
                tree = json.loads(Path(tree).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise InputError(f"cannot read EAGLE tree file {tree}: {e}") from None
        if tree is not None:
            if not isinstance(tree, dict) or set(tree) - {"topk", "depth", "total_tokens"}:
                raise InputError('an EAGLE tree is {"topk": k, "depth": d, "total_tokens": n}')
            cfg.update(tree)
        for k in ("topk", "depth", "total_tokens"):
            if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1:
                raise InputError(f"EAGLE tree {k} must be an int >= 1, got {cfg[k]!r}")
        vocab = self.drafter.get("draft_vocab_size") or self.manifest.source["vocab_size"]
        check_eagle_tree(cfg, vocab, self.max_positions)
        return cfg


def is_batch(prompt) -> bool:
    """Whether ``prompt`` is a list of prompts (not one prompt of token ids)."""
    return (isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0
            and not isinstance(prompt[0], (int, float, np.integer, np.floating)))

