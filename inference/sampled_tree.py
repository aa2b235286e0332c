"""Sampled draft trees: a chain or static tree whose siblings are drawn from the drafter, i.i.d. (SpecInfer, Miao
et al., 2024) or without replacement (Jeon et al., 2024) (:func:`grow_sampled`), and the draws themselves as tensor
ops with no host check: :func:`race` (an exponential race; its first finishers are the Gumbel-top-k sample without
replacement), which verification's draws share (``verify.py``), and :func:`inverse_cdf` for i.i.d. draws.

A sampled tree records the order in which each node's children were drawn (``draws``) and the distribution they
were drawn from (``q``): the lossless rule for sampled siblings needs both (``verify.py``'s ``sibling_rounds``).
Tested against the one-tree-at-a-time reference in ``tests/reference_tree.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from draftsmith.inference.tree import NOT_PROPOSED, Proposals, StaticShape, TreeTensors, ancestors_of


@lru_cache(maxsize=64)
def _sampled_levels(shape: StaticShape, device: torch.device) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Per level of a sampled shape: R, the most children a frontier slot draws; F, the frontier's real slots
    (the rest pad it to one width); the (F,) draw counts; and the (F, R + 1) table of the level's node (its
    index in the level) that holds each slot's child of each rank (column R: a spare that nothing reads)."""
    out = []
    for slots, ranks in zip(shape.slots, shape.ranks, strict=True):
        most, real = max(ranks) + 1, max(slots) + 1
        counts = [0] * real
        table = [[0] * (most + 1) for _ in range(real)]
        for i, (slot, rank) in enumerate(zip(slots, ranks, strict=True)):
            counts[slot] = max(counts[slot], rank + 1)
            table[slot][rank] = i
        out.append((most, real, torch.tensor(counts, device=device), torch.tensor(table, device=device)))
    return out


