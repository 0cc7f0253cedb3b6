"""Sampled speculative decoding keeps the base model's distribution: a chi-square test.

A tiny vocabulary (16 ids) lets PyTorch compute the exact joint distribution of the first three new
tokens, p(x1) p(x2 | x1) p(x3 | x1, x2), from the base's softmax. The runtime samples the same
prompt many times (one batch of identical prompts per seed, fixed seeds), and a chi-square
goodness-of-fit test on the joint counts (cells with an expected count under 5 merged) must not
reject at p = 1e-3. Three tokens, not two: x1 comes from the prefill, so only x2 and x3 go through
tree acceptance (x3 both as a second accepted draft of step 1 and from step 2).

The drafters are self-distilled on *sampled* continuations, so drafts are often accepted (asserted),
and the same test run with a deliberately biased acceptance rule rejects by a wide margin: the test
can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import chi2_sf, torch_threads
from tiny import tiny_model

import graphs
import graphs.results
import graphs.runtime
from exporter.export import export
from exporter.speculative import convert, enable_huggingface_checkpointing

VOCAB = 16
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LM_HEAD_SCALE = 20.0  # entropy ~1.6 nats per token: neither flat nor peaked
PROMPT = [5, 9, 3, 12, 7]
N_TOKENS = 3
BATCH, SEEDS = 1000, range(8)  # 8,000 samples per distribution test
P_MIN = 1e-3
DRAFTERS = {
    "medusa": ("medusa", {"medusa_num_heads": 2, "medusa_num_layers": 1}),
    "eagle": ("eagle", {"eagle_num_layers": 1}),
}


def _base():
    model = tiny_model("llama", seed=3, **SIZES)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    return model


@torch.no_grad()
def _sampled_text(model, n: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, 3), generator=gen)
    for _ in range(length):
        p = torch.softmax(model(input_ids=ids).logits[:, -1].double(), -1)
        ids = torch.cat([ids, torch.multinomial(p, 1, generator=gen)], dim=1)
    return ids


def _distill(model, ids: torch.Tensor, steps: int = 120, batch: int = 32, lr: float = 3e-3) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, ids.shape[0], (batch,), generator=gen)
        loss = model(input_ids=ids[idx], labels=ids[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(decoders by kind, the base model): drafters self-distilled on sampled text, exported, loaded."""
    decoders = {}
    with torch_threads(1):
        base = _base()
        text = _sampled_text(base, n=96, length=24, seed=1)
        for kind, drafter in DRAFTERS.items():
            root = tmp_path_factory.mktemp(f"sampling-{kind}")
            torch.manual_seed(2)
            model = convert(_base(), [(drafter[0], dict(drafter[1]))])
            _distill(model, text)
            enable_huggingface_checkpointing()
            model.save_pretrained(root / "model")
            export(root / "model", root / "onnx", log=lambda *a, **k: None)
            dec = graphs.load(root / "onnx", provider="cpu", threads=1)
            dec.eos = set()  # the tiny vocabulary holds the EOS id: sample it like any other token
            decoders[kind] = dec
    return decoders, base


