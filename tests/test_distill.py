"""Self-distillation: the base's own greedy continuations as training examples, fed to a HF Trainer."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from exporter.speculative import DraftCollator, DraftDataset, convert, self_distill

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [3]]  # different lengths: the batch is left-padded


def _greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0].tolist()


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return tok


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_examples_are_the_base_greedy_continuations(arch):
    model = tiny_model(arch)
    examples = self_distill(model, None, PROMPTS, max_new_tokens=8, batch_size=2, eos_token_id=255)
    assert len(examples) == len(PROMPTS)
    for prompt, ex in zip(PROMPTS, examples):
        full = _greedy(model, prompt, 8)
        end = full.index(255, len(prompt)) + 1 if 255 in full[len(prompt) :] else len(full)
        assert ex["input_ids"] == full[:end]
        assert ex["labels"] == [-100] * len(prompt) + full[len(prompt) : end]
        assert ex["attention_mask"] == [1] * end
    # batching (left padding) changes nothing
    assert self_distill(model, None, PROMPTS, 8, batch_size=1, eos_token_id=255) == examples


def test_converted_model_distills_like_its_base():
    ref = self_distill(tiny_model("mistral"), None, PROMPTS, 6)
    for mode in ("medusa", "eagle"):
        model = convert(tiny_model("mistral"), [(mode, {})])
        model.train()
        assert self_distill(model, None, PROMPTS, 6) == ref
        assert model.training  # mode restored


def test_continuation_stops_after_eos():
    model = tiny_model("llama")
    new = _greedy(model, [4, 5, 6], 10)[3:]
    j = next(j for j in range(1, len(new)) if new[j] not in new[:j])  # a token first generated at step j
    (ex,) = self_distill(model, None, [[4, 5, 6]], 10, eos_token_id=new[j])
    assert ex["input_ids"] == [4, 5, 6, *new[: j + 1]]


def test_string_prompts_with_tokenizers_and_transformers_tokenizers():
    from transformers import PreTrainedTokenizerFast

    tok = _char_tokenizer()
    model = tiny_model("qwen2", vocab_size=128)
    a = self_distill(model, tok, ["def f(x):", "import os"], 5)
    assert a[0]["input_ids"][:9] == tok.encode("def f(x):").ids and a[0]["labels"][:9] == [-100] * 9
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<unk>")
    assert self_distill(model, hf, ["def f(x):", "import os"], 5) == a
    assert self_distill(model, None, [tok.encode("def f(x):").ids, torch.tensor(tok.encode("import os").ids)], 5) == a


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="string prompts need a tokenizer"):
        self_distill(model, None, ["hello"], 4)
    with pytest.raises(TypeError, match="prompts must be a list"):
        self_distill(model, None, "hello", 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        self_distill(model, None, [[1]], 0)
    with pytest.raises(ValueError, match="empty prompt"):
        self_distill(model, None, [[]], 4)
    with pytest.raises(ValueError, match="has no input_ids"):
        DraftDataset([{"labels": [1]}])


def test_collator_right_pads_and_masks_labels():
    batch = DraftCollator(pad_token_id=0, pad_to_multiple_of=4)(
        [
            {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
            {"input_ids": torch.tensor([8, 9])},  # no labels: train on every token
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100], [8, 9, -100, -100]]
    assert DraftCollator(max_length=2)([{"input_ids": [1, 2, 3]}])["input_ids"].tolist() == [[1, 2]]


def test_trainer_trains_on_distilled_examples(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = convert(tiny_model("llama"), [("medusa", {"medusa_num_heads": 2})])
    examples = self_distill(model, None, [[i, i + 1, i + 2] for i in range(3, 11)], 12, batch_size=4)
    collate = DraftCollator(pad_token_id=0)
    fixed = collate(examples)
    model.eval()
    with torch.no_grad():
        before = model(**fixed).loss.item()
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=8, learning_rate=1e-2,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
    )
    Trainer(model=model, args=args, train_dataset=DraftDataset(examples), data_collator=collate).train()
    model.eval()
    with torch.no_grad():
        assert model(**fixed).loss.item() < 0.8 * before
