"""convert → train (base frozen) → save → restore, for every architecture and drafter kind."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from exporter.modeling import causal_mask
from exporter.speculative import (
    convert,
    enable_huggingface_checkpointing,
    is_converted,
    load_drafter,
    save_drafter,
)
from exporter.speculative.medusa import MedusaHead, medusa_logits

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MODES = {
    "medusa": ("medusa", {"medusa_num_heads": 3, "medusa_num_layers": 2}),
    "eagle1": ("eagle", {"eagle_num_layers": 2}),
    "eagle3": ("eagle", {"use_aux_hidden_state": True, "draft_vocab_size": 100, "eagle_num_layers": 1}),
}
B, S = 2, 12


@pytest.fixture(autouse=True)
def _hf_checkpointing():
    with enable_huggingface_checkpointing():
        yield


def _ids(seed=0, vocab=256, batch=B, seq=S):
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _converted(arch, kind, seed=0):
    mode, cfg = MODES[kind]
    return convert(tiny_model(arch, seed=seed), [(mode, dict(cfg))])


@pytest.mark.parametrize("kind", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_convert_shapes_frozen_base_and_unchanged_logits(arch, kind):
    ids = _ids()
    ref = tiny_model(arch)(input_ids=ids).logits
    model = _converted(arch, kind)
    assert is_converted(model)
    assert type(model).__name__ == type(tiny_model(arch)).__name__  # config.architectures unchanged
    # only drafter parameters train
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    prefix = "medusa_heads." if kind == "medusa" else "eagle_module."
    assert trainable and all(n.startswith(prefix) for n in trainable)
    assert trainable == {prefix + n for n, _ in model.drafter.named_parameters()}
    # base logits: plain forward (what generate uses) and the training forward
    torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=0, atol=0)
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, ref, rtol=1e-5, atol=1e-5)  # eager kernel, explicit mask
    assert out.loss.ndim == 0 and torch.isfinite(out.loss) and out.loss.requires_grad
    # drafter shapes
    cfg = model.config
    _, hidden, aux = model.base_outputs(ids)
    assert hidden.shape == (B, S, cfg.hidden_size)
    if kind == "medusa":
        assert medusa_logits(model.medusa_heads, hidden).shape == (B, S, 3, cfg.vocab_size)
        assert aux is None
        return
    em = model.eagle_module
    mask = causal_mask(B, S)
    pos = torch.arange(S).expand(B, S)
    if kind == "eagle3":
        n_aux = len(model.spec_config.eagle_aux_hidden_state_layer_ids)
        assert aux.shape == (B, S, n_aux * cfg.hidden_size)
        assert em.fc.weight.shape == (cfg.hidden_size, n_aux * cfg.hidden_size)
        out_h, draft_logits, kv = em.step(model, hidden[:, :0], ids, pos, mask, None, aux)
        assert draft_logits.shape == (B, S, 100) and em.d2t.shape == (100,)
    else:
        assert em.fc.weight.shape == (cfg.hidden_size, 2 * cfg.hidden_size)
        out_h, draft_logits, kv = em.step(model, hidden, ids, pos, mask)
        assert draft_logits.shape == (B, S, cfg.vocab_size)
    assert out_h.shape == (B, S, cfg.hidden_size)
    assert len(kv) == len(em.layers)
    for k, v in kv:
        assert k.shape == v.shape == (B, em.num_kv_heads, S, em.head_dim)


def test_eagle3_default_aux_layers_are_modelopts():
    model = convert(tiny_model("llama", num_hidden_layers=8), [("eagle", {"use_aux_hidden_state": True})])
    assert model.spec_config.eagle_aux_hidden_state_layer_ids == [1, 3, 4]  # 1, L//2-1, L-4
    assert model.spec_config.draft_vocab_size == model.config.vocab_size


def test_modelopt_eagle_architecture_config_is_accepted():
    arch_cfg = {"num_hidden_layers": 2, "use_aux_hidden_state": True, "draft_vocab_size": 64, "intermediate_size": 96}
    model = convert(tiny_model("llama"), [("eagle", {"eagle_architecture_config": arch_cfg})])
    assert len(model.eagle_module.layers) == 2
    assert model.eagle_module.lm_head.out_features == 64
    assert model.eagle_module.layers[1].mlp.up_proj.out_features == 96


def test_medusa_blocks_do_not_share_weights():
    """Regression: `[ResBlock(h)] * n` (FasterDecoding) repeats one module, so its n layers share weights."""
    model = _converted("llama", "medusa")
    head = model.medusa_heads[0]
    assert isinstance(head, MedusaHead)
    blocks = head.medusa_layers
    assert len({id(b) for b in blocks}) == len(blocks) == 2
    ptrs = {p.data_ptr() for h in model.medusa_heads for p in h.parameters()}
    assert len(ptrs) == sum(1 for _ in model.medusa_heads.parameters())  # no parameter shared anywhere
    with torch.no_grad():
        blocks[0].linear.weight.add_(1.0)
    assert not torch.equal(blocks[0].linear.weight, blocks[1].linear.weight)
    # heads start as the base lm_head, and as copies (not the same tensor)
    lm = model.lm_head.weight
    assert torch.equal(head.lm_head.weight, lm) and head.lm_head.weight.data_ptr() != lm.data_ptr()


@pytest.mark.parametrize("kind", MODES)
def test_right_padding_does_not_change_the_loss(kind):
    model = _converted("qwen2", kind)
    ids = _ids(seq=10)[:1]
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], dim=1).long()
    labels = padded.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(model(input_ids=padded, attention_mask=mask, labels=labels).loss, loss)


def _train(model, batch, tmp_path, steps=15, lr=5e-3):
    from torch.utils.data import Dataset

    class Fixed(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return {"input_ids": batch[i % len(batch)], "labels": batch[i % len(batch)]}

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=len(batch),
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    Trainer(model=model, args=args, train_dataset=Fixed()).train()


@pytest.mark.parametrize(("arch", "kind"), [("llama", "medusa"), ("qwen3", "eagle1"), ("mistral", "eagle3")])
def test_trainer_lowers_drafter_loss_and_leaves_base_alone(tmp_path, arch, kind):
    base = tiny_model(arch)
    with torch.no_grad():  # a random base is near-uniform: sharpen it so there is something to learn
        base.lm_head.weight.mul_(30)
    mode, cfg = MODES[kind]
    model = convert(base, [(mode, dict(cfg))])
    batch = _ids(seed=1, batch=4, seq=16)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model.eval()
    with torch.no_grad():
        before = model(input_ids=batch, labels=batch).loss.item()
    _train(model, batch, tmp_path)
    model.eval()
    with torch.no_grad():
        after = model(input_ids=batch, labels=batch).loss.item()
    assert after < 0.9 * before, (before, after)
    for n, p in model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n


@pytest.mark.parametrize("kind", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_restores_identical_model(tmp_path, arch, kind):
    model = _converted(arch, kind, seed=3)
    with torch.no_grad():  # a drafter that differs from a fresh one's initialisation
        for p in model.drafter.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    restored = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert is_converted(restored) and restored.spec_mode == model.spec_mode
    assert restored.config.speculative_decoding == model.config.speculative_decoding
    a, b = model.state_dict(), restored.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    drafter = ("medusa_heads.", "eagle_module.")
    assert not any(p.requires_grad for n, p in restored.named_parameters() if not n.startswith(drafter))
    ids = _ids()
    torch.testing.assert_close(restored(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(restored(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss)


def test_from_pretrained_of_a_plain_model_is_unchanged(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    assert not is_converted(AutoModelForCausalLM.from_pretrained(tmp_path))


@pytest.mark.parametrize("kind", MODES)
def test_drafter_alone_pairs_with_a_fresh_base(tmp_path, kind):
    model = _converted("qwen3", kind, seed=5)
    with torch.no_grad():
        for p in model.drafter.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_drafter(model, tmp_path)
    files = sorted(f.name for f in tmp_path.iterdir())
    assert files == ["drafter.safetensors", "drafter_config.json"]
    base_bytes = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad) * 4
    assert (tmp_path / "drafter.safetensors").stat().st_size < base_bytes  # the drafter, not the base
    fresh = load_drafter(tiny_model("qwen3", seed=5), tmp_path)
    ids = _ids()
    for k, v in model.drafter.state_dict().items():
        assert torch.equal(v, fresh.drafter.state_dict()[k]), k
    torch.testing.assert_close(fresh(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss)


def test_drafter_for_another_base_is_refused(tmp_path):
    save_drafter(_converted("llama", "eagle1"), tmp_path)
    other = tiny_model("llama", hidden_size=32)
    with pytest.raises(ValueError, match=r"trained for hidden_size=64, this base has hidden_size=32"):
        load_drafter(other, tmp_path)
    assert not is_converted(other)
