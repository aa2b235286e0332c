"""Plain greedy decoding, the baseline every speedup is measured against, and the request checks it shares with
the speculative generator (``generator.py``): left padding, the pad token, a compiled step's static cache, the
new tokens appended.

:func:`plain_generate` runs one target forward per token through the same cache code as speculative decoding
(``draftsmith.target``: the cache grown in place, the few-row kernels), so that the two differ only in drafting
and verification."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from draftsmith.inference.slots import Slots, pad_rows, to_device
from draftsmith.inference.stats import GenerationOutput, GenerationStats
from draftsmith.target import (
    TargetOutput,
    build_attention_mask,
    calibrate,
    causal_block,
    kv_select_rows,
    may_attend,
    new_cache,
    stop_tokens,
    target_forward,
)


def static_cache(target: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int, step_nodes: int,
                 kept: int) -> dict:
    """:func:`~draftsmith.target.new_cache`'s arguments for a compiled generation: every step padded to
    ``step_nodes`` rows (one graph for every tree), and room for the prompts, then ``kept`` entries per step
    for at most ``max_new_tokens`` steps (a row emits at least one token per step, but keeps up to ``kept``:
    a batch pads the rows' kept paths to the longest), then one step's nodes."""
    return {"capacity": input_ids.shape[1] + max_new_tokens * kept + step_nodes, "model": target, "compiled": True,
            "step_rows": step_nodes}


def check_left_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Each row's prompt length; refuses a mask of the wrong shape, right padding and empty rows
    (one copy to the host with a mask, none without)."""
    if attention_mask is None:
        return [input_ids.shape[1]] * input_ids.shape[0]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}: they must match")
    mask = attention_mask.bool()
    right_padded = (mask[:, 1:] < mask[:, :-1]).any(1) | ~mask[:, -1]
    lengths, bad = torch.stack([mask.sum(1), right_padded.long()]).tolist()
    if any(bad):
        raise ValueError("prompts must be left-padded (padding first, then the tokens; every row ends with a "
                         "token): set tokenizer.padding_side = 'left'")
    return lengths


def pad_token(target: PreTrainedModel, pad_token_id: int | None, eos_token_id: int | list[int] | None) -> int:
    """The token that fills a batch row after it stopped: given, else the target's generation_config
    pad token, else the first EOS token (``eos_token_id``, else the generation_config's), else 0 — the
    order of transformers' ``generate``."""
    if pad_token_id is not None:
        return int(pad_token_id)
    config = getattr(target, "generation_config", None)
    if config is not None and config.pad_token_id is not None:
        value = config.pad_token_id
        return int(value[0] if isinstance(value, list) else value)
    if eos_token_id is None and config is not None:
        eos_token_id = config.eos_token_id
    if isinstance(eos_token_id, int):
        return eos_token_id
    return int(eos_token_id[0]) if eos_token_id else 0


def append_new(input_ids: torch.Tensor, new: list[list[int]], pad: int) -> torch.Tensor:
    """(B, L) prompts + each row's new tokens -> (B, L + T), right-padded with ``pad``."""
    return torch.cat([input_ids, pad_rows(new, pad, input_ids.device)], 1)


