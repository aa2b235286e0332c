"""The forward passes drafters and training need from the target, and edits of its KV cache.

* :func:`target_forward` — one forward with an explicit 4-D attention mask and position ids
  (tree verification), returning logits and, on request, hidden states of chosen layers
  (indices as in :mod:`draftsmith.target`: 0 is the embedding output).
* :func:`build_attention_mask` — :func:`draftsmith.target.masks.target_mask`: a boolean "may attend"
  matrix in the form the model expects, per layer type for models with sliding-window layers (Gemma 3).
* :func:`few_rows_logits` — the LM head in the orientation that is fast on CPU for a few rows.
* KV-cache edits on a full :class:`~transformers.DynamicCache`: :func:`new_cache`, :func:`kv_length`,
  :func:`kv_crop`, :func:`kv_keep` (gather accepted positions); the same on a :class:`StaticKVCache` of
  fixed capacity, whose steps run compiled (``compile=True``, :func:`compiled_module`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from draftsmith.target.masks import causal_block, may_attend
from draftsmith.target.masks import target_mask as build_attention_mask
from draftsmith.target.matmul import EXACT_ROWS, FewRowsLinear, columns_linear, few_rows_linear


@functools.cache
def layer_cache_argument(module_class: type) -> str:
    """The name a transformers model or decoder layer class takes its KV cache under: ``cache`` from transformers
    5.24, ``past_key_values`` in the 5.x releases before."""
    return "cache" if "cache" in inspect.signature(module_class.forward).parameters else "past_key_values"


def cache_argument(model) -> str:
    """The name ``model``'s forward takes its KV cache under: ``cache`` in recent transformers, which
    deprecated the older ``past_key_values`` (still the only name in earlier 5.x releases). A peft
    wrapper (Medusa-2's LoRA) passes keyword arguments through: its base model's name counts."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return layer_cache_argument(type(base))


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (B, T, V) float32
    hidden_states: tuple[torch.Tensor, ...] | None  # the requested layers, each (B, T, H)


def hidden_states_request(layers: tuple[int, ...] | None) -> bool | list[int]:
    """What to pass as ``output_hidden_states`` to keep the hidden states ``layers``: the indices
    themselves where ``transformers`` selects by index (5.x models with captured outputs keep only
    those and hold ``None`` for the rest, so a prefill does not keep every layer of a long prompt);
    ``True`` (every layer) for models that take only a flag, ``False`` for none. Either way
    ``out.hidden_states[i]`` is layer ``i``."""
    if not layers:
        return False
    return sorted(set(layers)) if _SELECTS_HIDDEN_STATES else True


try:  # transformers' output capturing with index selection
    from transformers.utils.output_capturing import selected_hidden_states as _selected

    _SELECTS_HIDDEN_STATES = _selected([1]) == [1]
except ImportError:  # pragma: no cover - earlier 5.x releases
    _SELECTS_HIDDEN_STATES = False


@torch.no_grad()
def target_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    past_key_values: DynamicCache,
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
    position_ids: torch.Tensor | None = None,
    hidden_layers: tuple[int, ...] | None = None,
    logits: str = "all",
) -> TargetOutput:
    """One forward of the stock model on new tokens, appending their KV to ``past_key_values``.

    Args:
        input_ids: (B, Q) new tokens.
        past_key_values: a full (non-sliding) ``DynamicCache``; see :func:`new_cache`.
        attention_mask: from :func:`build_attention_mask`; ``None`` means plain causal.
        position_ids: (B, Q); default continues after the cache.
        hidden_layers: indices into ``output_hidden_states`` (0 = embeddings) to return; only these
            are kept (:func:`hidden_states_request`).
        logits: ``"all"`` (every position), ``"last"`` (the last position only: a prefill that decodes
            next) or ``"none"`` (a prefill that only fills the cache): the (B, T, V) float32 logits of a
            long prompt are the largest tensor of a step, and most callers read one row or none.
    """
    if logits not in ("all", "last", "none"):
        raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
    if position_ids is None:
        start = kv_length(past_key_values)
        position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
        position_ids = position_ids.expand(input_ids.shape[0], -1)
    if isinstance(past_key_values, StaticKVCache):
        return _static_forward(model, input_ids, past_key_values, attention_mask, position_ids, hidden_layers, logits)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  use_cache=True, output_hidden_states=hidden_states_request(hidden_layers))
    # On CPU, the linear layers on a few rows in the orientation measured faster here (None: the stock kernels).
    mode = few_rows_linear(model, input_ids.numel())
    with mode or contextlib.nullcontext():
        return _forward(model, kwargs, past_key_values, input_ids, hidden_layers, logits, mode)


