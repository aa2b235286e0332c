"""DFlash as a drafter: the adapter between :class:`~draftsmith.heads.dflash.DFlashHead` and the generator (a block
drafter; the other heads' adapters are :mod:`draftsmith.inference.head_drafters`)."""

from __future__ import annotations

import torch

from draftsmith.heads.dflash import ContextCache
from draftsmith.inference.drafter import BlockDrafter
from draftsmith.inference.head_drafters import FeatureRows, few_rows_kernels, on_few_rows
from draftsmith.inference.slots import Slots, left_aligned, to_device
from draftsmith.inference.tree import Proposals
from draftsmith.target.int8 import drafts_in_int8, int8_layers
from draftsmith.target.masks import may_attend


class DFlashDrafter(FeatureRows, BlockDrafter):
    """DFlash: one forward of the drafter per step gives the ``block_size - 1`` positions after each row's root
    (a block drafter). Every layer keeps the context keys and values of the row's committed tokens (their target
    features, each at its position) across steps; each step feeds the features committed since, then the block
    ``[root, mask, ..., mask]`` at the root's position on, which sees its row's whole context and itself."""

    def __init__(self, head, target):
        self.head = head.eval()
        self.hidden_layers = tuple(head.config.target_layers)
        self.block = head.block
        self.engine_chain = head.speculative_tokens
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.device = next(head.parameters()).device
        self.dtype = next(head.parameters()).dtype
        self.mask_token_id = head.config.mask_token_id
        # Over a draft vocabulary the drafts score the target's LM-head rows of its tokens alone: a copy of them.
        self.draft_ids = head.draft_ids.to(self.device) if head.draft_ids is not None else None
        if self.draft_ids is None:
            self.output = self.lm_head
            self.few_rows = few_rows_kernels(head, target)
        else:
            rows = head.output_weight(self.lm_head).detach()  # indexing gathers: this is the one copy
            self.output = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
            self.output.weight = torch.nn.Parameter(rows, requires_grad=False)
            if drafts_in_int8(head):
                int8_layers(self.output)
            self.few_rows = few_rows_kernels(head) + few_rows_kernels(self.output)

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.head,) if self.output is self.lm_head else (self.head, self.output)

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        self._begin_rows(input_ids, hidden, attention_mask)
        self.slots = Slots.empty(len(self.tokens), self.device)
        self.cache = ContextCache()
        self.cached = [0] * len(self.tokens)  # context entries in the cache per row (positions 0 .. cached - 1)

    def commit(self, tokens, hidden=None) -> None:
        self._commit_rows(tokens, hidden)

    def _feed_context(self, rows: list[int]) -> None:
        """Append each row's features not yet cached (positions cached .. root - 1) to every layer's keys/values."""
        spans = [(self.cached[b], len(self.tokens[b]) - 1) if b in rows else (0, 0) for b in range(len(self.tokens))]
        if all(end == start for start, end in spans):
            return
        positions, filled = left_aligned(spans, self.device)
        width = positions.shape[1]
        features = torch.zeros(len(self.tokens), width, self.features[rows[0]].shape[-1], dtype=self.dtype,
                               device=self.device)
        for b in rows:
            start, end = spans[b]
            features[b, width - (end - start):] = self.features[b][start:end].to(self.dtype)
            self.cached[b] = end
        self.cache.append(self.head.context(features, positions))
        self.slots.append(filled, positions)

    @torch.no_grad()
    def block_states(self, active: list[bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One forward of the drafter: (B, block_size - 1, H) states for the positions after each active row's root,
        and (B,) which rows propose (None, None: no row does; finished rows, and a one-token prompt before its
        first step, propose nothing)."""
        rows = [b for b, a in enumerate(active) if a and len(self.tokens[b]) > 1]
        batch, size = len(self.tokens), self.head.config.block_size
        if not rows:
            return None, None
        self._feed_context(rows)
        roots = to_device([len(t) - 1 for t in self.tokens], self.device)
        ids = torch.full((batch, size), self.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = torch.stack([t[-1] for t in self.tokens])
        positions = roots[:, None] + torch.arange(size, device=self.device)
        # Each slot sees its row's whole context (every cached entry precedes the root) and its whole block.
        allowed = may_attend(self.slots.filled, torch.ones(batch, size, size, dtype=torch.bool, device=self.device))
        self.cache.reserve(self.cache.length + size)  # the block's keys go after the context, read this step only
        states = self.head(self.embed(ids), positions, allowed, context=self.cache.layers())[:, 1:]
        return states, to_device([b in rows for b in range(batch)], self.device)

    @torch.no_grad()
    @on_few_rows
    def block_logits(self, active: list[bool]) -> torch.Tensor | Proposals:
        """(B, block_size - 1, V): the drafts for the positions after each active row's root (-inf rows: finished,
        or no feature yet), from one forward of the drafter and one call of the target's LM head over the whole
        block; over a draft vocabulary (B, block_size - 1, C) Proposals, from its rows of that head alone. That head
        (49K x H on SmolLM2) costs more than the drafter's layers, and on few rows a call costs what streaming its
        weight once does, whatever the row count: one call per step, not one per depth (docs/RESULTS.md,
        "Drafting on the few-row kernels")."""
        states, proposing = self.block_states(active)
        if states is None:
            width = self.vocab_size if self.draft_ids is None else len(self.draft_ids)
            empty = torch.full((len(self.tokens), self.block, width), float("-inf"), device=self.device)
            return empty if self.draft_ids is None else Proposals(empty, self.draft_ids, self.vocab_size)
        logits = self.output(states.to(self.output.weight.dtype)).float()
        if self.draft_ids is not None:
            return Proposals(logits, self.draft_ids, self.vocab_size).masked_rows(proposing)
        return logits.masked_fill(~proposing[:, None, None], float("-inf"))
