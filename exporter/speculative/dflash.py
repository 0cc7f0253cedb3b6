"""DFlash drafter (z-lab, arXiv 2602.06036; ModelOpt's ``dflash`` mode): a block drafted in one call.

The base's hidden states of a few layers ``F`` (B, A, n*H) become the drafter's context, entering
every draft layer as K/V only; the block ``[anchor, mask x (b-1)]`` attends that context and itself
bidirectionally, and slot k's logits guess the token at anchor position + k::

    C = hidden_norm(fc(F))                                   (B, A, H)   fc: n*H -> H, no bias
    per draft layer l:  k_ctx, v_ctx = k_norm(k_proj(C)) + RoPE(context positions), v_proj(C)
    X = embed(block)                                         (B, b, H)   the base's embeddings
    per draft layer l:  X += o_proj(attn(q(X), [k_ctx ; k(X)], [v_ctx ; v(X)]));  X += mlp(norm(X))
    logits = base.lm_head(norm(X)[:, 1:])                    (B, b-1, V) the base's head

With a draft vocabulary (``dflash_draft_vocab_size``, ours) the head keeps the rows of those tokens
only and every other logit is -inf: the drafter never proposes them, the verifier stays lossless.

A context row's K/V in every layer is a function of its feature and position only, so the export
keeps them in a cache (like the base's K/V) and each call adds the new rows. Tensor names follow
ModelOpt's ``DFlashModule`` (``plugins/modeling_dflash.py``) and z-lab's ``DFlashDraftModel``:
``fc``, ``hidden_norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj|q_norm|k_norm``, ``layers.{i}.mlp.*``,
``layers.{i}.{input,post_attention}_layernorm``, ``norm``. The loss is ModelOpt's
(``plugins/hf_dflash.py``: random answer anchors, block masking, D-PACE or decay weights, the mean
weighted by the weights' sum), see :func:`dflash_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from exporter.modeling import mask_to_bias
from exporter.speculative.config import DFlashConfig

PastKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DraftDims:
    """The draft layers' sizes: ``dflash_architecture_config``'s, else the base's."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    rope_theta: float
    initializer_range: float


