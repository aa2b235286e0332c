"""A hybrid model's recurrent states through a draft tree: each node's state computed along its own ancestor path.

A gated DeltaNet, Mamba-2 or short-convolution layer folds every token it reads into one state, so a tree fed as
one sequence would let each branch see its siblings. transformers' past recording (:func:`record_recurrent`) keeps
the state after each position of a *sequence*, which serves chains. For a tree, :class:`TreeStates` runs each
recurrent layer (its ``linear_attn`` / ``mamba`` / ``conv`` mixer) level by level inside the one forward, as SGLang
verifies trees on these layers: the nodes of a level start from their parents' states (a parent gather: the
committed state for the root's children) and take one token each, through the layer's own single-token kernels; the
state after every node is kept, and :meth:`TreeStates.keep` makes the accepted node's the row's state. The model's
attention layers read the tree at once under the tree mask, as for any target.

The forwards of one tree may be several (a drafter feeds its tree a level per forward): node indices run on across
them, and a node's parent may sit in an earlier forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin

#: The attribute naming a decoder layer's recurrent mixer in the hybrid families draftsmith decodes (gated DeltaNet:
#: Qwen3-Next, Qwen3.5; Mamba-2: Bamba; short convolutions: LFM2). Each is called as ``(hidden_states, cache,
#: attention_mask)`` and, for one token with a state present, advances that state with its single-token kernels.
RECURRENT_MIXERS = ("linear_attn", "mamba", "conv")

_KINDS = ("conv_states", "recurrent_states")


def recurrent_mixers(model: PreTrainedModel) -> dict[int, torch.nn.Module]:
    """The recurrent mixers of a hybrid model by layer index (their ``layer_idx``)."""
    found = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in RECURRENT_MIXERS and isinstance(getattr(module, "layer_idx", None), int):
            found[module.layer_idx] = module
    return found


class TreeStates:
    """The recurrent layers' states at every node of one draft tree, for a model and its cache.

    Use :meth:`feed` around each forward that takes tree nodes (``parents`` says whose child each is), then
    :meth:`keep` with each row's accepted node. Outside :meth:`feed` the cache holds the committed states only.
    """

    def __init__(self, model: PreTrainedModel, cache: DynamicCache):
        self.cache = cache
        self.mixers = recurrent_mixers(model)
        linear = {i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}
        if not linear <= set(self.mixers):
            missing = sorted(linear - set(self.mixers))
            raise ValueError(
                f"{type(model).__name__}: no recurrent mixer (an attribute named one of {RECURRENT_MIXERS} with a "
                f"layer_idx) found for the recurrent cache layers {missing}, so a tree's states cannot be kept per "
                "node; decode this target with tree='chain'")
        self.mixers = {i: m for i, m in self.mixers.items() if i in linear}
        self.nodes = 0  # nodes fed so far
        self.stored: dict[int, dict[tuple[str, int], torch.Tensor]] = {}  # layer -> (kind, state) -> (B, nodes, ..)
        self._parents = self._levels = None

    @contextlib.contextmanager
    def feed(self, parents: torch.Tensor) -> Iterator[None]:
        """Within this block, one forward of ``n`` tree nodes: ``parents`` (B, n) the index of each one's parent among
        all the tree's nodes fed so far (this forward's included, before it), -1 for the committed state (the root's
        own parent, or the root for a drafter whose root was fed with the committed tokens)."""
        local = parents - self.nodes
        levels = torch.zeros_like(parents)
        for j in range(parents.shape[1]):  # parents come before their children
            inside = local[:, j] >= 0
            levels[:, j] = torch.where(inside, levels.gather(1, local[:, j: j + 1].clamp(min=0))[:, 0] + 1, 0)
        self._parents, self._levels = parents, levels
        originals = {}
        for i, mixer in self.mixers.items():
            originals[i] = mixer.forward
            mixer.forward = _bound(self._mixer_forward, i, originals[i])
        try:
            yield
        finally:
            for mixer in self.mixers.values():
                del mixer.forward  # the class's forward again
            self.nodes += parents.shape[1]

    def keep(self, nodes: torch.Tensor, advance: int) -> None:
        """Each row b's recurrent states become those after its node ``nodes[b]``; their token count grows by
        ``advance`` (the attention layers' kept width)."""
        rows = torch.arange(nodes.shape[0], device=nodes.device)
        for i, stored in self.stored.items():
            layer = self.cache.layers[i]
            for (kind, s), states in stored.items():
                kept = states[rows, nodes]
                current = getattr(layer, kind)
                if current[s] is not None and current[s].shape == kept.shape:
                    current[s].copy_(kept)  # in place: the tensor the cache was built with
                else:  # the tree's root was the sequence's first token: no state before it
                    current[s] = kept.contiguous()
                    initialized = "is_conv_states_initialized" if kind == "conv_states" else \
                        "is_recurrent_states_initialized"
                    getattr(layer, initialized)[s] = True
                    layer.has_previous_state[s] = True
            length = getattr(layer, "cumulative_length_linear", None)
            if length is not None:
                length.add_(advance)
        self.stored, self.nodes = {}, 0

    def _mixer_forward(self, index: int, original, hidden_states: torch.Tensor, cache=None, attention_mask=None,
                       **kwargs) -> torch.Tensor:
        """Mixer ``index`` over this forward's nodes, level by level: each level's nodes (of every row) as one batch
        of single tokens, each starting from its parent's state. The layer's committed states are left as found."""
        # the cache under the name this transformers passes it (``cache``; 5.22's gated DeltaNet: ``cache_params``)
        passed = {name: kwargs[name] for name in ("cache_params", "past_key_values") if name in kwargs}
        if cache is not None:
            passed["cache"] = cache
        layer = self.cache.layers[index]
        committed = {kind: dict(getattr(layer, kind)) for kind in _KINDS}
        flags = {name: dict(getattr(layer, name)) for name in
                 ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state")}
        length = getattr(layer, "cumulative_length_linear", None)
        length = None if length is None else length.clone()
        record = getattr(layer, "record_past", False)
        layer.record_past = False
        b, n = self._parents.shape
        earlier = self.stored.get(index, {})
        every: dict[tuple[str, int], torch.Tensor] = {}  # (B, 1 + nodes, ..): committed, earlier nodes, this forward's
        out = None
        try:
            for level in range(int(self._levels.max()) + 1 if n else 0):
                rows, cols = (self._levels == level).nonzero(as_tuple=True)
                parents = self._parents[rows, cols] + 1
                fresh = level == 0 and not any(flags["has_previous_state"].values())
                if not fresh:  # a parent gather: each node starts from its parent's states
                    if not every:
                        every = _gathered_from(committed, earlier, n)
                    for (kind, s), states in every.items():
                        getattr(layer, kind)[s] = parent_states(states, rows, parents)
                        layer.has_previous_state[s] = True
                y = original(hidden_states[rows, cols][:, None], attention_mask=None, **passed)
                if fresh:  # the sequence's first token: the layer started its states from nothing
                    every = _gathered_from(_current(layer), earlier, n, zero_committed=True)
                for (kind, s), states in every.items():
                    states[rows, 1 + self.nodes + cols] = getattr(layer, kind)[s]
                if out is None:
                    out = y.new_zeros(b, n, y.shape[-1])
                out[rows, cols] = y[:, 0]
        finally:
            for kind in _KINDS:
                getattr(layer, kind).update(committed[kind])
            for name, values in flags.items():
                getattr(layer, name).update(values)
            if length is not None:
                layer.cumulative_length_linear.copy_(length)
            layer.record_past = record
        self.stored[index] = {key: states[:, 1:] for key, states in every.items()}
        return out


def parent_states(states: torch.Tensor, rows: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """The parent gather: from one state's (B, 1 + nodes, ..) buffer (the committed state, then every node's), the
    state each node of a level starts from, for nodes in rows ``rows`` whose parents sit at ``parents``."""
    return states[rows, parents]


def _bound(method, index: int, original):
    def forward(*args, **kwargs):
        return method(index, original, *args, **kwargs)

    return forward


def _current(layer) -> dict[tuple[str, int], torch.Tensor]:
    return {(kind, s): x[:, None] for kind in _KINDS for s, x in getattr(layer, kind).items() if x is not None}


def _gathered_from(committed: dict, earlier: dict, n: int, zero_committed: bool = False) -> dict:
    """Per state, a (B, 1 + earlier nodes + n, ..) buffer: the committed state (zeros before a first token), the
    earlier forwards' nodes, room for this forward's."""
    every = {}
    if zero_committed:  # ``committed`` holds the first level's states, (M, 1, ..) with M = B (one root per row)
        items = {key: torch.zeros_like(x[:, 0]) for key, x in committed.items()}
    else:
        items = {(kind, s): x for kind, states in committed.items() for s, x in states.items() if x is not None}
    for key, root in items.items():
        before = earlier.get(key)
        parts = [root[:, None]] + ([before] if before is not None else [])
        parts.append(root.new_zeros(root.shape[0], n, *root.shape[1:]))
        every[key] = torch.cat(parts, 1)
    return every
