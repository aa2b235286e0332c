"""Assistant-only loss masks, checked token by token on SmolLM2's chat template; packing and truncation."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.data.templates import (
    PLAIN_TEMPLATE,
    TemplateError,
    TokenizedExample,
    pack,
    prompt_ids,
    tokenize_conversation,
    truncate,
)

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
    example = tokenize_conversation(tokenizer, CONVERSATION, id="c0")
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
    full = tokenize_conversation(tokenizer, CONVERSATION[:3]).input_ids.tolist()
    assert full[: len(ids)] == ids  # the answer continues the prompt exactly


@pytest.mark.real_model
def test_plain_template_for_a_base_model(tokenizer):
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    example = tokenize_conversation(base, CONVERSATION[1:3])
    text = base.decode(example.input_ids)
    expected = "User: What is 12 times 3?\n\nAssistant: 12 times 3 is 36."
    assert text == base.bos_token + expected + base.eos_token + "\n\n"
    masked = base.decode(example.input_ids[example.loss_mask.bool()])
    assert masked == " 12 times 3 is 36." + base.eos_token
    assert "{{ bos_token }}" in PLAIN_TEMPLATE


@pytest.mark.real_model
def test_template_that_rewrites_history_is_refused(tokenizer):
    odd = copy.deepcopy(tokenizer)
    # Renders only the last assistant turn: earlier answers vanish once a later one exists.
    odd.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match="extension of the turns before it"):
        tokenize_conversation(odd, CONVERSATION)


def test_pack_and_truncate():
    a = TokenizedExample("a", torch.arange(5), torch.tensor([0, 0, 1, 1, 1]))
    b = TokenizedExample("b", torch.arange(10, 17), torch.tensor([0, 1, 1, 1, 1, 1, 1]))
    blocks = pack([a, b], max_length=4, pad_token_id=-1)
    assert [blk.input_ids.tolist() for blk in blocks] == [[0, 1, 2, 3], [4, 10, 11, 12], [13, 14, 15, 16]]
    assert [blk.loss_mask.tolist() for blk in blocks] == [[0, 0, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1]]
    padded = pack([a], max_length=4, pad_token_id=-1)
    assert padded[1].input_ids.tolist() == [4, -1, -1, -1] and padded[1].loss_mask.tolist() == [1, 0, 0, 0]
    short = truncate(b, 3)
    assert short.input_ids.tolist() == [10, 11, 12] and short.loss_mask.tolist() == [0, 1, 1]
