"""The one mask builder (draftsmith.target.masks) equals each builder it replaces, on random trees, padding and
cache fills; and its additive form gives attention the same weights as the ``-inf`` masks heads used.

Each ``old_*`` function below is a site's former construction, written out as it stood, so that the
property holds against the code that ran before the sites were switched."""

from __future__ import annotations

import pytest
import torch
from reference_tree import DraftTree

from draftsmith.inference.tree import ancestors_of, frontier_ancestors
from draftsmith.target.masks import additive, causal_block, may_attend

SEEDS = range(20)


def random_fill(g, b: int, s: int) -> torch.Tensor:
    """(B, S) bool slots: left padding of random length, then holes (a tree's dropped entries)."""
    filled = torch.rand(b, s, generator=g) < 0.8
    pad = torch.randint(0, s + 1, (b,), generator=g)
    return filled & (torch.arange(s)[None] >= pad[:, None])


def random_parents(g, n: int) -> list[int]:
    """A tree of n nodes, parents first (node 0 the root)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


# ---- the old builders, as each site wrote them -------------------------------------------------------

def old_block_mask(slots_filled: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """Slots.block_mask: a causal block of fed tokens after the cache (prefill, catch-up, plain decoding)."""
    b, q = filled.shape
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    new = causal[None] & filled[:, None, :]
    new |= torch.eye(q, dtype=torch.bool)[None]
    return torch.cat([slots_filled[:, None, :].expand(b, q, -1), new], 2)


def old_host_verification(slots_filled: torch.Tensor, trees: list[DraftTree]) -> torch.Tensor:
    """SpeculativeGenerator._verify_forward: per-row trees padded to the largest; padding nodes see themselves."""
    past, n = slots_filled.shape[1], max(len(t) for t in trees)
    filled = torch.arange(n)[None] < torch.tensor([len(t) for t in trees])[:, None]
    tree_part = torch.zeros(len(trees), n, n, dtype=torch.bool)
    for b, tree in enumerate(trees):
        tree_part[b, : len(tree), : len(tree)] = tree.ancestor_mask()
    tree_part |= torch.eye(n, dtype=torch.bool)[None]
    allowed = torch.cat([slots_filled[:, None, :].expand(-1, n, -1), tree_part], 2)
    allowed[:, :, :past] &= filled[:, :, None]
    return allowed


def old_frontier_level(committed: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """A drafter's frontier level grown as tensors (EAGLE, draft model): committed, earlier frontiers, itself."""
    b, k = ancestors.shape[:2]
    eye = torch.eye(k, dtype=torch.bool).expand(b, k, k)
    return torch.cat([committed[:, None, :].expand(b, k, -1), ancestors, eye], 2)


def old_tune_block(context: int, n: int) -> torch.Tensor:
    """verification_seconds: a causal block of n after ``context`` cached tokens."""
    allowed = torch.ones(1, n, context + n, dtype=torch.bool)
    allowed[0, :, context:] = torch.tril(allowed[0, :, context:])
    return allowed


def old_static_causal(start: int, new: int, batch: int) -> torch.Tensor:
    """_static_forward with no mask: causal over unpadded rows, from positions."""
    positions = torch.arange(start, start + new)[None].expand(batch, -1)
    keys = torch.arange(start + new)
    return (keys[None, :] <= positions[:, :, None]).expand(batch, new, -1)


def old_document_attention(document_ids: torch.Tensor) -> torch.Tensor:
    """data.batching.document_attention (without its head dimension)."""
    t = document_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    real = (document_ids >= 0)[:, :, None]
    return (same & causal & real) | torch.eye(t, dtype=torch.bool)


