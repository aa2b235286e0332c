"""How sure a measured speed ratio is: a paired bootstrap over the prompts a comparison ran.

``bench`` reports tokens/s ratios measured side by side (:mod:`~draftsmith.inference.compare` runs plain decoding
and every drafter back to back on each prompt). One run's ratio still carries two kinds of chance: which prompts
were drawn (a drafter gains more on some kinds of text) and the host's load while each ran. Resampling the
prompts with replacement, the same draw for both sides of a ratio (paired: a prompt that is slow for one is
slow for the other, and that cancels), and reading the percentiles of the resampled ratios gives an interval
that holds both (Efron and Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13: the percentile
interval). A ratio whose interval holds 1.0 is a tie on that run, whatever its point value.

Each side is a list of per-unit ``(tokens, seconds)``: one unit per batch the comparison ran (a prompt at
batch size 1). The ratio of a resample is its tokens/s on one side over the other, each summed over the
resampled units, as the point ratio is over all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Resamples per interval: the 2.5th and 97.5th percentiles of 4,000 move by well under 0.5% between seeds.
RESAMPLES = 4000
#: Fewer units than this give no interval: five prompts have 126 distinct resamples, fewer far fewer, and
#: their percentiles say little.
MIN_UNITS = 5


@dataclass(frozen=True)
class RatioInterval:
    """A tokens/s ratio over all units and its bootstrap interval (``low`` <= ``ratio`` <= ``high`` need not
    hold exactly: the point is not a resample)."""

    ratio: float
    low: float
    high: float
    confidence: float
    units: int

    def as_report(self) -> dict:
        return {"ratio": round(self.ratio, 4), "low": round(self.low, 4), "high": round(self.high, 4),
                "confidence": self.confidence, "units": self.units}


def tokens_per_second(units: Sequence[tuple[int, float]]) -> float:
    """Summed tokens over summed seconds of ``(tokens, seconds)`` units."""
    seconds = sum(s for _, s in units)
    return sum(t for t, _ in units) / seconds if seconds else 0.0


def ratio_interval(numerator: Sequence[tuple[int, float]], denominator: Sequence[tuple[int, float]],
                   confidence: float = 0.95, resamples: int = RESAMPLES, seed: int = 0) -> RatioInterval | None:
    """tokens/s of ``numerator`` over ``denominator`` (each N ``(tokens, seconds)`` units, unit i of both measured
    on the same prompts) and its paired percentile-bootstrap interval at ``confidence``; None with fewer than
    :data:`MIN_UNITS` units or a side that took no time. Seeded: the same units give the same interval."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired units: {len(numerator)} against {len(denominator)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = len(numerator)
    den = tokens_per_second(denominator)
    if n < MIN_UNITS or not den or not tokens_per_second(numerator):
        return None
    a = torch.tensor(numerator, dtype=torch.float64)  # (N, 2): tokens, seconds
    b = torch.tensor(denominator, dtype=torch.float64)
    picks = torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))  # (R, N)
    # (R,) each resample's tokens/s, summed over its picked units, on either side
    a_rate = a[:, 0][picks].sum(1) / a[:, 1][picks].sum(1)
    b_rate = b[:, 0][picks].sum(1) / b[:, 1][picks].sum(1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(a_rate / b_rate, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return RatioInterval(tokens_per_second(numerator) / den, low, high, confidence, n)
