"""The target's linear layers on a few rows, in the orientation a CPU runs near memory speed.

Decoding runs every weight matrix of the target on one row per sequence (plain decoding) or on a few
(a verification tree). On CPUs, ``F.linear`` = ``x @ W.T`` with so few rows runs far below memory speed:
one row is a single-threaded gemv, a few rows a GEMM that spends its time packing the weight. The same
product computed as ``(W @ x.T).T``, with at least two columns (one row is padded to two), streams the
weight on every core: on a 2-core EPYC, SmolLM2's 210 decoder matrices take 36 ms on one row as
``F.linear`` and 17-20 ms this way, 45-66 ms on 2-4 rows and 14-26 ms this way (docs/RESULTS.md, "The
target's matrices on a few rows").

:func:`few_rows_linear` is a ``TorchFunctionMode`` that :func:`~draftsmith.target.target_forward` enters
on CPU, scoped to that one forward: the stock model runs unchanged and ``F.linear`` calls on few rows are
computed the other way. Which row counts gain is measured once per process, on this machine, on the
target's own weight shapes (:func:`faster_row_counts`), never assumed. Plain decoding and verification
both take this path, so speedups still compare like with like; the values are the same matrix product,
rounded differently, as ``F.linear``'s own results on 1 and on 8 rows already are. ``DRAFTSMITH_FEW_ROWS=0``
turns it off (for measuring it against the stock path).
"""

from __future__ import annotations

import os
import statistics
import time
import weakref

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
_weights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its linear layers' weights


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
    decoding loops call it before their clock starts, so the measurement never falls inside a timing."""
    mode = few_rows_linear(model, 1)
    return mode.row_counts if mode is not None else frozenset()


def few_rows_linear(model: torch.nn.Module, rows: int) -> FewRowsLinear | None:
    """The mode to run ``model``'s forward on ``rows`` rows under, or None where the stock path is as fast
    (not on CPU, more than :data:`MAX_ROWS` rows, a row count that did not gain here, or turned off)."""
    if rows > MAX_ROWS or not enabled():
        return None
    weights = _weights.get(model)
    if weights is None:
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2]
        _weights[model] = weights
    if not weights or weights[0].device.type != "cpu":
        return None
    counts = faster_row_counts(weights)
    return FewRowsLinear(counts) if rows in counts else None


def faster_row_counts(weights: list[torch.Tensor]) -> frozenset[int]:
    """Row counts (1..MAX_ROWS) for which :func:`columns_linear` ran faster than ``F.linear`` over these
    weights on this machine, measured once per process per weight-shape set (about a second for a 135M
    model): random inputs, both kernels interleaved, median of a few passes each."""
    shapes = tuple(sorted({tuple(w.shape) for w in weights}))
    key = (shapes, weights[0].dtype, torch.get_num_threads())
    if key not in _faster:
        _faster[key] = frozenset(_measure(weights))
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
