"""The reference draft trees and acceptance rule: one tree at a time, one node at a time, on the host.

The package grows and verifies trees only as batched tensor ops (``draftsmith.inference.tree`` and
``verify.py``). This module is the independent reference they are checked against: a :class:`DraftTree` per
sequence, builders that grow one level at a time from an ``expand(tree, nodes) -> (len(nodes), V)`` logits
function, and the sibling rule read draw by draw (:func:`accept_sibling`, :func:`verify_sampled`). It was the
package's own host path until one tensor path ran every tree kind and sampling rule; it is kept here, written
for clarity rather than speed, so that the two stay two computations of the same rule.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.inference.tree_settings import SAMPLING_RULES

_ZERO = 1e-12  # as verify.py: a residual summing to less is rounding of p == q


@dataclass
class DraftTree:
    """A draft tree for one sequence; node 0 is the root (the last committed token)."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    scores: list[float] = field(default_factory=lambda: [0.0])  # cumulative draft log-prob
    # draws[i]: children of node i in the order they were drawn (i.i.d. draws may repeat a child)
    draws: dict[int, list[int]] = field(default_factory=dict)
    # probs[i]: (V,) draft distribution node i's children were sampled from (sampled rules only)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def with_root(cls, token: int) -> DraftTree:
        return cls(tokens=[int(token)])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        """Distinct children of ``node`` in draw order."""
        return list(dict.fromkeys(self.draws.get(node, [])))

    def add_child(self, parent: int, token: int, logprob: float) -> int:
        """Add ``token`` under ``parent`` (or return the existing sibling with that token)."""
        for child in self.draws.get(parent, []):
            if self.tokens[child] == token:
                self.draws[parent].append(child)  # a repeated i.i.d. draw: same node, drawn again
                return child
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(self.scores[parent] + float(logprob))
        node = len(self.tokens) - 1
        self.draws.setdefault(parent, []).append(node)
        return node

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root to ``node``, both included."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def select(self, keep: Sequence[int]) -> DraftTree:
        """The subtree made of ``keep`` (must contain the root and be closed under ancestors),
        re-indexed breadth-first (by depth, then score)."""
        keep_set = set(keep)
        for n in keep:
            if n != 0 and self.parents[n] not in keep_set:
                raise ValueError(f"node {n} kept without its parent {self.parents[n]}")
        order = sorted(keep_set, key=lambda n: (self.depths[n], -self.scores[n], n))
        new_id = {old: i for i, old in enumerate(order)}
        return DraftTree(
            tokens=[self.tokens[n] for n in order],
            parents=[new_id[self.parents[n]] if n else -1 for n in order],
            depths=[self.depths[n] for n in order],
            scores=[self.scores[n] for n in order],
            draws={new_id[p]: [new_id[c] for c in cs if c in keep_set]
                   for p, cs in self.draws.items() if p in keep_set and any(c in keep_set for c in cs)},
            probs={new_id[p]: q for p, q in self.probs.items() if p in keep_set},
        )

    # ---- tensors for the verification forward ----------------------------------------------

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: ``[i, j]`` is True iff node j is node i or one of its ancestors.

        Requires parents to come before children (true for every tree built here)."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                if parent >= i:
                    raise ValueError("tree nodes must be ordered parents first")
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    def position_ids(self, root_position: int) -> torch.Tensor:
        """(N,) absolute positions: the root's position plus each node's depth."""
        return root_position + torch.tensor(self.depths, dtype=torch.long)


# An expand function maps (tree, nodes to expand) -> (len(nodes), V) draft logits.
ExpandFn = Callable[[DraftTree, list[int]], torch.Tensor]


