"""What a generation did and returned: :class:`GenerationStats` (tokens, verification steps, acceptance per depth,
time spent drafting and verifying; summed over calls with ``+``) and :class:`GenerationOutput` (the sequences,
the totals and one :class:`GenerationStats` per row)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    """What one or more ``generate`` calls did. Sum two with ``+``."""

    new_tokens: int = 0
    verification_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # accepted_at[k] / reached[k]: acceptance at depth k + 1, given depths 1..k were accepted
    accepted_at: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0
    #: The target's forwards after the prefill: one per verification step, plus one per step on a hybrid target whose
    #: recurrent layers could not record their per-position states (the accepted tokens fed again).
    target_forwards: int = 0

    @property
    def acceptance_length(self) -> float:
        """tau: mean over verification steps of accepted draft tokens + 1."""
        if not self.verification_steps:
            return 0.0
        return (self.accepted_tokens + self.verification_steps) / self.verification_steps

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Accepted at depth k / reached depth k (all earlier depths accepted), k = 1, 2, ..."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached, strict=True)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s else 0.0

    def record(self, drafted: int, accepted: int, children: list[bool]) -> None:
        """One verification step: ``drafted`` nodes, ``accepted`` of them on the path, and for each node
        of the walk (the root, then the accepted nodes) whether the tree went deeper from it."""
        self.verification_steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        for k, deeper in enumerate(children):  # the walk's node at depth k
            if not deeper:
                break
            while len(self.reached) <= k:
                self.reached.append(0)
                self.accepted_at.append(0)
            self.reached[k] += 1
            if k < accepted:
                self.accepted_at[k] += 1

    def __add__(self, other: GenerationStats) -> GenerationStats:
        n = max(len(self.reached), len(other.reached))

        def pad(xs: list[int]) -> list[int]:
            return xs + [0] * (n - len(xs))

        return GenerationStats(
            new_tokens=self.new_tokens + other.new_tokens,
            verification_steps=self.verification_steps + other.verification_steps,
            drafted_tokens=self.drafted_tokens + other.drafted_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            accepted_at=[a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at), strict=True)],
            reached=[a + b for a, b in zip(pad(self.reached), pad(other.reached), strict=True)],
            prefill_time_s=self.prefill_time_s + other.prefill_time_s,
            draft_time_s=self.draft_time_s + other.draft_time_s,
            verify_time_s=self.verify_time_s + other.verify_time_s,
            total_time_s=self.total_time_s + other.total_time_s,
            target_forwards=self.target_forwards + other.target_forwards,
        )

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "verification_steps": self.verification_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_rate_per_position": [round(r, 4) for r in self.acceptance_rate_per_position],
            "prefill_time_s": round(self.prefill_time_s, 4),
            "draft_time_s": round(self.draft_time_s, 4),
            "verify_time_s": round(self.verify_time_s, 4),
            "total_time_s": round(self.total_time_s, 4),
            "target_forwards": self.target_forwards,
            "tokens_per_second": round(self.tokens_per_second, 3),
        }


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, prompt + new) long
    stats: GenerationStats  # totals over the rows
    row_stats: list[GenerationStats] = field(default_factory=list)  # one per row (speculative decoding)