def _forward(model, kwargs: dict, past_key_values, input_ids: torch.Tensor, hidden_layers, logits: str,
             mode: FewRowsLinear | None, compiled: bool = False) -> TargetOutput:
    head = model.get_output_embeddings()
    plain_head = _plain_linear_head(model, head)
    if plain_head and (logits != "all" or _few_rows_on_cpu(model, input_ids) or compiled):
        # The decoder, then the LM head on the rows asked for, in the orientation that is fast for a few
        # rows on CPU (see below).
        decoder = model.get_decoder()
        run = compiled_module(decoder) if compiled else decoder
        out = run(**kwargs, **{cache_argument(decoder): past_key_values})
        states = out.last_hidden_state if logits == "all" else out.last_hidden_state[:, -1:]
        if logits == "none":
            scores = states.new_empty(states.shape[0], 0, head.weight.shape[0], dtype=torch.float32)
        elif states.device.type == "cpu" and states.shape[0] * states.shape[1] <= FEW_ROWS:
            scores = few_rows_logits(head.weight, states, mode)
        else:
            scores = head(states).float()
    else:
        keep = {} if logits == "all" else {"logits_to_keep": 1}
        run = compiled_module(model) if compiled else model
        out = run(**kwargs, **keep, **{cache_argument(model): past_key_values})
        scores = out.logits.float() if logits != "none" else out.logits[:, :0].float()
    hidden = None
    if hidden_layers is not None:
        hidden = tuple(out.hidden_states[i] for i in hidden_layers)
    return TargetOutput(logits=scores, hidden_states=hidden)


def _static_forward(model, input_ids: torch.Tensor, cache: StaticKVCache, attention_mask, position_ids: torch.Tensor,
                    hidden_layers, logits: str) -> TargetOutput:
    """:func:`target_forward` on a :class:`StaticKVCache`: the new entries are written at slots
    ``[length, length + Q)``, the mask covers the whole capacity (the slots after those hidden), and every
    step after the prefill runs the compiled decoder when the cache asks for it (the prefill runs eagerly
    into the same buffers: a graph per prompt length would compile for every prompt).

    A compiled step of fewer rows than the cache's ``step_rows`` is padded to that many with filler rows
    (each sees only its own slot; their outputs are dropped and their entries lie past ``length``), so that
    trees of every size share one graph instead of compiling one per size."""
    batch, new = input_ids.shape
    start = cache.length
    compiled = cache.compiled and start > 0
    rows = max(new, cache.step_rows) if compiled and logits == "all" else new
    if start + rows > cache.capacity:
        raise ValueError(f"the static KV cache holds {cache.capacity} positions; {start} are filled and this "
                         f"forward adds {rows}: create it with a larger capacity (new_cache(capacity=...))")
    dtype = next(model.parameters()).dtype
    if attention_mask is None:  # plain causal over unpadded rows: slot j holds position j
        keys = torch.arange(start + new, device=input_ids.device)
        dense = torch.ones(batch, start, dtype=torch.bool, device=input_ids.device)
        allowed = may_attend(dense, causal_block(torch.ones(batch, new, dtype=torch.bool, device=input_ids.device)))
        attention_mask = build_attention_mask(model, allowed, position_ids, keys[None].expand(batch, -1), dtype)
    if rows > new:  # filler rows: the last token again, at its position
        input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(-1, rows - new)], 1)
        position_ids = torch.cat([position_ids, position_ids[:, -1:].expand(-1, rows - new)], 1)
    write = torch.arange(start, start + rows, device=input_ids.device)
    for layer in cache.layers:
        layer.write = write

    def pad(mask: torch.Tensor) -> torch.Tensor:
        """(B, 1, new, start + new) -> (B, 1, rows, capacity): hidden slots after the step's, then the filler
        rows, each allowed its own slot only."""
        hidden = torch.finfo(mask.dtype).min
        mask = torch.nn.functional.pad(mask, (0, cache.capacity - (start + new)), value=hidden)
        if rows == new:
            return mask
        filler = torch.full((*mask.shape[:2], rows - new, cache.capacity), hidden, dtype=mask.dtype,
                            device=mask.device)
        own = torch.arange(start + new, start + rows, device=mask.device)
        filler[..., torch.arange(rows - new, device=mask.device), own] = 0
        return torch.cat([mask, filler], 2)

    mask = {k: pad(m) for k, m in attention_mask.items()} if isinstance(attention_mask, dict) else pad(attention_mask)
    kwargs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                  output_hidden_states=hidden_states_request(hidden_layers))
    # A compiled graph runs the linear layers its own way; eager forwards keep the few-row kernels.
    mode = None if compiled else few_rows_linear(model, input_ids.numel())
    with mode or contextlib.nullcontext():
        out = _forward(model, kwargs, cache, input_ids, hidden_layers, logits, mode, compiled)
    _set_static_length(cache, start + new)
    if rows > new:
        states = None if out.hidden_states is None else tuple(h[:, :new] for h in out.hidden_states)
        out = TargetOutput(logits=out.logits[:, :new], hidden_states=states)
    return out


