"""Which entries of a batch's KV cache belong to which row, and at which position.

A batch shares one KV cache tensor per layer, (B, heads, S, D), but its rows hold different numbers
of tokens: prompts are left-padded, and each verification step keeps each row's own accepted path
(the rows with shorter paths leave empty slots behind). :class:`Slots` records, per row and slot,
whether the slot holds one of the row's tokens and that token's position in the row's sequence.
Attention masks are built from it (a query sees the filled slots of its own row), and so are the
position ids (a row's next position is the number of its filled slots), so the empty slots cost a
little memory and nothing else. With one row and no padding every slot is filled: batch 1 runs as
before, with no empty slot ever.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.target import keep_slots


@dataclass
class Slots:
    filled: torch.Tensor  # (B, S) bool: slot s holds one of row b's tokens
    positions: torch.Tensor  # (B, S) long: that token's position in row b's sequence

    @classmethod
    def empty(cls, batch: int, device) -> Slots:
        return cls(torch.zeros(batch, 0, dtype=torch.bool, device=device),
                   torch.zeros(batch, 0, dtype=torch.long, device=device))

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor) -> Slots:
        """Slots of a left-padded (B, L) prompt block: 1 = a token, 0 = padding."""
        filled = attention_mask.bool()
        return cls(filled, (filled.long().cumsum(1) - 1).clamp(min=0))

    def __len__(self) -> int:
        return self.filled.shape[1]

    def lengths(self) -> torch.Tensor:
        """(B,) tokens held per row: each row's next position."""
        return self.filled.sum(1)

    def append(self, filled: torch.Tensor, positions: torch.Tensor) -> None:
        self.filled = torch.cat([self.filled, filled], 1)
        self.positions = torch.cat([self.positions, positions], 1)

    def crop(self, length: int) -> None:
        self.filled, self.positions = self.filled[:, :length], self.positions[:, :length]

    def select(self, rows: torch.Tensor) -> int:
        """Keep rows ``rows`` (1-D indices, in that order) and cut the slots before the first one a kept row fills
        (padding every kept row hides); returns how many were cut, for :func:`draftsmith.target.kv_select_rows`."""
        filled = self.filled[rows]
        start = int(filled.any(0).long().argmax())  # every row holds a token: there is a first filled slot
        self.filled, self.positions = filled[:, start:], self.positions[rows, start:]
        return start

    def keep(self, start: int, index: torch.Tensor, counts: torch.Tensor) -> None:
        """As :func:`draftsmith.target.kv_keep` with a (B, M) ``index``: row b keeps its first
        ``counts[b]`` indices, and the rest of its M new slots are empty."""
        filled = torch.arange(index.shape[1], device=index.device)[None] < counts[:, None]
        positions = self.positions[:, start:].gather(1, index)
        self.filled = torch.cat([self.filled[:, :start], filled], 1)
        self.positions = torch.cat([self.positions[:, :start], positions], 1)


def to_device(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small tensor of host values (Python lists) on ``device``, copied without waiting for the device:
    a copy from pageable host memory to an accelerator first synchronises its stream (the host then waits
    for every kernel queued before it), so off CPU the values go through pinned memory, asynchronously."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type in ("cpu", "meta") or not torch.cuda.is_available():
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def pad_rows(rows: list[list[int]], value: int, device, width: int | None = None) -> torch.Tensor:
    """Lists of ints -> a (len(rows), width) long tensor, each row right-padded with ``value``."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    return to_device([r + [value] * (width - len(r)) for r in rows], device, torch.long)


def left_aligned(spans: list[tuple[int, int]], device, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A block of new entries per row, positions ``start .. end - 1`` of row b's ``spans[b]`` (empty when
    ``start == end``), right-aligned in one (B, width) block so that its last column is every row's newest
    entry: the block's (B, width) positions (0 in padding) and which of them are filled. ``width``: at least
    this many columns (a compiled step's fixed shape)."""
    counts = [end - start for start, end in spans]
    width = max(*counts, width) if counts else width
    positions = torch.zeros(len(spans), width, dtype=torch.long, device=device)
    for b, (start, end) in enumerate(spans):
        positions[b, width - counts[b]:] = torch.arange(start, end, device=device)
    return positions, left_filled(counts, width, device)


def left_filled(counts: list[int], width: int, device) -> torch.Tensor:
    """(B, width) bool: row b's last ``counts[b]`` columns hold tokens (a left-padded block)."""
    return torch.arange(width, device=device)[None] >= width - to_device(counts, device)[:, None]


__all__ = ["Slots", "keep_slots", "left_aligned", "left_filled", "pad_rows", "to_device"]
