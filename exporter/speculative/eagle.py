"""EAGLE drafters: EAGLE-1 (last hidden state) and EAGLE-3 (fused multi-layer hidden states).

Notation: f_t is the base hidden state at position t, x_t the token at t. The drafter at position t
reads (f_t, x_{t+1}) and predicts f_{t+1}; its logits predict x_{t+2}.

EAGLE-1::

    h = fc(cat(embed(x_{t+1}), f_t))            fc: 2H -> H (bias)
    out = decoder_layers(h)                      layers of the base's own architecture
    logits = base.lm_head(out)                   f_t is the base's post-norm hidden

EAGLE-3::

    g = fc(cat(f_t^(l1), f_t^(l2), f_t^(l3)))    fc: 3H -> H, hidden states of 3 base layers
    out = layer0(cat(norm(embed(x_{t+1})), norm(g)) -> 2H attention, residual g) [+ more layers]
    logits = lm_head(norm(out))                  own head over a draft vocabulary (d2t maps back)

When drafting further, ``out`` replaces g/f (the drafter feeds itself). Layouts follow ModelOpt
(``eagle_module.fc``, ``eagle_module.layers.{i}``, ``eagle_module.d2t``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from exporter.hf_compat import cache_kwargs
from exporter.modeling import NewRowsCache, mask_to_bias, run_layers
from exporter.speculative.config import EagleConfig


def drafter_layer_config(base_config, cfg: EagleConfig):
    """The HF config the drafter's decoder layers are built from."""
    c = copy.deepcopy(base_config)
    c.num_hidden_layers = cfg.eagle_num_layers
    for k, v in cfg.layer_overrides.items():
        setattr(c, k, v)
    if getattr(c, "layer_types", None) is not None:
        c.layer_types = ["full_attention"] * cfg.eagle_num_layers
    c._attn_implementation = "eager"
    return c


class Eagle3FirstLayer(nn.Module):
    """A base decoder layer whose attention reads cat(norm(embedding), norm(hidden)) (2H)."""

    def __init__(self, layer_config, arch):
        super().__init__()
        layer = arch.decoder_layer_cls(layer_config, 0)
        h = layer_config.hidden_size
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.self_attn = attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.hidden_norm = arch.rms_norm_cls(h, eps=layer_config.rms_norm_eps)

    def forward(self, emb, hidden, bias, position_ids, cache, position_embeddings):
        residual = hidden
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B, S, 2H)
        attn, _ = self.self_attn(
            hidden_states=x,
            attention_mask=bias,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            **cache_kwargs(self.self_attn, cache),
        )
        hidden = residual + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleModule(nn.Module):
    def __init__(self, cfg: EagleConfig, base_config, arch):
        super().__init__()
        h = base_config.hidden_size
        self.eagle3 = cfg.use_aux_hidden_state
        self.layer_config = drafter_layer_config(base_config, cfg)
        n = cfg.eagle_num_layers
        if self.eagle3:
            n_aux = len(cfg.eagle_aux_hidden_state_layer_ids)
            self.fc = nn.Linear(n_aux * h, h, bias=False)
            layers = [Eagle3FirstLayer(self.layer_config, arch)]
            layers += [arch.decoder_layer_cls(self.layer_config, i) for i in range(1, n)]
            self.layers = nn.ModuleList(layers)
            self.norm = arch.rms_norm_cls(h, eps=base_config.rms_norm_eps)
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            # draft id d -> target id d + d2t[d] (SafeAILab/ModelOpt convention)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.fc = nn.Linear(2 * h, h, bias=True)
            self.layers = nn.ModuleList(arch.decoder_layer_cls(self.layer_config, i) for i in range(n))
            if not cfg.use_input_layernorm_in_first_layer:
                self.layers[0].input_layernorm = nn.Identity()

    @property
    def num_kv_heads(self) -> int:
        return self.layer_config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        c = self.layer_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids] if self.eagle3 else ids

    def step(self, base, hidden, input_ids, position_ids, attention_mask, past=None, aux_hidden=None):
        """One drafting forward over S positions.

        hidden (B, S1, H): f_t (EAGLE-1) or the drafter's own previous output; aux_hidden
        (B, S0, n_aux*H): EAGLE-3 base layers, fused by fc and placed before ``hidden``.
        input_ids (B, S): x_{t+1}. attention_mask bool (B, 1, S, P+S). ``base`` supplies the frozen
        embeddings, rotary embedding and (EAGLE-1) lm_head.
        Returns (out (B, S, H), logits (B, S, V_draft), new K/V per layer).
        """
        out, new = self.hidden_step(base, hidden, input_ids, position_ids, attention_mask, past, aux_hidden)
        return out, self.logits(base, out), new

    def hidden_step(self, base, hidden, input_ids, position_ids, attention_mask, past=None, aux_hidden=None):
        """:meth:`step` without the head: (out (B, S, H), new K/V per layer)."""
        inner = base.model
        emb = inner.embed_tokens(input_ids)  # (B, S, H)
        cache = NewRowsCache(past)
        bias = mask_to_bias(attention_mask, emb.dtype)
        if self.eagle3:
            h = hidden if aux_hidden is None else torch.cat([self.fc(aux_hidden), hidden], dim=1)
            pos_emb = inner.rotary_emb(h, position_ids)
            h = self.layers[0](emb, h, bias, position_ids, cache, pos_emb)
            out = run_layers(self.layers[1:], h, pos_emb, bias, cache, position_ids)
        else:
            h = self.fc(torch.cat([emb, hidden], dim=-1))  # (B, S, H)
            pos_emb = inner.rotary_emb(h, position_ids)
            out = run_layers(self.layers, h, pos_emb, bias, cache, position_ids)
        return out, cache.new_rows(len(self.layers))

    def logits(self, base, out: torch.Tensor) -> torch.Tensor:
        """Draft logits (..., V_draft) of drafter outputs ``out`` (..., H): a per-row head, so a caller
        that needs only some rows' logits (exporter.eagle_tree) may select the rows first."""
        return self.lm_head(self.norm(out)) if self.eagle3 else base.lm_head(out)


