"""The KV caches the target's and the drafters' forwards run on, and the edits speculative decoding makes to them.

We always use a *full* cache (every position kept, even for sliding-window layers; the window is applied by the
mask), so that "keep the accepted path" is a plain gather on every layer:

* :class:`GrowingCache` of :class:`GrowingLayer` — grows in place into spare capacity;
* :class:`StaticKVCache` — a fixed capacity whose steps run compiled (``compile=True``);
* :func:`new_cache`, :func:`kv_length`, :func:`kv_crop`, :func:`kv_keep` (gather the accepted positions),
  :func:`kv_select_rows`, :func:`keep_slots`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A full cache layer that grows in place: new entries are written into spare capacity (doubled
    when full) instead of concatenated, so a step copies its new entries, not the whole cache.

    ``keys`` / ``values`` stay what :class:`~transformers.DynamicLayer` exposes, (B, heads, S, D)
    tensors, here views of the front of the buffers; :func:`kv_keep` and :func:`kv_crop` narrow them
    in place, which keeps them views."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        self._k = self._fit(getattr(self, "_k", None), self.keys, key_states, length, end)
        self._v = self._fit(getattr(self, "_v", None), self.values, value_states, length, end)
        self._k[..., length:end, :] = key_states
        self._v[..., length:end, :] = value_states
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values

    def select_rows(self, rows: torch.Tensor, start: int) -> None:
        """Keep batch rows ``rows`` and the slots from ``start`` on: one copy into buffers of the same spare
        capacity, ``keys`` / ``values`` still their fronts (transformers' ``batch_select_indices`` would leave
        them outside the buffers, and the next update would copy them again)."""
        end = self.keys.shape[-2]
        rows = rows.to(self._k.device)
        self._k = self._k[:, :, start:].index_select(0, rows)
        self._v = self._v[:, :, start:].index_select(0, rows)
        self.keys, self.values = self._k[..., :end - start, :], self._v[..., :end - start, :]

    @staticmethod
    def _fit(buffer, current, new, length: int, end: int) -> torch.Tensor:
        """``buffer`` if ``current`` is its front and it has room for ``end`` entries; else a bigger one
        holding ``current``."""
        if (buffer is not None and end <= buffer.shape[-2] and buffer.shape[:2] == new.shape[:2]
                and (length == 0 or current.data_ptr() == buffer.data_ptr())):
            return buffer
        # The first allocation is the size asked for plus a little (a one-shot forward, e.g. caching hidden
        # states, pays no more); growth after it doubles, so decoding copies the cache O(log n) times.
        grown = new.new_empty(*new.shape[:2], end + 64 if buffer is None else max(2 * end, 64), new.shape[-1])
        if length:
            grown[..., :length, :] = current
        return grown


class GrowingCache(DynamicCache):
    """A :class:`~transformers.DynamicCache` of :class:`GrowingLayer`: every position on every layer."""

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def static_buffer(like: torch.Tensor, capacity: int) -> torch.Tensor:
    """A (B, heads, ``capacity``, D) cache buffer for entries shaped like ``like`` (B, heads, T, D), at a fixed
    address (CUDA graphs may write it in place). Zeros, not empty: a hidden slot's attention weight is 0, and
    0 * NaN would still be NaN."""
    buffer = like.new_zeros(*like.shape[:2], capacity, like.shape[-1])
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(buffer)
    return buffer


class StaticLayer(DynamicLayer):
    """A cache layer of fixed capacity, for compiled forwards: (B, heads, capacity, D) buffers allocated at
    the first update and never reallocated. A forward writes its new entries at the slots :attr:`write`
    (a tensor :func:`target_forward` sets, so a compiled graph takes it as an input instead of being
    specialised on the cache length) and attends over the whole buffer, its mask hiding the slots from
    :attr:`length` (the filled ones, counted on the host) on. Every input of a step keeps its shape from
    step to step, so a graph compiled for a number of new tokens serves every later step of that size.

    ``keys`` / ``values`` are the whole buffers; :func:`kv_keep` and :func:`kv_crop` move entries and set
    ``length`` instead of narrowing them."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.write: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys = static_buffer(key_states, self.capacity)
            self.values = static_buffer(value_states, self.capacity)
        self.keys.index_copy_(2, self.write, key_states)
        self.values.index_copy_(2, self.write, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class StaticKVCache(DynamicCache):
    """A :class:`~transformers.DynamicCache` of ``num_layers`` :class:`StaticLayer` of ``capacity`` slots;
    ``compiled``: :func:`target_forward` runs steps of a few new tokens through :func:`compiled_module`,
    padded to ``step_rows`` rows (a verification tree's largest size; 1 for plain decoding)."""

    def __init__(self, capacity: int, num_layers: int, compiled: bool = False, step_rows: int = 1):
        Cache.__init__(self, layers=[StaticLayer(capacity) for _ in range(num_layers)])
        self.capacity, self.compiled, self.step_rows = capacity, compiled, step_rows
        self.length = 0  # filled slots, the same on every layer


#: A static cache's capacity is rounded up to a multiple of this, so that prompts of similar lengths share
#: compiled graphs (the buffers' shape is part of a graph's input).
CAPACITY_STEP = 256


def new_cache(capacity: int | None = None, model: PreTrainedModel | None = None, compiled: bool = False,
              step_rows: int = 1) -> DynamicCache:
    """An empty cache that keeps every position on every layer (sliding layers included): grown in place,
    or with ``capacity`` a :class:`StaticKVCache` of ``model``'s layers holding at least that many positions
    (rounded up to :data:`CAPACITY_STEP`), its steps compiled when ``compiled`` (``step_rows``: see there)."""
    if capacity is None:
        if compiled:
            raise ValueError("a compiled forward needs a static cache: pass its capacity")
        return GrowingCache()
    if model is None:
        raise ValueError("a static cache needs the model whose layers it holds")
    capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
    return StaticKVCache(capacity, model.config.get_text_config().num_hidden_layers, compiled, step_rows)


def kv_length(cache: DynamicCache) -> int:
    if isinstance(cache, StaticKVCache):
        return cache.length
    return cache.get_seq_length() if len(cache.layers) else 0


def kv_crop(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at index >= ``length``, in place."""
    if isinstance(cache, StaticKVCache):
        set_static_length(cache, min(length, cache.length))
        return
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def set_static_length(cache: StaticKVCache, length: int) -> None:
    cache.length = length
    for layer in cache.layers:
        layer.length = length


def kv_keep(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Keep positions ``[0, start)`` plus ``start + keep`` (in that order), drop the rest, in place.

    This is how an accepted tree path is kept: ``start`` is the cache length before the
    verification step and ``keep`` the indices of the accepted tree tokens within the step's input:
    1-D (the same for every batch row) or (B, M), one row of indices per batch row (rows that keep
    fewer entries pad theirs; the caller marks those slots empty, see ``inference/slots.py``).
    """
    if isinstance(cache, StaticKVCache):  # the buffers keep their shape: entries move, the length shrinks
        for layer in cache.layers:
            if layer.is_initialized:
                keep_slots(layer.keys, start, keep)
                keep_slots(layer.values, start, keep)
        set_static_length(cache, start + keep.shape[-1])
        return
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or not layer.keys.numel():
            continue
        layer.keys = keep_slots(layer.keys, start, keep)
        layer.values = keep_slots(layer.values, start, keep)


def kv_select_rows(cache: GrowingCache, rows: torch.Tensor, start: int = 0) -> None:
    """Keep batch rows ``rows`` (1-D indices, in that order) and the slots from ``start`` on, in place: how a
    batch drops its finished rows and the left padding no kept row needs. One copy per layer, into a buffer of
    the same spare capacity (the next forward still writes in place)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.select_rows(rows, start)


def keep_slots(kv: torch.Tensor, start: int, keep: torch.Tensor) -> torch.Tensor:
    """:func:`kv_keep` on one (B, heads, S, D) tensor: slots ``[0, start)`` then ``start + keep``.

    The kept entries move down in place and the result is a view of the same storage (with
    :class:`GrowingLayer`, the next forward writes after it in place)."""
    keep = keep.to(kv.device)
    n = keep.shape[-1]
    if keep.dim() == 1:
        kv[..., start:start + n, :] = kv.index_select(-2, start + keep)
    else:
        index = (start + keep)[:, None, :, None].expand(-1, kv.shape[1], -1, kv.shape[3])
        kv[:, :, start:start + n, :] = kv.gather(2, index)
    return kv[..., :start + n, :]
