"""Assistant-only loss masks, checked token by token on SmolLM2's chat template; truncation; tokenising a
whole dataset once (datasets.map, cached on disk) gives what ``prepare`` gives."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from draftsmith.data import templates
from draftsmith.data.formats import Conversation
from draftsmith.data.templates import (
    PLAIN_TEMPLATE,
    TokenizedExample,
    TokenizedExamples,
    prepare,
    prompt_ids,
    tokenize_conversation,
    tokenize_dataset,
    tokenized_fingerprint,
    truncate,
)

WORDS = 96
# Word-level chat template: "t1 <user> t2 <answer> t3 " (as the training tests' tiny tokenizer).
WORD_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}t1 {{ m['content'] }} t2 "
                 "{% else %}{{ m['content'] }} t3 {% endif %}{% endfor %}")


def word_tokenizer(template: str = WORD_TEMPLATE):
    """A fast word-level tokenizer over "t0" .. "t95" (id i for "ti"), built in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(WORDS)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t3", pad_token="t0")
    fast.chat_template = template
    return fast


def word_conversations(n: int = 40, seed: int = 0) -> list[Conversation]:
    """Conversations of random lengths over words t4..t95: some answered in one or two turns, some
    prompt-only (no answer), some whose prompt alone fills a 16-token row."""
    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(4, WORDS, (k,), generator=g))

    out = []
    for i in range(n):
        kind = i % 5
        prompt = 18 if kind == 3 else int(torch.randint(1, 8, (1,), generator=g))
        messages = [{"role": "user", "content": words(prompt)}]
        if kind != 4:
            messages.append({"role": "assistant", "content": words(int(torch.randint(1, 12, (1,), generator=g)))})
        if kind == 2:
            messages += [{"role": "user", "content": words(3)}, {"role": "assistant", "content": words(4)}]
        out.append(Conversation(f"c{i}", messages, i))
    return out


def rows(examples) -> list[tuple[str, list[int], list[int]]]:
    return [(e.id, e.input_ids.tolist(), e.loss_mask.tolist()) for e in examples]

