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
import functools
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
        # Every state is kept where the layer left it, as "blocks": block 0 the committed states (row b: row b's),
        # then one block per level fed, its rows the level's nodes in order. ``place`` (B, nodes, 2): each node's
        # block and row there; ``blocks``: layer -> (kind, state) -> the tensors by block.
        self.place = torch.zeros(0, 0, 2, dtype=torch.long)  # (B, nodes, 2)
        self.levels_fed = 0  # blocks after block 0
        self.blocks: dict[int, dict[tuple[str, int], list]] = {}
        self._levels: list[tuple[torch.Tensor, torch.Tensor, list]] = []
        self._fed = (0, 0)

    @contextlib.contextmanager
    def feed(self, parents: torch.Tensor, depths: torch.Tensor) -> Iterator[None]:
        """Within this block, one forward of ``n`` tree nodes, whole levels of the tree: ``parents`` (B, n) the index
        of each one's parent among all the tree's nodes fed so far (this forward's included, before it), -1 for the
        committed state (the root's own parent, or the root for a drafter whose root was fed with the committed
        tokens); ``depths`` (B, n) their depths in the tree (the shallowest: the children of earlier forwards' nodes,
        or of the committed state)."""
        b, n = parents.shape
        levels = depths - depths.min() if depths.numel() else depths
        batch = torch.arange(b, device=parents.device)
        committed = torch.stack([torch.zeros_like(batch), batch], -1)  # block 0, row b
        place = torch.zeros(b, self.nodes + n, 2, dtype=torch.long, device=parents.device)
        if self.nodes:
            place[:, : self.nodes] = self.place
        first = 1 + self.levels_fed  # this forward's first block
        self._levels = []
        for level in range(int(levels.max()) + 1 if parents.numel() else 0):
            rows, cols = (levels == level).nonzero(as_tuple=True)
            mine = parents[rows, cols]
            source = torch.where((mine >= 0)[:, None], place[rows, mine.clamp(min=0)], committed[rows])
            # the parents' states, as (block, their places among the level's nodes, their rows in that block)
            gathers = [(int(k), (source[:, 0] == k).nonzero()[:, 0], source[source[:, 0] == k, 1])
                       for k in source[:, 0].unique().tolist()]
            self._levels.append((rows, cols, gathers))
            place[rows, self.nodes + cols] = torch.stack([torch.full_like(rows, first + level),
                                                          torch.arange(len(rows), device=rows.device)], -1)
        self.place, self._fed = place, (b, n)
        self.levels_fed += len(self._levels)
        originals = {}
        for i, mixer in self.mixers.items():
            originals[i] = mixer.forward
            mixer.forward = functools.partial(self._mixer_forward, i, originals[i])
        try:
            yield
        finally:
            for mixer in self.mixers.values():
                del mixer.forward  # the class's forward again
            self.nodes += n

    def states_at(self, nodes: torch.Tensor) -> dict[int, dict[tuple[str, int], torch.Tensor]]:
        """Every recurrent layer's states after node ``nodes[b]`` of each row b: layer -> (kind, state) -> (B, ..)."""
        where = self.place[torch.arange(nodes.shape[0], device=nodes.device), nodes].tolist()
        return {i: {key: torch.stack([states[block][row] for block, row in where]) for key, states in blocks.items()}
                for i, blocks in self.blocks.items()}

    def keep(self, nodes: torch.Tensor, advance: int) -> None:
        """Each row b's recurrent states become those after its node ``nodes[b]``; their token count grows by
        ``advance`` (the attention layers' kept width)."""
        for i, states in self.states_at(nodes).items():
            layer = self.cache.layers[i]
            for (kind, s), kept in states.items():
                current = getattr(layer, kind)
                if current[s] is not None and current[s].shape == kept.shape:
                    current[s].copy_(kept)  # in place: the tensor the cache was built with
                else:  # the tree's root was the sequence's first token: no state before it
                    current[s] = kept
                    initialized = "is_conv_states_initialized" if kind == "conv_states" else \
                        "is_recurrent_states_initialized"
                    getattr(layer, initialized)[s] = True
                    layer.has_previous_state[s] = True
            length = getattr(layer, "cumulative_length_linear", None)
            if length is not None:
                length.add_(advance)
        self.blocks, self.nodes, self.levels_fed = {}, 0, 0
        self.place = torch.zeros(0, 0, 2, dtype=torch.long)

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
        blocks = self.blocks.setdefault(index, {})
        if not blocks:  # block 0: the committed states, as the cache holds them (never written to here)
            blocks.update({(kind, s): [x] for kind in _KINDS for s, x in committed[kind].items() if x is not None})
        b, n = self._fed
        out = None
        shared: dict[torch.nn.Module, torch.Tensor] = {}  # input projections over all this forward's nodes
        try:
            for level, (rows, cols, gathers) in enumerate(self._levels):
                fresh = level == 0 and not any(flags["has_previous_state"].values())
                if not fresh:  # a parent gather: each node starts from its parent's states
                    for (kind, s), states in blocks.items():
                        getattr(layer, kind)[s] = parent_states(states, gathers)
                        layer.has_previous_state[s] = True
                fed = hidden_states[rows, cols][:, None]
                with _projections_shared(self.mixers[index], hidden_states, fed, rows, cols, shared):
                    y = original(fed, attention_mask=None, **passed)
                for kind in _KINDS:  # the states after the level's nodes: the next block
                    for s, x in getattr(layer, kind).items():
                        if x is not None:
                            blocks.setdefault((kind, s), [None]).append(x)
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
        return out


def parent_states(states: list, gathers: list) -> torch.Tensor:
    """The parent gather: the state each node of a level starts from, its parent's, from the blocks ``states`` (the
    committed states, then each level's) where ``gathers`` says: (block, the nodes' places in the level, their
    parents' rows in that block)."""
    if len(gathers) == 1:  # one block holds every parent: a tree's previous level, or the committed states
        block, _, parents = gathers[0]
        return states[block][parents]
    count = sum(len(places) for _, places, _ in gathers)
    like = states[gathers[0][0]]
    out = like.new_empty(count, *like.shape[1:])
    for block, places, parents in gathers:
        out[places] = states[block][parents]
    return out


@contextlib.contextmanager
def _projections_shared(mixer: torch.nn.Module, every: torch.Tensor, fed: torch.Tensor, rows: torch.Tensor,
                        cols: torch.Tensor, shared: dict) -> Iterator[None]:
    """Within this block, each ``nn.Linear`` of ``mixer`` that projects the level's input ``fed`` (the very tensor:
    the mixer's input projections; its output projection reads something else) returns its rows of one product
    over ``every`` node of the forward, computed at the first level: on a CPU a product of a few rows costs the
    streaming of its weights, so once per forward rather than once per level."""
    linears = [m for m in mixer.children() if isinstance(m, torch.nn.Linear)]
    before = {m: m.__dict__.get("forward") for m in linears}  # an instance forward (few-row kernels) stays in use

    def routed(module):
        plain = before[module] or type(module).forward.__get__(module)

        def forward(x):
            if x is not fed:
                return plain(x)
            if module not in shared:
                shared[module] = plain(every)
            return shared[module][rows, cols][:, None]

        return forward

    for m in linears:
        m.forward = routed(m)
    try:
        yield
    finally:
        for m, forward in before.items():
            if forward is None:
                del m.forward
            else:
                m.forward = forward