def _warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution (float64), written independently of graphs.sampling: HF's order."""
    x = logits.double() / temperature
    if top_k:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    p = torch.softmax(x, -1)
    if top_p < 1:
        sp, order = torch.sort(p, dim=-1, descending=True)
        keep_sorted = (torch.cumsum(sp, -1) - sp) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        p = torch.where(keep, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


@torch.no_grad()
def exact_joint(model, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """(V, V, V) float64: p(x1, x2, x3 | PROMPT) from PyTorch."""
    v = VOCAB
    p1 = _warp(model(input_ids=torch.tensor([PROMPT])).logits[0, -1], temperature, top_k, top_p)  # (V,)
    one = torch.tensor([[*PROMPT, a] for a in range(v)])
    p2 = _warp(model(input_ids=one).logits[:, -1], temperature, top_k, top_p)  # (V, V)
    two = torch.tensor([[*PROMPT, a, b] for a in range(v) for b in range(v)])
    p3 = _warp(model(input_ids=two).logits[:, -1], temperature, top_k, top_p).reshape(v, v, v)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.numpy()


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit test; cells expecting < ``min_expected`` are pooled into one.

    Returns (statistic, degrees of freedom, p-value).
    """
    counts, probs = counts.ravel().astype(np.float64), probs.ravel()
    n = counts.sum()
    expected = probs / probs.sum() * n
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    rest_o, rest_e = counts[~big].sum(), expected[~big].sum()
    if rest_e > 0:
        if rest_e >= min_expected or not exp:
            obs.append(rest_o)
            exp.append(rest_e)
        else:  # too small alone: pool it into the smallest kept cell
            i = int(np.argmin(exp))
            obs[i] += rest_o
            exp[i] += rest_e
    obs_a, exp_a = np.array(obs), np.array(exp)
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    dof = len(exp) - 1
    return stat, dof, chi2_sf(stat, dof)


def test_chi2_sf_reference_values():
    # scipy.stats.chi2.sf values (scipy is not a dependency)
    assert chi2_sf(3.84145882, 1) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(124.342113, 100) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(10.0, 30) == pytest.approx(0.99977374632, rel=1e-9)
    assert chi2_sf(50.0, 50) == pytest.approx(0.47339846856, rel=1e-9)
    assert chi2_sf(300.0, 150) == pytest.approx(4.5398243815e-12, rel=1e-6)


def sample_counts(decoder, seeds=SEEDS, **kwargs) -> tuple[np.ndarray, float]:
    """Counts (V, V, V) of the first three tokens over BATCH * len(seeds) samples; mean accepted length."""
    counts = np.zeros((VOCAB,) * N_TOKENS, dtype=np.int64)
    taus = []
    for seed in seeds:
        results = decoder.generate([PROMPT] * BATCH, max_new_tokens=N_TOKENS, seed=seed, **kwargs)
        toks = np.array([r.token_ids for r in results])  # (BATCH, 3)
        assert toks.shape == (BATCH, N_TOKENS)
        np.add.at(counts, tuple(toks.T), 1)
        taus.append(results[0].stats.mean_accepted_length)
    return counts, float(np.mean(taus))


@pytest.mark.parametrize("kind", [*DRAFTERS, "autoregressive"])
def test_sampling_matches_the_base_distribution(setup, kind):
    decoders, base = setup
    if kind == "autoregressive":
        counts, tau = sample_counts(decoders["medusa"], temperature=1.0, mode="autoregressive")
    else:
        counts, tau = sample_counts(decoders[kind], temperature=1.0)
        assert tau > 1.05, f"{kind}: drafts are (almost) never accepted; the test would prove little"
    stat, dof, p = chi_square(counts, exact_joint(base))
    print(f"\n{kind}: chi2 {stat:.1f} dof {dof} p {p:.3g} tau {tau:.2f}")
    assert p > P_MIN, f"{kind}: sampled tokens do not follow the base distribution (chi2 {stat:.1f}, dof {dof})"


@pytest.mark.parametrize("kind", DRAFTERS)
def test_warped_sampling_matches(setup, kind):
    """temperature, top-k and top-p: speculative sampling keeps the *warped* base distribution."""
    decoders, base = setup
    warp = dict(temperature=0.8, top_k=8, top_p=0.9)
    counts, tau = sample_counts(decoders[kind], seeds=range(100, 104), **warp)  # few cells: 4,000 samples
    assert tau > 1.05
    expected = exact_joint(base, **warp)
    assert counts[expected == 0].sum() == 0  # nothing outside the top-k / top-p sets
    stat, dof, p = chi_square(counts, expected)
    print(f"\n{kind} warped: chi2 {stat:.1f} dof {dof} p {p:.3g} tau {tau:.2f}")
    assert p > P_MIN


def _accept_first_child(tree, tokens, probs, rng):
    """A biased rule: always take the first child (a draft is never rejected); bonus from p."""
    accepted, n = [0], 0
    while len(tree.children[n]):
        n = int(tree.children[n][0])
        accepted.append(n)
    p = probs[n]
    return accepted, int(rng.choice(p.shape[-1], p=p / p.sum()))


def _accept_or_resample_wrongly(tree, tokens, probs, rng):
    """A subtler bias: accept the first child with probability p(x), but draw the bonus from p itself
    (not from the residual with x removed), so x is over-sampled."""
    accepted, n = [0], 0
    while True:
        p = probs[n]
        kids = tree.children[n]
        if len(kids) and rng.random() < p[int(tokens[kids[0]])]:
            n = int(kids[0])
            accepted.append(n)
            continue
        return accepted, int(rng.choice(p.shape[-1], p=p / p.sum()))


@pytest.mark.parametrize("rule", [_accept_first_child, _accept_or_resample_wrongly])
def test_the_test_detects_a_biased_acceptance(setup, monkeypatch, rule):
    decoders, base = setup
    monkeypatch.setattr(graphs.results, "sample_accept", rule)
    counts, _ = sample_counts(decoders["medusa"], seeds=range(200, 202), temperature=1.0)
    stat, dof, p = chi_square(counts, exact_joint(base))
    print(f"\n{rule.__name__}: chi2 {stat:.1f} dof {dof} p {p:.3g}")
    assert p < 1e-6
