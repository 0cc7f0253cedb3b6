"""DFlash: convert with ModelOpt's config, the drafter's function against ModelOpt's dense form, the loss,
training on the feature cache, save / restore."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model

from exporter.speculative import DFlashConfig, convert, enable_huggingface_checkpointing, is_converted
from exporter.speculative import training as T
from exporter.speculative.config import build_target_layer_ids
from exporter.speculative.dflash import dflash_loss, dpace_weights, sample_anchors

CFG = {"dflash_block_size": 4, "dflash_mask_token_id": 255, "dflash_target_layer_ids": [0, 2],
       "dflash_architecture_config": {"num_hidden_layers": 2}}


def dflash_model(arch="llama", seed=0, **over):
    torch.manual_seed(seed + 1)
    return convert(tiny_model(arch, seed=seed), [("dflash", {**CFG, **over})])


def test_modelopt_defaults_and_layer_ids():
    cfg = DFlashConfig(dflash_mask_token_id=3)
    assert (cfg.dflash_block_size, cfg.num_layers, cfg.dflash_loss_objective, cfg.dflash_num_anchors) == (8, 5, "dpace",
                                                                                                          512)
    assert cfg.dflash_architecture_config["rms_norm_eps"] == 1e-6 and cfg.dflash_dpace_alpha == 0.5
    # ModelOpt's test_layer_ids_match_zlab, and docs/dflash.md 1.3
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert build_target_layer_ids(30, 3) == [1, 14, 27] and build_target_layer_ids(6, 2) == [1, 3]
    two = {"dflash_mask_token_id": 3, "dflash_architecture_config": {"num_hidden_layers": 2}}
    model = convert(tiny_model(num_hidden_layers=6), [("dflash", two)])
    assert model.spec_config.dflash_target_layer_ids == [1, 3]
    dm = model.dflash_module
    assert (dm.num_kv_heads, dm.head_dim, dm.dims.intermediate_size) == (2, 16, 128)  # the base's dims
    assert all(not p.requires_grad for n, p in model.named_parameters() if not n.startswith("dflash_module."))
    assert all(p.requires_grad for p in dm.parameters())
    assert not hasattr(model, "embed_tokens") and "lm_head" not in dict(dm.named_modules())  # shared with the base


@pytest.mark.parametrize("bad, fragment", [
    ({"dflash_mask_token_id": None}, "dflash_mask_token_id is unset"),
    ({"dflash_swa_window_size": 16}, "not supported yet"),
    ({"dflash_architecture_config": {"projector_type": "domino"}}, "not supported"),
    ({"dflash_target_layer_ids": [3]}, "out of range"),
    ({"dflash_dpace_alpha": 0.0}, "(0, 1]"),
    ({"dflash_blok_size": 4}, "unknown dflash config key"),
])
def test_bad_config_is_one_line_and_leaves_the_base(bad, fragment):
    model = tiny_model()
    with pytest.raises(ValueError, match=None) as e:
        convert(model, [("dflash", {**CFG, **bad})])
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert not is_converted(model)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def modelopt_dense(dm, base, noise_ids, target_hidden, full_pos, mask):
    """ModelOpt's DFlashModule.forward + DFlashAttention as written there: K/V of cat(context, block),
    RoPE over [context; block] positions (q the last q_len), one dense boolean mask, SDPA."""
    x = base.model.embed_tokens(noise_ids)
    th = dm.hidden_norm(dm.fc(target_hidden))
    inv = dm.rotary_emb.inv_freq
    freqs = full_pos[..., None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    q_len = x.shape[1]
    for layer in dm.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        b, L = h.shape[0], th.shape[1]
        q = a.q_norm(a.q_proj(h).view(b, q_len, -1, a.head_dim)).transpose(1, 2)
        k = a.k_norm(torch.cat([a.k_proj(th), a.k_proj(h)], 1).view(b, L + q_len, -1, a.head_dim)).transpose(1, 2)
        v = torch.cat([a.v_proj(th), a.v_proj(h)], 1).view(b, L + q_len, -1, a.head_dim).transpose(1, 2)
        q, k = _rope(q, cos[:, :, -q_len:], sin[:, :, -q_len:]), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return dm.norm(x)


def test_block_attention_is_modelopts_dense_masked_forward():
    """The training forward (block-diagonal blocks, context strictly before each anchor) equals ModelOpt's
    dense mask over [context; all blocks], block by block."""
    from exporter.speculative.dflash import block_hidden

    model = dflash_model()
    dm = model.dflash_module
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (2, 14), generator=g)
    with torch.no_grad():
        _, _, aux = model.base_outputs(ids)
        anchors = torch.tensor([[2, 5, 9], [1, 4, 10]])
        keep = torch.ones_like(anchors, dtype=torch.bool)
        ours = block_hidden(dm, model, aux, ids, anchors, keep)
        b, n, L = dm.block_size, 3, ids.shape[1]
        noise = torch.full((2, n * b), dm.mask_token_id)
        noise[:, ::b] = torch.gather(ids, 1, anchors)
        full_pos = torch.cat([torch.arange(L).expand(2, L), (anchors[..., None] + torch.arange(b)).view(2, -1)], 1)
        qi = torch.arange(n * b)[:, None]
        kv = torch.arange(L + n * b)[None]
        anchor_q = anchors.repeat_interleave(b, 1)[:, None, :, None]
        mask = ((kv < L) & (kv < anchor_q)) | ((kv >= L) & ((kv - L) // b == qi // b))
        ref = modelopt_dense(dm, model, noise, aux, full_pos, mask)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)


def test_dpace_weights_are_suffix_sums_of_cumulative_confidence():
    q = torch.tensor([[0.8, 0.5, 0.9]])
    w = dpace_weights(q, 0.5, torch.ones(1, 3))
    qt = 0.5 + 0.5 * q
    c = torch.cumprod(qt, -1)
    torch.testing.assert_close(w, torch.stack([c[0, 0:].sum(), c[0, 1:].sum(), c[0, 2:].sum()])[None])
    w = dpace_weights(q, 0.5, torch.tensor([[1.0, 1.0, 0.0]]))  # a masked slot counts for nothing
    assert w[0, 2] == 0 and torch.isclose(w[0, 1], c[0, 1])


def test_anchors_are_answer_positions_that_fit_a_block():
    torch.manual_seed(0)
    mask = torch.zeros(2, 12)
    mask[0, 3:12] = 1
    mask[1, 5:7] = 1
    anchors, keep = sample_anchors(mask, 4, 512)
    assert anchors.shape[1] == min(512, 6 - 1)  # row 0: anchors 3..8 (L - b = 8), 6 valid; max_n = 6 - 1
    for r in range(2):
        a = anchors[r][keep[r]].tolist()
        assert a == sorted(set(a)) and all(mask[r, t] == 1 and t <= 8 for t in a)
    assert keep[1].sum() == 2


def test_loss_on_cached_features_is_the_loss_with_the_base_running():
    """Hard targets: the cached-feature path and the base-running path give the same loss (same anchors)."""
    model = dflash_model(dflash_self_logit_distillation=False)
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = -100
    _, _, aux = model.base_outputs(ids)
    torch.manual_seed(7)
    cached = model(input_ids=ids, labels=labels, base_features=aux.half().float()).loss
    torch.manual_seed(7)
    direct = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(cached, direct, atol=1e-2, rtol=1e-2)
    cached.backward()
    assert all(p.grad is not None for p in model.dflash_module.parameters())
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("dflash_module."))


def test_kd_loss_is_cross_entropy_against_the_base_distribution():
    """Self-distillation (ModelOpt's default): against a one-hot teacher it is the hard loss."""
    model = dflash_model()
    dm, cfg = model.dflash_module, model.spec_config
    ids = torch.randint(3, 250, (1, 14), generator=torch.Generator().manual_seed(2))
    valid = torch.ones_like(ids, dtype=torch.bool)
    _, _, aux = model.base_outputs(ids)
    onehot = torch.full((1, 14, 256), -1e4)
    onehot[0, torch.arange(13), ids[0, 1:]] = 1e4  # the base "predicts" exactly the next token
    torch.manual_seed(3)
    kd = dflash_loss(dm, cfg, model, (onehot, aux), ids, valid)
    torch.manual_seed(3)
    hard = dflash_loss(dm, cfg, model, (None, aux), ids, valid)
    torch.testing.assert_close(kd, hard, atol=1e-4, rtol=1e-4)
    assert dflash_loss(dm, cfg, model, (None, aux), ids, torch.zeros_like(valid)).item() == 0.0  # no answer


def test_save_pretrained_and_from_pretrained_restore(tmp_path):
    from transformers import AutoModelForCausalLM

    model = dflash_model()
    with torch.no_grad():
        for p in model.dflash_module.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    enable_huggingface_checkpointing()
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.spec_mode == "dflash" and back.spec_config == model.spec_config
    a, b = model.dflash_module.state_dict(), back.dflash_module.state_dict()
    assert a.keys() == b.keys() and "rotary_emb.inv_freq" not in a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_a_draft_vocabulary_keeps_the_heads_rows_and_is_saved(tmp_path):
    """dflash_draft_vocab_size: logits are the base head's at those tokens, -inf elsewhere, the same with
    the rows precomputed (as the export keeps them); the loss runs over them; the ids are saved and
    restored; a size at or over the base's vocabulary is one line."""
    from transformers import AutoModelForCausalLM

    model = dflash_model(dflash_draft_vocab_size=64)
    dm = model.dflash_module
    vocab = torch.randperm(256, generator=torch.Generator().manual_seed(0))[:64].sort().values
    dm.draft_vocab.copy_(vocab)
    hidden = torch.randn(2, 3, 64)
    got = dm.logits(model, hidden)
    want = model.lm_head(hidden)
    assert got.shape == want.shape and torch.isneginf(got).sum() == 2 * 3 * (256 - 64)
    torch.testing.assert_close(got[..., vocab], want[..., vocab])
    torch.testing.assert_close(dm.logits(model, hidden, model.lm_head.weight[vocab].clone()), got)
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    _, _, aux = model.base_outputs(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    torch.manual_seed(3)
    own = dflash_loss(dm, model.spec_config, model, (None, aux), ids, valid)
    torch.manual_seed(3)
    passed = dflash_loss(dm, model.spec_config, model, (None, aux), ids, valid, vocab=torch.arange(64))
    torch.testing.assert_close(own, passed)  # the module's own vocabulary wins over the argument
    enable_huggingface_checkpointing()
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(back.dflash_module.draft_vocab, vocab)
    with pytest.raises(ValueError, match="must be below the base's vocabulary") as e:
        dflash_model(dflash_draft_vocab_size=256)
    assert "\n" not in str(e.value)


def test_training_on_the_cache_lowers_the_loss_and_reports_block_acceptance(tmp_path):
    """training.run with given examples (no distillation): the mask token picked, features cached, the
    drafter trained (loss falls), held-out acceptance over the block (depth b-1)."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(3, 200, (12,), generator=g).tolist()
    examples = [T.Example(torch.randint(3, 200, (4,), generator=g).tolist(), pattern * 2, f"c{i % 2}")
                for i in range(12)]
    cfg = T.TrainingConfig(mode="dflash", seconds_budget=None, epochs=20, batch_size=4, learning_rate=5e-3,
                           heldout_fraction=0.2, drafter_config={"dflash_block_size": 4,
                                                                 "dflash_target_layer_ids": [0, 2]})
    lines = []
    report = T.run(tiny_model(seed=0), None, [], cfg, tmp_path, log=lines.append, examples=examples)
    assert any("mask token" in ln for ln in lines)
    acc = report["heldout_acceptance"]["all"]
    assert len(acc["per_position"]) == 3 and acc["anchors"] > 0
    assert report["training"]["final_loss"] is not None
    assert acc["tau_chain"] > 1.5, acc  # a repeated pattern: the trained block drafts it
    assert set(acc["tau_tree"]) == {"4", "8"} and acc["tau_tree"]["8"] >= 1.5, acc  # block-size and 2x trees
    assert set(acc["tau_static_tree"]) == {"4", "8"} and len(acc["acceptance_by_slot_rank"]) == 3
    assert any("trees from the block" in ln for ln in lines)


def test_tree_acceptance_follows_the_true_continuation():
    """The greedy verify's walk: from the root, the child holding the next true token, while there is one."""
    import numpy as np

    from graphs.dflash_tree import block_tree

    tree, tokens = block_tree(np.array([[5, 9], [7, 8]]), np.log([[0.6, 0.3], [0.5, 0.4]]), 4, size=4)
    assert T.tree_accepted(tree, tokens, [5, 7, 1]) == 2  # root 4 -> 5 -> 7, then no child
    assert T.tree_accepted(tree, tokens, [9, 7]) == 1  # 9 kept, its children pruned
    assert T.tree_accepted(tree, tokens, [8]) == 0


def test_train_drafter_sample_trains_a_dflash_drafter_for_a_base(tmp_path, capsys):
    """samples/train_drafter.py --mode dflash --base DIR: distilled by our engine, trained, saved, restorable;
    without --base one line."""
    from conftest import save_tiny_model
    from transformers import AutoModelForCausalLM

    from samples import train_drafter

    base = save_tiny_model(tiny_model(num_hidden_layers=6), tmp_path / "base")
    with pytest.raises(SystemExit):
        train_drafter.main(["--out", str(tmp_path / "x"), "--mode", "dflash", "--tiny"])
    assert "--base" in capsys.readouterr().err
    out = train_drafter.main(["--out", str(tmp_path / "d"), "--mode", "dflash", "--tiny", "--base", str(base),
                              "--distill-new-tokens", "24", "--budget-s", "120"])
    enable_huggingface_checkpointing()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.spec_mode == "dflash" and model.spec_config.dflash_target_layer_ids == [1, 3]
    report = (out / "training_report.json").read_text()
    assert '"tau_chain"' in report
