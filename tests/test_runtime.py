"""The ONNX Runtime decoder (graphs.runtime) on tiny exported models with *trained* drafters.

Random drafters are almost never accepted, which would leave every tree-acceptance path untested.
So each drafter here is first self-distilled on the base's own greedy continuations (a tiny random
model's greedy output falls into short loops, which a drafter learns in a few hundred Adam steps),
and the tests assert that trees are really accepted (mean accepted length well above 1) before
checking, for many prompts, batch sizes and tree shapes, that

    greedy speculative tokens == PyTorch greedy tokens of the base == the runtime's autoregressive tokens.

The base's ``lm_head`` is scaled by a constant before anything else: argmax (greedy) is unchanged,
but its distributions become peaked enough for the EAGLE losses (soft targets) to teach the argmax.
The drafters are also trained on the test prompts' own continuations (they are the references
anyway), so acceptance is high and stable; correctness (equality) does not depend on it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_tiny_tokenizer
from helpers import torch_threads
from tiny import tiny_model

import graphs
from exporter.export import export
from exporter.speculative import convert, enable_huggingface_checkpointing

VOCAB = 256
EOS, PAD = 2, 0  # exporter.tiny's ids (bos 1): the manifest's eos_token_ids == [EOS]
N_NEW = 40  # new tokens per reference continuation
LM_HEAD_SCALE = 20.0
PROMPT_LENGTHS = (1, 2, 3, 4, 6, 8, 11, 14, 17, 20)
PROMPTS = [
    np.random.default_rng(1000 + i).integers(3, VOCAB, size=n).tolist() for i, n in enumerate(PROMPT_LENGTHS)
]
DRAFTERS = {
    "medusa": ("medusa", {"medusa_num_heads": 3, "medusa_num_layers": 1}),
    "eagle": ("eagle", {"eagle_num_layers": 1}),
    "eagle3": ("eagle", {"eagle_num_layers": 1, "use_aux_hidden_state": True, "draft_vocab_size": 200}),
}
KINDS = tuple(DRAFTERS)
TRAIN_STEPS = {"medusa": 100, "eagle": 100, "eagle3": 80}
MIN_TAU = 2.0  # mean accepted length the trained drafters must reach (measured 2.8-3.1)

MEDUSA_TREES = {
    "default": None,
    "chain": [[0], [0, 0]],
    "wide": [[0], [1], [2], [3]],
    "deep_wide": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]],
}
EAGLE_TREES = {
    "default": None,
    "1-1-2": {"topk": 1, "depth": 1, "total_tokens": 2},
    "2-3-6": {"topk": 2, "depth": 3, "total_tokens": 6},
    "4-4-12": {"topk": 4, "depth": 4, "total_tokens": 12},
    "8-5-32": {"topk": 8, "depth": 5, "total_tokens": 32},
}
CASES = [("medusa", name) for name in MEDUSA_TREES] + [
    (kind, name) for kind in ("eagle", "eagle3") for name in EAGLE_TREES
]


def _tree(kind: str, name: str):
    return (MEDUSA_TREES if kind == "medusa" else EAGLE_TREES)[name]


def sharpened_base():
    """The tiny Llama base with its lm_head scaled: the same greedy tokens, peaked distributions."""
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """PyTorch's greedy tokens (HF generate), stopping after EOS like the runtime."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=EOS, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def greedy_rollouts(model, n: int, prompt_len: int, new: int, seed: int) -> list[torch.Tensor]:
    """Extra training text: random prompts and their greedy continuations (no EOS handling needed)."""
    ids = torch.randint(3, VOCAB, (n, prompt_len), generator=torch.Generator().manual_seed(seed))
    for _ in range(new):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return list(ids)


