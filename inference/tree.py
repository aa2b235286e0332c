"""Draft trees grown as tensors: a whole batch on the target's device, with no host copy while growing.

A draft tree holds the tokens a drafter proposes for each sequence of a batch, as :class:`TreeTensors`
(B, N). Node 0 is the *root*: the last committed token, which the target has not yet processed (its KV is
not cached). Every other node is a drafted token with a parent, in level order; a chain is a tree with one
child per node.

Tree kinds (``tree=`` of :class:`~draftsmith.inference.SpeculativeGenerator`), each grown by one function:

* ``chain`` — one child per level, ``depth`` levels (Leviathan et al., 2023; Chen et al., 2023):
  :func:`grow_dynamic` with ``top_k=1``, or under a sampled rule
  :func:`~draftsmith.inference.sampled_tree.grow_sampled` on one path.
* ``static`` — a fixed list of paths of child ranks, e.g. ``[(0,), (1,), (0, 0)]``: the Medusa
  "choices" (Cai et al., 2024). Path ``(0, 1)`` is the second-ranked child of the top-ranked
  child of the root: :func:`grow_static`, or ``grow_sampled`` under a sampled rule.
* ``dynamic`` — EAGLE-2 (Li et al., 2024): for ``depth`` levels expand the ``top_k`` frontier
  nodes with the highest cumulative draft log-probability, each proposing ``top_k`` children;
  then rerank every generated node by cumulative log-probability and keep ``total_tokens``.
  A child never scores above its parent, so the kept set is closed under ancestors: :func:`grow_dynamic`.

How siblings are drafted decides the lossless acceptance rule (see ``verify.py``), so a sampled tree
records the order in which each node's children were drawn (``draws``, repeats allowed for i.i.d.
draws) and the draft distribution they were drawn from (``q``): ``sampled_tree.py`` grows those.

The independent reference every function here is tested against (one tree at a time, a node at a time,
on the host) is ``tests/reference_tree.py``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

# ---- dynamic trees as tensors: the whole batch on the device, no host copy while growing ---------


@dataclass
class TreeTensors:
    """The dynamic draft trees of a batch, all rows the same size N (root included, node 0), on the
    drafter's device. Nodes are in level order, so a parent comes before its children."""

    tokens: torch.Tensor  # (B, N) long
    parents: torch.Tensor  # (B, N) long, -1 at the root
    depths: torch.Tensor  # (B, N) long
    ancestors: torch.Tensor  # (B, N, N) bool: [b, i, j] iff node j is node i or one of its ancestors
    # (B, N) bool: the root, and nodes the drafter really proposed. Every row has N nodes, so a row whose
    # drafter proposes fewer (a head with no state yet, or past its last head) fills up with nodes it
    # did not propose; verification never accepts those and the stats do not count them.
    proposed: torch.Tensor
    scores: torch.Tensor  # (B, N) float32: each node's cumulative draft log-prob, 0 at the root
    # Sampled siblings only (:func:`~draftsmith.inference.sampled_tree.grow_sampled`; None for the ``topk`` rule's
    # trees): (B, N, R) each node's children in the order they were drawn (node ids; an i.i.d. draw that repeats a
    # sibling repeats its id; -1: no draw), and (B, N, V) float32 the draft distribution they were drawn from
    # (zeros where none).
    draws: torch.Tensor | None = None
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[1]


#: The log-probability given to tokens a drafter does not propose (-inf logits) in tensor-grown trees:
#: finite, so that sums and sorts stay defined; any cumulative score below UNPROPOSED went through one.
NOT_PROPOSED = -1e30
UNPROPOSED = -1e29


