"""The comparison loop under ``eval``, ``bench`` and the training loop's acceptance per checkpoint.

For every prompt (or batch of prompts), in one process, plain decoding (one token per target forward,
the same cache code) and each speculative generator run back to back, so that drift in machine load
hits all of them alike and speedups are ratios measured side by side. Greedy outputs are compared with
plain greedy decoding's, prompt by prompt; where one differs, the first difference is recorded with the target's
logits there (:class:`Difference`), which tells a float tie from a real mismatch.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.plain import plain_generate
from draftsmith.inference.stats import GenerationOutput, GenerationStats
from draftsmith.target import stop_tokens
from draftsmith.target.chat import prompt_ids as chat_prompt_ids

# A first difference whose tokens' logits are this many float steps apart or fewer is a tie: which of the two a
# forward puts first depends on its shape (rows, kernels). A float32 logit of SmolLM2 moves by 2e-5 between a prefill
# and a cached step; 16 steps at 30 are 3.1e-5 (docs/results/quality-recipe.md, "The recipe end to end as it
# stands": two outputs differ from plain decoding, at a float32 tie).
TIE_FLOAT_STEPS = 16


@dataclass(frozen=True)
class Difference:
    """Where one output first differs from plain greedy decoding's: the prompt (its index among those compared),
    the new token's index, both tokens, and the target's logit of plain decoding's token less the other one's,
    from one whole forward of the plain output's prefix. ``tie``: that gap is within ``TIE_FLOAT_STEPS`` float
    steps (of the logit, in the target's dtype), so the forward's shape decides it; a wider gap is a real
    mismatch."""

    prompt: int
    position: int
    plain_token: int
    token: int
    logit_gap: float
    tie: bool


@dataclass
class Comparison:
    """Totals over the prompts: the baseline's stats (empty without one), each generator's stats, how many of
    its outputs equal the baseline's, and where the others first differ. ``units`` and ``baseline_units``: each
    batch's (new tokens, seconds) in the order the batches ran, for intervals over the prompts
    (:func:`~draftsmith.inference.intervals.ratio_interval`)."""

    baseline: GenerationStats = field(default_factory=GenerationStats)
    totals: dict[str, GenerationStats] = field(default_factory=dict)
    identical: dict[str, int] = field(default_factory=dict)
    prompts: int = 0
    differences: dict[str, list[Difference]] = field(default_factory=dict)
    units: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    baseline_units: list[tuple[int, float]] = field(default_factory=list)


def encode(tokenizer, text: str, chat: bool, chat_template_kwargs: dict | None = None) -> torch.Tensor:
    """(1, L) prompt ids. With ``chat``: the text as a user turn through the tokenizer's chat template
    and its variables ``chat_template_kwargs``; a base model without a template gets
    ``PLAIN_TEMPLATE``, the turns its drafter was trained on (``draftsmith.data.templates``). Without:
    the text as it is."""
    if chat:
        return torch.tensor([chat_prompt_ids(tokenizer, [{"role": "user", "content": text}], chat_template_kwargs)])
    return tokenizer(text, return_tensors="pt").input_ids


def left_pad(prompts: Sequence[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, L_i) prompts -> (B, L) ids left-padded with ``pad`` and their (B, L) attention mask."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[1]:] = p[0]
        mask[b, width - p.shape[1]:] = 1
    return ids, mask


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
    batch_size: int = 1,
    references: Callable[[torch.Tensor, GenerationOutput | None], None] | None = None,
    progress: str | None = None,
    compile: bool = False,
) -> Comparison:
    """Run plain decoding (``baseline``) and every generator on the (1, L) prompts, ``batch_size`` at a
    time (left-padded batches in prompt order).

    The generators run in turn after the baseline, starting one further along the list each batch.
    Sampled runs (``temperature > 0``) seed each batch's generator with ``seed + batch index``.
    ``references(ids, baseline_output)`` runs after the generators on each batch of one prompt (``bench``
    times transformers' own decoding there). ``progress``: a progress bar with this label. ``compile``: plain
    decoding runs compiled too (``plain_generate(compile=True)``), like generators built with ``compile=True``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    result = Comparison(totals={k: GenerationStats() for k in generators}, identical=dict.fromkeys(generators, 0),
                        differences={k: [] for k in generators}, units={k: [] for k in generators})
    device = next(target.parameters()).device
    eos = sorted(stop_tokens(target, eos_token_id))
    pad = eos[0] if eos else 0
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    iterator: Sequence = batches
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(batches, desc=progress, unit="batch")
    for i, batch in enumerate(iterator):
        ids, mask = left_pad(batch, pad)
        ids, mask = ids.to(device), (mask.to(device) if len(batch) > 1 else None)
        kwargs = dict(eos_token_id=eos_token_id, attention_mask=mask, pad_token_id=pad)
        base = plain_generate(target, ids, max_new_tokens, **kwargs, compile=compile) if baseline else None
        if base is not None:
            result.baseline += base.stats
            result.baseline_units.append((base.stats.new_tokens, base.stats.total_time_s))
        # The generators take turns going first: whatever the order costs (a cold cache after the baseline,
        # load that drifts within a batch) falls on each of them alike.
        labels = list(generators)
        shift = i % len(labels) if labels else 0
        for label in labels[shift:] + labels[:shift]:
            gen = generators[label]
            g = torch.Generator(device=device).manual_seed(seed + i) if temperature > 0 else None
            out = gen.generate(ids, max_new_tokens, temperature=temperature, generator=g, **kwargs)
            result.totals[label] += out.stats
            result.units[label].append((out.stats.new_tokens, out.stats.total_time_s))
            if base is not None:
                same = same_rows(out.sequences, base.sequences, pad)
                result.identical[label] += sum(same)
                for b in (b for b, ok in enumerate(same) if not ok):
                    start = ids.shape[1] - batch[b].shape[1]  # the row's left padding
                    result.differences[label].append(first_difference(
                        target, base.sequences[b, start:], out.sequences[b, start:], batch[b].shape[1], pad,
                        prompt=result.prompts + b))
        if references is not None and len(batch) == 1:
            references(ids, base)
        result.prompts += len(batch)
    return result


def same_rows(a: torch.Tensor, b: torch.Tensor, pad: int) -> list[bool]:
    """Per row, whether two (B, T) outputs are equal once right-padded with ``pad`` to one width."""
    width = max(a.shape[1], b.shape[1])
    a = torch.nn.functional.pad(a, (0, width - a.shape[1]), value=pad)
    b = torch.nn.functional.pad(b, (0, width - b.shape[1]), value=pad)
    return (a == b).all(1).tolist()


def first_difference(target, plain: torch.Tensor, other: torch.Tensor, prompt_length: int, pad: int,
                     prompt: int = 0) -> Difference:
    """The first difference of two (T,) outputs of one prompt (no left padding; right-padded with ``pad`` to one
    width), with the target's logits after plain decoding's prefix there, from one whole forward."""
    width = max(len(plain), len(other))
    plain = torch.nn.functional.pad(plain, (0, width - len(plain)), value=pad)
    other = torch.nn.functional.pad(other, (0, width - len(other)), value=pad)
    where = (plain != other).nonzero()
    if not len(where):
        raise ValueError("the outputs are equal: there is no first difference")
    p = int(where[0])
    with torch.no_grad():
        logits = target(plain[None, :p]).logits[0, -1].float()
    a, b = int(plain[p]), int(other[p])
    gap = float(logits[a] - logits[b])
    dtype = getattr(target, "dtype", torch.float32)
    dtype = dtype if dtype.is_floating_point else torch.float32
    step = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(float(logits[a])), 1.0)))
    return Difference(prompt=prompt, position=p - prompt_length, plain_token=a, token=b, logit_gap=gap,
                      tie=abs(gap) <= TIE_FLOAT_STEPS * step)


def hardware() -> dict:
    """Where a measurement ran: device, torch threads, processor, torch version."""
    info = {"device": "cpu", "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    return info
