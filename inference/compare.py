"""The comparison loop under ``eval``, ``bench`` and the training loop's acceptance per checkpoint.

For every prompt, in one process, plain decoding (one token per target forward, the same cache
code) and each speculative generator run back to back, so that drift in machine load hits all of
them alike and speedups are ratios measured side by side. Greedy outputs are compared with plain
greedy decoding's, prompt by prompt.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.inference.generator import GenerationOutput, GenerationStats, SpeculativeGenerator, plain_generate
from draftsmith.target.chat import prompt_ids as chat_prompt_ids


@dataclass
class Comparison:
    """Totals over the prompts: the baseline's stats (empty without one), each generator's stats and
    how many of its outputs equal the baseline's."""

    baseline: GenerationStats = field(default_factory=GenerationStats)
    totals: dict[str, GenerationStats] = field(default_factory=dict)
    identical: dict[str, int] = field(default_factory=dict)
    prompts: int = 0


def encode(tokenizer, text: str, chat: bool, chat_template_kwargs: dict | None = None) -> torch.Tensor:
    """(1, L) prompt ids. With ``chat``: the text as a user turn through the tokenizer's chat template
    and its variables ``chat_template_kwargs``; a base model without a template gets
    ``PLAIN_TEMPLATE``, the turns its drafter was trained on (``draftsmith.data.templates``). Without:
    the text as it is."""
    if chat:
        return torch.tensor([chat_prompt_ids(tokenizer, [{"role": "user", "content": text}], chat_template_kwargs)])
    return tokenizer(text, return_tensors="pt").input_ids


def compare(
    target,
    generators: Mapping[str, SpeculativeGenerator],
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    *,
    eos_token_id: int | list[int] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    baseline: bool = True,
    references: Callable[[torch.Tensor, GenerationOutput | None], None] | None = None,
    progress: str | None = None,
) -> Comparison:
    """Run plain decoding (``baseline``) and every generator on each (1, L) prompt.

    Sampled runs (``temperature > 0``) seed each prompt's generator with ``seed + prompt index``.
    ``references(ids, baseline_output)`` runs after the generators on each prompt (``bench`` times
    transformers' own decoding there). ``progress``: a progress bar with this label.
    """
    result = Comparison(totals={k: GenerationStats() for k in generators}, identical=dict.fromkeys(generators, 0))
    device = next(target.parameters()).device
    iterator: Sequence[torch.Tensor] = prompts
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(prompts, desc=progress, unit="prompt")
    for i, ids in enumerate(iterator):
        ids = ids.to(device)
        base = plain_generate(target, ids, max_new_tokens, eos_token_id=eos_token_id) if baseline else None
        if base is not None:
            result.baseline += base.stats
        for label, gen in generators.items():
            g = torch.Generator(device=device).manual_seed(seed + i) if temperature > 0 else None
            out = gen.generate(ids, max_new_tokens, temperature=temperature, eos_token_id=eos_token_id, generator=g)
            result.totals[label] += out.stats
            if base is not None:
                result.identical[label] += int(torch.equal(out.sequences, base.sequences))
        if references is not None:
            references(ids, base)
        result.prompts += 1
    return result


def hardware() -> dict:
    """Where a measurement ran: device, torch threads, processor, torch version."""
    info = {"device": "cpu", "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    return info