def distill(model, seqs: list[torch.Tensor], steps: int, batch: int = 16, lr: float = 3e-3, seed: int = 0):
    """Train the drafter (the only trainable parameters) on ``seqs`` with the model's own loss."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    labels = ids.masked_fill(mask == 0, -100)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(seqs), (batch,), generator=gen)
        loss = model(input_ids=ids[idx], attention_mask=mask[idx], labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def set_draft_vocab(model, seqs: list[torch.Tensor]) -> list[int]:
    """EAGLE-3: a non-trivial draft vocabulary (the most frequent target ids, many above its size).

    Draft id d maps to target id d + d2t[d]; the draft lm_head starts from those rows of the base's.
    """
    mod = model.eagle_module
    n = mod.lm_head.out_features
    counts = torch.bincount(torch.cat(seqs), minlength=VOCAB)
    counts[:3] = -1  # pad/bos/eos are never worth a draft slot
    targets = sorted(torch.argsort(counts, descending=True, stable=True)[:n].tolist())
    with torch.no_grad():
        mod.d2t.copy_(torch.tensor(targets) - torch.arange(n))
        mod.lm_head.weight.copy_(model.lm_head.weight[targets])
    return targets


@dataclass
class Trained:
    kind: str
    out_dir: Path
    decoder: graphs.Decoder
    refs: list[list[int]]  # PyTorch greedy continuations of PROMPTS
    draft_targets: list[int] | None = None  # EAGLE-3: the target ids its draft vocabulary covers


@pytest.fixture(scope="session")
def references():
    """PyTorch greedy continuations of PROMPTS (HF generate on the unconverted base) + training text."""
    with torch_threads(1):
        base = sharpened_base()
        refs = [hf_greedy(base, p, N_NEW) for p in PROMPTS]
        extra = greedy_rollouts(base, n=48, prompt_len=4, new=N_NEW, seed=7)
    seqs = [torch.tensor(p + r) for p, r in zip(PROMPTS, refs)] + extra
    return refs, seqs


@pytest.fixture(scope="session")
def trained(references, tmp_path_factory):
    """``trained(kind) -> Trained``: a self-distilled drafter, exported (with a tokenizer) and loaded."""
    refs, seqs = references
    cache: dict[str, Trained] = {}

    def make(kind: str) -> Trained:
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"trained-{kind}")
            with torch_threads(1):
                torch.manual_seed(1)
                model = convert(sharpened_base(), [copy.deepcopy(DRAFTERS[kind])])
                targets = set_draft_vocab(model, seqs) if kind == "eagle3" else None
                distill(model, seqs, TRAIN_STEPS[kind])
                enable_huggingface_checkpointing()
                model.save_pretrained(root / "model")
            write_tiny_tokenizer(root / "model", VOCAB)
            trees = [(2, 3, 6), (4, 4, 12)] if kind != "medusa" else None  # one-call graphs: default + 4-4-12
            export(root / "model", root / "onnx", log=lambda *a, **k: None, eagle_trees=trees)
            # adaptive=False: these tests exercise tree acceptance, which the adaptive policy may skip on
            # models this small (a plain step is often faster); test_adaptive_greedy_is_exact covers it
            decoder = graphs.load(root / "onnx", provider="cpu", threads=1, adaptive=False)
            cache[kind] = Trained(kind, root / "onnx", decoder, refs, targets)
        return cache[kind]

    return make


@pytest.fixture(scope="session")
def autoregressive_tokens(trained):
    """The runtime's own autoregressive tokens for PROMPTS (the base graph is the same for every kind)."""
    t = trained("medusa")
    return [t.decoder.generate(p, max_new_tokens=N_NEW, mode="autoregressive").token_ids for p in PROMPTS]


# --------------------------------------------------------------------------------------------
# Acceptance: the trained drafters really are accepted


@pytest.mark.parametrize("kind", KINDS)
def test_trained_drafters_are_accepted(trained, kind):
    t = trained(kind)
    taus = []
    for p in PROMPTS:
        r = t.decoder.generate(p, max_new_tokens=N_NEW)
        taus.append(r.stats.mean_accepted_length)
    tau = float(np.mean(taus))
    print(f"{kind}: mean accepted length {tau:.2f} over {len(PROMPTS)} prompts (per prompt {np.round(taus, 2)})")
    assert tau > MIN_TAU, f"{kind} drafter accepts too little ({tau:.2f}) to exercise tree acceptance"
    assert max(taus) > 2.0  # some steps accept several drafted tokens