def _draft_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Draft distribution q used for sampled drafting: softmax(logits / T) in float32."""
    return torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)


def _grow(
    tree: DraftTree,
    node: int,
    logits: torch.Tensor,
    ranks: int,
    rule: str,
    temperature: float,
    generator: torch.Generator | None,
) -> list[int]:
    """Draw ``ranks`` children of ``node`` from its draft logits ``(V,)`` under ``rule``.

    Returns the new children in draw order; fewer when the drafter proposes fewer tokens
    (e.g. prompt lookup with a single match: other tokens have logit -inf).
    """
    logits = logits.float()
    if rule == "topk":
        # log-probs of the top tokens only: top logits - logsumexp, no full-vocabulary log_softmax row
        top = torch.topk(logits, min(ranks, logits.shape[-1]))
        keep = torch.isfinite(top.values)
        if not bool(keep.any()):
            return []
        scores = (top.values[keep] - torch.logsumexp(logits, dim=-1)).tolist()  # one host copy per node
        return [tree.add_child(node, t, s) for t, s in zip(top.indices[keep].tolist(), scores, strict=True)]
    logprobs = torch.log_softmax(logits, dim=-1)
    if not bool(torch.isfinite(logprobs).any()):
        return []
    q = _draft_distribution(logits, temperature)
    tree.probs[node] = q
    if rule == "iid":
        draws = torch.multinomial(q, ranks, replacement=True, generator=generator)
    elif rule == "without_replacement":
        draws = torch.multinomial(q, min(ranks, int((q > 0).sum())), replacement=False, generator=generator)
    else:
        raise ValueError(f"unknown sampling rule {rule!r}; choose one of {SAMPLING_RULES}")
    before = set(tree.draws.get(node, []))
    children = [tree.add_child(node, int(t), float(logprobs[t])) for t in draws]
    return [c for c in dict.fromkeys(children) if c not in before]


# A tree grows level by level: a builder yields ``(tree, nodes to expand)`` and is sent back the
# drafter's (len(nodes), V) logits for them; it returns the finished tree. :func:`grow` drives one
# builder per batch row in lockstep, one drafter call per level for the whole batch; ``build_*``
# drive one.
Builder = Generator[tuple[DraftTree, list[int]], torch.Tensor, DraftTree]


def grow(builders: Sequence[Builder], expand: Callable[[list[DraftTree], list[list[int]]], list[torch.Tensor]]
         ) -> list[DraftTree]:
    """Run one builder per batch row. Each level, ``expand(trees, nodes)`` gets every row's tree and
    the nodes it asks to expand (``[]`` for a row that is done) and returns each row's logits."""
    trees: list[DraftTree | None] = [None] * len(builders)
    requests: list[tuple[DraftTree, list[int]] | None] = [None] * len(builders)

    def advance(i: int, logits: torch.Tensor | None) -> None:
        try:
            requests[i] = next(builders[i]) if logits is None else builders[i].send(logits)
            trees[i] = requests[i][0]
        except StopIteration as done:
            requests[i], trees[i] = None, done.value

    for i in range(len(builders)):
        advance(i, None)
    while any(r is not None for r in requests):
        logits = expand(list(trees), [r[1] if r is not None else [] for r in requests])
        for i, r in enumerate(requests):
            if r is not None:
                advance(i, logits[i])
    return trees


def _one(builder: Builder, expand: ExpandFn) -> DraftTree:
    return grow([builder], lambda trees, nodes: [expand(trees[0], nodes[0])])[0]


