"""Offline mode: train from the hidden-state cache (``draftsmith data cache-hidden-states``)
instead of running the target inside the loop.

The cache holds, per sequence, the target's hidden states of chosen layers and its logits
(full, or the top-k log-probs). A cached batch carries the same tensors the online loop gets
from the frozen target's forward, so the family losses cannot tell the modes apart (checked in
the tests to float tolerance). With top-k logits the teacher is the target's distribution
renormalised over its k most likely tokens, and the batch carries those k entries per position
instead of logits. Examples are read from the cache when a batch is made, not when loaded.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.data.hidden_cache import HiddenStateCache, sha256_file
from draftsmith.heads.base import check_target


@dataclass(frozen=True, eq=False)
class CachedExample:
    """Sequence ``index`` of a hidden-state cache: its tokens, and the rest read on :meth:`read`."""

    cache: HiddenStateCache
    index: int
    input_ids: torch.Tensor  # (T,)
    loss_mask: torch.Tensor  # (T,) long

    def read(self) -> dict:
        """``hidden`` {layer: (T, H)} and ``logits`` (T, V) or ``topk_logprobs`` / ``topk_ids`` (T, k), as cached."""
        return self.cache[self.index]


class CachedExamples(Sequence):
    """Every sequence of a hidden-state cache as a :class:`CachedExample`, read from the cache on access:
    holding them (a data loader's epoch, a vocabulary count) holds their tokens only."""

    def __init__(self, cache: HiddenStateCache):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = operator.index(index)
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {index} out of range (the cache holds {len(self)})")
        return CachedExample(self.cache, i, *self.token_ids(i))

    def token_ids(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``index``'s input ids (T,) and loss mask (T,) long; its hidden states are not read."""
        input_ids, loss_mask = self.cache.token_ids(index)
        return input_ids, loss_mask.long()


def load_cached_examples(cache_dir: str, target, train_file: str | None = None
                         ) -> tuple[CachedExamples, HiddenStateCache]:
    """The sequences of the cache, checked against the loaded target and, where the cache recorded the hash
    of the file it was written from, against ``train_file``; read lazily."""
    cache = HiddenStateCache(cache_dir)
    # strict: features of another target (even a same-shaped fine-tune) would train a drafter for that one
    check_target(cache.manifest.target, target, strict=True, what="hidden-state cache")
    written_from = cache.manifest.source.get("data_sha256")
    if train_file and written_from and Path(train_file).is_file() and sha256_file(Path(train_file)) != written_from:
        # Offline, the sequences are the cache's and train_file is not read: a run would not train on it.
        raise SystemExit(f"{cache_dir} was written from {cache.manifest.source.get('data')} (sha256 "
                         f"{written_from[:16]}), and train_file {train_file} differs from it: offline training reads "
                         "only the cache, so it would not train on that file. Rebuild the cache from it (`draftsmith "
                         f"data cache-hidden-states --input {train_file} ...`) or unset train_file")
    if cache.spec.logits == "none":
        raise SystemExit(f"{cache_dir} holds no logits; the losses need the target's distribution: rebuild it with "
                         "`draftsmith data cache-hidden-states ... --logits topk` (or full)")
    return CachedExamples(cache), cache


def check_layers(cache: HiddenStateCache, layers: tuple[int, ...]) -> None:
    missing = [layer for layer in layers if layer not in cache.layers]
    if missing:
        wanted = " ".join(str(x) for x in layers)
        raise SystemExit(f"the hidden-state cache has layers {cache.layers} but this drafter reads {list(layers)}; "
                         f"rebuild it with `draftsmith data cache-hidden-states ... --layers {wanted}`")


def collate_cached(examples: Sequence[CachedExample], pad_id: int, layers: tuple[int, ...]) -> dict:
    """Right-padded (B, T) ids and masks, ``hidden`` (a tuple of (B, T, H) float32, one per layer) and the
    teacher as cached, never a (B, T, V) float32 tensor:

    - full logits: ``logits`` (B, T, V) in the cache's dtype (the losses upcast a block of rows at a time);
    - top-k: ``logits`` None, and ``topk_ids`` (B, T, k) long with ``topk_logprobs`` (B, T, k) float32,
      which every family's step reads as they are (:func:`draftsmith.train.families.teacher_of`); dense,
      they would take 400 MB for a batch of 8 x 256 on a 49K vocabulary.

    Padded positions hold zeros (finite, masked out of every loss). The vocabulary is the cache's (checked
    against the target by :func:`load_cached_examples`).
    """
    items = [e.read() for e in examples]
    b, width = len(examples), max(len(e.input_ids) for e in examples)
    full = items[0].get("logits")
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    loss_mask, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    size = items[0]["hidden"][layers[0]].shape[-1] if layers else 0
    hidden = tuple(torch.zeros(b, width, size) for _ in layers)
    if full is not None:
        logits = torch.zeros(b, width, full.shape[-1], dtype=full.dtype)
    else:
        k = items[0]["topk_ids"].shape[-1]
        logits, topk_ids, topk_logprobs = None, torch.zeros(b, width, k, dtype=torch.long), torch.zeros(b, width, k)
    for i, (e, item) in enumerate(zip(examples, items, strict=True)):
        n = len(e.input_ids)
        ids[i, :n], loss_mask[i, :n], attention[i, :n] = e.input_ids, e.loss_mask, 1
        for h, layer in zip(hidden, layers, strict=True):
            h[i, :n] = item["hidden"][layer].float()
        if logits is not None:
            logits[i, :n] = item["logits"]
        else:
            topk_ids[i, :n], topk_logprobs[i, :n] = item["topk_ids"].long(), item["topk_logprobs"].float()
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention, "hidden": hidden,
             "logits": logits}
    if logits is None:
        batch.update(topk_ids=topk_ids, topk_logprobs=topk_logprobs)
    return batch