# --------------------------------------------------------------------------------------------
# Greedy is lossless: speculative == PyTorch == autoregressive


def test_autoregressive_matches_pytorch(trained, autoregressive_tokens):
    refs = trained("medusa").refs
    for p, ref, got in zip(PROMPTS, refs, autoregressive_tokens):
        assert got == ref, f"prompt {p}"


@pytest.mark.parametrize(("kind", "tree"), CASES)
def test_greedy_speculative_matches_pytorch(trained, autoregressive_tokens, kind, tree):
    t = trained(kind)
    accepted = []
    for p, ref, ar in zip(PROMPTS, t.refs, autoregressive_tokens):
        r = t.decoder.generate(p, max_new_tokens=N_NEW, tree=_tree(kind, tree))
        assert r.token_ids == ref, f"{kind}/{tree}: prompt {p}"
        assert r.token_ids == ar
        assert r.finish_reason == ("eos" if ref[-1] == EOS else "length")
        accepted += r.stats.accepted
    assert np.mean(accepted) > 1.05, f"{kind}/{tree}: trees never accepted"


@pytest.mark.parametrize(("kind", "tree"), [("medusa", "default"), ("medusa", "deep_wide"), ("eagle", "default"),
                                             ("eagle", "8-5-32"), ("eagle3", "default"), ("eagle3", "2-3-6")])
def test_batch_of_different_lengths(trained, kind, tree):
    """Prompts of different lengths decoded together accept different lengths per step."""
    t = trained(kind)
    results = t.decoder.generate(PROMPTS, max_new_tokens=N_NEW, tree=_tree(kind, tree))
    assert [r.token_ids for r in results] == t.refs
    stats = results[0].stats
    assert all(r.stats is stats for r in results)
    assert len(set(stats.accepted)) > 1  # sequences did accept different lengths
    ar = t.decoder.generate(PROMPTS[::-1], max_new_tokens=N_NEW, mode="autoregressive")
    assert [r.token_ids for r in ar] == t.refs[::-1]


@pytest.mark.parametrize("kind", KINDS)
def test_io_binding_is_refused_loudly_and_decodes_on_the_host(trained, kind):
    """The io_binding flag is gone (K/V stays in host memory on the host executor): True is a one-line
    error instead of a warning that pretended, False a deprecation; the tokens stay PyTorch's."""
    from graphs.errors import InputError

    t = trained(kind)
    with pytest.raises(InputError, match="io_binding was removed"):
        graphs.load(t.out_dir, provider="cpu", threads=1, io_binding=True)
    with pytest.warns(DeprecationWarning, match="io_binding"):
        bound = graphs.load(t.out_dir, provider="cpu", threads=1, io_binding=False)
    results = bound.generate(PROMPTS[:3], max_new_tokens=N_NEW)
    assert [r.token_ids for r in results] == t.refs[:3]


def test_medusa_tree_file(trained, tmp_path):
    t = trained("medusa")
    f = tmp_path / "tree.json"
    f.write_text(json.dumps({"paths": MEDUSA_TREES["deep_wide"]}))
    g = tmp_path / "tree_list.json"
    g.write_text(json.dumps(MEDUSA_TREES["chain"]))
    for p, ref in zip(PROMPTS[:4], t.refs):
        assert t.decoder.generate(p, max_new_tokens=N_NEW, tree=str(f)).token_ids == ref
        assert t.decoder.generate(p, max_new_tokens=N_NEW, tree=g).token_ids == ref