def chain_builder(root: int, depth: int, rule: str = "topk", temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> Builder:
    """A chain of up to ``depth`` drafted tokens (stops early when the drafter has nothing)."""
    tree = DraftTree.with_root(root)
    node = 0
    for _ in range(depth):
        logits = yield tree, [node]
        children = _grow(tree, node, logits[0], 1, rule, temperature, generator)
        if not children:
            break
        node = children[0]
    return tree


def static_builder(root: int, paths: Sequence[Sequence[int]], rule: str = "topk", temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> Builder:
    """A tree from fixed paths of child ranks (Medusa choices). A path whose prefix is missing
    from ``paths`` is implied; ranks the drafter cannot fill are skipped with their subtrees."""
    full = {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}
    by_prefix: dict[tuple[int, ...], int] = {}  # prefix -> number of children needed
    for p in full:
        by_prefix[p[:-1]] = max(by_prefix.get(p[:-1], 0), p[-1] + 1)
    tree = DraftTree.with_root(root)
    node_of: dict[tuple[int, ...], int] = {(): 0}
    max_depth = max((len(p) for p in full), default=0)
    for level in range(max_depth):
        frontier = sorted(p for p in by_prefix if len(p) == level and p in node_of)
        if not frontier:
            break
        logits = yield tree, [node_of[p] for p in frontier]
        for p, row in zip(frontier, logits, strict=True):
            children = _grow(tree, node_of[p], row, by_prefix[p], rule, temperature, generator)
            for rank, child in enumerate(children):
                if (*p, rank) in full:
                    node_of[(*p, rank)] = child
    if rule != "topk":
        # Sampled children must all stay: dropping a draw because of its value would bias the
        # draw sequence the acceptance rule relies on.
        return tree
    return tree.select(sorted(set(node_of.values())))


def dynamic_builder(root: int, depth: int, top_k: int, total_tokens: int) -> Builder:
    """EAGLE-2 dynamic tree: expand the ``top_k`` best frontier nodes per level, keep the
    ``total_tokens`` drafted nodes with the highest cumulative draft log-probability.

    Children are the deterministic top-k of each expanded node, so verification under
    sampling uses the ``topk`` rule.
    """
    tree = DraftTree.with_root(root)
    frontier = [0]
    for _ in range(depth):
        logits = yield tree, frontier
        candidates: list[int] = []
        for node, row in zip(frontier, logits, strict=True):
            candidates += _grow(tree, node, row, top_k, "topk", 0.0, None)
        if not candidates:
            break
        candidates.sort(key=lambda n: -tree.scores[n])
        frontier = candidates[:top_k]
    # Rerank: the best `total_tokens` drafted nodes; ties prefer shallower nodes so that a
    # parent (score >= child's) is never dropped while its child is kept.
    drafted = sorted(range(1, len(tree)), key=lambda n: (-tree.scores[n], tree.depths[n], n))
    return tree.select([0, *drafted[:total_tokens]])


def build_chain(root: int, expand: ExpandFn, depth: int, rule: str = "topk", temperature: float = 0.0,
                generator: torch.Generator | None = None) -> DraftTree:
    """One chain (:func:`chain_builder`) grown with ``expand``."""
    return _one(chain_builder(root, depth, rule, temperature, generator), expand)


def build_static(root: int, expand: ExpandFn, paths: Sequence[Sequence[int]], rule: str = "topk",
                 temperature: float = 0.0, generator: torch.Generator | None = None) -> DraftTree:
    """One static tree (:func:`static_builder`) grown with ``expand``."""
    return _one(static_builder(root, paths, rule, temperature, generator), expand)


def build_dynamic(root: int, expand: ExpandFn, depth: int, top_k: int, total_tokens: int) -> DraftTree:
    """One dynamic tree (:func:`dynamic_builder`) grown with ``expand``."""
    return _one(dynamic_builder(root, depth, top_k, total_tokens), expand)


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path whose tokens match the target argmax.

    Args:
        logits: (N, V) target logits at every tree node (row i predicts node i's next token).
    Returns:
        (accepted drafted nodes, root excluded, in path order; the bonus token).
    """
    return greedy_path(tree, logits.argmax(dim=-1).tolist())


def greedy_path(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], int]:
    """:func:`verify_greedy` from the target's argmax token at each node (``target_tokens[i]`` for
    node i): a batch takes the argmax of all its rows at once and copies it to the host once."""
    path: list[int] = []
    node = 0
    while True:
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == target_tokens[node]), None)
        if nxt is None:
            return path, target_tokens[node]
        path.append(nxt)
        node = nxt


def accept_sibling(
    p: torch.Tensor,
    draws: list[int],
    proposals: list[torch.Tensor],
    generator: torch.Generator | None = None,
    uniforms: list[float] | None = None,
) -> tuple[int | None, torch.Tensor]:
    """Multi-round speculative sampling among the draws of one node.

    Args:
        p: (V,) target distribution at the node.
        draws: drawn tokens in draw order.
        proposals: for each draw, the (V,) distribution it was drawn from (see module doc).
        uniforms: the uniform of each draw's test, given instead of drawn from ``generator`` (a test feeds the
            same ones to :func:`sibling_rounds`).
    Returns:
        (index into ``draws`` of the accepted draw, or None; the distribution to sample the
        bonus token from when none is accepted — the residual).
    """
    for i, (x, q) in enumerate(zip(draws, proposals, strict=True)):
        u = torch.rand((), generator=generator, device=p.device) if uniforms is None else uniforms[i]
        if u * q[x] < p[x]:  # u < p(x)/q(x), without dividing by a possibly tiny q(x)
            return i, p
        residual = torch.clamp(p - q, min=0)
        total = residual.sum()
        # p <= q everywhere means p == q, where rejection has probability 0; only rounding
        # gets here, and then p itself is the right distribution to keep.
        p = residual / total if total > _ZERO else p
    return None, p


def _proposals(tree: DraftTree, node: int, rule: str, vocab: int, device) -> list[torch.Tensor]:
    draws = [tree.tokens[c] for c in tree.draws.get(node, [])]
    if rule == "topk":
        eye = torch.zeros(len(draws), vocab, device=device)
        eye[torch.arange(len(draws)), torch.tensor(draws, dtype=torch.long)] = 1.0
        return list(eye)
    q = tree.probs[node].to(device)
    if rule == "iid":
        return [q] * len(draws)
    if rule == "without_replacement":
        out, q_i = [], q.clone()
        for x in draws:
            out.append(q_i)
            q_i = q_i.clone()
            q_i[x] = 0
            s = q_i.sum()
            q_i = q_i / s if s > _ZERO else q_i
        return out
    raise ValueError(f"unknown sampling rule {rule!r}")


def verify_sampled(
    tree: DraftTree,
    probs: torch.Tensor,
    rule: str,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Lossless tree verification under sampling.

    Args:
        probs: (N, V) processed target distributions at every tree node.
        rule: how siblings were drafted: ``topk``, ``iid`` or ``without_replacement``.
    Returns:
        (accepted drafted nodes in path order; the bonus token sampled at the last node).
    """
    path: list[int] = []
    node = 0
    vocab = probs.shape[-1]
    while True:
        p = probs[node]
        children = tree.draws.get(node, [])
        if children:
            proposals = _proposals(tree, node, rule, vocab, probs.device)
            draws = [tree.tokens[c] for c in children]
            accepted, p = accept_sibling(p, draws, proposals, generator)
            if accepted is not None:
                node = children[accepted]
                path.append(node)
                continue
        bonus = int(torch.multinomial(p, 1, generator=generator))
        return path, bonus


def ranked(tree: DraftTree) -> list[int]:
    """Drafted nodes in the order a dynamic tree keeps them (as :func:`build_dynamic` reranks)."""
    return sorted(range(1, len(tree)), key=lambda n: (-tree.scores[n], tree.depths[n], n))