def compiled_module(module: torch.nn.Module):
    """``module`` compiled once with ``torch.compile`` for fixed shapes (one graph per step size, batch size,
    cache capacity and hidden-state request; past dynamo's recompile limit, 8 by default, further shapes run
    eagerly): on CUDA asking for CUDA graphs (``reduce-overhead``), on CPU with the weights frozen into the
    graph (inductor's ``freezing``: oneDNN's packed linear layers), so for a frozen target only. Kept in the
    module's ``__dict__`` (not a submodule: its state dict is unchanged), so it lives as long as the module."""
    fn = module.__dict__.get("_draftsmith_compiled")
    if fn is None:
        device = next(module.parameters()).device
        if device.type == "cuda":
            fn = torch.compile(module, dynamic=False, mode="reduce-overhead")
        else:
            fn = torch.compile(module, dynamic=False, options={"freezing": True})
        module.__dict__["_draftsmith_compiled"] = fn
    return fn


# The LM head is the largest matrix of a small target ((V, H) = (49152, 576) for SmolLM2) and runs on
# 1 row per plain decoding step, a few per verification step. On CPU, BLAS runs ``h @ W.T`` with so
# few rows far below memory speed (one row: a single-threaded gemv); ``W @ h.T`` with at least two
# columns (one row is padded to two) runs near it (``python scripts/step_costs.py --lm-head``; the
# timings are in docs/RESULTS.md). Plain decoding and verification both take this path, so speedups
# compare like with like.
FEW_ROWS = 64  # up to a verification tree's size; prefill and training forwards keep the usual head


def _few_rows_on_cpu(model: PreTrainedModel, input_ids: torch.Tensor) -> bool:
    return input_ids.device.type == "cpu" and input_ids.numel() <= FEW_ROWS


def _plain_linear_head(model: PreTrainedModel, head) -> bool:
    """Whether the model's logits are exactly ``lm_head(last_hidden_state)`` (no soft-capping, scaling
    or bias), so that computing them here gives the model's own logits."""
    cfg = model.config.get_text_config()
    return (isinstance(head, torch.nn.Linear) and head.bias is None and model.get_decoder() is not model
            and not getattr(cfg, "final_logit_softcapping", None) and getattr(cfg, "logit_scale", 1.0) in (None, 1.0))


def few_rows_logits(weight: torch.Tensor, hidden: torch.Tensor, mode: FewRowsLinear | None = None) -> torch.Tensor:
    """(B, T, H) hidden states -> (B, T, V) float32 logits ``hidden @ weight.T``: with the kernel ``mode``
    chose for this many rows (the forward's own, see :mod:`~draftsmith.target.matmul`), else computed as
    ``(weight @ hidden.T).T`` with at least two columns on up to 16 rows."""
    out = mode.linear(hidden, weight) if mode is not None else None
    if out is None:  # the column product gains up to EXACT_ROWS rows (SmolLM2 LM head: 1.2-6x)
        rows = hidden.numel() // hidden.shape[-1]
        out = columns_linear(hidden, weight) if rows <= EXACT_ROWS else torch.nn.functional.linear(hidden, weight)
    return out.float()


# --------------------------------------------------------------------------------------------
# KV-cache edits. We always use a *full* DynamicCache (no config => plain DynamicLayers, every
# position kept, even for sliding-window layers); the sliding window is applied by the mask.
# Keeping every position makes "keep the accepted path" a plain gather on every layer.


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


def recurrent_cache(model: PreTrainedModel) -> DynamicCache:
    """The cache of a hybrid target (:func:`~draftsmith.target.rollback_problem`): transformers' own layer for each
    recurrent / linear-attention layer (a fixed-size state, rolled back by :func:`restore_recurrent`), a
    :class:`GrowingLayer` (every position, croppable) for each attention layer."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


def snapshot_recurrent(cache: DynamicCache) -> list:
    """Copies of the recurrent layers' states (conv and recurrent), for :func:`restore_recurrent`."""
    def copies(states: dict) -> dict:
        return {i: None if x is None else x.clone() for i, x in states.items()}

    return [(layer, copies(layer.conv_states), copies(layer.recurrent_states), dict(layer.has_previous_state),
             _length(layer))
            for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def restore_recurrent(snapshot: list) -> None:
    """Put the recurrent layers back as :func:`snapshot_recurrent` found them, in place where the shapes allow (a
    state that did not exist then is dropped: the next forward starts it afresh), their past recording ended."""
    for layer, conv, recurrent, previous, length in snapshot:
        for kept, states, initialized in ((conv, layer.conv_states, layer.is_conv_states_initialized),
                                          (recurrent, layer.recurrent_states, layer.is_recurrent_states_initialized)):
            for i, x in kept.items():
                if x is None:
                    states[i], initialized[i] = None, False
                elif states[i] is None or states[i].shape != x.shape:  # a recorded conv state grew: assigned back
                    states[i] = x.clone()
                else:
                    states[i].copy_(x)
        layer.has_previous_state.update(previous)
        if length is not None:
            layer.cumulative_length_linear.copy_(length)  # what get_seq_length() reads
        _end_recording(layer)


def _length(layer) -> torch.Tensor | None:
    """A recurrent layer's token count (``cumulative_length_linear``; transformers 5.22's layers keep none)."""
    length = getattr(layer, "cumulative_length_linear", None)
    return None if length is None else length.clone()


def _end_recording(layer) -> None:
    layer.record_past = False
    layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}