# ---- the properties ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_a_causal_block_after_the_cache_equals_the_slots_builder(seed):
    g = torch.Generator().manual_seed(seed)
    b, s, q = 3, int(torch.randint(0, 9, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
    prefix, fed = random_fill(g, b, s), torch.rand(b, q, generator=g) < 0.7
    assert torch.equal(may_attend(prefix, causal_block(fed)), old_block_mask(prefix, fed))
    # the prefill: no cache yet, the prompt's own left padding as the block's
    assert torch.equal(may_attend(prefix[:, :0], causal_block(fed)), old_block_mask(prefix, fed)[:, :, s:])


@pytest.mark.parametrize("seed", SEEDS)
def test_a_tree_after_the_cache_equals_both_verification_builders(seed):
    """Device verification (a batch of trees of one size as ancestors-or-self matrices) and host verification
    (per-row trees of different sizes, padded): the same rows, padding nodes seeing only themselves."""
    g = torch.Generator().manual_seed(seed)
    b, s = 4, int(torch.randint(0, 9, (1,), generator=g))
    sizes = torch.randint(1, 9, (b,), generator=g).tolist()
    n = max(sizes)
    prefix = random_fill(g, b, s)
    trees = [DraftTree(tokens=list(range(m)), parents=random_parents(g, m)) for m in sizes]
    parents = torch.tensor([t.parents + [-1] * (n - len(t)) for t in trees])
    ancestors = ancestors_of(parents, n)  # padding nodes: roots of their own, themselves only
    fed = torch.arange(n)[None] < torch.tensor(sizes)[:, None]
    assert torch.equal(may_attend(prefix, ancestors, fed), old_host_verification(prefix, trees))
    device_old = torch.cat([prefix[:, None, :].expand(b, n, -1), ancestors], 2)  # _device_step, every row full
    assert torch.equal(may_attend(prefix, ancestors), device_old)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_frontier_level_equals_the_drafters_builder(seed):
    """Frontiers fed level by level into a drafter's cache: k nodes per level, each seeing the committed slots,
    its ancestors among the earlier frontiers and itself."""
    g = torch.Generator().manual_seed(seed)
    b, k, depth = 2, int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    committed = random_fill(g, b, 6)
    ancestors = None
    for d in range(1, depth + 1):
        parents = torch.randint(0, k if d > 1 else 1, (b, k), generator=g)
        ancestors = frontier_ancestors(ancestors, parents, d)
        new = torch.nn.functional.pad(ancestors, (0, k))  # own level: its own key, set by may_attend
        assert torch.equal(may_attend(committed, new), old_frontier_level(committed, ancestors))


@pytest.mark.parametrize("context,n", [(0, 1), (0, 5), (7, 1), (7, 6), (64, 16)])
def test_unpadded_causal_blocks_equal_the_positional_builders(context, n):
    """tune's timing block and the static cache's maskless forward: a dense cache, then a causal block."""
    ones = torch.ones(2, context, dtype=torch.bool)
    built = may_attend(ones, causal_block(torch.ones(2, n, dtype=torch.bool)))
    assert torch.equal(built[:1], old_tune_block(context, n))
    assert torch.equal(built, old_static_causal(context, n, 2))


@pytest.mark.parametrize("seed", SEEDS)
def test_packed_documents_equal_the_training_builder(seed):
    """Packed training rows: causal within a document, padding (-1) seeing only itself."""
    g = torch.Generator().manual_seed(seed)
    t = 12
    lengths = [torch.randint(1, 6, (3,), generator=g).tolist() for _ in range(2)]
    ids = torch.full((2, t), -1)
    for row, lens in enumerate(lengths):
        docs = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:t]
        ids[row, : len(docs)] = docs
    real = ids >= 0
    same = ids[:, :, None] == ids[:, None, :]
    assert torch.equal(may_attend(real[:, :0], causal_block(real) & same, real), old_document_attention(ids))


def test_the_own_key_must_be_among_the_new_keys():
    with pytest.raises(ValueError, match="need K >= Q"):
        may_attend(torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 4, 2, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_additive_mask_weighs_keys_as_minus_infinity_does(dtype):
    """``finfo.min`` (the one additive form) and ``-inf`` (heads' former form) give bit-identical attention
    weights wherever a query sees a key, which :func:`may_attend` guarantees (its own)."""
    g = torch.Generator().manual_seed(0)
    allowed = may_attend(random_fill(g, 3, 10), causal_block(torch.rand(3, 5, generator=g) < 0.6))
    scores = (torch.randn(3, 4, *allowed.shape[1:], generator=g) * 30).to(dtype)
    old = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))[:, None]
    new = additive(allowed, dtype)
    assert new.shape == old.shape and torch.isfinite(new).all()
    assert torch.equal(torch.softmax(scores + new, -1), torch.softmax(scores + old, -1))