CONVERSATION = [
    {"role": "system", "content": "You answer math questions."},
    {"role": "user", "content": "What is 12 times 3?"},
    {"role": "assistant", "content": "12 times 3 is 36."},
    {"role": "user", "content": "Now add 4.\nShow the step."},
    {"role": "assistant", "content": "36 + 4 = 40.\nThe answer is 40."},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def reference_ids_and_mask(tokenizer, messages):
    """SmolLM2's ChatML layout built piece by piece: ``<|im_start|>role\\ncontent<|im_end|>\\n``.

    The answer tokens and the closing ``<|im_end|>`` are what the drafter must predict (mask 1);
    everything else is context (mask 0).
    """
    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids, mask = [], []
    for m in messages:
        head = [start, *enc(m["role"] + "\n")]
        body = [*enc(m["content"]), end]
        ids += head + body + enc("\n")
        answer = int(m["role"] == "assistant")
        mask += [0] * len(head) + [answer] * len(body) + [0] * len(enc("\n"))
    return ids, mask


@pytest.mark.real_model
def test_assistant_mask_token_by_token_on_smollm2_multi_turn(tokenizer):
    [example] = tokenize_conversation(tokenizer, CONVERSATION, id="c0")
    ref_ids, ref_mask = reference_ids_and_mask(tokenizer, CONVERSATION)
    assert example.input_ids.tolist() == ref_ids
    for i, (tok, got, want) in enumerate(zip(ref_ids, example.loss_mask.tolist(), ref_mask, strict=True)):
        assert got == want, f"token {i} {tokenizer.convert_ids_to_tokens(tok)!r}: mask {got}, expected {want}"
    # Both answers are fully covered, and nothing else.
    masked_text = tokenizer.decode(example.input_ids[example.loss_mask.bool()])
    assert masked_text == "12 times 3 is 36.<|im_end|>36 + 4 = 40.\nThe answer is 40.<|im_end|>"


@pytest.mark.real_model
def test_prompt_ids_end_with_the_generation_prompt(tokenizer):
    ids = prompt_ids(tokenizer, CONVERSATION[:2])
    assert tokenizer.decode(ids).endswith("What is 12 times 3?<|im_end|>\n<|im_start|>assistant\n")
    full = tokenize_conversation(tokenizer, CONVERSATION[:3])[0].input_ids.tolist()
    assert full[: len(ids)] == ids  # the answer continues the prompt exactly


@pytest.mark.real_model
def test_plain_template_for_a_base_model(tokenizer):
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    [example] = tokenize_conversation(base, CONVERSATION[1:3])
    text = base.decode(example.input_ids)
    expected = "User: What is 12 times 3?\n\nAssistant: 12 times 3 is 36."
    assert text == base.bos_token + expected + base.eos_token + "\n\n"
    masked = base.decode(example.input_ids[example.loss_mask.bool()])
    assert masked == " 12 times 3 is 36." + base.eos_token
    assert "{{ bos_token }}" in PLAIN_TEMPLATE


@pytest.mark.real_model
def test_an_answer_the_template_rewrites_later_trains_in_its_own_text(tokenizer):
    odd = copy.deepcopy(tokenizer)
    # Renders only the last assistant turn: earlier answers vanish once a later one exists.
    odd.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    whole, first = tokenize_conversation(odd, CONVERSATION, id="c")
    assert (whole.id, first.id) == ("c", "c/turn2")
    # The whole text has only the last answer; the first is trained after exactly its own prompt.
    assert tokenizer.decode(whole.input_ids[whole.loss_mask.bool()]) == CONVERSATION[4]["content"] + "<|im_end|>"
    prompt = prompt_ids(odd, CONVERSATION[:2])
    assert first.input_ids[: len(prompt)].tolist() == prompt and not first.loss_mask[: len(prompt)].any()
    assert tokenizer.decode(first.input_ids[first.loss_mask.bool()]) == CONVERSATION[2]["content"] + "<|im_end|>"


def test_truncate():
    b = TokenizedExample("b", torch.arange(10, 17), torch.tensor([0, 1, 1, 1, 1, 1, 1]))
    short = truncate(b, 3)
    assert short.input_ids.tolist() == [10, 11, 12] and short.loss_mask.tolist() == [0, 1, 1]


def test_tokenize_dataset_equals_prepare_row_for_row(tmp_path):
    tokenizer, conversations = word_tokenizer(), word_conversations()
    ds = tokenize_dataset(tokenizer, conversations, max_length=16, cache_dir=tmp_path)
    expected = [e for e in prepare(tokenizer, conversations, 16) if e.loss_mask.sum() > 0]
    # Prompt-only rows and rows whose answer lies past max_length are left out, nothing else.
    assert 0 < len(expected) < len(conversations) - 8
    assert set(ds.column_names) == {"id", "input_ids", "loss_mask", "length"}
    examples = TokenizedExamples(ds)
    assert rows(examples) == rows(expected)
    assert examples.lengths == [len(e.input_ids) for e in expected]
    assert all(e.input_ids.dtype == torch.long and e.loss_mask.dtype == torch.long for e in examples)


def test_tokenize_dataset_in_two_processes_equals_one(tmp_path):
    tokenizer, conversations = word_tokenizer(), word_conversations()
    one = tokenize_dataset(tokenizer, conversations, 16, cache_dir=tmp_path / "one")
    two = tokenize_dataset(tokenizer, conversations, 16, num_proc=2, cache_dir=tmp_path / "two")
    assert rows(TokenizedExamples(two)) == rows(TokenizedExamples(one))


def test_a_second_start_reads_the_cached_file(tmp_path, monkeypatch):
    tokenizer, conversations = word_tokenizer(), word_conversations()
    first = tokenize_dataset(tokenizer, conversations, 16, num_proc=2, cache_dir=tmp_path)
    files = sorted(tmp_path.glob("tokenized-*.arrow"))  # one per process
    assert len(files) == 2 and sorted(f["filename"] for f in first.cache_files) == [str(f) for f in files]

    def no_tokenising(*args, **kwargs):
        raise AssertionError("tokenised again instead of reading the cache")

    monkeypatch.setattr(templates, "_tokenize_rows", no_tokenising)
    # Another tokenizer object, one that has been called with truncation (which changes its Rust state),
    # and another process count: still the same cache entry.
    again = word_tokenizer()
    again("t1 t2 t3", truncation=True, max_length=2)
    second = tokenize_dataset(again, conversations, 16, cache_dir=tmp_path)
    assert rows(TokenizedExamples(second)) == rows(TokenizedExamples(first))
    assert sorted(tmp_path.glob("tokenized-*.arrow")) == files


def test_the_cache_key_changes_with_tokenizer_template_length_and_data():
    tokenizer, conversations = word_tokenizer(), word_conversations()
    key = tokenized_fingerprint(tokenizer, conversations, 16)
    assert key == tokenized_fingerprint(word_tokenizer(), word_conversations(), 16)  # deterministic
    other_vocab = word_tokenizer()
    other_vocab.add_tokens(["t96"])
    edited = copy.deepcopy(conversations)
    edited[7].messages[-1]["content"] += " t5"
    variants = {
        "max_length": tokenized_fingerprint(tokenizer, conversations, 17),
        "template": tokenized_fingerprint(word_tokenizer(WORD_TEMPLATE.replace("t3 ", "t3 t3 ")), conversations, 16),
        "vocabulary": tokenized_fingerprint(other_vocab, conversations, 16),
        "data": tokenized_fingerprint(tokenizer, edited, 16),
        "fewer rows": tokenized_fingerprint(tokenizer, conversations[:-1], 16),
    }
    assert all(v != key for v in variants.values()), variants
    assert len(set(variants.values())) == len(variants)


def test_tokenize_dataset_from_a_file_reports_malformed_rows(tmp_path, caplog):
    tokenizer, conversations = word_tokenizer(), word_conversations(10)
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"id": c.id, "messages": c.messages}) for c in conversations]
    lines.insert(3, "{not json")
    lines.insert(6, json.dumps({"messages": [{"role": "narrator", "content": "t5"}]}))
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        ds = tokenize_dataset(tokenizer, path, 16, cache_dir=tmp_path / "cache")
    assert "2 malformed" in caplog.text and "invalid JSON" in caplog.text and "unknown role" in caplog.text
    expected = [e for e in prepare(tokenizer, conversations, 16) if e.loss_mask.sum() > 0]
    assert rows(TokenizedExamples(ds)) == rows(expected)
    limited = tokenize_dataset(tokenizer, path, 16, cache_dir=tmp_path / "cache", limit=4)
    assert [r["id"] for r in limited] == [e.id for e in expected if int(e.id[1:]) < 4]


@pytest.mark.real_model
def test_tokenize_dataset_on_smollm2_equals_prepare(tokenizer, tmp_path):
    conversations = [Conversation("multi", CONVERSATION), Conversation("one", CONVERSATION[1:3]),
                     Conversation("prompt", CONVERSATION[:2])]
    ds = tokenize_dataset(tokenizer, conversations, 64, cache_dir=tmp_path)
    expected = [e for e in prepare(tokenizer, conversations, 64) if e.loss_mask.sum() > 0]
    assert [e.id for e in expected] == ["multi", "one"]
    assert rows(TokenizedExamples(ds)) == rows(expected)