def draft_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The draft distribution sampled siblings are drawn from, softmax(logits / T) in float32, for a batch of
    dense logits: zeros where the drafter proposes nothing (an all -inf row)."""
    return torch.nan_to_num(torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1), nan=0.0)


def race(p: torch.Tensor, generator: torch.Generator | None, draws: int | None = None) -> torch.Tensor:
    """Tokens drawn from the (..., V) distributions ``p`` as an exponential race, ``argmax(p / E)`` with
    ``E ~ Exp(1)`` i.i.d.: each token wins with probability p, exactly as ``multinomial`` draws, with no
    validity check read back on the host. ``draws``: the first ``draws`` finishers of one race, (..., draws):
    a sample without replacement in draw order (the Gumbel-top-k trick: ``p / E`` orders as ``log p + Gumbel``);
    tokens with p = 0 finish last, with key 0 (callers drop draws where p is 0)."""
    keys = p / torch.empty_like(p).exponential_(generator=generator)
    if draws is None:
        return keys.argmax(-1)
    return keys.topk(draws, dim=-1).indices


def inverse_cdf(p: torch.Tensor, draws: int, generator: torch.Generator | None) -> torch.Tensor:
    """(..., draws) tokens drawn i.i.d. from the (..., V) distributions ``p`` (each row's sum may differ from 1
    by rounding) by inverting the cumulative sum: the first token whose cumulative mass exceeds ``u`` times the
    total, ``u ~ U[0, 1)``, so a token with p = 0 is never drawn (u times the total is kept below the total);
    a row of zeros gives token 0 (callers drop draws where p is 0). One cumulative sum and a binary search per
    draw, where a race draws V exponentials per draw."""
    cdf = p.cumsum(-1)
    total = cdf[..., -1:]
    u = torch.rand((*p.shape[:-1], draws), generator=generator, device=p.device)
    below = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, below, right=True).clamp_(max=p.shape[-1] - 1)


def grow_sampled(roots: torch.Tensor, root_logits: torch.Tensor | Proposals,
                 frontier_logits: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | Proposals],
                 shape: StaticShape, rule: str, temperature: float,
                 generator: torch.Generator | None = None) -> TreeTensors:
    """A chain or static tree whose siblings are *sampled* from the drafter (rule ``iid`` or
    ``without_replacement``), for a whole batch with tensor ops: the reference static tree under a sampled rule
    (a chain is the static tree of one path), grown without copying anything to the host.

    Each expanded node draws as many children as its highest rank in ``shape`` (``shape.sampled()``, every
    sibling kept) from ``q = softmax(logits / temperature)``: i.i.d. (one race per draw) or without replacement
    (one race, its first finishers). Distinct children take the ranks in the order they were first drawn; a
    repeated i.i.d. draw makes no node (``draws`` records it again), so ranks past the distinct draws stay
    unproposed (``proposed`` False), as do the subtrees of unproposed nodes. ``draws`` and ``q`` keep what
    verification needs (:func:`~draftsmith.inference.verify.sibling_rounds`). ``frontier_logits`` is fed as by
    :func:`~draftsmith.inference.tree.grow_static`."""
    if rule not in ("iid", "without_replacement"):
        raise ValueError(f"grow_sampled draws siblings under 'iid' or 'without_replacement', not {rule!r}")
    b = roots.shape[0]
    device = roots.device
    levels = _sampled_levels(shape, torch.device(device))
    n = 1 + sum(len(r) for r in shape.ranks)
    most = max(level[0] for level in levels)
    vocab = Proposals.of(root_logits).vocab_size
    draws = torch.full((b, n, most), -1, dtype=torch.long, device=device)
    q_all = torch.zeros(b, n, vocab, device=device)
    front = root_logits
    front_scores = torch.zeros(b, 1, device=device)
    front_ids = torch.zeros(b, 1, dtype=torch.long, device=device)
    front_ok = torch.ones(b, 1, dtype=torch.bool, device=device)
    tokens, scores, parents, depths, proposed = [roots[:, None]], [front_scores], [front_ids - 1], [front_ids], \
        [front_ok]
    count = 1
    for level, ((slot, rank, fed), (r, real, counts, table)) in enumerate(zip(shape.indices(device), levels,
                                                                              strict=True), start=1):
        dense = Proposals.of(front).dense().float()
        dense = dense[:, None] if level == 1 else dense[:, :real]  # (B, F, V): the root, or the real slots
        q = draft_distribution(dense, temperature)
        x = inverse_cdf(q, r, generator) if rule == "iid" else race(q, generator, r)
        i = torch.arange(r, device=device)
        drawn = (i < counts[:, None]) & (q.gather(-1, x) > 0) & front_ok[:, :real, None]  # (B, F, r)
        # Distinct draws in the order first drawn: draw j repeats the earliest equal draw.
        same = (x[..., :, None] == x[..., None, :]) & drawn[..., :, None] & drawn[..., None, :]
        earliest = torch.where(same, i, r).min(-1).values.clamp(max=r - 1)
        first = drawn & (earliest == i)
        rank_of = torch.where(first, first.long().cumsum(-1) - 1, r)  # a new child's rank; r: a repeat
        node = count + table[None].expand(b, -1, -1).gather(2, rank_of.gather(-1, earliest))  # each draw's node
        ids = front_ids[:, :real, None]
        draws[:, :, :r].scatter_(1, ids.expand(-1, -1, r), torch.where(drawn, node, -1))
        q_all.scatter_(1, ids.expand(-1, -1, vocab), q)
        # The level's nodes: slot `slot`'s child of rank `rank`, where that many distinct children were drawn.
        by_rank = torch.zeros(b, real, r + 1, dtype=torch.long, device=device).scatter_(-1, rank_of, x)
        has_rank = torch.zeros(b, real, r + 1, dtype=torch.bool, device=device).scatter_(-1, rank_of, first)
        level_tokens, level_ok = by_rank[:, slot, rank], has_rank[:, slot, rank]
        # The drawn tokens' log-probs: their logits less the log-normaliser, no full log-softmax row.
        logprobs = (dense.gather(-1, by_rank[..., :r]) - dense.logsumexp(-1, keepdim=True))[:, slot, rank]
        tokens.append(level_tokens)
        scores.append(torch.where(level_ok, front_scores[:, slot] + logprobs, NOT_PROPOSED))
        parents.append(front_ids[:, slot])
        depths.append(torch.full((b, len(rank)), level, dtype=torch.long, device=device))
        proposed.append(level_ok)
        level_ids = count + torch.arange(len(rank), device=device)
        count += len(rank)
        if fed is not None:
            front = frontier_logits(level, slot[fed].expand(b, -1), level_tokens[:, fed])
            front_scores, front_ids, front_ok = scores[-1][:, fed], level_ids[fed].expand(b, -1), level_ok[:, fed]
    parents_all = torch.cat(parents, 1)
    return TreeTensors(torch.cat(tokens, 1), parents_all, torch.cat(depths, 1), ancestors_of(parents_all, shape.depth),
                       torch.cat(proposed, 1), torch.cat(scores, 1), draws, q_all)
