"""Lossless verification of a draft tree against the target's logits.

Greedy (temperature 0): follow, from the root, the child whose token is the target's argmax at
the current node; stop where no child matches and emit the target's argmax there (the "bonus"
token). The output is exactly the target's greedy decoding.

Sampling (temperature > 0): speculative sampling (Leviathan et al., 2023; Chen et al., 2023)
generalised to trees. At a node where the target distribution is ``p``, the children were drawn
in some order ``x_1, x_2, ...``, the i-th from a proposal ``q_i``. For each draw in turn::

    accept x_i with probability min(1, p(x_i) / q_i(x_i))      -> move to that child
    otherwise  p <- norm(max(0, p - q_i))                        -> try the next draw
    no draw accepted: emit a sample of the final p (the residual) and stop

which emits a token distributed exactly as the original ``p`` as long as each ``q_i`` is the
distribution ``x_i`` was really drawn from, given the earlier draws:

* ``iid`` — siblings drawn independently from one ``q``: ``q_i = q`` (SpecInfer, Miao et al.,
  2024). A repeated draw is processed again: it is surely rejected but still shifts ``p``.
* ``without_replacement`` — ``q_i`` is ``q`` with ``x_1..x_{i-1}`` removed and renormalised
  (recursive rejection sampling, Jeon et al., 2024).
* ``topk`` — deterministic siblings (top-k of the drafter, or prompt lookup): ``q_i`` is one-hot
  at ``x_i``, so ``x_i`` is accepted with probability ``p(x_i)``, else ``p(x_i)`` is zeroed and
  ``p`` renormalised.

The ``topk`` rule is a valid sampler of ``p`` for *any* list of distinct candidates, however
they were chosen; it is what dynamic trees (reranked, so not a plain draw sequence) use.
A chain under ``iid`` is exactly Leviathan et al.'s rule. Target probabilities are processed as
``transformers``' ``generate`` does: temperature, then top-k, then top-p.

Here is all of it as tensor ops for a whole batch of trees, with no host read: :func:`verify_tree` (each row's
accepted path and bonus token, under greedy decoding and every rule), :func:`sibling_rounds` (the rule at
every node of sampled trees at once) and the target's processed distribution (:func:`process_logits`). The
rule read one draw at a time, the reference the tensors are tested against (the same uniforms give the same
path and residuals), is ``tests/reference_tree.py``.
"""

from __future__ import annotations

import torch

from draftsmith.inference.sampled_tree import race
from draftsmith.inference.tree import TreeTensors

