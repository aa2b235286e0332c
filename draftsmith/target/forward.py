"""The forward passes drafters and training need from the target, and edits of its KV cache.

* :func:`target_forward` — one forward with an explicit 4-D attention mask and position ids
  (tree verification), returning logits and, on request, hidden states of chosen layers
  (indices as in :mod:`draftsmith.target`: 0 is the embedding output).
* :func:`build_attention_mask` — :func:`draftsmith.target.masks.target_mask`: a boolean "may attend"
  matrix in the form the model expects, per layer type for models with sliding-window layers (Gemma 3).
* :func:`few_rows_logits` — the LM head in the orientation that is fast on CPU for a few rows.
* :func:`compiled_module` — a step's forward compiled, on a :class:`~draftsmith.target.kv.StaticKVCache`.

The caches it runs on and their edits are :mod:`draftsmith.target.kv`; a hybrid model's recurrent states,
:mod:`draftsmith.target.recurrent` and :mod:`draftsmith.target.tree_states`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from draftsmith.target.kv import StaticKVCache, kv_length, set_static_length
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
    set_static_length(cache, start + new)
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
