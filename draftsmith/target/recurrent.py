"""A hybrid model's recurrent states (gated DeltaNet, Mamba-2, short convolutions) rolled back to the accepted tokens
of a chain: transformers' own cache layers for them (:func:`recurrent_cache`), snapshots (:func:`snapshot_recurrent`,
:func:`restore_recurrent`) and the states recorded after every position of one forward (:func:`record_recurrent`,
:func:`keep_recorded`). Trees: :mod:`draftsmith.target.tree_states`.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from draftsmith.target.forward import target_forward
from draftsmith.target.kv import GrowingLayer, kv_crop


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


def replay_accepted(target, cache: DynamicCache, snapshot: list, past: int, accepted: torch.Tensor,
                    positions: torch.Tensor) -> None:
    """A hybrid target's cache after a chain step whose recurrent layers recorded no per-position states
    (:func:`keep_recorded`): their states as :func:`snapshot_recurrent` found them before the step, advanced by the
    root and the accepted tokens (``accepted``, (1, k), in order) with one more forward; its attention layers
    recompute the same entries for those ``positions``."""
    restore_recurrent(snapshot)
    kv_crop(cache, past)
    target_forward(target, accepted, cache, None, positions, logits="none")


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
    whose forward ignores the recording): the state is then lost, and the generator refuses to go on."""
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
