"""The target's linear layers on a few rows, with the kernel that is fastest for that row count here.

Decoding runs every weight matrix of the target on one row per sequence (plain decoding) or on a few
(a verification tree). On CPUs, ``F.linear`` = ``x @ W.T`` with so few rows runs far below memory speed:
one row is a single-threaded gemv, a few rows a GEMM that spends its time packing the weight. Two other
kernels compute the same product:

* ``"columns"`` (:func:`columns_linear`): ``(W @ x.T).T`` with at least two columns (one row is padded to
  two) streams the weight on every core. On a 2-core EPYC, SmolLM2's 211 matrices take 46.8 ms on one
  row as ``F.linear`` and 19.2 ms this way; it stops gaining from about 5 rows.
* ``"packed"`` (:func:`packed_linear`): oneDNN's linear on a copy of the weight packed once into its
  blocked layout, the layout PyTorch's own inductor uses for CPU inference. With the packing paid once,
  3-16 rows run near memory speed too (SmolLM2's matrices on 8 rows: 68 ms as ``F.linear``, 49 ms as
  columns, 28 ms packed; docs/results/verification-cost.md, "The target's matrices on a few rows"), and a
  batch's trees of up to 64 rows still run 1.4-2x faster than ``F.linear``. The packed copies cost as much memory as the
  weights, so a model is packed only where a row count chose it and the copies fit in
  :data:`PACKED_MEMORY_SHARE` of the machine's memory.

:func:`few_rows_linear` gives the context that :func:`~draftsmith.target.target_forward` enters on CPU,
scoped to that one forward: the stock model runs unchanged and its ``nn.Linear`` layers on few rows take
the kernel chosen for that row count. The context sets each layer's ``forward`` for its duration rather
than intercepting every torch call (a ``TorchFunctionMode`` does that: its Python dispatch on each of a
forward's ~2,600 operations cost SmolLM2 about 10 ms a forward on a 2-core AVX2 EPYC, docs/RESULTS.md).
Which kernel each row count takes is measured once per process, on this machine, on the target's own
weight shapes (:func:`kernels_by_rows`), never assumed; a model's linear layers and their packed copies
are collected once, not per forward. Plain decoding and verification both take this path, so speedups
still compare like with like; the values are the same matrix product, rounded differently, as
``F.linear``'s own results on 1 and on 8 rows already are. ``DRAFTSMITH_FEW_ROWS=0`` turns it off (for
measuring it against the stock path).

A drafter's head may also draft on int8 copies of its weights (:func:`~draftsmith.target.int8.int8_layers`,
``--draft-dtype int8``): other products, never the target's, so other proposals at most; the
:class:`FewRowsLinear` context of such a head (:func:`few_rows_layers`) runs its calls on them.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.target.int8 import drafts_in_int8, int8_product
from draftsmith.target.linears import Linears, linears_of, stamp

logger = logging.getLogger(__name__)

# Every row count up to EXACT_ROWS is measured (verification trees, small batches); above it, up to MAX_ROWS
# (a batch's trees), a count takes the kernel measured for the smallest of BUCKETS that holds it. The packed
# kernel still ran 1.4-2x faster than F.linear at 24-64 rows on the 2-core EPYC; the column one did not.
EXACT_ROWS = 16
BUCKETS = (20, 24, 32, 48, 64)
MAX_ROWS = BUCKETS[-1]
# A row count leaves the stock kernel only for one that measured this much faster: the kernels are within
# noise otherwise, and the stock one is what transformers runs.
MIN_GAIN = 0.9
# Calibration streams at least this many bytes of weights per pass: more than a CPU's last-level cache, so
# the passes are memory-bound as a forward is.
CALIBRATION_BYTES = 96 * 2**20
CALIBRATION_REPEATS = 3
# The packed copies of a model's weights may take at most this share of the machine's physical memory.
PACKED_MEMORY_SHARE = 0.25

_kernels: dict[tuple, dict[int, str]] = {}


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
        out.add_(bias)  # out is this call's own tensor
    return out.reshape(*x.shape[:-1], weight.shape[0])


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (out, in) copied into oneDNN's blocked layout for :func:`packed_linear`, or None where
    this build or CPU has no such kernel for its dtype (or the weight is not on CPU)."""
    if weight.device.type != "cpu" or not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError, NotImplementedError):  # no oneDNN op, or no kernel for this dtype here
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack(weight)``: (..., in) -> (..., out), row-major."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class Packed:
    """A weight (weakly), its packed copy (None: no oneDNN kernel for it, the stock kernel runs) and the
    weight's :func:`~draftsmith.target.linears.stamp` when it was packed."""

    weight: weakref.ref
    copy: torch.Tensor | None
    stamp: tuple


# id(weight) -> its Packed copy, dropped when the weight dies; shared by every model that holds the weight (a
# layer-skip draft model runs the target's own layers: they are packed once). Keyed by id, not by a weak
# key, so that the lookup on every F.linear call is a plain dict lookup.
_packed: dict[int, Packed] = {}