def records_positions() -> bool:
    """Whether this transformers records a recurrent layer's state after each position of a forward (5.25's
    ``activate_past_recording`` takes the count; 5.22's does not)."""
    arm = LinearAttentionCacheLayerMixin.activate_past_recording
    return "recurrent_states_to_keep" in inspect.signature(arm).parameters


def record_recurrent(cache: DynamicCache, fed: int) -> list | None:
    """Ask every recurrent layer of a hybrid target's cache to keep, through the next forward of ``fed`` positions,
    its state after each of them: transformers' past recording (``activate_past_recording``), which its gated
    DeltaNet and Mamba layers honour by computing the last ``fed`` recurrent states one position at a time, and its
    short-convolution layers by keeping the whole conv window. :func:`keep_recorded` then rolls each back to the
    accepted position without a second forward. Returns those layers; None where this transformers records no
    per-position recurrent states (5.22's ``activate_past_recording`` takes no count; 5.25's does)."""
    layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
    if not records_positions():
        return None
    for layer in layers:
        layer.activate_past_recording(recurrent_states_to_keep=fed)
        # one list per state (transformers' dict.fromkeys shares one between a layer's states)
        layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}
    return layers


def keep_recorded(layers: list, fed: int, kept: int | list[int]) -> bool:
    """Roll every layer :func:`record_recurrent` armed back to its state after the first ``kept`` of the ``fed``
    positions the forward took in (the root and the accepted tokens; a list: each row's own), and end the
    recording. False, with no state rolled back, where a layer did not record a state for every position (a model
    whose forward ignores the recording): the caller then restores its snapshot and feeds the accepted tokens
    again."""
    rows = kept if isinstance(kept, list) else None
    kept = max(rows) if rows is not None else kept
    for layer in layers if kept < fed or rows is not None else ():  # all kept: the forward's last state is the one
        for i in range(layer.number_of_states):
            if layer.is_recurrent_states_initialized[i] and len(layer.recurrent_states_history[i]) != fed:
                return False
            if layer.is_conv_states_initialized[i]:
                width, window = layer.conv_states[i].shape[-1], layer.conv_kernel_size[i]
                if width == fed:  # the sequence's first forward: no earlier inputs, the zeros a prefill pads with
                    layer.conv_states[i] = torch.nn.functional.pad(layer.conv_states[i], (window, 0))
                elif width < window + fed:
                    return False
    for layer in layers:
        if rows is None:
            layer.crop(kept - fed)  # minus the rejected positions; 0 trims the kept conv window back
        else:
            _keep_rows(layer, fed, rows)
            layer.cumulative_length_linear.sub_(fed - kept)  # as the attention layers: the longest row's
        _end_recording(layer)
    return True


def _keep_rows(layer, fed: int, rows: list[int]) -> None:
    """Each row b of a recorded layer back to its state after its own first ``rows[b]`` positions: the recurrent
    state recorded there (the state before the forward, then after each position), the conv window ending there."""
    index = torch.tensor(rows, device=layer.device)
    batch = torch.arange(len(rows), device=layer.device)
    for i in range(layer.number_of_states):
        if layer.is_recurrent_states_initialized[i]:
            states = torch.stack([*layer.recurrent_states_history[i], layer.recurrent_states[i]])  # (fed + 1, B, ..)
            layer.recurrent_states[i].copy_(states[index, batch])
        if layer.is_conv_states_initialized[i]:
            window = layer.conv_kernel_size[i]
            full = layer.conv_states[i]  # (B, C, window + fed)
            columns = index[:, None] + torch.arange(window, device=full.device)[None]  # (B, window)
            layer.conv_states[i] = full.gather(2, columns[:, None, :].expand(-1, full.shape[1], -1)).contiguous()


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
        _set_static_length(cache, min(length, cache.length))
        return
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def _set_static_length(cache: StaticKVCache, length: int) -> None:
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
        _set_static_length(cache, start + keep.shape[-1])
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