def test_eagle_tree_file(trained, tmp_path):
    t = trained("eagle")
    f = tmp_path / "tree.json"
    f.write_text(json.dumps({"topk": 3, "depth": 2}))  # total_tokens from the manifest's default
    for p, ref in zip(PROMPTS[:4], t.refs):
        assert t.decoder.generate(p, max_new_tokens=N_NEW, tree=f).token_ids == ref


def test_eagle3_draft_vocabulary_maps_to_target_ids(trained, monkeypatch):
    """EAGLE-3 drafts over 200 ids; the graph maps them through d2t to target ids (some >= 200)."""
    from graphs.host import HostExecutor

    t = trained("eagle3")
    targets = set(t.draft_targets)
    assert max(targets) >= 200 and len(targets) == 200
    seen: list[np.ndarray] = []
    decoder = graphs.load(t.out_dir, provider="cpu", threads=1, eagle_draft="stepwise", adaptive=False)
    run_draft = HostExecutor.draft_step

    def spy(self, *args, **kwargs):
        out = run_draft(self, *args, **kwargs)
        if kwargs.get("rows") is None:  # decode-step calls (prefill calls feed a single row, topk 1)
            seen.append(out["topk_ids"].ravel())
        return out

    monkeypatch.setattr(HostExecutor, "draft_step", spy)
    accepted_drafts = []  # drafted tokens the base accepted: all but the last token of each step
    for p, ref in zip(PROMPTS, t.refs):
        events = list(decoder.stream(p, max_new_tokens=N_NEW))
        assert [x for e in events for x in e.token_ids] == ref
        accepted_drafts += [x for e in events[1:] for x in e.token_ids[:-1]]
    ids = np.concatenate(seen)
    assert set(ids.tolist()) <= targets  # every drafted id is a mapped target id
    assert ids.max() >= 200  # ... and the mapping was applied (draft ids are < 200)
    assert max(accepted_drafts) >= 200  # drafts above the draft vocabulary's size are accepted


