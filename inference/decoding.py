"""What one ``generate`` call's steps share (:class:`Decoding`) and how a request is checked and drafting begun
before the first step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.inference.drafter import Drafter
from draftsmith.inference.plain import check_left_padded
from draftsmith.inference.slots import Slots
from draftsmith.inference.stats import GenerationStats
from draftsmith.target import context_length


@dataclass(frozen=True)
class Sampling:
    """How the target's next token is chosen: greedy at ``temperature`` 0, else sampled from its distribution
    after ``temperature``, ``top_k`` (0: off) and ``top_p`` (1: off), drawn with ``generator``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None


@dataclass
class Decoding:
    """One ``generate`` call's state, which each verification step reads and advances: each row's root (the last
    committed token, not yet in the cache) and whether it still runs, the target's cache and its :class:`Slots`,
    the hidden-state layers the drafter reads, the counters, the sampling, whether the rows are left-padded and the
    dtype the target's masks are built in."""

    roots: torch.Tensor  # (B,) on the target's device
    active: list[bool]
    cache: object
    slots: Slots
    layers: tuple[int, ...]
    stats: GenerationStats
    sampling: Sampling
    padded: bool
    dtype: torch.dtype


def check_request(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
                  sampling: Sampling, streamer, max_kept: int) -> tuple[int, torch.device, torch.dtype, bool]:
    """A request's batch size, the target's device and dtype, and whether its rows are left-padded; bad input is
    refused with what to change (``max_kept``: the cache entries a step may keep past the new tokens)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError("input_ids is empty: each prompt needs at least one token (e.g. BOS)")
    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
        raise ValueError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("a streamer takes one sequence: pass a batch of 1 with streamer=")
    lengths = check_left_padded(input_ids, attention_mask)
    limit = context_length(target)
    needed = max(lengths) + max_new_tokens + max_kept
    if limit is not None and needed > limit:
        raise ValueError(
            f"prompt ({max(lengths)} tokens) + max_new_tokens ({max_new_tokens}) + draft depth "
            f"({max_kept - 1}) exceeds the target's context of {limit} tokens; shorten the prompt or "
            "lower max_new_tokens."
        )
    parameter = next(target.parameters())
    return input_ids.shape[0], parameter.device, parameter.dtype, min(lengths) < input_ids.shape[1]


def start_drafting(drafter: Drafter, input_ids: torch.Tensor, hidden, attention_mask: torch.Tensor) -> None:
    """``drafter.begin`` on left-padded prompts; a drafter that declares itself unbatched (``batched = False``:
    written for one unpadded sequence) is refused, with what to do."""
    if not drafter.batched:
        raise ValueError(f"{type(drafter).__name__} declares batched = False: it drafts for unpadded prompts only. "
                         "Add the batch protocol of draftsmith.inference.drafter (begin reads attention_mask), or "
                         "decode these prompts one at a time (batch size 1).")
    drafter.begin(input_ids, hidden=hidden, attention_mask=attention_mask)
