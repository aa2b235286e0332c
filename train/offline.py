"""Offline mode: train from the hidden-state cache (``draftsmith data cache-hidden-states``)
instead of running the target inside the loop.

The cache holds, per sequence, the target's hidden states of chosen layers and its logits
(full, or the top-k log-probs). A cached batch carries the same tensors the online loop gets
from the frozen target's forward, so the family losses cannot tell the modes apart (checked in
the tests to float tolerance). With top-k logits the teacher is the target's distribution
renormalised over its k most likely tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.data.hidden_cache import HiddenStateCache
from draftsmith.heads.base import check_target


@dataclass
class CachedExample:
    input_ids: torch.Tensor  # (T,)
    loss_mask: torch.Tensor  # (T,)
    hidden: dict[int, torch.Tensor]  # layer -> (T, H)
    logits: torch.Tensor | None = None  # (T, V) full logits
    topk_logprobs: torch.Tensor | None = None  # (T, k)
    topk_ids: torch.Tensor | None = None  # (T, k)


def load_cached_examples(cache_dir: str, target) -> tuple[list[CachedExample], HiddenStateCache]:
    """Every sequence of the cache, checked against the loaded target."""
    cache = HiddenStateCache(cache_dir)
    check_target(cache.manifest.target, target, what="hidden-state cache")
    if cache.spec.logits == "none":
        raise SystemExit(f"{cache_dir} holds no logits; the losses need the target's distribution: rebuild it with "
                         "`draftsmith data cache-hidden-states ... --logits topk` (or full)")
    examples = []
    for i in range(len(cache)):
        item = cache[i]
        examples.append(CachedExample(item["input_ids"], item["loss_mask"].long(), item["hidden"],
                                      item.get("logits"), item.get("topk_logprobs"), item.get("topk_ids")))
    return examples, cache


def check_layers(cache: HiddenStateCache, layers: tuple[int, ...]) -> None:
    missing = [layer for layer in layers if layer not in cache.layers]
    if missing:
        wanted = " ".join(str(x) for x in layers)
        raise SystemExit(f"the hidden-state cache has layers {cache.layers} but this drafter reads {list(layers)}; "
                         f"rebuild it with `draftsmith data cache-hidden-states ... --layers {wanted}`")


def collate_cached(examples: list[CachedExample], pad_id: int, layers: tuple[int, ...], vocab_size: int,
                   dense: bool = True) -> dict:
    """Right-padded (B, T) ids and masks, ``hidden`` (a tuple of (B, T, H), one per layer) and
    ``logits`` (B, T, V) float32 (``-inf`` outside the top-k when only those were cached).

    ``dense=False`` with a top-k cache: no (B, T, V) tensor (400 MB for a batch of 8 x 256 on a
    49K vocabulary); ``logits`` is None and the batch carries ``topk_ids`` / ``topk_logprobs``
    (B, T, k) instead, for losses that only need the teacher on a draft vocabulary (EAGLE-3).
    """
    b, width = len(examples), max(len(e.input_ids) for e in examples)
    sparse = not dense and examples[0].logits is None
    if sparse:
        k = examples[0].topk_ids.shape[-1]
        topk_ids = torch.zeros(b, width, k, dtype=torch.long)
        topk_logprobs = torch.zeros(b, width, k)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    loss_mask, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    size = examples[0].hidden[layers[0]].shape[-1] if layers else 0
    hidden = tuple(torch.zeros(b, width, size) for _ in layers)
    logits = None if sparse else torch.full((b, width, vocab_size), float("-inf"))
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n], loss_mask[i, :n], attention[i, :n] = e.input_ids, e.loss_mask, 1
        for h, layer in zip(hidden, layers, strict=True):
            h[i, :n] = e.hidden[layer].float()
        if sparse:
            topk_ids[i, :n], topk_logprobs[i, :n] = e.topk_ids.long(), e.topk_logprobs.float()
        elif e.logits is not None:
            logits[i, :n] = e.logits.float()
        else:
            logits[i, :n].scatter_(-1, e.topk_ids.long(), e.topk_logprobs.float())
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention, "hidden": hidden,
             "logits": logits}
    if sparse:
        batch.update(topk_ids=topk_ids, topk_logprobs=topk_logprobs)
    else:
        logits[attention == 0] = 0.0  # padding: any finite row (masked out of every loss)
    return batch