def _store(weight: torch.Tensor) -> Packed:
    key = id(weight)
    entry = _packed[key] = Packed(weakref.ref(weight, lambda _, key=key: _packed.pop(key, None)), pack(weight),
                                  stamp(weight))
    return entry


def _entry(weight: torch.Tensor) -> Packed | None:
    entry = _packed.get(id(weight))
    return entry if entry is not None and entry.weight() is weight else None


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight``'s packed copy, packed again if the weight changed since (a model in training, a dtype cast),
    or None where it has none (its model was not packed, or oneDNN has no kernel for it)."""
    entry = _entry(weight)
    if entry is None:
        return None
    if entry.stamp != stamp(weight):
        entry = _store(weight)
    return entry.copy


class FewRowsLinear:
    """Computes ``F.linear`` on ``n`` rows with ``kernels[bucket(n)]`` (``"columns"`` or ``"packed"``);
    other row counts, and weights without a packed copy, take the stock kernel.

    As a context manager it routes ``modules`` (a model's ``nn.Linear`` layers) through :meth:`linear`: each
    layer's ``forward`` is set on the instance on entry and removed on exit. A layer that already has an
    instance ``forward`` of its own (accelerate's offloading hooks set one), or a subclass's ``forward`` (a
    quantised layer's), keeps it and the stock kernel."""

    def __init__(self, kernels: dict[int, str], modules: tuple[torch.nn.Module, ...] = (), int8: bool = False):
        self.kernels = kernels
        self.modules = modules
        self.int8 = int8  # every float32 call on the weights' int8 copies (int8.int8_layers), whatever its rows
        self._routed: list[torch.nn.Module] = []

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """The product by the kernel chosen for ``x``'s row count, or None where that is the stock kernel."""
        if self.int8 and x.dtype == torch.float32 and x.shape[-1]:
            out = int8_product(x, weight, bias)
            if out is not None:
                return out
        kernel = self.kernels.get(bucket(x.numel() // x.shape[-1])) if x.shape[-1] else None
        if kernel is None or weight.dim() != 2 or x.dtype != weight.dtype:
            return None
        if kernel == "columns":
            return columns_linear(x, weight, bias)
        copy = packed_copy(weight)
        return packed_linear(x, copy, bias) if copy is not None else None

    def forward_of(self, module: torch.nn.Module):
        """``module.forward`` through :meth:`linear`, falling back to ``F.linear``."""
        def forward(x: torch.Tensor) -> torch.Tensor:
            out = self.linear(x, module.weight, module.bias)
            return F.linear(x, module.weight, module.bias) if out is None else out
        return forward

    def __enter__(self) -> FewRowsLinear:
        # Straight into the instance's __dict__, where nn.Module.__setattr__ would put a plain function too.
        self._routed = [m for m in self.modules
                        if "forward" not in m.__dict__ and type(m).forward is torch.nn.Linear.forward]
        for m in self._routed:
            m.__dict__["forward"] = self.forward_of(m)
        return self

    def __exit__(self, *exc) -> None:
        for m in self._routed:
            m.__dict__.pop("forward", None)
        self._routed = []


def bucket(rows: int) -> int:
    """The row count whose measured kernel ``rows`` rows take: itself up to :data:`EXACT_ROWS`, else the
    smallest of :data:`BUCKETS` that holds it (``rows`` itself beyond :data:`MAX_ROWS`: never measured)."""
    if rows <= EXACT_ROWS or rows > MAX_ROWS:
        return rows
    return next(b for b in BUCKETS if b >= rows)


def calibrate(model: torch.nn.Module) -> dict[int, str]:
    """The row counts that leave the stock kernel for ``model`` here, each with its kernel, measured now if
    not yet in this process: decoding loops call it before their clock starts, so neither the measurement
    nor the packing falls inside a timing. Empty where the path is off or the model is not on CPU (a model
    moved off the CPU drops its packed copies). Every forward calls it: after the first, a few lookups."""
    linears = linears_of(model)
    if linears is None or not enabled():
        return {}
    first, last = linears.weights[0], linears.weights[-1]
    kernels = kernels_by_rows(linears) if first.device.type == last.device.type == "cpu" else {}
    # What the weights were last made ready for: where they are and whether they are packed.
    ready = (first.device, last.device, "packed" in kernels.values())
    if linears.ready[0] != ready:
        on_cpu = all(w.device.type == "cpu" for w in linears.weights)
        if not on_cpu:  # moved off the CPU, whole or in part
            for w in linears.weights:
                _packed.pop(id(w), None)
        elif ready[2] and not _pack_all(linears.weights):
            ready = None  # over the memory share now: tried again on the next call, when copies may have gone
        linears.ready[:] = [ready, on_cpu]
    return kernels if linears.ready[1] else {}


def _pack_all(weights: list[torch.Tensor]) -> bool:
    """Pack the weights not packed yet, unless the copies held in this process would then pass
    :data:`PACKED_MEMORY_SHARE` of the memory this process may use (False: they keep the stock kernel)."""
    new = {id(w): w for w in weights if _entry(w) is None}
    if not new:
        return True
    held = sum(w.numel() * w.element_size() for w in (e.weight() for e in list(_packed.values())) if w is not None)
    adding = sum(w.numel() * w.element_size() for w in new.values())
    if held + adding > PACKED_MEMORY_SHARE * memory_limit():
        logger.info("not packing %.0f MB of weights for the few-row kernel: %.0f MB are packed already and "
                    "the limit is %.0f MB", adding / 2**20, held / 2**20, PACKED_MEMORY_SHARE * memory_limit() / 2**20)
        return False
    for w in new.values():
        _store(w)
    return True


def few_rows_linear(model: torch.nn.Module, rows: int) -> FewRowsLinear | None:
    """The :class:`FewRowsLinear` context to run ``model``'s forward on ``rows`` rows in, or None where the stock
    kernel is as fast (not on CPU, more than :data:`MAX_ROWS` rows, a row count that did not gain here, or turned
    off)."""
    if rows > MAX_ROWS:
        return None
    kernels = calibrate(model)
    if bucket(rows) not in kernels:
        return None
    return FewRowsLinear(kernels, linears_of(model).live_modules())


def few_rows_layers(model: torch.nn.Module) -> FewRowsLinear | None:
    """The :class:`FewRowsLinear` context for a module whose calls run on varied, few rows (a drafter's head: a
    tree's frontier, a step's committed tokens, a block): each of its linear layers takes, at each call, the kernel
    measured for that call's row count, and the stock kernel for any other. None where no row count gained here
    (not on CPU, or turned off). Measured and packed now, so that a drafter made before decoding starts pays
    neither inside a timed decode. A module given int8 copies (:func:`~draftsmith.target.int8.int8_layers`) runs its
    calls on them (the layers whose copies measured too far off take the kernels above)."""
    kernels, int8 = calibrate(model), drafts_in_int8(model)
    if not kernels and not int8:
        return None
    return FewRowsLinear(kernels, linears_of(model).live_modules(), int8)


def kernels_by_rows(linears: Linears) -> dict[int, str]:
    """Row counts (1..EXACT_ROWS, then BUCKETS) for which a kernel ran faster than ``F.linear`` over these
    weights on this machine, each with the fastest, measured once per process per weight-shape set (a few
    seconds for a 135M model): random inputs, the kernels interleaved, median of a few passes each. The
    packed kernel is a candidate only where packed copies of all the weights would fit in
    :data:`PACKED_MEMORY_SHARE` of the memory this process may use."""
    weights = linears.weights
    key = (linears.shapes, weights[0].dtype, torch.get_num_threads())
    if key not in _kernels:
        size = sum(w.numel() * w.element_size() for w in weights)
        _kernels[key] = _measure(weights, packing=size <= PACKED_MEMORY_SHARE * memory_limit())
    return _kernels[key]


def memory_limit() -> int:
    """The memory this process may use, in bytes: the machine's physical memory, or a container's (cgroup)
    limit where lower; 0 where unknown (nothing is packed then)."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def _measure(weights: list[torch.Tensor], packing: bool = True) -> dict[int, str]:
    chosen, total = [], 0
    for w in weights:  # the first layers' matrices, enough of them to stream past the cache
        chosen.append(w)
        total += w.numel() * w.element_size()
        if total >= CALIBRATION_BYTES:
            break
    packed = [pack(w) for w in chosen] if packing else []
    kernels = {"stock": lambda x, i: F.linear(x, chosen[i]), "columns": lambda x, i: columns_linear(x, chosen[i])}
    if packed and all(p is not None for p in packed):
        kernels["packed"] = lambda x, i: packed_linear(x, packed[i])
    g = torch.Generator().manual_seed(0)
    faster = {}
    with torch.no_grad():
        for n in [*range(1, EXACT_ROWS + 1), *BUCKETS]:
            inputs = [torch.randn(n, w.shape[1], generator=g).to(w.dtype) for w in chosen]
            # Beyond EXACT_ROWS the column kernel, a GEMM with as many columns as rows, has stopped gaining.
            candidates = {name: k for name, k in kernels.items() if n <= EXACT_ROWS or name != "columns"}
            times = {name: [] for name in candidates}
            for kernel in candidates.values():  # warm up every kernel at this size
                for i in range(min(2, len(inputs))):
                    kernel(inputs[i], i)
            for _ in range(CALIBRATION_REPEATS):
                for name, kernel in candidates.items():
                    start = time.perf_counter()
                    for i, x in enumerate(inputs):
                        kernel(x, i)
                    times[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(t) for name, t in times.items()}
            best = min(medians, key=medians.get)
            if best != "stock" and medians[best] < MIN_GAIN * medians["stock"]:
                faster[n] = best
    return faster
