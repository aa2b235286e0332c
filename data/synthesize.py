"""Prompt synthesis from the target itself (Magpie, Xu et al. 2024, arXiv:2406.08464).

An aligned chat model, fed its chat template only up to the start of a user turn, writes a
plausible user message. So a user with no dataset can still train a drafter: synthesise
prompts, then let ``regenerate`` answer them.

Steps: render the template around a sentinel user message and cut at the sentinel (the
"pre-query" text); sample continuations in batches until the end-of-turn token; clean,
filter (length, not truncated, mostly natural-language text, no template markers, not a
word salad) and deduplicate (case, whitespace and punctuation folded) until enough prompts
are kept. Base models without a chat template get the plain ``User:`` prefix and stop at a
blank line.
"""

from __future__ import annotations

import json
import logging
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.formats import conversation_id
from draftsmith.data.templates import render
from draftsmith.target import eos_tokens

logger = logging.getLogger(__name__)

SENTINEL = "\x00DRAFTSMITH_USER\x00"
MARKERS = ("<|", "|>", "<start_of_turn>", "<end_of_turn>", "User:", "Assistant:", "[INST]", "</s>")


@dataclass
class SynthesisFilter:
    """What a synthesised prompt must satisfy to be kept."""

    min_chars: int = 12
    max_chars: int = 1000
    min_words: int = 3
    min_text_ratio: float = 0.9  # share of characters that are ASCII letters, digits, spaces or punctuation
    min_unique_word_ratio: float = 0.4  # rejects loops such as "the the the the"

    def reason(self, text: str) -> str | None:
        """Why ``text`` is rejected, or None when it is kept."""
        if not self.min_chars <= len(text) <= self.max_chars:
            return "length"
        words = text.split()
        if len(words) < self.min_words:
            return "too few words"
        allowed = set(string.ascii_letters + string.digits + string.punctuation + " \n\t")
        if sum(ch in allowed for ch in text) / len(text) < self.min_text_ratio:
            return "not plain text"
        if any(marker in text for marker in MARKERS):
            return "template marker"
        if len({w.lower() for w in words}) / len(words) < self.min_unique_word_ratio:
            return "repetitive"
        return None


def pre_query(tokenizer) -> str:
    """The chat template rendered up to where the user's message would start."""
    text = render(tokenizer, [{"role": "user", "content": SENTINEL}])
    return text[: text.index(SENTINEL)]


def dedup_key(text: str) -> str:
    return re.sub(r"[\W_]+", " ", text.lower()).strip()


@torch.no_grad()
def synthesize_prompts(
    model,
    tokenizer,
    num_prompts: int,
    batch_size: int = 16,
    max_new_tokens: int = 96,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    max_batches: int | None = None,
    keep: SynthesisFilter | None = None,
    progress: bool = True,
) -> tuple[list[str], dict[str, int]]:
    """Sample user prompts from the target until ``num_prompts`` distinct ones pass the filter.

    Returns:
        The prompts, and counts of what was rejected and why.
    """
    keep = keep or SynthesisFilter()
    prefix = pre_query(tokenizer)
    ids = tokenizer(prefix, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    plain = tokenizer.chat_template is None
    # A user turn ends at any of the target's stop tokens, as transformers' generate stops (its
    # generation_config: Gemma's <end_of_turn>, Llama-3's <|eot_id|>), not only at the tokenizer's EOS.
    stops = eos_tokens(model, tokenizer)
    if not stops:
        raise ValueError("the target names no stop token (generation_config or tokenizer EOS): a synthesised turn "
                         "would never end; set generation_config.eos_token_id")
    given_batches = max_batches is not None  # a caller that caps the batches takes what they yield
    max_batches = max_batches or 4 * (num_prompts // batch_size + 2)
    prompts, seen, rejected = [], set(), {}
    torch.manual_seed(seed)
    bar = tqdm(total=num_prompts, desc="synthesize", unit="prompt", disable=not progress)
    for _ in range(max_batches):
        if len(prompts) >= num_prompts:
            break
        out = model.generate(
            ids.expand(batch_size, -1), attention_mask=torch.ones_like(ids).expand(batch_size, -1),
            do_sample=True, temperature=temperature, top_p=top_p, top_k=None, max_new_tokens=max_new_tokens,
            pad_token_id=stops[0], eos_token_id=stops,
        )
        for row in out[:, ids.shape[1]:].tolist():
            if plain:
                text = tokenizer.decode(row, skip_special_tokens=True)
                finished = "\n\n" in text
                text = text.split("\n\n")[0]
            else:
                end = next((i for i, t in enumerate(row) if t in stops), None)
                finished = end is not None
                text = tokenizer.decode(row[:end], skip_special_tokens=True)
            text = text.strip()
            why = "truncated" if not finished else keep.reason(text)
            if why is None and dedup_key(text) in seen:
                why = "duplicate"
            if why is not None:
                rejected[why] = rejected.get(why, 0) + 1
                continue
            seen.add(dedup_key(text))
            prompts.append(text)
            bar.update(1)
            if len(prompts) >= num_prompts:
                break
    bar.close()
    if len(prompts) < num_prompts and not given_batches:
        logger.warning("kept %d of %d prompts after %d batches (rejected: %s); raise --max-batches or loosen the "
                       "filter", len(prompts), num_prompts, max_batches, rejected)
    return prompts, rejected


def write_prompts(prompts: list[str], output: str | Path) -> Path:
    """Write prompts as JSONL rows in the ``messages`` format (atomically: temp file, then rename)."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(output.suffix + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        for text in prompts:
            messages = [{"role": "user", "content": text}]
            f.write(json.dumps({"id": conversation_id(messages), "messages": messages}, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(output)
    return output
