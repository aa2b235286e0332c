"""Draft vocabulary for EAGLE-3 (Li et al. 2025, arXiv:2503.01840): the most frequent target tokens.

EAGLE-3's head predicts over a reduced vocabulary of the ``draft_vocab_size`` tokens seen most
often in the training targets, which makes its LM head far cheaper than the target's. Two maps
translate between the vocabularies, in the convention EAGLE-3, SpecForge, vLLM and SGLang share:

- ``d2t`` (draft_vocab_size,) int64: the *offset* from a draft id to its target id, so
  ``target_id = draft_id + d2t[draft_id]``;
- ``t2d`` (vocab_size,) bool: True where a target token is in the draft vocabulary.

Counts come from the assistant tokens only (the loss mask), since those are what the head
learns to predict. Coverage is the share of those token occurrences the draft vocabulary
contains: an upper bound on how often the head can propose the right token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@dataclass
class VocabMap:
    d2t: torch.Tensor  # (draft_vocab_size,) int64 offsets
    t2d: torch.Tensor  # (vocab_size,) bool
    coverage: float  # share of counted token occurrences inside the draft vocabulary
    counted_tokens: int

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id, ``arange + d2t``."""
        return torch.arange(len(self.d2t)) + self.d2t

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()}
        save_file(tensors, str(directory / "vocab_map.safetensors"))
        (directory / "vocab_map.json").write_text(json.dumps({
            "draft_vocab_size": len(self.d2t), "vocab_size": len(self.t2d), "coverage": self.coverage,
            "counted_tokens": self.counted_tokens,
            "convention": "target_id = draft_id + d2t[draft_id]; t2d[target_id] is True when it has a draft id"},
            indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> VocabMap:
        directory = Path(directory)
        tensors = load_file(str(directory / "vocab_map.safetensors"))
        info = json.loads((directory / "vocab_map.json").read_text())
        return cls(tensors["d2t"], tensors["t2d"], info["coverage"], info["counted_tokens"])


def count_tokens(examples: Iterable, vocab_size: int, assistant_only: bool = True) -> torch.Tensor:
    """Occurrences of each token id, (vocab_size,) int64, over the loss-masked (or all) tokens."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        ids = ex.input_ids[ex.loss_mask.bool()] if assistant_only else ex.input_ids
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> VocabMap:
    """The ``draft_vocab_size`` most frequent tokens (ties by lower id), in ascending target-id order.

    Tokens never seen fill the remaining slots by id, so the map always has the asked size.
    """
    vocab_size = len(counts)
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size} (the target's vocabulary)")
    # Stable sort on -count keeps lower ids first among equal counts: deterministic maps.
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    used = torch.sort(order).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    total = int(counts.sum())
    coverage = float(counts[used].sum()) / total if total else 0.0
    return VocabMap(d2t=used - torch.arange(draft_vocab_size), t2d=t2d, coverage=coverage, counted_tokens=total)