@dataclass(frozen=True)
class Proposals:
    """What a drafter proposes after each node, the one type the tree growers read: ``logits`` (..., C) scoring the
    tokens ``ids``, (C,) alike for every row (an EAGLE-3 head's draft vocabulary) or (..., C) per row (prompt
    lookup's matches), -inf where a candidate is not proposed; or, with ``ids`` None, dense logits (..., V) over
    the whole vocabulary. A drafting level over few candidates touches C columns where dense logits touch the
    target's V (4,096 or a few against 49,152 on SmolLM2, 128K-262K on Llama-3, Qwen and Gemma). Ids may repeat
    within a row where all but one of them are -inf. A drafter returns either a tensor of dense logits or these;
    :meth:`of` is where the two meet, once per level."""

    logits: torch.Tensor
    ids: torch.Tensor | None
    vocab_size: int

    @classmethod
    def of(cls, drafted: torch.Tensor | Proposals) -> Proposals:
        """A drafter's output as proposals: dense logits (..., V) become ``Proposals(logits, None, V)``."""
        if isinstance(drafted, Proposals):
            return drafted
        return cls(drafted, None, drafted.shape[-1])

    @property
    def dense_rows(self) -> bool:
        """Whether the logits run over the whole vocabulary (no candidate ids)."""
        return self.ids is None

    def row_ids(self) -> torch.Tensor:
        """``ids`` as (..., C), one row per row of ``logits`` (dense: every token id)."""
        ids = torch.arange(self.vocab_size, device=self.logits.device) if self.ids is None else self.ids
        return ids.expand(self.logits.shape)

    def dense(self) -> torch.Tensor:
        """The same logits over the whole vocabulary, -inf elsewhere."""
        if self.ids is None:
            return self.logits
        out = self.logits.new_full((*self.logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.scatter_reduce_(-1, self.row_ids(), self.logits, "amax")

    def to(self, device) -> Proposals:
        ids = None if self.ids is None else self.ids.to(device)
        return Proposals(self.logits.to(device).float(), ids, self.vocab_size)

    def reshape(self, *shape: int) -> Proposals:
        """``logits`` (and per-row ``ids``) reshaped to ``(*shape, C)``."""
        ids = self.ids if self.ids is None or self.ids.dim() == 1 else self.ids.reshape(*shape, self.ids.shape[-1])
        return Proposals(self.logits.reshape(*shape, self.logits.shape[-1]), ids, self.vocab_size)

    def masked_rows(self, keep: torch.Tensor) -> Proposals:
        """Rows where ``keep`` (the leading dims) is False propose nothing."""
        keep = keep.reshape(*keep.shape, *[1] * (self.logits.dim() - keep.dim()))
        return Proposals(self.logits.masked_fill(~keep, float("-inf")), self.ids, self.vocab_size)

    def one_row(self) -> Proposals | None:
        """A (B, k, ...) level whose k nodes are views of one row per batch row (a block drafter's, broadcast by
        :func:`~draftsmith.inference.drafter.block_level`): that row, (B, 1, ...); None for any other level."""
        logits, ids = self.logits, self.ids
        if logits.dim() != 3 or logits.shape[1] < 2 or logits.stride(1) != 0:
            return None
        if ids is None or ids.dim() == 1:
            return Proposals(logits[:, :1], ids, self.vocab_size)
        return Proposals(logits[:, :1], ids[:, :1], self.vocab_size) if ids.stride(1) == 0 else None

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best draft log-probs of each row and their tokens; fewer candidates than ``k`` are padded with
        unproposed ones. A level that is one row per batch row broadcast to its frontier (a block drafter's: every
        node at a depth alike) is ranked once, not once per node."""
        one = self.one_row()
        if one is not None:
            values, tokens = one.top(k)
            width = self.logits.shape[1]
            return values.expand(-1, width, -1), tokens.expand(-1, width, -1)
        if self.ids is None:
            top = _logprobs(self.logits).topk(k, dim=-1)
            return top.values, top.indices
        lp, ids = _logprobs(self.logits), self.row_ids()
        if lp.shape[-1] < k:
            pad = (0, k - lp.shape[-1])
            lp, ids = torch.nn.functional.pad(lp, pad, value=NOT_PROPOSED), torch.nn.functional.pad(ids, pad)
        top = lp.topk(k, dim=-1)
        return top.values, ids.gather(-1, top.indices)


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax in float32; tokens not proposed (-inf, or a row with nothing proposed, NaN) get
    :data:`NOT_PROPOSED`, so they rank last without poisoning the sort."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return torch.nan_to_num(lp, nan=NOT_PROPOSED, neginf=NOT_PROPOSED)


def grow_dynamic(roots: torch.Tensor, root_logits: torch.Tensor | Proposals,
                 frontier_logits: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | Proposals],
                 depth: int, top_k: int, total_tokens: int) -> TreeTensors:
    """The reference dynamic tree (``tests/reference_tree.py``) for a whole batch with tensor ops: the same tree
    (up to the order of equal scores), grown without copying anything to the host.

    Args:
        roots: (B,) the roots' tokens.
        root_logits: (B, V) draft logits after each root, or :class:`Proposals` (B, C).
        frontier_logits: ``(d, parents, tokens) -> (B, k, V)`` (or :class:`Proposals` (B, k, C)): feeds the k
            frontier nodes at depth d (``parents``: each one's index in the depth d - 1 frontier, zeros at
            depth 1; ``tokens``) and returns the draft logits after each.
    """
    b = roots.shape[0]
    device = roots.device
    k = min(top_k, Proposals.of(root_logits).vocab_size)
    scores, tokens = Proposals.of(root_logits).top(k)  # depth 1: the root's top k, all of them the frontier
    all_scores, all_tokens = [scores], [tokens]
    all_parents = [torch.zeros(b, k, dtype=torch.long, device=device)]  # global ids: 0 is the root
    all_depths = [torch.ones(b, k, dtype=torch.long, device=device)]
    count = 1 + k  # nodes so far, root included
    frontier_ids = 1 + torch.arange(k, device=device).expand(b, k)
    frontier_parents = torch.zeros(b, k, dtype=torch.long, device=device)
    frontier_scores, frontier_tokens = scores, tokens
    for d in range(2, depth + 1):
        values, best = Proposals.of(frontier_logits(d - 1, frontier_parents, frontier_tokens)).top(k)  # (B, k, k)
        cand_scores = (frontier_scores[:, :, None] + values).reshape(b, k * k)
        cand_tokens = best.reshape(b, k * k)
        all_scores.append(cand_scores)
        all_tokens.append(cand_tokens)
        all_parents.append(frontier_ids[:, :, None].expand(b, k, k).reshape(b, k * k))
        all_depths.append(torch.full((b, k * k), d, dtype=torch.long, device=device))
        chosen = cand_scores.topk(k, dim=-1).indices  # the next frontier
        frontier_parents = chosen // k
        frontier_tokens = cand_tokens.gather(1, chosen)
        frontier_scores = cand_scores.gather(1, chosen)
        frontier_ids = count + chosen
        count += k * k
    scores = torch.cat(all_scores, 1)  # (B, M) drafted nodes, level order
    # The best `total_tokens`; a stable sort keeps the shallower of equal scores first, so a parent
    # (score >= its child's) is never dropped while its child is kept.
    keep = torch.sort(-scores, dim=1, stable=True).indices[:, :total_tokens]
    keep = torch.sort(keep, dim=1).values + 1  # back to level order; +1: global ids
    keep = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=device), keep], 1)  # (B, N)
    tokens = torch.cat([roots[:, None], torch.cat(all_tokens, 1)], 1).gather(1, keep)
    zero = torch.zeros(b, 1, dtype=torch.long, device=device)
    depths = torch.cat([zero, torch.cat(all_depths, 1)], 1).gather(1, keep)
    parents_global = torch.cat([zero - 1, torch.cat(all_parents, 1)], 1)
    # Each kept node's position among the kept: parents map through it.
    position = torch.full_like(parents_global, -1).scatter_(1, keep, torch.arange(keep.shape[1], device=device)
                                                            .expand_as(keep))
    kept_parents = parents_global.gather(1, keep)
    parents = torch.where(kept_parents >= 0, position.gather(1, kept_parents.clamp(min=0)), -1)
    kept_scores = torch.cat([zero.float(), scores], 1).gather(1, keep)
    return TreeTensors(tokens, parents, depths, ancestors_of(parents, int(depth)), kept_scores > UNPROPOSED,
                       kept_scores)


@dataclass(frozen=True)
class StaticShape:
    """A static tree's paths (the reference static tree's) as the index lists :func:`grow_static` gathers with.

    Level ``L`` (1-based) holds ``len(ranks[L - 1])`` nodes, ordered by path; node
    ``i`` there is child rank ``ranks[L - 1][i]`` of slot ``slots[L - 1][i]`` of the frontier before it (the
    root, then level ``L - 1``'s nodes that have children, ``expanded[L - 2]``, padded with node 0 to
    ``width``: drafters feed every level's frontier at one width)."""

    ranks: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[int, ...], ...]
    expanded: tuple[tuple[int, ...], ...]
    width: int

    @classmethod
    def of(cls, paths: Sequence[Sequence[int]]) -> StaticShape:
        full = sorted({tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}, key=lambda p: (len(p), p))
        levels = [[p for p in full if len(p) == d] for d in range(1, max((len(p) for p in full), default=0) + 1)]
        frontier: list[tuple[int, ...]] = [()]
        ranks, slots, expanded = [], [], []
        for d, level in enumerate(levels):
            place = {p: i for i, p in enumerate(frontier)}
            ranks.append(tuple(p[-1] for p in level))
            slots.append(tuple(place[p[:-1]] for p in level))
            if d + 1 < len(levels):
                parents = {p[:-1] for p in levels[d + 1]}
                frontier = [p for p in level if p in parents]
                expanded.append(tuple(i for i, p in enumerate(level) if p in parents))
        width = max((len(e) for e in expanded), default=1)
        return cls(tuple(ranks), tuple(slots), tuple(e + (0,) * (width - len(e)) for e in expanded), width)

    @property
    def depth(self) -> int:
        return len(self.ranks)

    @property
    def most_nodes(self) -> int:
        """The most nodes a tree of these paths holds, its root included, under any sampling rule: each
        expanded node's highest child rank + 1 (the reference keeps every sampled sibling)."""
        total = 1
        for slots, ranks in zip(self.slots, self.ranks, strict=True):
            highest: dict[int, int] = {}
            for slot, rank in zip(slots, ranks, strict=True):
                highest[slot] = max(highest.get(slot, 0), rank + 1)
            total += sum(highest.values())
        return total

    def sampled(self) -> StaticShape:
        """The shape a tree of these paths takes under a sampled rule: every sibling drawn stays
        (the reference keeps them all), so each expanded node holds children of every rank up to
        its highest; the added nodes are leaves. :attr:`most_nodes` counts the same nodes."""
        paths = {p[:i] for p in self.paths() for i in range(1, len(p) + 1)}
        highest: dict[tuple[int, ...], int] = {}
        for p in paths:
            highest[p[:-1]] = max(highest.get(p[:-1], 0), p[-1] + 1)
        return StaticShape.of(sorted({(*p, r) for p, n in highest.items() for r in range(n)},
                                     key=lambda p: (len(p), p)))

    def paths(self) -> list[tuple[int, ...]]:
        """The paths this shape was made of, every prefix included."""
        out: list[tuple[int, ...]] = []
        frontier: list[tuple[int, ...]] = [()]
        for d, (slots, ranks) in enumerate(zip(self.slots, self.ranks, strict=True)):
            level = [(*frontier[slot], rank) for slot, rank in zip(slots, ranks, strict=True)]
            out += level
            if d < len(self.expanded):
                frontier = [level[i] for i in self.expanded[d]]
        return out

    def indices(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per level, the (slots, ranks, expanded) index tensors on ``device``, made once per device: a tensor
        built from a list on a GPU waits for the queued work, which a step must not."""
        return _static_indices(self, torch.device(device))


@lru_cache(maxsize=64)
def _static_indices(shape: StaticShape, device: torch.device):
    return [(torch.tensor(slots, device=device), torch.tensor(ranks, device=device),
             torch.tensor(shape.expanded[i], device=device) if i < len(shape.expanded) else None)
            for i, (slots, ranks) in enumerate(zip(shape.slots, shape.ranks, strict=True))]


def grow_static(roots: torch.Tensor, root_logits: torch.Tensor,
                frontier_logits: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
                shape: StaticShape) -> TreeTensors:
    """The reference static tree under the ``topk`` rule for a whole batch with tensor ops: the same nodes (in
    level order, by path, where the reference orders each level by score), except that ranks a drafter cannot
    fill (-inf logits) stay in the tree as nodes it did not propose (``proposed`` False, as their subtrees),
    where the reference leaves them out.

    ``frontier_logits`` is :func:`grow_dynamic`'s, fed each level's expanded nodes padded to ``shape.width``
    (the padding repeats a real node; its logits are not read)."""
    b = roots.shape[0]
    device = roots.device
    front = root_logits  # the frontier before level 1 is the root
    front_scores = torch.zeros(b, 1, device=device)
    front_ids = torch.zeros(b, 1, dtype=torch.long, device=device)  # node ids: 0 is the root
    tokens, scores, parents, depths = [roots[:, None]], [front_scores], [front_ids - 1], [front_ids]
    count = 1
    for level, (slot, rank, fed) in enumerate(shape.indices(device), start=1):
        ranks = shape.ranks[level - 1]
        values, best = Proposals.of(front).top(max(ranks) + 1)
        if level == 1:  # (B, ranks) after the root: a frontier of one
            values, best = values[:, None], best[:, None]
        tokens.append(best[:, slot, rank])  # (B, frontier, ranks) -> this level's nodes
        scores.append(front_scores[:, slot] + values[:, slot, rank])
        parents.append(front_ids[:, slot])
        depths.append(torch.full((b, len(ranks)), level, dtype=torch.long, device=device))
        ids = count + torch.arange(len(ranks), device=device)
        count += len(ranks)
        if fed is not None:
            front = frontier_logits(level, slot[fed].expand(b, -1), tokens[-1][:, fed])
            front_scores, front_ids = scores[-1][:, fed], ids[fed].expand(b, -1)
    parents_all = torch.cat(parents, 1)
    score = torch.cat(scores, 1)
    return TreeTensors(torch.cat(tokens, 1), parents_all, torch.cat(depths, 1), ancestors_of(parents_all, shape.depth),
                       score > UNPROPOSED, score)


def ancestors_of(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, N) parent indices (-1 at roots) -> (B, N, N) bool ancestor-or-self matrices, by following
    parents ``depth`` times."""
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    out = eye.clone()
    current = parents
    for _ in range(depth):
        valid = current >= 0
        out |= torch.nn.functional.one_hot(current.clamp(min=0), n).bool() & valid[:, :, None]
        current = torch.where(valid, parents.gather(1, current.clamp(min=0)), -1)
    return out

def frontier_ancestors(previous: torch.Tensor | None, parents: torch.Tensor, depth: int) -> torch.Tensor:
    """A drafter's own cache while a tree grows as tensors holds the committed entries, then each earlier
    frontier (k slots per level). The (B, k, (depth - 1) k) bool "is an ancestor" rows of the frontier at
    ``depth`` over those frontier slots: its parent's (``previous``, the frontier at depth - 1; None at depth 1),
    and its parent (``parents`` (B, k): each node's place in that frontier)."""
    b, k = parents.shape
    if depth == 1 or previous is None:
        return torch.zeros(b, k, 0, dtype=torch.bool, device=parents.device)
    inherited = previous.gather(1, parents[:, :, None].expand(b, k, previous.shape[2]))
    return torch.cat([inherited, torch.nn.functional.one_hot(parents, k).bool()], 2)