def base_rope_theta(base_config) -> float:
    """The base's RoPE base (transformers 5 keeps it in ``rope_parameters``, 4 in ``rope_theta``)."""
    rp = getattr(base_config, "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        return float(rp["rope_theta"])
    return float(getattr(base_config, "rope_theta", None) or 10000.0)


def draft_dims(cfg: DFlashConfig, base_config) -> DraftDims:
    arch = cfg.dflash_architecture_config
    h = base_config.hidden_size
    heads = arch.get("num_attention_heads") or base_config.num_attention_heads
    kv = arch.get("num_key_value_heads") or (None if "num_attention_heads" in arch else
                                             getattr(base_config, "num_key_value_heads", None)) or heads
    head_dim = arch.get("head_dim") or (None if "num_attention_heads" in arch else
                                        getattr(base_config, "head_dim", None)) or h // heads
    if heads % kv:
        raise ValueError(f"DFlash drafter: {heads} attention heads are not a multiple of {kv} K/V heads")
    return DraftDims(
        hidden_size=h, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=arch.get("intermediate_size") or base_config.intermediate_size,
        rms_norm_eps=float(arch["rms_norm_eps"]), hidden_act=arch["hidden_act"],
        attention_bias=bool(arch["attention_bias"]),
        # ModelOpt enforces the base's theta (the drafter's RoPE must match the target's); an override
        # is for imported drafters trained otherwise (docs/dflash.md, trap 2)
        rope_theta=float(arch.get("rope_theta") or base_rope_theta(base_config)),
        initializer_range=float(arch["initializer_range"]),
    )


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, S, d), cos/sin (B, S, d): HF's rotary embedding."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Rotary(nn.Module):
    """Default RoPE (no scaling) at ``theta``; ``inv_freq`` is not saved (ModelOpt and z-lab drop it)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)),
                             persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, S, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, S, d)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_ok, blk_ok, n_blocks: int, scaling: float):
    """Block queries over the context keys and their own block's keys, one softmax over both.

    q (B, hq, Q, d) with Q = n_blocks * b; k_ctx/v_ctx (B, hkv, C, d); k_blk/v_blk (B, hkv, Q, d);
    ctx_ok (B, 1, Q, C) and blk_ok (B, 1, Q, b) bool, True = may attend. Query j of block n sees the
    context columns ``ctx_ok`` allows and the b keys of block n only (never another block's): memory
    Q*(C+b) instead of the dense Q*(C+Q) of ModelOpt's mask, the same function. Returns (B, hq, Q, d).
    """
    groups = q.shape[1] // k_ctx.shape[1]
    k_ctx, v_ctx = repeat_kv(k_ctx, groups), repeat_kv(v_ctx, groups)  # (B, hq, C, d)
    k_blk, v_blk = repeat_kv(k_blk, groups), repeat_kv(v_blk, groups)  # (B, hq, Q, d)
    s_ctx = torch.matmul(q, k_ctx.transpose(2, 3)) * scaling  # (B, hq, Q, C)
    if n_blocks == 1:
        s_blk = torch.matmul(q, k_blk.transpose(2, 3)) * scaling  # (B, hq, b, b)
    else:
        bsz, h, nq, d = q.shape
        b = nq // n_blocks
        qb = q.reshape(bsz, h, n_blocks, b, d)
        kb = k_blk.reshape(bsz, h, n_blocks, b, d)
        s_blk = torch.matmul(qb, kb.transpose(3, 4)).reshape(bsz, h, nq, b) * scaling  # (B, hq, Q, b)
    s = torch.cat([s_ctx + mask_to_bias(ctx_ok, s_ctx.dtype), s_blk + mask_to_bias(blk_ok, s_blk.dtype)], dim=-1)
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, hq, Q, C + b)
    c = k_ctx.shape[2]
    p_ctx, p_blk = p[..., :c], p[..., c:]
    out = torch.matmul(p_ctx, v_ctx)  # (B, hq, Q, d)
    if n_blocks == 1:
        return out + torch.matmul(p_blk, v_blk)
    bsz, h, nq, d = out.shape
    b = nq // n_blocks
    blk = torch.matmul(p_blk.reshape(bsz, h, n_blocks, b, b), v_blk.reshape(bsz, h, n_blocks, b, d))
    return out + blk.reshape(bsz, h, nq, d)


class DFlashAttention(nn.Module):
    def __init__(self, d: DraftDims):
        super().__init__()
        self.head_dim = d.head_dim
        self.scaling = d.head_dim**-0.5
        bias = d.attention_bias
        self.q_proj = nn.Linear(d.hidden_size, d.num_heads * d.head_dim, bias=bias)
        self.k_proj = nn.Linear(d.hidden_size, d.num_kv_heads * d.head_dim, bias=bias)
        self.v_proj = nn.Linear(d.hidden_size, d.num_kv_heads * d.head_dim, bias=bias)
        self.o_proj = nn.Linear(d.num_heads * d.head_dim, d.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(d.head_dim, eps=d.rms_norm_eps)  # over head_dim, before RoPE
        self.k_norm = Qwen3RMSNorm(d.head_dim, eps=d.rms_norm_eps)

    def kv(self, x, cos, sin):
        """K (k_norm, RoPE) and V of rows ``x`` (B, S, H): each (B, hkv, S, d)."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        k = _rope(self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        return k, v

    def forward(self, x, k_ctx, v_ctx, cos, sin, ctx_ok, blk_ok, n_blocks: int):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = _rope(self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2), cos, sin)  # (B, hq, Q, d)
        k_blk, v_blk = self.kv(x, cos, sin)  # (B, hkv, Q, d): the block's own, never cached
        out = block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_ok, blk_ok, n_blocks, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))  # (B, Q, H)


class DFlashDecoderLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context K/V (the context is not normed
    by ``input_layernorm``: only the block is, ModelOpt ``DFlashDecoderLayer``)."""

    def __init__(self, d: DraftDims):
        super().__init__()
        self.self_attn = DFlashAttention(d)
        self.mlp = Qwen3MLP(SimpleNamespace(hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
                                            hidden_act=d.hidden_act))
        self.input_layernorm = Qwen3RMSNorm(d.hidden_size, eps=d.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(d.hidden_size, eps=d.rms_norm_eps)

    def forward(self, x, k_ctx, v_ctx, cos, sin, ctx_ok, blk_ok, n_blocks: int):
        x = x + self.self_attn(self.input_layernorm(x), k_ctx, v_ctx, cos, sin, ctx_ok, blk_ok, n_blocks)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModule(nn.Module):
    def __init__(self, cfg: DFlashConfig, base_config):
        super().__init__()
        d = self.dims = draft_dims(cfg, base_config)
        self.block_size = cfg.dflash_block_size
        self.mask_token_id = cfg.dflash_mask_token_id
        self.target_layer_ids = list(cfg.dflash_target_layer_ids)
        h = d.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=d.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(d) for _ in range(cfg.num_layers))
        self.norm = Qwen3RMSNorm(h, eps=d.rms_norm_eps)
        self.rotary_emb = Rotary(d.head_dim, d.rope_theta)
        n = cfg.dflash_draft_vocab_size
        if n is not None and n >= base_config.vocab_size:
            raise ValueError(f"dflash_draft_vocab_size {n} must be below the base's vocabulary "
                             f"({base_config.vocab_size}); leave it None for the whole vocabulary")
        # sorted token ids (the training sets them: training.set_dflash_vocab); a buffer, so it is saved
        self.register_buffer("draft_vocab", None if n is None else torch.arange(n))
        for m in self.modules():  # ModelOpt's _init_weights: normal(0, initializer_range), zero biases
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=d.initializer_range)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @property
    def num_kv_heads(self) -> int:
        return self.dims.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dims.head_dim

    def logits(self, base, hidden, head_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The base's head over ``hidden`` (..., H): (..., V). With a draft vocabulary, only its rows
        (``head_rows``: those rows, precomputed, as the export keeps them) and -inf elsewhere."""
        if self.draft_vocab is None:
            return base.lm_head(hidden)
        head = base.lm_head
        w = head.weight[self.draft_vocab] if head_rows is None else head_rows
        sub = F.linear(hidden, w, None if head.bias is None else head.bias[self.draft_vocab])  # (..., n)
        full = torch.full((*hidden.shape[:-1], head.out_features), float("-inf"), dtype=sub.dtype, device=sub.device)
        return full.scatter(-1, self.draft_vocab.expand(*hidden.shape[:-1], -1), sub)

    def context(self, aux_hidden, context_position_ids) -> PastKV:
        """Per draft layer, the K/V (B, hkv, A, d) of context rows: features (B, A, n*H) at positions (B, A)."""
        c = self.hidden_norm(self.fc(aux_hidden))  # (B, A, H)
        cos, sin = self.rotary_emb(c, context_position_ids)
        return [layer.self_attn.kv(c, cos, sin) for layer in self.layers]

    def blocks(self, emb, position_ids, ctx_kv: PastKV, ctx_ok, blk_ok, n_blocks: int = 1):
        """Normed drafter output (B, Q, H) of ``n_blocks`` blocks of embedded tokens ``emb`` (B, Q, H) at
        ``position_ids`` (B, Q) over the context K/V; masks as :func:`block_attention`'s."""
        cos, sin = self.rotary_emb(emb, position_ids)
        x = emb
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, cos, sin, ctx_ok, blk_ok, n_blocks)
        return self.norm(x)

    def step(self, base, aux_hidden, context_position_ids, input_ids, position_ids, attention_mask,
             past: PastKV | None = None, head_rows: torch.Tensor | None = None):
        """The draft graph: new context rows into the cache, then one block.

        aux_hidden (B, A, n*H) at context_position_ids (B, A); the block input_ids/position_ids (B, S);
        attention_mask bool (B, 1, S, P+A+S) over cached context | new context | block; past per layer
        (B, hkv, P, d); ``head_rows`` as :meth:`logits`. Returns (logits of slots 1..S-1 (B, S-1, V),
        the A rows' K/V per layer)."""
        new = self.context(aux_hidden, context_position_ids)
        # the context concat is its own node per past input (the in-place pass turns it into a write)
        kv = new if not past else [(torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
                                   for (pk, pv), (k, v) in zip(past, new)]
        n_ctx = kv[0][0].shape[2]
        emb = base.model.embed_tokens(input_ids)  # (B, S, H)
        hidden = self.blocks(emb, position_ids, kv, attention_mask[..., :n_ctx], attention_mask[..., n_ctx:])
        return self.logits(base, hidden[:, 1:], head_rows), new


# ----------------------------------------------------------------------------------------------- training


def sample_anchors(loss_mask: torch.Tensor, block_size: int, num_anchors: int):
    """ModelOpt's ``_sample_anchor_positions``: per row up to ``num_anchors`` distinct positions in
    0..L-b whose loss mask is set, uniformly at random, ascending; (anchors (B, N), keep (B, N))."""
    bsz, seq_len = loss_mask.shape
    device = loss_mask.device
    max_anchor = max(seq_len - block_size, 0)
    valid = loss_mask[:, : max_anchor + 1] > 0.5
    counts = valid.sum(dim=1)
    max_n = min(num_anchors, int(counts.max().item()) - 1)
    if max_n <= 0:
        return torch.zeros(bsz, 1, dtype=torch.long, device=device), torch.zeros(bsz, 1, dtype=torch.bool,
                                                                                  device=device)
    idx = torch.arange(max_anchor + 1, device=device).expand(bsz, -1)
    masked = torch.where(valid, idx, torch.tensor(seq_len + 1, device=device))
    r = torch.where(valid, torch.rand(bsz, max_anchor + 1, device=device), torch.tensor(2.0, device=device))
    anchors = torch.gather(masked, 1, r.sort(dim=1).indices)[:, :max_n].sort(dim=1).values
    keep = torch.arange(max_n, device=device)[None] < counts[:, None].clamp(max=max_n)
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


def dpace_weights(confidences: torch.Tensor, alpha: float, valid: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``_dpace_position_weights`` (D-PACE Eq. 7-8): q~ = alpha + (1-alpha) q (1 where not
    valid), C_j = prod_{i<=j} q~_i (0 where not valid), w_j = sum_{m>=j} C_m. Detached."""
    with torch.no_grad():
        keep = valid.bool()
        smoothed = torch.where(keep, alpha + (1.0 - alpha) * confidences.float(), torch.ones_like(confidences))
        cum = torch.cumprod(smoothed, dim=-1) * keep
        inclusive = torch.cumsum(cum, dim=-1)
        return (inclusive[..., -1:] - inclusive + cum).to(confidences.dtype)


def block_hidden(module: DFlashModule, base, aux, input_ids, anchors, keep):
    """Drafter output (B, N*b, H) of the blocks at ``anchors`` (B, N): context = every position before
    the block's anchor (the anchor's own features do not exist yet at serving time)."""
    bsz, length = input_ids.shape
    b, n = module.block_size, anchors.shape[1]
    dev = input_ids.device
    noise = torch.full((bsz, n, b), module.mask_token_id, dtype=torch.long, device=dev)
    noise[..., 0] = torch.where(keep, torch.gather(input_ids, 1, anchors.clamp(max=length - 1)), module.mask_token_id)
    emb = base.model.embed_tokens(noise.view(bsz, n * b))  # (B, N*b, H)
    pos = (anchors[..., None] + torch.arange(b, device=dev)).view(bsz, n * b)  # anchor + 0..b-1
    ctx_kv = module.context(aux, torch.arange(length, device=dev).expand(bsz, length))
    ctx_ok = (torch.arange(length, device=dev) < anchors[..., None]).repeat_interleave(b, dim=1)[:, None]  # (B,1,Nb,L)
    blk_ok = torch.ones(bsz, 1, n * b, b, dtype=torch.bool, device=dev)
    return module.blocks(emb, pos, ctx_kv, ctx_ok, blk_ok, n_blocks=n)


def dflash_loss(module: DFlashModule, cfg: DFlashConfig, base, base_out, input_ids, valid,
                vocab: torch.Tensor | None = None):
    """ModelOpt's DFlash loss (``HFDFlashModel.forward`` + ``_compute_loss``) on one batch.

    base_out = (logits (B, L, V) | None, aux features (B, L, n*H)); valid (B, L) bool: answer tokens.
    Anchors are random answer positions (:func:`sample_anchors`); slot k of a block predicts
    input_ids[anchor + k], weighted by keep * in-range * (k > 0) * valid[anchor + k] times the D-PACE
    (or decay) position weight; per-token loss is the soft cross-entropy against the base's
    distribution at anchor + k - 1 when its logits are given (``dflash_self_logit_distillation``),
    else hard cross-entropy (on self-distilled text the label is the base's argmax); the loss is
    sum(loss * w) / (sum(w) + 1e-6). Only the rows with a weight go through the (large) LM head.
    ``vocab`` (sorted token ids): the softmax over those tokens only (the head's rows of them), a slot
    whose target is outside weighing nothing; on a CPU the head is most of a step's cost.
    """
    logits_b, aux = base_out
    if module.draft_vocab is not None:  # the drafter's own vocabulary is the loss's
        vocab = module.draft_vocab
    bsz, length = input_ids.shape
    b = module.block_size
    dev = input_ids.device
    anchors, keep = sample_anchors(valid.float(), b, cfg.dflash_num_anchors)
    n = anchors.shape[1]
    if not keep.any():  # touch every drafter parameter (DDP), as ModelOpt does
        return sum((p.reshape(-1)[0] * 0.0 for p in module.parameters() if p.requires_grad),
                   torch.zeros((), device=dev))
    hidden = block_hidden(module, base, aux, input_ids, anchors, keep)  # (B, N*b, H)
    offs = torch.arange(b, device=dev)
    labels_at = anchors[..., None] + offs  # (B, N, b)
    in_range = labels_at < length
    safe = labels_at.clamp(max=length - 1).view(bsz, n * b)
    targets = torch.gather(input_ids, 1, safe)  # (B, N*b)
    w = keep[..., None] & in_range & (offs > 0) & torch.gather(valid, 1, safe).view(bsz, n, b)  # (B, N, b)
    head = base.lm_head.weight
    if vocab is not None:  # targets as indices into vocab; outside it, no weight
        index = torch.full((head.shape[0],), -1, dtype=torch.long, device=dev)
        index[vocab] = torch.arange(len(vocab), device=dev)
        targets = index[targets]
        w = w & (targets >= 0).view(bsz, n, b)
        head = head[vocab]
    rows = w.view(-1).nonzero().squeeze(1)  # (R,) into the flat B*N*b rows
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1])[rows], head).float()  # (R, V or len(vocab))
    hard = F.cross_entropy(logits, targets.view(-1)[rows], reduction="none")  # (R,)
    weight = w.float()
    if cfg.dflash_loss_objective == "dpace" and b > 1:
        ce = torch.zeros(bsz * n * b, device=dev)
        ce[rows] = hard.detach()
        dp = torch.ones_like(weight)
        dp[..., 1:] = dpace_weights(torch.exp(-ce.view(bsz, n, b)[..., 1:]), cfg.dflash_dpace_alpha, w[..., 1:])
        weight = weight * dp
    elif cfg.dflash_loss_decay_factor > 0:
        weight = weight * torch.exp(-(offs - 1).clamp(min=0).float() / cfg.dflash_loss_decay_factor)
    w_rows = weight.view(-1)[rows]
    total = weight.sum() + 1e-6
    if total <= 1.0:
        return logits.sum() * 0.0 + hidden.sum() * 0.0
    per = hard
    if logits_b is not None and cfg.dflash_self_logit_distillation:
        teacher_pos = (safe - 1).clamp(min=0).view(-1)[rows]  # the base's distribution of token anchor+k
        batch = torch.arange(bsz, device=dev).repeat_interleave(n * b)[rows]
        teacher_logits = logits_b[batch, teacher_pos].float()  # (R, V)
        teacher = F.softmax(teacher_logits if vocab is None else teacher_logits[:, vocab], dim=-1)
        per = -(teacher * F.log_softmax(logits, dim=-1)).sum(-1)
    return (per * w_rows).sum() / total


@torch.no_grad()
def dflash_block_topk(model, features, input_ids, anchors, k: int = 1):
    """Top-``k`` drafts of the blocks at ``anchors`` (N,) of one sequence: (ids, log-probs), each
    (N, b-1, k); entry [j, s] is the guess for input_ids[anchors[j] + s + 1] (what the draft graph's
    topk_ids / topk_logprobs give at serving time). ``features`` (1, L, n*H): the base's target layers."""
    dm = model.dflash_module
    a = torch.as_tensor(anchors, dtype=torch.long)[None]  # (1, N)
    hidden = block_hidden(dm, model, features, input_ids, a, torch.ones_like(a, dtype=torch.bool))
    logits = dm.logits(model, hidden.view(a.shape[1], dm.block_size, -1)[:, 1:])  # (N, b-1, V)
    lp, ids = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    return ids, lp
