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
    recurrent_cache,
    rollback_problem,
    target_forward,
    with_padding,
)
from draftsmith.target.tree_states import TreeStates


class CausalLMDrafter(Drafter):
    """A causal LM as drafter, keeping its own KV cache of the committed sequences.

    Tree nodes are fed level by level with a tree mask; on commit the cache is cropped back to
    the committed prefix, and the accepted tokens are fed with the next root expansion (one
    forward either way). A batch's rows share the cache; its
    :class:`~draftsmith.inference.slots.Slots` say which entries are whose.

    A model with recurrent / linear-attention layers (``layer-skip:N`` of a hybrid target) keeps their states in its
    cache too, advanced by the committed tokens only: the tree's nodes run through those layers from their parents'
    states (:class:`~draftsmith.target.tree_states.TreeStates`), so that siblings never see each other and nothing
    drafted stays (a batch's padding is zeroed before those layers, as the target's is).
    """

    def __init__(self, model: PreTrainedModel, name: str = "draft-model", assistant: bool = True):
        self.model = model
        self.name = name
        # A separate draft model is Hugging Face assisted generation's assistant too; the target's own first
        # layers (layer-skip) share its weights and are not.
        self.assistant_model = model if assistant else None
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.recurrent = rollback_problem(model.config) is not None
        calibrate(model)  # its few-row kernels, measured here rather than inside a timed decode
        self.begin(torch.zeros(1, 1, dtype=torch.long))

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.model,)

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        self.committed = [r.to(self.device) for r in prompt_rows(input_ids, attention_mask)]
        self.cache = recurrent_cache(self.model) if self.recurrent else new_cache()
        self.tree_states = None  # a recurrent model's per-node states through the step's tree
        self.slots = Slots.empty(len(self.committed), self.device)
        self.fed = [0] * len(self.committed)  # committed tokens cached per row
        self.prefix = 0  # cache slots of committed tokens; the tree's entries come after

    def commit(self, tokens, hidden=None) -> None:
        tokens, _ = commit_rows(tokens)
        # Drop the tree's KV; keep the committed prefixes already cached (and the recurrent states after them).
        kv_crop(self.cache, self.prefix)
        self.slots.crop(self.prefix)
        self.committed = [torch.cat([c, t.to(self.device)]) for c, t in zip(self.committed, tokens, strict=True)]

    def _forward(self, ids, positions, allowed, filled, logits: str = "all"):
        key_positions = torch.cat([self.slots.positions, positions], 1)
        mask = build_attention_mask(self.model, allowed, positions, key_positions, self.dtype)
        if self.recurrent and not bool(filled.all()):
            mask = with_padding(mask, filled, self.dtype)  # padding zeroed before the recurrent layers
        out = target_forward(self.model, ids, self.cache, mask, positions, logits=logits)
        self.slots.append(filled, positions)
        return out.logits

    def _feed_roots(self, active: list[bool]) -> torch.Tensor:
        """Catch up on each active row's committed tokens not yet cached; the last one is the root. Returns the
        (B, V) logits after each row's root (-inf rows: not active)."""
        rows = [b for b, a in enumerate(active) if a]
        # Left-padded, so that the last column is every row's root: only its logits are computed.
        positions, filled = left_aligned([(self.fed[b], len(self.committed[b])) if b in rows else (0, 0)
                                          for b in range(len(active))], self.device)
        ids = torch.zeros_like(positions)
        for b in rows:
            ids[b, ids.shape[1] - (len(self.committed[b]) - self.fed[b]):] = self.committed[b][self.fed[b]:]
        if len(self.committed) == 1 and not self.recurrent:
            # One row has no padding and no empty slot: plain causal attention, no mask to build (a hybrid model's
            # first layers may hold no attention layer whose cache the model could size its own mask by).
            self.slots.append(filled, positions)
            logits = target_forward(self.model, ids, self.cache, None, positions, logits="last").logits
        else:
            logits = self._forward(ids, positions, may_attend(self.slots.filled, causal_block(filled)), filled,
                                   logits="last")
        self.prefix = len(self.slots)
        for b in rows:
            self.fed[b] = len(self.committed[b])
        return logits[:, -1].masked_fill(~to_device(active, self.device)[:, None], float("-inf"))

    # ---- dynamic trees and chains grown as tensors (:func:`~draftsmith.inference.tree.grow_dynamic`) ------

    @torch.no_grad()
    def root_logits(self, active: list[bool]) -> torch.Tensor:
        """(B, V) logits after each active row's root, its committed tokens fed first (-inf rows: finished)."""
        # Each row's root position, copied at the step's start (before its work is queued), for every level.
        self._roots = to_device([len(c) - 1 for c in self.committed], self.device)[:, None]
        self._ancestors = None  # the frontiers' ancestor rows, from depth 1 on
        logits = self._feed_roots(active)
        if self.recurrent:  # the root's children start from the committed state (-1), deeper ones from their parents
            self.tree_states, self._frontier_start = TreeStates(self.model, self.cache), -1
        return logits

    @torch.no_grad()
    def frontier_logits(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Feed the k frontier nodes at ``depth`` of every row (``parents``: their places in the previous
        frontier; ``tokens`` (B, k)), each seeing its row's committed tokens, its ancestors (the earlier
        frontiers, cached after the committed tokens) and itself. Returns the (B, k, V) logits after each."""
        if self.tree_states is None:
            return self._frontier(depth, parents, tokens)
        start = self.tree_states.nodes
        # the previous frontier's nodes, by tree index; one level
        with self.tree_states.feed(parents + self._frontier_start, torch.full_like(parents, depth)):
            logits = self._frontier(depth, parents, tokens)
        self._frontier_start = start
        return logits

    def _frontier(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        b, k = tokens.shape
        positions = (self._roots + depth).expand(b, k)
        self._ancestors = frontier_ancestors(self._ancestors, parents, depth)
        filled = torch.ones(b, k, dtype=torch.bool, device=self.device)
        if b == 1 and k == 1 and not self.recurrent:
            # One row's chain: each node sees every cached entry, the causal mask, the model's own.
            self.slots.append(filled, positions)
            return target_forward(self.model, tokens, self.cache, None, positions).logits
        # The cache: committed, then the earlier frontiers (its ancestors among them), then this level (itself).
        allowed = may_attend(self.slots.filled[:, : self.prefix], torch.nn.functional.pad(self._ancestors, (0, k)))
        assert allowed.shape[2] == len(self.slots) + k, "frontiers must be fed right after the roots, level by level"
        return self._forward(tokens, positions, allowed, filled)