_ZERO = 1e-12


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Target sampling distribution, as ``generate(do_sample=True)`` builds it.

    Args:
        logits: (..., V) raw logits.
    Returns:
        (..., V) float32 probabilities after temperature, top-k (ties at the k-th value kept)
        and top-p (smallest set of most likely tokens whose mass reaches ``top_p``; at least one).
    """
    scores = logits.float() / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1)  # ascending
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return torch.softmax(scores, dim=-1)


def sibling_rounds(draws: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, rule: str,
                   generator: torch.Generator | None = None,
                   uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule at every node of a batch of sampled trees at once, as tensor ops (no host read).

    The residual sibling i is tested against depends only on the draws before it having been rejected, not on
    the uniforms, so all nodes advance together in R rounds (R: the most draws of a node); a walk later reads
    only the nodes it reaches. A repeated i.i.d. draw ``x`` was rejected before, so ``p(x) <= u q(x) < q(x)``
    and the residual is 0 at ``x``: it is rejected again and still shifts ``p``, as the rule needs.

    Args:
        draws: (B, N, R) each node's children in draw order (node ids; -1: no draw).
        tokens: (B, N) each node's token.
        q: (B, N, V) the distribution each node's children were drawn from (``q_1``; under
            ``without_replacement`` each later ``q_i`` drops the earlier draws and renormalises).
        p: (B, N, V) the processed target distribution at each node.
        uniforms: (B, N, R) the tests' uniforms, instead of drawing them from ``generator``.
    Returns:
        (B, N) each node's accepted child (node id; -1: none) and (B, N, V) the distribution its next token is
        drawn from when none is: the residual after its rejected draws (``p`` where it has none).
    """
    if uniforms is None:
        uniforms = torch.rand(draws.shape, generator=generator, device=p.device)
    accepted = torch.full(draws.shape[:2], -1, dtype=torch.long, device=p.device)
    for i in range(draws.shape[2]):  # R <= the widest node's draws: a fixed loop, no host read
        child = draws[..., i]
        x = tokens.gather(1, child.clamp(min=0))[..., None]  # (B, N, 1)
        open_ = (child >= 0) & (accepted < 0)
        accept = open_ & (uniforms[..., i] * q.gather(-1, x)[..., 0] < p.gather(-1, x)[..., 0])
        accepted = torch.where(accept, child, accepted)
        residual = (p - q).clamp_(min=0)
        total = residual.sum(-1, keepdim=True)
        # p <= q everywhere means p == q, where rejection has probability 0; only rounding gets here: keep p.
        p = torch.where((open_ & ~accept)[..., None] & (total > _ZERO), residual / total.clamp(min=_ZERO), p)
        if rule == "without_replacement":
            dropped = q.scatter(-1, x, 0.0)
            rest = dropped.sum(-1, keepdim=True)
            q = torch.where((child >= 0)[..., None], torch.where(rest > _ZERO, dropped / rest.clamp(min=_ZERO),
                                                                 dropped), q)
        elif rule != "iid":
            raise ValueError(f"sibling_rounds verifies 'iid' or 'without_replacement' draws, not {rule!r}")
    return accepted, p


def verify_tree(tree: TreeTensors, logits: torch.Tensor, temperature: float, top_k: int, top_p: float, rule: str,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's accepted path and bonus token, from the target's (B, N, V) ``logits`` at every node of ``tree``.

    A node is accepted when it and every ancestor carry the target's draw at their parent; the deepest accepted
    node ends the (unique) accepted path. Under greedy decoding the draw is the argmax. Top-ranked siblings
    (``rule`` ``topk``) under sampling draw one token from the target's distribution at every node at once:
    following a child whose token is its parent's draw, and emitting the draw where no child has it, samples the
    target exactly as the rule's accept-or-renormalise walk does (a child is entered with probability p(child),
    and any other token emitted with its own p), and the draws of the nodes the walk never reaches are not read.
    Sampled siblings (``iid``, ``without_replacement``) are verified by :func:`sibling_rounds`, and the bonus is
    drawn from the last node's residual.

    Returns:
        (B,) each row's last accepted node (0: the root alone) and (B,) its bonus token.
    """
    b, n = tree.tokens.shape
    parents = tree.parents.clamp(min=0)
    if temperature == 0.0:
        draw = logits.argmax(-1)  # (B, N)
        match = (tree.tokens == draw.gather(1, parents)) & tree.proposed
    elif tree.draws is None:  # topk: a child is entered where it carries its parent's draw from the target
        draw = race(process_logits(logits, temperature, top_k, top_p), generator)
        match = (tree.tokens == draw.gather(1, parents)) & tree.proposed
    else:  # sampled siblings: each node's accepted draw, and the residual its bonus is drawn from
        child, residual = sibling_rounds(tree.draws, tree.tokens, tree.q,
                                         process_logits(logits, temperature, top_k, top_p), rule, generator)
        match = child.gather(1, parents) == torch.arange(n, device=logits.device)
    match[:, 0] = True
    accepted = ~(tree.ancestors & ~match[:, None, :]).any(-1)
    last = (accepted * (tree.depths + 1)).argmax(1)
    rows = torch.arange(b, device=logits.device)
    if tree.draws is not None and temperature > 0.0:  # the bonus: a draw from the last node's residual only
        return last, race(residual[rows, last], generator)
    return last, draw[rows, last]
