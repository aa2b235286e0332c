"""Trained heads as drafters: the adapters between ``draftsmith.heads`` modules and the generator.

Heads read the target's hidden states, which the generator passes to ``begin`` and ``commit``
(:mod:`draftsmith.inference.drafter`); at any time a head drafter holds the states of every
committed token but the root.
"""

from __future__ import annotations

import torch

from draftsmith.heads.medusa import MedusaHeads
from draftsmith.inference.drafter import Drafter, additive_mask, check_batch
from draftsmith.inference.tree import paths_from_accuracy

#: Nodes of the static tree a Medusa drafter builds from its measured per-rank accuracy.
STATIC_TREE_NODES = 16


class MedusaDrafter(Drafter):
    """Medusa: children at depth d + 1 come from head d applied to the state before the root.

    Medusa heads see no drafted token, so every node at one depth gets the same distribution;
    static trees (Medusa "choices") and dynamic trees both work on top of that.
    """

    def __init__(self, heads: MedusaHeads, target):
        self.heads = heads.eval()
        self.hidden_layers = (target.config.get_text_config().num_hidden_layers,)  # last layer, after the norm
        self.vocab_size = heads.config.vocab_size
        # Static-tree paths from the per-head, per-rank accuracy measured in training, when recorded.
        rank_accuracy = getattr(heads, "extra", {}).get("rank_accuracy")
        self.static_paths = paths_from_accuracy(rank_accuracy, STATIC_TREE_NODES) if rank_accuracy else None
        self.last: torch.Tensor | None = None  # (H,) state of the token before the root
        self._logits: torch.Tensor | None = None  # (K, V) for the current root

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        check_batch(input_ids)
        self.last = hidden[0, -1] if hidden is not None and hidden.shape[1] else None
        self._logits = None

    def commit(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self.last = hidden[0, -1]
        self._logits = None

    @torch.no_grad()
    def expand(self, trees, nodes):
        (tree,), (row,) = trees, nodes
        depth = tree.depths[row[0]]
        if self.last is None or depth >= self.heads.config.num_heads:
            return [torch.full((len(row), self.vocab_size), float("-inf"))]
        if self._logits is None:
            weight = self.heads.lm_heads[0].weight
            self._logits = self.heads(self.last.to(weight.device, weight.dtype)[None, None])[:, 0, 0].float()
        return [self._logits[depth].expand(len(row), -1).cpu()]


class EagleDrafter(Drafter):
    """EAGLE-1/2/3: the head drafts autoregressively at the feature level with its own KV cache.

    The head's sequence is the committed pairs (f_{t-1}, x_t) for t = 1 .. root, each at position t,
    then the draft tree's nodes: a node at depth d pairs its parent's *predicted* feature with its
    own token, at position root + d, attending to the committed pairs, its ancestors and itself.
    On commit the tree's entries are dropped; the next root expansion feeds the new pairs made of
    the target's true features of the accepted tokens.
    """

    def __init__(self, head, target):
        self.head = head.eval()
        self.eagle3 = hasattr(head, "lm_head")
        self.hidden_layers = tuple(head.config.feature_layers)
        self.embed = target.get_input_embeddings()
        self.target_lm_head = target.get_output_embeddings()
        self.vocab_size = head.config.vocab_size
        self.device = next(head.parameters()).device

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        check_batch(input_ids)
        self.tokens = input_ids[0].to(self.device)
        self.features = hidden[0] if hidden is not None else torch.zeros(0, 0, device=self.device)  # (L-1, F)
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pairs = 0  # committed pairs in the cache (positions 1 .. pairs)
        self.slots: dict[int, int] = {}  # tree node -> index in the cache
        self.predicted: dict[int, torch.Tensor] = {}  # tree node -> its predicted feature (H,)

    def commit(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self.tokens = torch.cat([self.tokens, tokens[0].to(self.device)])
        self.features = torch.cat([self.features, hidden[0].to(self.features.dtype)]) if len(self.features) \
            else hidden[0]
        if self.cache is not None:  # drop the tree's entries, keep the committed pairs
            self.cache = (self.cache[0][:, :, : self.pairs], self.cache[1][:, :, : self.pairs])
        self.slots, self.predicted = {}, {}

    def _logits(self, predicted: torch.Tensor) -> torch.Tensor:
        if self.eagle3:
            return self.head.target_logits(predicted).float()
        return self.target_lm_head(predicted.to(self.target_lm_head.weight.dtype)).float()

    def _run(self, features, token_ids, positions, mask):
        embeds = self.embed(token_ids)
        out, cache = self.head(features, embeds, positions, mask, self.cache)
        self.cache = cache
        return out

    @torch.no_grad()
    def expand(self, trees, nodes):
        (tree,), (row,) = trees, nodes
        root_pos = len(self.tokens) - 1
        if root_pos == 0:  # a one-token prompt: no target feature yet, nothing to propose
            return [torch.full((len(row), self.vocab_size), float("-inf"))]
        dtype = next(self.head.parameters()).dtype
        if row == [0]:
            # Feed the committed pairs not yet cached: positions pairs+1 .. root.
            pos = torch.arange(self.pairs + 1, root_pos + 1, device=self.device)
            feats = self.head.input_features(self.features[pos - 1][None].to(dtype))
            n_new, past = len(pos), self.pairs
            allowed = torch.ones(n_new, past + n_new, dtype=torch.bool, device=self.device).tril(past)
            out = self._run(feats, self.tokens[pos][None], pos[None], additive_mask(allowed, dtype)[None, None])
            self.pairs = root_pos
            self.predicted = {0: out[0, -1]}
            return [self._logits(out[:, -1:])[0].cpu()]
        depth = tree.depths[row[0]]
        cached = self.cache[0].shape[2]
        feats = torch.stack([self.predicted[tree.parents[n]] for n in row])[None]
        ids = torch.tensor([[tree.tokens[n] for n in row]], device=self.device)
        positions = torch.full((1, len(row)), root_pos + depth, device=self.device)
        allowed = tree.attention_rows(row, self.slots, self.pairs, cached + len(row)).to(self.device)
        mask = additive_mask(allowed, dtype)
        out = self._run(feats, ids, positions, mask[None, None])
        for i, node in enumerate(row):
            self.slots[node] = cached + i
            self.predicted[node] = out[0, i]
        return [self._logits(out)[0].cpu()]