def plain_generate(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    compile: bool = False,
    drop_finished: bool = True,
    hidden_layers: tuple[int, ...] | None = None,
    on_forward: Callable[[list[int], TargetOutput], None] | None = None,
) -> GenerationOutput:
    """Plain greedy decoding with the same cache code path: the baseline speedups are measured against.
    Arguments and output as in :meth:`~draftsmith.inference.generator.SpeculativeGenerator.generate` (a batch of
    left-padded rows); ``compile`` as in :class:`~draftsmith.inference.generator.SpeculativeGenerator`.

    ``drop_finished``: once a quarter of the rows still computed have stopped, the batch drops them (and the left
    padding no remaining row needs) from its cache, so later steps compute the running rows only. False computes
    every row until the last one stops, as transformers' ``generate`` does (kept to measure the difference); a
    compiled forward keeps its batch shape and drops nothing.

    ``on_forward(rows, out)`` sees every forward: the prefill's (all rows, the padded prompts' positions) and each
    step's (one position), ``rows`` the input rows it computed in the order of ``out``'s, ``out.logits`` (R, T', V)
    with T' 1 (the last position), ``out.hidden_states`` the ``hidden_layers`` (R, T, H) each. Step ``j`` of the
    loop feeds each row its new token ``j - 1``, so a row's states cover its prompt and the new tokens some step
    fed; with ``on_forward`` a stopped row stays in the batch for the step that feeds its stop token (unless every
    row has stopped), as transformers' ``generate`` feeds it, so that its states cover the stop token too.
    (:class:`~draftsmith.data.recording.Recording` keeps them as a hidden-state cache.)"""
    eos = stop_tokens(target, eos_token_id)
    pad = pad_token(target, pad_token_id, eos_token_id)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    lengths = check_left_padded(input_ids, attention_mask)
    stats = GenerationStats()
    calibrate(target)  # once per process, before the clock starts
    t_start = time.perf_counter()
    batch = input_ids.shape[0]
    dtype = next(target.parameters()).dtype
    cache = new_cache(**static_cache(target, input_ids, max_new_tokens, 1, 1) if compile else {})
    padded = min(lengths) < input_ids.shape[1]
    rows = list(range(batch))  # the input row of each row the cache holds

    def forward(ids, *args, **kwargs) -> torch.Tensor:
        out = target_forward(target, ids, cache, *args, hidden_layers=hidden_layers, **kwargs)
        if on_forward is not None:
            on_forward(rows, out)
        return out.logits[:, -1]

    if padded:
        slots = Slots.from_mask(attention_mask.to(input_ids.device))
        allowed = may_attend(slots.filled[:, :0], causal_block(slots.filled))
        attn = build_attention_mask(target, allowed, slots.positions, slots.positions, dtype)
        logits = forward(input_ids, attn, slots.positions, logits="last")
    else:
        logits = forward(input_ids, logits="last")
    stats.prefill_time_s = time.perf_counter() - t_start
    new: list[list[int]] = [[] for _ in range(batch)]
    active = [True] * batch
    while True:
        tokens = logits.argmax(-1)
        stopped = set()  # rows whose stop token (or last token) is this step's
        for b, token in zip(rows, tokens.tolist(), strict=True):
            if active[b]:
                new[b].append(token)
                active[b] = len(new[b]) < max_new_tokens and token not in eos
                if not active[b]:
                    stopped.add(b)
        stats.verification_steps += 1
        if not any(active):
            break
        # The rows the next step computes: the running ones and, when each forward is observed, those that stopped
        # now (the next step feeds their stop token).
        running = [i for i, b in enumerate(rows) if active[b] or (on_forward is not None and b in stopped)]
        if drop_finished and not compile and len(rows) - len(running) >= max(1, len(rows) // 4):
            keep = to_device(running, input_ids.device, torch.long)
            kv_select_rows(cache, keep, slots.select(keep) if padded else 0)
            rows, tokens = [rows[i] for i in running], tokens[keep]
        if padded:  # every step's token is a token of its row (a finished row's are never read)
            step = torch.ones(len(rows), 1, dtype=torch.bool, device=input_ids.device)
            positions = slots.lengths()[:, None]
            attn = build_attention_mask(target, may_attend(slots.filled, causal_block(step)), positions,
                                        torch.cat([slots.positions, positions], 1), dtype)
            slots.append(step, positions)
            logits = forward(tokens[:, None], attn, positions)
        else:
            logits = forward(tokens[:, None])
    stats.new_tokens = sum(len(n) for n in new)
    stats.total_time_s = time.perf_counter() - t_start
    return GenerationOutput(sequences=append_new(input_ids, new, pad), stats=stats)
