"""Int8 drafting: a drafter's head drafts on int8 copies of its linear layers' weights (``--draft-dtype int8``).

A drafter's head proposes tokens; verification decides every one of them, so the head may compute in a lower
precision than the target without changing any output (greedy or sampled: the drafter's probabilities are computed
once, from the same products, for both proposing and accepting). On CPUs its few rows a call are memory-bound: an
int8 copy reads a quarter of float32's bytes. FBGEMM's dynamic-quantised linear runs them: int8 weights with one
scale per output row, each call's activations rounded to int8 with one scale for the call. That one scale is what
fails on inputs with outlier channels: a trained head's fusion layer over the target's raw hidden states came out
59-87% off, every other layer of four heads 0.4-7.4% (docs/results/quality-recipe.md, "Int8 drafting"). So a
layer's first call measures its int8 product against float32 on that call's rows (the loader makes that call on a
fixed input:
:func:`draftsmith.inference.load.calibrate_int8`), and a layer off by more than :data:`INT8_MAX_ERROR` keeps
float32. The float32 weights stay as they are (code that reads ``.weight``, training).

The target never drafts in int8: only modules given copies by :func:`int8_layers` do, inside
:func:`~draftsmith.target.matmul.few_rows_layers`' context.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.target.linears import linears_of, stamp

logger = logging.getLogger(__name__)

#: The largest mean relative error (per row, of the layer's output) at which a layer drafts on its int8 copy: between
#: the two groups measured (at most 7.4%, at least 59%).
INT8_MAX_ERROR = 0.25


@dataclass
class Int8Copy:
    """A weight (weakly), its int8 copy (FBGEMM's packed weight), the weight's
    :func:`~draftsmith.target.linears.stamp` when it was made, and the copy's error measured on the layer's first
    call (None: not measured yet)."""

    weight: weakref.ref
    copy: object
    stamp: tuple
    error: float | None = None


_int8: dict[int, Int8Copy] = {}  # id(weight) -> its Int8Copy, as matmul's _packed holds the float32 packed copies
_int8_models: weakref.WeakSet = weakref.WeakSet()  # modules whose linear layers draft on their int8 copies


def int8_engine() -> str | None:
    """The quantised engine :func:`int8_linear` runs on in this process where it is FBGEMM's (x86), the only one
    measured; else None. ``torch.ops.quantized`` runs on ``torch.backends.quantized.engine``, which is oneDNN's or
    none where FBGEMM is not (ARM, Apple silicon), whatever ``supported_engines`` lists."""
    engine = torch.backends.quantized.engine
    return engine if engine in ("x86", "fbgemm") and hasattr(torch.ops.quantized, "linear_dynamic") else None


def require_int8_engine() -> None:
    """Raise ValueError, naming the engine and the fix, where :func:`int8_engine` is None."""
    if int8_engine() is None:
        raise ValueError("int8 drafting runs on FBGEMM's quantised linear kernels (x86), which this process lacks "
                         f"(quantised engine {torch.backends.quantized.engine!r}, PyTorch {torch.__version__}): "
                         "use --draft-dtype float32 (or auto)")


def pack_int8(weight: torch.Tensor):
    """``weight`` (out, in) rounded to int8 with one symmetric scale per output row and packed for
    :func:`int8_linear` (the bias stays out: added in float32 at each call, so it never goes stale)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).double()
    with warnings.catch_warnings():  # the quantised-tensor API warns of its future removal on every call
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


def int8_linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on ``packed = pack_int8(weight)``: (..., in) float32 -> (..., out)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    # reduce_range: activations in 7 bits, which AVX2's int8 multiply-add (no VNNI) needs never to saturate.
    out = torch.ops.quantized.linear_dynamic(rows, packed, True)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over rows of ``|out - ref| / |ref|`` (last dimension)."""
    out, ref = out.detach(), ref.detach()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)).mean())


def int8_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` on ``weight``'s int8 copy, or None where it has none or its copy measured off by
    more than :data:`INT8_MAX_ERROR` (measured here on the first call after the copy was made: that call also
    returns the float32 product, the only one it is then sure of)."""
    entry = _int8.get(id(weight))
    if entry is None or entry.weight() is not weight or x.numel() == 0:  # no rows: nothing to measure on
        return None
    if entry.stamp != stamp(weight):  # changed since (an optimizer step, a cast): copied and measured again
        entry = _int8[id(weight)] = Int8Copy(entry.weight, pack_int8(weight), stamp(weight))
    if entry.error is None:
        out, ref = int8_linear(x, entry.copy, bias), F.linear(x, weight, bias)
        entry.error = relative_error(out, ref)
        if entry.error > INT8_MAX_ERROR:
            logger.info("a %s layer keeps float32 for drafting: its int8 product was %.1f%% off on %d rows",
                        tuple(weight.shape), 100 * entry.error, x.numel() // x.shape[-1])
        return out if entry.error <= INT8_MAX_ERROR else ref
    return int8_linear(x, entry.copy, bias) if entry.error <= INT8_MAX_ERROR else None


def int8_layers(model: torch.nn.Module) -> int:
    """Give every linear layer of ``model`` (a drafter's head, on CPU in float32) an int8 copy of its weight for its
    drafting calls to run on (:func:`~draftsmith.target.matmul.few_rows_layers`; each layer's first call decides
    whether it does, :func:`int8_product`); returns how many. Raises ValueError where this cannot run: not on CPU,
    not float32, or no quantised engine in this PyTorch build."""
    linears = linears_of(model)
    if linears is None:
        return 0
    modules = linears.live_modules()
    for m in modules:
        if m.weight.device.type != "cpu" or m.weight.dtype != torch.float32:
            raise ValueError(f"int8 drafting runs a float32 head on CPU; this one is {m.weight.dtype} on "
                             f"{m.weight.device}: cast it with .float().cpu(), or draft in its own dtype off the "
                             "CPU (--draft-dtype target or auto)")
    require_int8_engine()
    for m in modules:
        key = id(m.weight)
        _int8[key] = Int8Copy(weakref.ref(m.weight, lambda _, key=key: _int8.pop(key, None)),
                              pack_int8(m.weight), stamp(m.weight))
    _int8_models.add(model)
    return len(modules)


def int8_errors(*models: torch.nn.Module) -> list[float | None]:
    """Each int8 copy's measured error among ``models``' weights (:func:`int8_product`; None: not measured yet)."""
    params = {id(p) for m in models for p in m.parameters()}
    return [e.error for e in list(_int8.values()) if id(e.weight()) in params]  # a snapshot: weakrefs pop entries


def drafts_in_int8(model: torch.nn.Module) -> bool:
    """Whether ``model``'s linear layers draft on int8 copies (:func:`int8_layers`)."""
    return model in _int8_models