@pytest.mark.parametrize("kind", KINDS)
def test_long_generation_crosses_cache_buckets(trained, kind):
    """150 new tokens: both K/V caches grow past several 64-column buckets mid-run."""
    t = trained(kind)
    p = PROMPTS[-1]
    with torch_threads(1):
        ref = hf_greedy(sharpened_base(), p, 150)
    r = t.decoder.generate(p, max_new_tokens=150)
    assert r.token_ids == ref
    assert t.decoder.generate([p, PROMPTS[0]], max_new_tokens=150)[0].token_ids == ref


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_with_top_k_1_is_greedy(trained, kind):
    """Lossless sampling from a one-hot distribution must reproduce greedy decoding exactly."""
    t = trained(kind)
    for p, ref in zip(PROMPTS[:4], t.refs):
        r = t.decoder.generate(p, max_new_tokens=N_NEW, temperature=1.0, top_k=1, seed=0)
        assert r.token_ids == ref
        assert r.stats.mean_accepted_length > 1.3
    if kind == "medusa":
        typical = t.decoder.generate(PROMPTS[0], max_new_tokens=N_NEW, temperature=1.0, top_k=1, seed=0,
                                     acceptance="typical")
        assert typical.token_ids == t.refs[0]


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_sampling_is_reproducible(trained, kind):
    t = trained(kind)
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=123)
    a = t.decoder.generate(PROMPTS[:3], **kw)
    b = t.decoder.generate(PROMPTS[:3], **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(len(r.token_ids) == 24 or r.token_ids[-1] == EOS for r in a)


# --------------------------------------------------------------------------------------------
# The interface: stream, stats, max_new_tokens, EOS, stop strings, text


@pytest.mark.parametrize("kind", KINDS)
def test_stream_yields_what_generate_returns(trained, kind):
    t = trained(kind)
    for mode in ("speculative", "autoregressive"):
        tokens = [[] for _ in PROMPTS[:5]]
        events = list(t.decoder.stream(PROMPTS[:5], max_new_tokens=N_NEW, mode=mode))
        for e in events:
            assert e.token_ids, "empty events are not yielded"
            tokens[e.index] += e.token_ids
        assert tokens == t.refs[:5]
        for i, ref in enumerate(t.refs[:5]):  # the streamed text adds up to the whole text
            assert "".join(e.text for e in events if e.index == i) == t.decoder.tokenizer.decode(ref)
        single = [e.token_ids for e in t.decoder.stream(PROMPTS[3], max_new_tokens=N_NEW, mode=mode)]
        assert [x for step in single for x in step] == t.refs[3]
        if mode == "speculative":
            assert max(len(x) for x in single) > 1  # several tokens per accepted step
    with pytest.raises(TypeError, match="unknown argument"):
        next(t.decoder.stream(PROMPTS[0], max_tokens=3))


@pytest.mark.parametrize("kind", KINDS)
def test_stats_are_sane(trained, kind):
    t = trained(kind)
    p = PROMPTS[6]
    n = len(t.refs[6])
    for mode in ("speculative", "autoregressive"):
        r = t.decoder.generate(p, max_new_tokens=N_NEW, mode=mode)
        s = r.stats
        assert s.prompt_tokens == len(p) and s.new_tokens == len(r.token_ids) == n
        assert s.steps >= 1 and len(s.accepted) == s.steps  # one entry per (step, live sequence)
        # the first token comes from the prefill; every step emits len(accepted) >= 1 more (the last
        # step's may be cut by max_new_tokens)
        assert all(a >= 1 for a in s.accepted)
        assert sum(s.accepted[:-1]) < n - 1 <= sum(s.accepted)
        j = s.to_json()
        assert sum(j["accepted_histogram"]) == s.steps
        assert j["accepted_histogram"][0] == 0
        assert j["mean_accepted_length"] == pytest.approx(np.mean(s.accepted))
        assert min(s.time_prefill, s.time_verify, s.time_host) >= 0 and s.time_prefill > 0 and s.time_verify > 0
        assert s.time_prefill + s.time_draft + s.time_verify <= s.time_total + 1e-9
        assert s.time_host == pytest.approx(s.time_total - s.time_prefill - s.time_draft - s.time_verify, abs=1e-9)
        assert s.tokens_per_s > 0
        json.dumps(j)  # plain JSON
        if mode == "autoregressive":
            assert s.time_draft == 0 and set(s.accepted) == {1} and s.steps == n - 1
        else:
            assert s.time_draft > 0 and s.mean_accepted_length > 1
            depth = {"medusa": 3, "eagle": 4, "eagle3": 4}[kind]  # deepest node: heads; EAGLE depth + 1 (2/3/6)
            assert max(s.accepted) <= depth + 1
    batch = t.decoder.generate(PROMPTS[:3], max_new_tokens=5)
    s = batch[0].stats
    assert s.prompt_tokens == sum(map(len, PROMPTS[:3])) and s.new_tokens == 15


@pytest.mark.parametrize("kind", KINDS)
def test_max_new_tokens_is_exact(trained, kind):
    t = trained(kind)
    i = next(i for i, r in enumerate(t.refs) if EOS not in r)
    for n in (1, 2, 3, 4, 7, 13):
        for mode in ("speculative", "autoregressive"):
            r = t.decoder.generate(PROMPTS[i], max_new_tokens=n, mode=mode)
            assert r.token_ids == t.refs[i][:n] and r.finish_reason == "length"
            assert r.stats.new_tokens == n
    batch = t.decoder.generate(PROMPTS, max_new_tokens=6)
    for r, ref in zip(batch, t.refs):
        assert r.token_ids == ref[:6]


@pytest.mark.parametrize("kind", KINDS)
def test_eos_stops(trained, kind, monkeypatch):
    """Make a token that greedy emits mid-way the EOS: the output ends with it, in every mode."""
    t = trained(kind)
    i = 7
    ref = t.refs[i]
    k = 9
    stop_token = ref[k]
    first = ref.index(stop_token)  # it may appear before k too
    monkeypatch.setattr(t.decoder, "eos", {stop_token})
    for mode in ("speculative", "autoregressive"):
        r = t.decoder.generate(PROMPTS[i], max_new_tokens=N_NEW, mode=mode)
        assert r.token_ids == ref[: first + 1] and r.finish_reason == "eos"
    # in a batch only that sequence stops; the others run on
    batch = t.decoder.generate(PROMPTS, max_new_tokens=N_NEW)
    for r, full in zip(batch, t.refs):
        want = full[: full.index(stop_token) + 1] if stop_token in full else full
        assert r.token_ids == want
        assert r.finish_reason == ("eos" if stop_token in full else "length")


def _ascii_pair(decoder, refs):
    """(prompt index, token position) of two consecutive greedy tokens that decode to plain ASCII."""
    for i, ref in enumerate(refs):
        for k in range(3, len(ref) - 1):
            text = decoder.tokenizer.decode(ref[k : k + 2])
            if len(text) == 2 and text.isascii() and text.isprintable():
                return i, k, text
    raise AssertionError("no ASCII pair in the references: change PROMPTS")


@pytest.mark.parametrize("kind", KINDS)
def test_stop_strings(trained, kind):
    t = trained(kind)
    i, _, stop = _ascii_pair(t.decoder, t.refs)
    full = t.decoder.tokenizer.decode(t.refs[i])
    want = full[: full.index(stop)]
    for mode in ("speculative", "autoregressive"):
        r = t.decoder.generate(PROMPTS[i], max_new_tokens=N_NEW, mode=mode, stop=[stop, "never-in-text"])
        assert r.finish_reason == "stop"
        assert r.text == want and stop not in r.text
        n = len(r.token_ids)
        assert r.token_ids == t.refs[i][:n]  # tokens up to the one that completes the stop string,
        assert stop in t.decoder.tokenizer.decode(r.token_ids)  # in every mode (a speculative step
        assert stop not in t.decoder.tokenizer.decode(r.token_ids[:-1])  # may accept tokens beyond it)
        assert r.stats.new_tokens == n
        streamed = "".join(e.text for e in t.decoder.stream(PROMPTS[i], max_new_tokens=N_NEW, mode=mode,
                                                            stop=stop))
        assert streamed == want
    r = t.decoder.generate(PROMPTS[i], max_new_tokens=N_NEW, stop="never-in-text")
    assert r.finish_reason != "stop" and r.token_ids == t.refs[i]


@pytest.mark.parametrize("kind", KINDS)
def test_text_prompts(trained, kind):
    t = trained(kind)
    text = "def main(x):"
    ids = t.decoder.encode(text)
    assert ids and t.decoder.tokenizer.decode(ids) == text
    r = t.decoder.generate(text, max_new_tokens=12)
    assert r.token_ids == t.decoder.generate(ids, max_new_tokens=12, mode="autoregressive").token_ids
    assert r.text == t.decoder.tokenizer.decode(r.token_ids)
    batch = t.decoder.generate([text, "ab"], max_new_tokens=5)
    assert batch[0].token_ids == r.token_ids[:5]
    assert batch[1].token_ids == t.decoder.generate(t.decoder.encode("ab"), max_new_tokens=5).token_ids


def test_speculative_is_faster_in_steps(trained):
    """Fewer base forwards than tokens: the point of speculative decoding (timing-free)."""
    t = trained("eagle")
    r = t.decoder.generate(PROMPTS[0], max_new_tokens=N_NEW)
    ar = t.decoder.generate(PROMPTS[0], max_new_tokens=N_NEW, mode="autoregressive")
    assert r.stats.steps < ar.stats.steps


@pytest.mark.parametrize("kind", KINDS)
def test_host_overhead_is_reported(trained, kind):
    """Measure (do not assert) the host share of a 64-token greedy run: tree building, acceptance, K/V moves."""
    t = trained(kind)
    t.decoder.generate(PROMPTS[4], max_new_tokens=8)  # warm up
    fractions = []
    for _ in range(3):
        s = t.decoder.generate(PROMPTS[4], max_new_tokens=64).stats
        fractions.append(s.time_host / s.time_total)
    s_ar = t.decoder.generate(PROMPTS[4], max_new_tokens=64, mode="autoregressive").stats
    print(f"\n{kind}: host share of a 64-token greedy run: speculative {np.median(fractions):.1%} "
          f"(tau {s.mean_accepted_length:.2f}, draft {s.time_draft * 1e3:.1f} ms, verify {s.time_verify * 1e3:.1f} ms, "
          f"host {s.time_host * 1e3:.1f} ms, total {s.time_total * 1e3:.1f} ms); autoregressive "
          f"{s_ar.time_host / s_ar.time_total:.1%}")
    assert 0 <= s.time_host <= s.time_total


# --------------------------------------------------------------------------------------------
# Drafting: every tree the runtime builds equals the PyTorch reference's (tests/draft_reference.py).
# Greedy equality cannot see a wrong draft (a stale drafter cache, an off-by-one position, the wrong
# hidden state): each of those only lowers acceptance. These tests see them.

REFERENCE_CASES = [("medusa", "default", "-", b) for b in (1, 3)] + [("medusa", "deep_wide", "-", 1)] + [
    (kind, name, draft, b) for kind in ("eagle", "eagle3") for name in ("default", "4-4-12")
    for draft in ("stepwise", "one_call") for b in ((1, 3) if name == "default" else (3,))]


@pytest.mark.parametrize(("kind", "name", "draft", "batch"), REFERENCE_CASES)
def test_drafts_equal_the_pytorch_reference(trained, kind, name, draft, batch):
    from draft_reference import captured_steps, check_drafts, torch_model

    t = trained(kind)
    model = torch_model(t.out_dir.parent / "model")
    tree = _tree(kind, name)
    prompts = [PROMPTS[i] for i in ((2, 5, 9) if batch > 1 else (7,))]
    decoder = t.decoder if kind == "medusa" else graphs.load(t.out_dir, provider="cpu", threads=1, eagle_draft=draft,
                                                                      adaptive=False)
    with captured_steps(decoder) as steps:
        results = decoder.generate(prompts, max_new_tokens=12, tree=tree)
    if kind != "medusa":  # one drafter call per step, or 1 + depth
        calls = 1 if draft == "one_call" else 1 + decoder.eagle_tree(tree)["depth"]
        assert results[0].stats.draft_calls == calls * results[0].stats.steps
    cfg = None if kind == "medusa" else t.decoder.eagle_tree(tree)
    checked = check_drafts(model, prompts, results, steps, eagle_cfg=cfg)
    assert checked >= 3 * batch
    assert max(results[0].stats.accepted) > 2  # trees were accepted: later steps had multi-token context


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_adaptive_greedy_is_exact(trained, kind, autoregressive_tokens):
    """Whatever the adaptive policy switches to (cut trees, plain steps without the drafter, probes),
    greedy output is the base's; forced into plain steps the drafter's waiting rows catch up later."""
    from graphs.adaptive import AdaptiveConfig

    t = trained(kind)
    decoder = graphs.load(t.out_dir, provider="cpu", threads=1, adaptive=True)
    results = decoder.generate(PROMPTS[:4], max_new_tokens=N_NEW)
    assert [r.token_ids for r in results] == autoregressive_tokens[:4]
    # a policy that must alternate: speculation costs 10x a plain step, probes every 2 plain steps
    decoder.adaptive_config = AdaptiveConfig(probe_every=2, max_probe_every=2, margin=10.0)
    with decoder.watch_verify() as records:
        results = decoder.generate(PROMPTS[4:7], max_new_tokens=N_NEW)
    assert [r.token_ids for r in results] == autoregressive_tokens[4:7]
    widths = [rec.tree.size for rec in records]
    assert 1 in widths and max(widths) > 1  # both kinds of step happened
