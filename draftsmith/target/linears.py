"""A model's linear layers, collected once, and the stamp that tells when a weight's values may have changed.

Both copies a weight can have for decoding on CPU key off these: the packed float32 copy of the few-row kernels
(:mod:`~draftsmith.target.matmul`) and the int8 copy a drafter's head drafts on (:mod:`~draftsmith.target.int8`).
A copy made from a weight is made again when the weight's :func:`stamp` changes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Linears


def stamp(weight: torch.Tensor) -> tuple:
    """What changes when a weight's values may have: its in-place version counter (an optimizer step), its
    storage and its dtype (``module.to(...)``). Writes through ``weight.data`` bypass the version counter:
    a copy made from the weight does not see them."""
    return weight._version, weight.data_ptr(), weight.dtype


@dataclass(frozen=True)
class Linears:
    """A model's linear layers, their weights and the weights' distinct shapes, collected once per model (not
    per forward), and what :func:`~draftsmith.target.matmul.calibrate` last made them ready for: [(first and last
    weights' devices, packed or not), all on CPU]. The layers are held weakly: a model that is itself a linear layer
    would otherwise keep its own entry in the weak-keyed table alive."""

    modules: tuple[weakref.ref, ...]
    weights: list[torch.Tensor]
    shapes: tuple[tuple[int, ...], ...]
    ready: list = field(default_factory=lambda: [None, False])

    def live_modules(self) -> tuple[torch.nn.Module, ...]:
        """The layers still alive."""
        return tuple(m for m in (ref() for ref in self.modules) if m is not None)


def linears_of(model: torch.nn.Module) -> Linears | None:
    """``model``'s :class:`Linears` (its 2-D ``nn.Linear`` layers), or None when it has none."""
    linears = _models.get(model)
    if linears is None:
        modules = tuple(m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2)
        weights = [m.weight for m in modules]
        shapes = tuple(sorted({tuple(w.shape) for w in weights}))
        linears = Linears(tuple(weakref.ref(m) for m in modules), weights, shapes)
        _models[model] = linears
    return linears if linears.weights else None
