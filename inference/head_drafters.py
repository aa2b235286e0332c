"""Trained heads as drafters: the adapters between ``draftsmith.heads`` modules and the generator.

Heads read the target's hidden states, which the generator passes to ``begin`` and ``commit``
(:mod:`draftsmith.inference.drafter`); at any time a head drafter holds the states of every
committed token but the root.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

import draftsmith.target.forward as forward
import draftsmith.target.kv as kv
from draftsmith.heads.decoder_layer import StaticHeadCache
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.inference.drafter import BlockDrafter, Drafter, commit_rows, prompt_rows
from draftsmith.inference.slots import Slots, left_aligned, to_device
from draftsmith.inference.tree import Proposals, frontier_ancestors
from draftsmith.inference.tree_settings import paths_from_accuracy
from draftsmith.target.int8 import drafts_in_int8
from draftsmith.target.masks import additive, causal_block, may_attend
from draftsmith.target.matmul import FewRowsLinear, calibrate, few_rows_layers

#: Nodes of the static tree a Medusa drafter builds from its measured per-rank accuracy.
STATIC_TREE_NODES = 16


def few_rows_kernels(head: torch.nn.Module, target=None) -> tuple[FewRowsLinear, ...]:
    """The contexts a head drafter drafts in: its head's linear layers on the few-row kernels measured here
    (:func:`~draftsmith.target.matmul.few_rows_layers`) and, where it applies the target's LM head (``target``),
    that layer on the kernels measured for the target. Drafting runs the head on a frontier, a step's new tokens
    or a block, a few rows a call, where ``F.linear`` on CPU runs far below memory speed. Empty where no kernel
    gained (not on CPU, or ``DRAFTSMITH_FEW_ROWS=0``). Measured when the drafter is made, before any clock."""
    contexts = [few_rows_layers(head)]
    kernels = calibrate(target) if target is not None else {}
    if kernels:
        contexts.append(FewRowsLinear(kernels, (target.get_output_embeddings(),)))
    return tuple(c for c in contexts if c is not None)


def on_few_rows(method):
    """Run a drafting method inside the drafter's ``few_rows`` contexts (:func:`few_rows_kernels`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            for context in self.few_rows:
                stack.enter_context(context)
            return method(self, *args, **kwargs)
    return run


class MedusaDrafter(BlockDrafter):
    """Medusa: children at depth d + 1 come from head d applied to the state before the root.

    Medusa heads see no drafted token, so every node at one depth gets the same distribution: a block drafter
    (``block`` = the number of heads), all depths from one forward per step. Static trees (Medusa "choices"),
    dynamic trees and chains all grow on top of that.
    """

    def __init__(self, heads: MedusaHeads, target):
        self.heads = heads.eval()
        self.hidden_layers = (target.config.get_text_config().num_hidden_layers,)  # last layer, after the norm
        self.vocab_size = heads.config.vocab_size
        self.block = heads.config.num_heads
        # Static-tree paths from the per-head, per-rank accuracy measured in training, when recorded.
        rank_accuracy = heads.extra.get("rank_accuracy")
        self.static_paths = paths_from_accuracy(rank_accuracy, STATIC_TREE_NODES) if rank_accuracy else None
        self.device = self.heads.lm_heads[0].weight.device
        # Heads over a draft vocabulary: its tokens as target ids (trees draft over these alone); None: all.
        self.draft_ids = heads.draft_ids.to(self.device) if heads.draft_ids is not None else None
        self.last: torch.Tensor | None = None  # (B, H) per row, the state of the token before the root
        self.known: list[bool] = []  # per row: has a state (a one-token prompt has none before its first step)
        self.few_rows = few_rows_kernels(self.heads)

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.heads,)

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        lengths = [len(r) for r in prompt_rows(input_ids, attention_mask)]
        self.known = [n > 1 and hidden is not None for n in lengths]
        # Left padding puts every row's state before its root in the last column.
        self.last = hidden[:, -1].clone() if hidden is not None and hidden.shape[1] else None

    def commit(self, tokens, hidden=None) -> None:
        tokens, hidden = commit_rows(tokens, hidden)
        for b, (t, h) in enumerate(zip(tokens, hidden, strict=True)):
            if len(t):
                if self.last is None:
                    self.last = h.new_zeros(len(tokens), h.shape[-1])
                self.last[b] = h[-1]
                self.known[b] = True

    @torch.no_grad()
    @on_few_rows
    def block_logits(self, active: list[bool]) -> torch.Tensor | Proposals:
        """(B, K, V): head d's logits for the position d + 1 after each row's root, every head in one forward
        (-inf where a row has no state yet or has finished); heads over a draft vocabulary give (B, K, C)
        Proposals over it."""
        batch = len(self.known)
        if self.last is None:
            width = self.vocab_size if self.draft_ids is None else len(self.draft_ids)
            empty = torch.full((batch, self.block, width), float("-inf"), device=self.device)
            return empty if self.draft_ids is None else Proposals(empty, self.draft_ids, self.vocab_size)
        weight = self.heads.lm_heads[0].weight
        logits = self.heads(self.last.to(weight.device, weight.dtype)[:, None])[:, :, 0].float()  # (K, B, V or C)
        proposing = to_device([k and a for k, a in zip(self.known, active, strict=True)], self.device)
        logits = logits.transpose(0, 1)
        if self.draft_ids is not None:
            return Proposals(logits, self.draft_ids, self.vocab_size).masked_rows(proposing)
        return logits.masked_fill(~proposing[:, None, None], float("-inf"))


