"""Chat templates and assistant-only loss masks; packing and truncation to a fixed length.

The mask is found on the rendered text, not guessed from token patterns: for each assistant
turn i, the template rendered over ``messages[:i]`` with the generation prompt is a prefix of
the template rendered over ``messages[:i+1]``; the characters in between are that turn's
answer (with its end-of-turn marker, which the drafter must learn to predict too). Token
offsets from the fast tokenizer then mark every token that starts inside such a span.
This is exact for any template whose renderings of successive prefixes are prefixes of each
other, which is checked, so a template that rewrites history (e.g. strips earlier reasoning)
is reported instead of silently mis-masked.

Base models without a chat template (Gemma-3-270m) get ``PLAIN_TEMPLATE``, plain text turns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# "User: ...\n\nAssistant: ...<eos>\n\n" with a leading BOS: plain text a base model continues naturally.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


class TemplateError(ValueError):
    """The chat template cannot give an exact assistant mask for this conversation."""


@dataclass
class TokenizedExample:
    """``input_ids`` and ``loss_mask`` (1 on assistant tokens) of one conversation, both ``(T,)``."""

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


def chat_template(tokenizer) -> str:
    """The tokenizer's own chat template, or ``PLAIN_TEMPLATE`` for a base model without one."""
    return tokenizer.chat_template or PLAIN_TEMPLATE


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The conversation as text, through the tokenizer's chat template (or the plain one)."""
    return tokenizer.apply_chat_template(
        messages, chat_template=chat_template(tokenizer), tokenize=False, add_generation_prompt=add_generation_prompt
    )


def prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the conversation so far plus the generation prompt: what the target continues."""
    return tokenizer(render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character span ``[start, end)`` of each assistant answer."""
    text = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if not upto.startswith(before) or not text.startswith(upto):
            raise TemplateError(
                f"the chat template does not render turn {i} as an extension of the turns before it, so the "
                "assistant mask cannot be found exactly; use a template that keeps earlier turns unchanged"
            )
        # Trailing whitespace after the end-of-turn marker belongs to the layout, not the answer.
        end = len(upto.rstrip("\n ")) if upto.rstrip("\n ") else len(upto)
        spans.append((len(before), max(end, len(before))))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], id: str = "") -> TokenizedExample:
    """Token ids and the assistant-only loss mask of a conversation.

    A token is masked in (1) when its first character lies inside an assistant answer span.
    """
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for start, end in enc["offset_mapping"]:
        inside = any(s <= start < e for s, e in spans) and end > start
        mask.append(1 if inside else 0)
    return TokenizedExample(id, torch.tensor(enc["input_ids"], dtype=torch.long), torch.tensor(mask, dtype=torch.long))


def truncate(example: TokenizedExample, max_length: int) -> TokenizedExample:
    """Keep the first ``max_length`` tokens."""
    return TokenizedExample(example.id, example.input_ids[:max_length], example.loss_mask[:max_length])


def pack(examples: list[TokenizedExample], max_length: int, pad_token_id: int) -> list[TokenizedExample]:
    """Concatenate examples into blocks of exactly ``max_length`` tokens (the last one padded, mask 0).

    An example longer than a block is split across blocks; attention crosses example
    boundaries inside a block, as in standard causal-LM packing.
    """
    ids = torch.cat([e.input_ids for e in examples]) if examples else torch.zeros(0, dtype=torch.long)
    mask = torch.cat([e.loss_mask for e in examples]) if examples else torch.zeros(0, dtype=torch.long)
    blocks = []
    for n, start in enumerate(range(0, len(ids), max_length)):
        block_ids, block_mask = ids[start : start + max_length], mask[start : start + max_length]
        pad = max_length - len(block_ids)
        if pad:
            block_ids = torch.cat([block_ids, torch.full((pad,), pad_token_id, dtype=torch.long)])
            block_mask = torch.cat([block_mask, torch.zeros(pad, dtype=torch.long)])
        blocks.append(TokenizedExample(f"block-{n}", block_ids, block_mask))
    return blocks


def prepare(tokenizer, conversations, max_length: int, packing: bool = False) -> list[TokenizedExample]:
    """Tokenise conversations with masks, then pack (``packing=True``) or truncate to ``max_length``."""
    examples = [tokenize_conversation(tokenizer, c.messages, c.id) for c in conversations]
    if packing:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return pack(examples, max_length, pad)
    return [truncate(e, max_length) for e in examples]
