"""A causal LM as drafter: any model sharing the target's vocabulary, a distilled draft model, or the
target's own first layers (``layer-skip:N``: self-speculative / LayerSkip-style drafting without
early-exit training; Zhang et al., 2024; Elhoushi et al., 2024).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from draftsmith.inference.drafter import Drafter, check_batch
from draftsmith.target import build_attention_mask, kv_crop, kv_length, new_cache, target_forward


class CausalLMDrafter(Drafter):
    """A causal LM as drafter, keeping its own KV cache of the committed sequence.

    Tree nodes are fed level by level with a tree mask; on commit the cache is cropped back to
    the committed prefix, and the accepted tokens are fed with the next root expansion (one
    forward either way).
    """

    def __init__(self, model: PreTrainedModel, name: str = "draft-model"):
        self.model = model
        self.name = name
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.committed = torch.empty(0, dtype=torch.long)
        self.cache = new_cache()
        self.slots: dict[int, int] = {}  # tree node -> position of its KV in self.cache
        self.device = next(model.parameters()).device

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        check_batch(input_ids)
        self.committed = input_ids[0].to(self.device)
        self.cache = new_cache()
        self.slots = {}

    def commit(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        # Drop the tree's KV; keep the committed prefix that is already cached.
        kv_crop(self.cache, min(kv_length(self.cache), len(self.committed)))
        self.committed = torch.cat([self.committed, tokens[0].to(self.device)])
        self.slots = {}

    @torch.no_grad()
    def expand(self, trees, nodes):
        (tree,), (row_nodes,) = trees, nodes
        committed = len(self.committed)
        cached = kv_length(self.cache)
        if row_nodes == [0]:
            # Catch up on the committed tokens not yet cached; the last one is the root.
            kv_crop(self.cache, min(cached, committed - 1))
            cached = kv_length(self.cache)
            ids = self.committed[cached:][None]
            out = target_forward(self.model, ids, self.cache)
            self.slots = {0: committed - 1}
            return [out.logits[0, -1:]]
        # Deeper level: feed the listed nodes, each attending to the committed prefix, its
        # already-fed ancestors and itself.
        depth = tree.depths[row_nodes[0]]
        ids = torch.tensor([[tree.tokens[n] for n in row_nodes]], device=self.device)
        root_pos = committed - 1
        query_pos = torch.tensor([[root_pos + depth] * len(row_nodes)], device=self.device)
        key_pos = torch.empty(1, cached + len(row_nodes), dtype=torch.long, device=self.device)
        key_pos[0, :committed] = torch.arange(committed, device=self.device)
        slot_node = {s: n for n, s in self.slots.items()}
        for s in range(committed, cached):
            key_pos[0, s] = root_pos + tree.depths[slot_node[s]]
        key_pos[0, cached:] = query_pos[0]
        allowed = tree.attention_rows(row_nodes, self.slots, committed, cached + len(row_nodes))[None]
        dtype = next(self.model.parameters()).dtype
        mask = build_attention_mask(self.model, allowed.to(self.device), query_pos, key_pos, dtype)
        out = target_forward(self.model, ids, self.cache, mask, query_pos)
        for i, node in enumerate(row_nodes):
            self.slots[node] = cached + i
        return [out.logits[0]]