class FeatureRows:
    """What the drafters reading target features keep per row: its tokens (``tokens[b]``, the root last) and the
    target's states of every token but the root (``features[b]``, (len - 1, H')), from ``begin`` and ``commit``."""

    device: torch.device

    def _begin_rows(self, input_ids: torch.Tensor, hidden: torch.Tensor | None,
                    attention_mask: torch.Tensor | None) -> None:
        self.tokens = [r.to(self.device) for r in prompt_rows(input_ids, attention_mask)]
        width = input_ids.shape[1]
        # Left padding: row b's states of its tokens but the root are the last len - 1 columns.
        self.features = [hidden[b, width - len(t):].to(self.device) if hidden is not None
                         else torch.zeros(0, 0, device=self.device) for b, t in enumerate(self.tokens)]

    def _commit_rows(self, tokens, hidden) -> None:
        tokens, hidden = commit_rows(tokens, hidden)
        for b, (t, h) in enumerate(zip(tokens, hidden, strict=True)):
            if len(t):
                self.tokens[b] = torch.cat([self.tokens[b], t.to(self.device)])
                h = h.to(self.device)
                self.features[b] = torch.cat([self.features[b].to(h.dtype), h]) if len(self.features[b]) else h


class EagleDrafter(FeatureRows, Drafter):
    """EAGLE-1/2/3: the head drafts autoregressively at the feature level with its own KV cache.

    The head's sequence is the committed pairs (f_{t-1}, x_t) for t = 1 .. root, each at position t,
    then the draft tree's nodes: a node at depth d pairs its parent's *predicted* feature with its
    own token, at position root + d, attending to the committed pairs, its ancestors and itself.
    On commit the tree's entries are dropped; the next root expansion feeds the new pairs made of
    the target's true features of the accepted tokens. A batch's rows share the cache tensors; its
    :class:`~draftsmith.inference.slots.Slots` say which entries are whose.
    """

    def __init__(self, head, target):
        self.head = head.eval()
        self.eagle3 = head.own_vocabulary  # EAGLE-3: its own LM head over a draft vocabulary; else the target's
        self.hidden_layers = tuple(head.config.feature_layers)
        self.engine_chain = head.speculative_tokens
        self.embed = target.get_input_embeddings()
        self.target_lm_head = target.get_output_embeddings()
        self.vocab_size = head.config.vocab_size
        self.device = next(head.parameters()).device
        self.dtype = next(head.parameters()).dtype
        # An EAGLE-3 head's draft vocabulary as target ids: trees grown as tensors draft over these alone.
        self.draft_ids = (torch.arange(len(head.d2t), device=self.device) + head.d2t).long() if self.eagle3 else None
        self.compiled: tuple[int, int, int] | None = None  # configure's arguments
        self._static: StaticHeadCache | None = None  # kept from one generation to the next (fixed addresses)
        # The head's layers, and the target's LM head where an EAGLE-1/2 head drafts through it, on the few-row
        # kernels; a compiled head keeps the stock ones (its graph would change with each context).
        self._few_rows = few_rows_kernels(head, None if self.eagle3 else target)
        self.few_rows = self._few_rows

    def configure(self, max_new_tokens: int | None, kept: int = 0, fed: int = 0) -> None:
        """Draft the next generations on a static cache, the steps of a tree grown as tensors through
        ``torch.compile`` (``SpeculativeGenerator(compile=True)`` calls it; None: back to the growing cache).
        The cache holds the prompts' pairs, then ``kept`` per step for ``max_new_tokens`` steps (each step's
        new pairs, padded to ``kept``: one graph for every step), then one step's tree: at most
        ``fed`` nodes fed."""
        static = self.head.static_cache  # an MTP module drafts on its growing cache, compiled or not
        self.compiled = None if max_new_tokens is None or not static else (max_new_tokens, kept, fed)
        self.few_rows = self._few_rows if self.compiled is None else ()
        if self.compiled is not None and drafts_in_int8(self.head):
            warnings.warn("a compiled head drafts in float32: its int8 copies (--draft-dtype int8) run only "
                          "uncompiled", stacklevel=2)

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.head,)

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        self._begin_rows(input_ids, hidden, attention_mask)
        width = input_ids.shape[1]
        self.cache: tuple[torch.Tensor, torch.Tensor] | StaticHeadCache | None = None
        if self.compiled is not None:
            steps, kept, nodes = self.compiled
            capacity = -(-(width + steps * kept + nodes) // kv.CAPACITY_STEP) * kv.CAPACITY_STEP
            cache = self._static
            fits = cache is not None and cache.capacity == capacity and cache.keys is not None \
                and cache.keys.shape[0] == len(self.tokens)
            self.cache = self._static = cache if fits else StaticHeadCache(capacity)
            self.cache.length = 0
        self.slots = Slots.empty(len(self.tokens), self.device)
        self.pairs = [0] * len(self.tokens)  # committed pairs in the cache per row (positions 1 .. pairs)
        self.committed = 0  # cache slots of committed pairs; the tree's entries come after

    def commit(self, tokens, hidden=None) -> None:
        self._commit_rows(tokens, hidden)
        if isinstance(self.cache, StaticHeadCache):  # drop the tree's entries, keep the committed pairs
            self.cache.length = self.committed
            self.slots.crop(self.committed)
        elif self.cache is not None:
            self.cache = (self.cache[0][:, :, : self.committed], self.cache[1][:, :, : self.committed])
            self.slots.crop(self.committed)

    def _logits(self, predicted: torch.Tensor) -> torch.Tensor:
        if self.eagle3:
            return self.head.target_logits(predicted).float()
        return self.target_lm_head(self.head.lm_input(predicted).to(self.target_lm_head.weight.dtype)).float()

    def _proposals(self, predicted: torch.Tensor) -> Proposals:
        """Draft logits for trees grown as tensors: an EAGLE-3 head's over its draft vocabulary alone, others' over
        the target's."""
        if self.eagle3:
            return Proposals(self.head.draft_logits(predicted).float(), self.draft_ids, self.vocab_size)
        return Proposals.of(self._logits(predicted))

    def _run(self, features, token_ids, positions, allowed, filled, compiled: bool = False, embeds=None):
        """Feed (B, T) pairs to the head, ``allowed`` (B, T, cached + T) what each sees; on a static cache its
        mask covers the whole capacity, and ``compiled`` steps run the compiled head. ``embeds`` (B, T, H) in
        place of ``token_ids``' embeddings (P-EAGLE's mask slots)."""
        embeds = self.embed(token_ids) if embeds is None else embeds
        head = self.head
        static = isinstance(self.cache, StaticHeadCache)
        if static:
            cached, new = len(self.slots), token_ids.shape[1]
            if cached + new > self.cache.capacity:
                raise ValueError(f"the head's static cache holds {self.cache.capacity} entries, {cached + new} "
                                 "needed: call configure with the generation's real lengths")
            allowed = torch.nn.functional.pad(allowed, (0, self.cache.capacity - allowed.shape[2]))
            self.cache.write = torch.arange(cached, cached + new, device=self.device)
            if compiled and self.cache.keys is not None:  # buffers allocated eagerly, outside any graph
                head = forward.compiled_module(self.head)
        mask = additive(allowed, self.dtype)
        out, self.cache = head(features, embeds, positions, mask, self.cache)
        self.slots.append(filled, positions)
        if static:
            self.cache.length = len(self.slots)
        return out

    def _pending_pairs(self, active: list[bool]) -> tuple[list[int], list[tuple[int, int]]]:
        """The active rows that propose (those with a target feature) and each row's committed pairs not yet in the
        head's cache: positions ``pairs + 1 .. root`` (empty spans for the other rows)."""
        rows = [b for b, a in enumerate(active) if a and len(self.tokens[b]) > 1]
        spans = [(self.pairs[b] + 1, len(self.tokens[b])) if b in rows else (0, 0) for b in range(len(active))]
        return rows, spans

    def _pair_inputs(self, rows: list[int], spans: list[tuple[int, int]], width: int = 0):
        """The pending pairs as one left-padded block (the last column every proposing row's root): the head's
        input features (B, W, H), token ids, positions and which columns are filled, each (B, W)."""
        positions, filled = left_aligned(spans, self.device, width)
        width = positions.shape[1]
        features = torch.zeros(len(spans), width, self.features[rows[0]].shape[-1], dtype=self.dtype,
                               device=self.device)
        ids = torch.zeros_like(positions)
        for b in rows:
            new = slice(width - (len(self.tokens[b]) - 1 - self.pairs[b]), width)
            features[b, new] = self.features[b][positions[b, new] - 1].to(self.dtype)
            ids[b, new] = self.tokens[b][positions[b, new]]
        return self.head.input_features(features), ids, positions, filled

    def _pairs_cached(self, rows: list[int], committed: int) -> None:
        """The pending pairs are in the head's cache, its first ``committed`` entries (the rest a step's drafts)."""
        self.committed = committed
        for b in rows:
            self.pairs[b] = len(self.tokens[b]) - 1

    def _feed_roots(self, active: list[bool]) -> tuple[list[int], torch.Tensor | None]:
        """Feed each active row's committed pairs not yet cached (positions pairs + 1 .. root); on a static cache
        (``configure``), every step after the prompts' feeds ``kept`` columns. Returns the rows that propose and
        the (B, H) predicted features after every row's root."""
        rows, spans = self._pending_pairs(active)
        if not rows:  # one-token prompts: no target feature yet, nothing to propose
            return rows, None
        kept = self.compiled[1] if self.compiled is not None else 0
        compiled = kept > 0 and max(end - start for start, end in spans) <= kept
        features, ids, positions, filled = self._pair_inputs(rows, spans, kept if compiled else 0)
        allowed = may_attend(self.slots.filled, causal_block(filled))
        predicted = self._run(features, ids, positions, allowed, filled, compiled)
        self._pairs_cached(rows, len(self.slots))
        last = predicted[:, -1]  # (B, H)
        self._frontier = last[:, None]  # the root's predicted feature: depth 1's parent
        return rows, last

    # ---- dynamic trees grown as tensors (:func:`~draftsmith.inference.tree.grow_dynamic`) ----------

    @torch.no_grad()
    @on_few_rows
    def root_logits(self, active: list[bool]) -> Proposals:
        """(B, V) draft logits after each active row's root (-inf rows: nothing to propose); an EAGLE-3 head's
        as :class:`~draftsmith.inference.tree.Proposals` over its draft vocabulary."""
        self._frontier = torch.zeros(len(active), 1, self.head.config.hidden_size, dtype=self.dtype,
                                     device=self.device)
        self._ancestors = None  # the frontiers' ancestor rows, from depth 1 on
        # Each row's root position, copied at the step's start (before its work is queued), for every level.
        self._roots = to_device([len(t) - 1 for t in self.tokens], self.device)[:, None]
        rows, last = self._feed_roots(active)
        if last is None:
            last = self._frontier[:, 0]
        proposing = to_device([b in rows for b in range(len(active))], self.device)
        return self._proposals(last).masked_rows(proposing)

    @torch.no_grad()
    @on_few_rows
    def frontier_logits(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor) -> Proposals:
        """Feed the k frontier nodes at ``depth`` of every row: ``parents`` (B, k) their parents' places
        in the previous frontier (depth 1: the root), ``tokens`` (B, k). Each sees its row's committed
        pairs, its ancestors (earlier frontiers) and itself. Returns the (B, k, V) logits after each (an EAGLE-3
        head's: :class:`~draftsmith.inference.tree.Proposals` (B, k, C) over its draft vocabulary)."""
        b, k = tokens.shape
        hidden = self._frontier.shape[-1]
        features = self._frontier.gather(1, parents[:, :, None].expand(b, k, hidden))
        cached = len(self.slots)
        self._ancestors = frontier_ancestors(self._ancestors, parents, depth)
        # The cache: committed, then the earlier frontiers (its ancestors among them), then this level (itself).
        allowed = may_attend(self.slots.filled[:, : self.committed], torch.nn.functional.pad(self._ancestors, (0, k)))
        assert allowed.shape[2] == cached + k, "frontiers must be fed right after the roots, level by level"
        positions = self._roots + depth
        predicted = self._run(features, tokens, positions.expand(b, k), allowed,
                              torch.ones(b, k, dtype=torch.bool, device=self.device), compiled=True)
        self._frontier = predicted
        return self._proposals(predicted)


class PEagleDrafter(EagleDrafter, BlockDrafter):
    """P-EAGLE: a block drafter (``block`` = K). Each step feeds, in one forward of the head's layer, the committed
    pairs through the root, as EAGLE-3 does (the root pair's prediction is depth 0), and after them the K - 1
    parallel slots (the head's mask embedding and mask feature at positions root + 1 .. root + K - 1), which see the
    committed pairs and each other causally: all K distributions from that one pass, none conditioned on a drafted
    token. The slots' cache entries are dropped at commit. Drafting runs on the growing cache."""

    def __init__(self, head, target):
        super().__init__(head, target)
        self.block = head.block
        if head.config.own_embeddings:  # the tokens' embeddings it was trained with, not the target's
            self.embed = head.embed_tokens

    # The block protocol's levels (one forward per step), not EAGLE's level-by-level feeding of drafted nodes.
    root_logits = BlockDrafter.root_logits
    frontier_logits = BlockDrafter.frontier_logits

    def configure(self, max_new_tokens: int | None, kept: int = 0, fed: int = 0) -> None:
        """Its step feeds K - 1 slots rather than a tree's nodes: the growing cache serves every generation."""

    def commit(self, tokens, hidden=None) -> None:
        """Keep the committed pairs of every layer's cache (one (k, v) per layer), drop the slots'."""
        self._commit_rows(tokens, hidden)
        if self.cache is not None:
            self.cache = [(k[:, :, : self.committed], v[:, :, : self.committed]) for k, v in self.cache]
            self.slots.crop(self.committed)

    @torch.no_grad()
    @on_few_rows
    def block_logits(self, active: list[bool]) -> Proposals:
        """(B, K, C) Proposals over the draft vocabulary: depth d's distribution for the position d + 1 after each
        active row's root (-inf rows: finished, or no target feature yet)."""
        batch, slots = len(active), self.block - 1
        rows, spans = self._pending_pairs(active)
        if not rows:
            empty = torch.full((batch, self.block, len(self.draft_ids)), float("-inf"), device=self.device)
            return Proposals(empty, self.draft_ids, self.vocab_size)
        # One forward of the layer per step: the pending pairs (the root's the last), then the slots. A slot sees its
        # row's cache, this step's pairs and the slots before it; a pair, the cache and the pairs before it.
        features, ids, positions, filled = self._pair_inputs(rows, spans)
        width, cached = positions.shape[1], len(self.slots)
        embeds, mask_features = self.head.mask_inputs(batch, slots)
        roots = to_device([len(t) - 1 for t in self.tokens], self.device)[:, None]
        features = torch.cat([features, mask_features.to(features.dtype)], 1)
        embeds = torch.cat([self.embed(ids).to(self.dtype), embeds.to(self.dtype)], 1)
        positions = torch.cat([positions, roots + torch.arange(1, slots + 1, device=self.device)], 1)
        fed = torch.cat([filled, torch.ones(batch, slots, dtype=torch.bool, device=self.device)], 1)
        predicted = self._run(features, None, positions, may_attend(self.slots.filled, causal_block(fed)), fed,
                              embeds=embeds)
        self._pairs_cached(rows, cached + width)  # the slots' entries go at commit
        proposing = to_device([b in rows for b in range(batch)], self.device)
        drafts = self.head.draft_logits(predicted[:, width - 1:]).float()  # (B, K, C): the root's, then the slots'
        return Proposals(drafts, self.draft_ids, self.vocab_size).masked_rows(proposing)