def _soft_ce(logits, target_probs):
    return -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # (B, S)


def _shifted(valid: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """(B, n) bool: entry t is valid[:, t + offset], False past the end."""
    out = torch.zeros(valid.shape[0], n, dtype=torch.bool, device=valid.device)
    hi = max(0, min(n, valid.shape[1] - offset))
    out[:, :hi] = valid[:, offset : offset + hi]
    return out


def _masked_mean(x, valid):
    valid = valid.to(x.dtype)
    return (x * valid).sum() / valid.sum().clamp(min=1)


def _ttt_unroll(module: EagleModule, cfg: EagleConfig, base, hidden_b, aux_b, input_ids, steps: int):
    """EAGLE-3 training-time test: yields (j, n, out (B, n, H)) for drafting steps j < ``steps``; the
    caller takes the head's logits (``module.logits``) of the rows it needs (a loss: the answer's).

    Step j feeds the drafter its own step j-1 output; a query attends the real context (step 0 keys
    at <= t) and its own chain (the diagonal of steps 1..j) exactly as it will at inference. Row t of
    step j predicts x_{t+j+2}."""
    bsz, length = input_ids.shape
    m = length - 1  # anchors t = 0..L-2 (x_{t+1} must exist)
    t = torch.arange(m, device=input_ids.device)
    past = None
    prev_out = None
    sizes: list[int] = []
    for j in range(steps):
        n = m - j
        if n < 1:
            break
        tj = t[:n]
        # keys: step 0 (m rows, causal: k <= t), then steps 1..j (diagonal: k == t), this step last
        blocks = [t[None, :] <= tj[:, None]]
        blocks += [t[None, :size] == tj[:, None] for size in [*sizes[1:], n][: j]]
        mask = torch.cat(blocks, dim=1).expand(bsz, 1, n, -1)
        pos = (tj + j).expand(bsz, n)
        toks = input_ids[:, 1 + j : 1 + j + n]
        if j == 0:
            out, new = module.hidden_step(base, hidden_b[:, :0], toks, pos, mask, None, aux_b[:, :n])
        else:
            out, new = module.hidden_step(base, prev_out[:, :n], toks, pos, mask, past)
        past = new if past is None else [
            (torch.cat([pk, k], 2), torch.cat([pv, v], 2)) for (pk, pv), (k, v) in zip(past, new)
        ]
        sizes.append(n)
        prev_out = out
        yield j, n, out


def _hard_ce(module: EagleModule, base, out, targets, ok):
    """Cross-entropy of the head on ``out`` (B, n, H) against target token ids (B, n), over the rows
    ``ok`` whose target is in the draft vocabulary: only those rows go through the head (its cost is
    most of a drafter's on a large vocabulary)."""
    if module.eagle3:
        t2d = torch.full((int(module.d2t.numel() + module.d2t.max().clamp(min=0)) + 1,), -1,
                         dtype=torch.long, device=targets.device)
        draft = torch.arange(module.d2t.numel(), device=targets.device)
        t2d[draft + module.d2t] = draft
        inside = targets < t2d.numel()
        targets = torch.where(inside, t2d[targets.clamp(max=t2d.numel() - 1)], -1)
        ok = ok & (targets >= 0)
    if not ok.any():
        return out.sum() * 0.0
    logits = module.logits(base, out[ok])  # (rows, V_draft)
    return F.cross_entropy(logits.float(), targets[ok])


def eagle_loss(module: EagleModule, cfg: EagleConfig, base, base_out, input_ids, valid):
    """Drafter loss on one batch.

    base_out = (logits (B,L,V) | None, hidden (B,L,H), aux (B,L,n_aux*H) | None) from the frozen base;
    valid (B, L) bool: True where token t may be a prediction target. Without logits (features from
    a cache, on self-distilled text) the targets are the next tokens themselves: the base's argmax.
    EAGLE-1: smooth-L1(out_t, f_{t+1}) * w + 0.1 * CE(p_base(. | t+1), q_t).
    EAGLE-3: sum over TTT steps j (:func:`_ttt_unroll`) of decay**j * CE(p_base(. | t+j+1), q_t^(j)).
    """
    logits_b, hidden_b, aux_b = base_out
    bsz, length = input_ids.shape
    m = length - 1  # anchors t = 0..L-2 (x_{t+1} must exist)
    if m < 1:
        return hidden_b.new_zeros((), dtype=torch.float32, requires_grad=True)
    device = input_ids.device
    t = torch.arange(m, device=device)
    target_p = None
    if logits_b is not None:
        target_p = F.softmax(logits_b.float(), dim=-1)  # (B, L, V)
        if module.eagle3 and module.lm_head.out_features != target_p.shape[-1]:
            target_ids = torch.arange(module.lm_head.out_features, device=device) + module.d2t
            target_p = target_p[..., target_ids]
            target_p = target_p / target_p.sum(-1, keepdim=True).clamp(min=1e-9)

    def ce(out, offset, n, ok):  # against the base at position offset.. (predicting x_{offset+1}..)
        if target_p is None:  # the last anchor's x_{offset+n} is past the end: n - 1 rows
            return _hard_ce(module, base, out[:, : n - 1], input_ids[:, offset + 1 : offset + n], ok[:, : n - 1])
        return _masked_mean(_soft_ce(module.logits(base, out), target_p[:, offset : offset + n]), ok)

    if not module.eagle3:
        mask = (t[None, :] <= t[:, None]).expand(bsz, 1, m, m)
        out, _ = module.hidden_step(base, hidden_b[:, :m], input_ids[:, 1:], t.expand(bsz, m), mask)
        reg = F.smooth_l1_loss(out.float(), hidden_b[:, 1:].float(), reduction="none").mean(-1)
        reg_ok, ce_ok = _shifted(valid, 1, m), _shifted(valid, 2, m)
        return cfg.eagle_hidden_loss_weight * _masked_mean(reg, reg_ok) + 0.1 * ce(out, 1, m, ce_ok)

    total = hidden_b.new_zeros((), dtype=torch.float32)
    for j, n, out in _ttt_unroll(module, cfg, base, hidden_b, aux_b, input_ids, cfg.eagle_ttt_steps):
        # target: base distribution at position t+j+1 predicts x_{t+j+2}
        if target_p is None and n < 2:
            break
        total = total + cfg.eagle_loss_decay**j * ce(out, 1 + j, n, _shifted(valid, 2 + j, n))
    return total


@torch.no_grad()
def eagle_chain_predictions(model, features, input_ids, depth: int) -> torch.Tensor:
    """(B, L-1, depth) draft-vocabulary-mapped top-1 chains: entry [b, t, j] guesses x_{t+j+2}.

    ``features``: the base's post-norm hidden (EAGLE-1) or its EAGLE-3 layers (B, L, ...). Rows past
    a step's end (t >= L-1-j) are -1."""
    em = model.eagle_module
    bsz, length = input_ids.shape
    out = torch.full((bsz, length - 1, depth), -1, dtype=torch.long)
    if em.eagle3:
        h = model.config.hidden_size
        for j, n, drafted in _ttt_unroll(em, model.spec_config, model, features[..., :h], features, input_ids,
                                         depth):
            out[:, :n, j] = em.draft_to_target(em.logits(model, drafted).argmax(-1))
        return out
    # EAGLE-1: step j reads its own previous outputs as hidden states, the true tokens as inputs
    hidden = features[:, : length - 1]
    m = length - 1
    t = torch.arange(m)
    for j in range(depth):
        n = m - j
        if n < 1:
            break
        mask = (t[None, :n] <= t[:n, None]).expand(bsz, 1, n, n)
        h, logits, _ = em.step(model, hidden[:, :n], input_ids[:, 1 + j : 1 + j + n], (t[:n] + j).expand(bsz, n),
                               mask)
        out[:, :n, j] = logits.argmax(-1)
        hidden = h
    return out
