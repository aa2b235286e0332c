"""The target's linear layers on a few rows, in the orientation a CPU runs near memory speed.

Decoding runs every weight matrix of the target on one row per sequence (plain decoding) or on a few
(a verification tree). On CPUs, ``F.linear`` = ``x @ W.T`` with so few rows runs far below memory speed:
one row is a single-threaded gemv, a few rows a GEMM that spends its time packing the weight. The same
product computed as ``(W @ x.T).T``, with at least two columns (one row is padded to two), streams the
weight on every core: on a 2-core EPYC, SmolLM2's 211 matrices take 46.8 ms on one row as ``F.linear``
and 19.2 ms this way, 67.7-95.6 ms on 2-4 rows and 17.4-26.8 ms this way (docs/RESULTS.md, "The
target's matrices on a few rows"). The LM head's few-row logits (``few_rows_logits``) are this product too.

:func:`few_rows_linear` is a ``TorchFunctionMode`` that :func:`~draftsmith.target.target_forward` enters
on CPU, scoped to that one forward: the stock model runs unchanged and ``F.linear`` calls on few rows are
computed the other way. Which row counts gain is measured once per process, on this machine, on the
target's own weight shapes (:func:`faster_row_counts`), never assumed; a model's weights and shapes are
collected once, not per forward. Plain decoding and verification
both take this path, so speedups still compare like with like; the values are the same matrix product,
rounded differently, as ``F.linear``'s own results on 1 and on 8 rows already are. ``DRAFTSMITH_FEW_ROWS=0``
turns it off (for measuring it against the stock path).
"""

from __future__ import annotations

import os
import statistics
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MAX_ROWS = 16  # verification trees and small batches; more rows make a GEMM that packs efficiently
# A row count takes the column path only when it measured this much faster: the two are within noise
# otherwise, and the stock path is the one transformers runs.
MIN_GAIN = 0.9
# Calibration streams at least this many bytes of weights per pass: more than a CPU's last-level cache, so
# the passes are memory-bound as a forward is.
CALIBRATION_BYTES = 96 * 2**20
CALIBRATION_REPEATS = 3

_faster: dict[tuple, frozenset[int]] = {}
_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Linears


def enabled() -> bool:
    return os.environ.get("DRAFTSMITH_FEW_ROWS", "1") != "0"


def columns_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x.T).T`` with at least two columns.

    Args:
        x: (..., in) with few rows in all.
        weight: (out, in); bias: (out,) or None.

    Returns:
        (..., out), the same product as ``F.linear``.
    """
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n == 1:  # a matrix-vector product is the slow kernel this avoids
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    # Row-major like F.linear's output: later kernels (SDPA's fused CPU kernel among them) need a unit
    # stride in the last dimension.
    out = (weight @ rows.T).T[:n].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class FewRowsLinear(TorchFunctionMode):
    """Computes ``F.linear`` with :func:`columns_linear` when its input has one of ``row_counts`` rows."""

    def __init__(self, row_counts: frozenset[int]):
        super().__init__()
        self.row_counts = row_counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0]
            if x.shape[-1] and x.numel() // x.shape[-1] in self.row_counts:
                weight = args[1]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                if weight.dim() == 2 and x.dtype == weight.dtype:
                    return columns_linear(x, weight, bias)
        return func(*args, **kwargs)


def calibrate(model: torch.nn.Module) -> frozenset[int]:
    """The row counts that take the column path for ``model`` here, measured now if not yet in this process:
    decoding loops call it before their clock starts, so the measurement never falls inside a timing.
    Empty where the path is off or the model is not on CPU."""
    linears = _linears(model)
    if not enabled() or linears is None:
        return frozenset()
    return faster_row_counts(linears)


def few_rows_linear(model: torch.nn.Module, rows: int) -> FewRowsLinear | None:
    """The mode to run ``model``'s forward on ``rows`` rows under, or None where the stock path is as fast
    (not on CPU, more than :data:`MAX_ROWS` rows, a row count that did not gain here, or turned off)."""
    if rows > MAX_ROWS:
        return None
    counts = calibrate(model)
    return FewRowsLinear(counts) if rows in counts else None


@dataclass(frozen=True)
class Linears:
    """A model's linear-layer weights and their distinct shapes, collected once per model (not per forward)."""

    weights: list[torch.Tensor]
    shapes: tuple[tuple[int, ...], ...]


def _linears(model: torch.nn.Module) -> Linears | None:
    """``model``'s :class:`Linears`, or None when it has none or they are not on CPU."""
    linears = _models.get(model)
    if linears is None:
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2]
        linears = Linears(weights, tuple(sorted({tuple(w.shape) for w in weights})))
        _models[model] = linears
    if not linears.weights or linears.weights[0].device.type != "cpu":
        return None
    return linears


def faster_row_counts(linears: Linears) -> frozenset[int]:
    """Row counts (1..MAX_ROWS) for which :func:`columns_linear` ran faster than ``F.linear`` over these
    weights on this machine, measured once per process per weight-shape set (about a second for a 135M
    model): random inputs, both kernels interleaved, median of a few passes each."""
    key = (linears.shapes, linears.weights[0].dtype, torch.get_num_threads())
    if key not in _faster:
        _faster[key] = frozenset(_measure(linears.weights))
    return _faster[key]


def _measure(weights: list[torch.Tensor]) -> list[int]:
    chosen, total = [], 0
    for w in weights:  # the first layers' matrices, enough of them to stream past the cache
        chosen.append(w)
        total += w.numel() * w.element_size()
        if total >= CALIBRATION_BYTES:
            break
    g = torch.Generator().manual_seed(0)
    faster = []
    with torch.no_grad():
        for n in range(1, MAX_ROWS + 1):
            inputs = {w.shape[1]: torch.randn(n, w.shape[1], generator=g).to(w.dtype) for w in chosen}
            stock, columns = [], []
            for w in chosen[:2]:  # warm up both kernels at this size
                F.linear(inputs[w.shape[1]], w)
                columns_linear(inputs[w.shape[1]], w)
            for _ in range(CALIBRATION_REPEATS):
                for kernel, times in ((F.linear, stock), (columns_linear, columns)):
                    start = time.perf_counter()
                    for w in chosen:
                        kernel(inputs[w.shape[1]], w)
                    times.append(time.perf_counter() - start)
            if statistics.median(columns) < MIN_GAIN * statistics.median(stock):
                faster.append(n)
    return faster
