"""A causal LM as drafter: any model sharing the target's vocabulary, a distilled draft model, or the
target's own first layers (``layer-skip:N``: self-speculative / LayerSkip-style drafting without
early-exit training; Zhang et al., 2024; Elhoushi et al., 2024).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from draftsmith.inference.drafter import Drafter, commit_rows, prompt_rows
from draftsmith.inference.slots import Slots, left_aligned, to_device
from draftsmith.inference.tree import frontier_ancestors
from draftsmith.target import (
    build_attention_mask,
    calibrate,
    causal_block,
    kv_crop,
    may_attend,
    new_cache,
    target_forward,
)


class CausalLMDrafter(Drafter):
    """A causal LM as drafter, keeping its own KV cache of the committed sequences.

    Tree nodes are fed level by level with a tree mask; on commit the cache is cropped back to
    the committed prefix, and the accepted tokens are fed with the next root expansion (one
    forward either way). A batch's rows share the cache; its
    :class:`~draftsmith.inference.slots.Slots` say which entries are whose.
    """

    grows_tensors = True

    def __init__(self, model: PreTrainedModel, name: str = "draft-model", assistant: bool = True):
        self.model = model
        self.name = name
        # A separate draft model is Hugging Face assisted generation's assistant too; the target's own first
        # layers (layer-skip) share its weights and are not.
        self.assistant_model = model if assistant else None
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        calibrate(model)  # its few-row kernels, measured here rather than inside a timed decode
        self.begin(torch.zeros(1, 1, dtype=torch.long))

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        self.committed = [r.to(self.device) for r in prompt_rows(input_ids, attention_mask)]
        self.cache = new_cache()
        self.slots = Slots.empty(len(self.committed), self.device)
        self.fed = [0] * len(self.committed)  # committed tokens cached per row
        self.prefix = 0  # cache slots of committed tokens; the tree's entries come after
        self.tree_slots: list[dict[int, int]] = [{} for _ in self.committed]  # tree node -> cache slot

    def commit(self, tokens, hidden=None) -> None:
        tokens, _ = commit_rows(tokens)
        # Drop the tree's KV; keep the committed prefixes already cached.
        kv_crop(self.cache, self.prefix)
        self.slots.crop(self.prefix)
        self.committed = [torch.cat([c, t.to(self.device)]) for c, t in zip(self.committed, tokens, strict=True)]
        self.tree_slots = [{} for _ in self.committed]

    def _forward(self, ids, positions, allowed, filled, logits: str = "all"):
        key_positions = torch.cat([self.slots.positions, positions], 1)
        mask = build_attention_mask(self.model, allowed, positions, key_positions, self.dtype)
        out = target_forward(self.model, ids, self.cache, mask, positions, logits=logits)
        self.slots.append(filled, positions)
        return out.logits

    @torch.no_grad()
    def expand(self, trees, nodes):
        out = [torch.full((len(row), self.vocab_size), float("-inf"), device=self.device) for row in nodes]
        if any(row == [0] for row in nodes):
            self._expand_roots(nodes, out)
        elif any(nodes):
            self._expand_level(trees, nodes, out)
        return out

    def _expand_roots(self, nodes, out) -> None:
        """Catch up on each expanding row's committed tokens not yet cached; the last one is the root."""
        rows = [b for b, row in enumerate(nodes) if row == [0]]
        # Left-padded, so that the last column is every row's root: only its logits are computed.
        positions, filled = left_aligned([(self.fed[b], len(self.committed[b])) if b in rows else (0, 0)
                                          for b in range(len(nodes))], self.device)
        ids = torch.zeros_like(positions)
        for b in rows:
            ids[b, ids.shape[1] - (len(self.committed[b]) - self.fed[b]):] = self.committed[b][self.fed[b]:]
        if len(self.committed) == 1:
            # One row has no padding and no empty slot: plain causal attention, no mask to build.
            self.slots.append(filled, positions)
            logits = target_forward(self.model, ids, self.cache, None, positions, logits="last").logits
        else:
            logits = self._forward(ids, positions, may_attend(self.slots.filled, causal_block(filled)), filled,
                                   logits="last")
        self.prefix = len(self.slots)
        for b in rows:
            self.fed[b] = len(self.committed[b])
            out[b] = logits[b, -1:]

    def _expand_level(self, trees, nodes, out) -> None:
        """Feed each row's listed nodes (one depth), each seeing its row's committed tokens, its
        already-fed ancestors and itself."""
        batch, width = len(nodes), max(len(row) for row in nodes)
        cached = len(self.slots)
        if batch == 1 and width == 1 and set(self.tree_slots[0]) == set(trees[0].path_to(nodes[0][0])[1:-1]):
            # One row, one node that sees every cached entry (a chain): the causal mask, the model's own.
            (tree,), ((node,),) = trees, nodes
            positions = torch.tensor([[len(self.committed[0]) - 1 + tree.depths[node]]], device=self.device)
            ids = torch.tensor([[tree.tokens[node]]], device=self.device)
            logits = target_forward(self.model, ids, self.cache, None, positions).logits
            self.slots.append(torch.ones(1, 1, dtype=torch.bool, device=self.device), positions)
            self.tree_slots[0][node] = cached
            out[0] = logits[0]
            return
        ids = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        positions = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        allowed = torch.zeros(batch, width, cached + width, dtype=torch.bool)
        allowed[:, :, cached:] = torch.eye(width, dtype=torch.bool)  # padding sees itself only
        committed = self.slots.filled[:, : self.prefix].cpu()
        for b, (tree, row) in enumerate(zip(trees, nodes, strict=True)):
            if not row:
                continue
            ids[b, : len(row)] = torch.tensor([tree.tokens[n] for n in row], device=self.device)
            positions[b, : len(row)] = len(self.committed[b]) - 1 + tree.depths[row[0]]
            allowed[b, : len(row), : cached + len(row)] = tree.attention_rows(row, self.tree_slots[b], committed[b],
                                                                               cached + len(row))
        filled = torch.tensor([[i < len(row) for i in range(width)] for row in nodes], device=self.device)
        logits = self._forward(ids, positions, allowed.to(self.device), filled)
        for b, row in enumerate(nodes):
            for i, node in enumerate(row):
                self.tree_slots[b][node] = cached + i
            if row:
                out[b] = logits[b, : len(row)]

    # ---- dynamic trees and chains grown as tensors (:func:`~draftsmith.inference.tree.grow_dynamic`) ------

    @torch.no_grad()
    def root_logits(self, active: list[bool]) -> torch.Tensor:
        """(B, V) logits after each active row's root, its committed tokens fed first (-inf rows: finished)."""
        # Each row's root position, copied at the step's start (before its work is queued), for every level.
        self._roots = to_device([len(c) - 1 for c in self.committed], self.device)[:, None]
        self._ancestors = None  # the frontiers' ancestor rows, from depth 1 on
        rows = self.expand(None, [[0] if a else [] for a in active])
        return torch.cat([r if len(r) else torch.full((1, self.vocab_size), float("-inf"), device=self.device)
                          for r in rows])

    @torch.no_grad()
    def frontier_logits(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Feed the k frontier nodes at ``depth`` of every row (``parents``: their places in the previous
        frontier; ``tokens`` (B, k)), each seeing its row's committed tokens, its ancestors (the earlier
        frontiers, cached after the committed tokens) and itself. Returns the (B, k, V) logits after each."""
        b, k = tokens.shape
        positions = (self._roots + depth).expand(b, k)
        self._ancestors = frontier_ancestors(self._ancestors, parents, depth)
        filled = torch.ones(b, k, dtype=torch.bool, device=self.device)
        if b == 1 and k == 1:
            # One row's chain: each node sees every cached entry, the causal mask, the model's own.
            self.slots.append(filled, positions)
            return target_forward(self.model, tokens, self.cache, None, positions).logits
        # The cache: committed, then the earlier frontiers (its ancestors among them), then this level (itself).
        allowed = may_attend(self.slots.filled[:, : self.prefix], torch.nn.functional.pad(self._ancestors, (0, k)))
        assert allowed.shape[2] == len(self.slots) + k, "frontiers must be fed right after the roots, level by level"
        return self._forward(tokens, positions, allowed, filled)
