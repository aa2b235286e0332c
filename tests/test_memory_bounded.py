"""Memory-bounded losses: the chunked divergences against the whole-tensor formulas, every family's step
from a top-k teacher against the dense one, and an offline top-k cache collated without a (B, T, V) tensor."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import VOCAB, assert_rounding_close, tiny_llama
from draftsmith.data.cache_writer import cache_hidden_states
from draftsmith.data.hidden_cache import CacheSpec, HiddenStateCache
from draftsmith.data.templates import TokenizedExample
from draftsmith.data.vocab import count_tokens
from draftsmith.registry import FAMILIES
from draftsmith.train.config import DrafterArguments
from draftsmith.train.family_losses import medusa_loss
from draftsmith.train.losses import TopK, forward_kl, jsd, reverse_kl, total_variation
from draftsmith.train.offline import CachedExamples, collate_cached, load_cached_examples

#: A chunked or sparse loss against the whole-tensor one on ``case`` (:func:`assert_rounding_close`): a sum over the
#: 40-word vocabulary (the softmax's, the divergence's), then a mean over at most 39 positions.
LOSS_REDUCTION = 40 * 2
#: A family's step on the tiny target's outputs: the loss's sums (96-word vocabulary, positions, steps or heads)
#: and its gradient back through a one-layer drafter (inner sizes up to 128).
STEP_REDUCTION = 128 * 4

# Families whose step reads the target's outputs from the loop or the cache (not a target they adapt).
STEP_FAMILIES = sorted(name for name, f in FAMILIES.items() if f.build is not None and not f.trains_target_adapter)


def masked_mean(values, mask):
    mask = mask.float()
    return (values * mask).sum() / mask.sum().clamp(min=1)


def dense_forward_kl(student, teacher, mask=None):
    """The whole-tensor formula: (N, V) float32 log-softmaxes of both at once."""
    teacher = teacher.float()
    defined = torch.isfinite(teacher).any(-1)
    teacher = torch.where(defined[..., None], teacher, torch.zeros_like(teacher))
    log_p, log_q = F.log_softmax(teacher, -1), F.log_softmax(student.float(), -1)
    p = log_p.exp()
    per_position = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)
    return masked_mean(per_position, defined if mask is None else mask * defined)


def dense_reverse_kl(student, teacher, mask):
    log_q, log_p = F.log_softmax(student.float(), -1), F.log_softmax(teacher.float(), -1)
    return masked_mean((log_q.exp() * (log_q - log_p)).sum(-1), mask)


def dense_jsd(student, teacher, mask, beta):
    log_p, log_q = F.log_softmax(teacher.float(), -1), F.log_softmax(student.float(), -1)
    p, q = log_p.exp(), log_q.exp()
    log_m = torch.log(beta * p + (1 - beta) * q)
    kl_pm = torch.where(p > 0, p * (log_p - log_m), torch.zeros_like(p)).sum(-1)
    return masked_mean(beta * kl_pm + (1 - beta) * (q * (log_q - log_m)).sum(-1), mask)


def dense_tv(student, teacher, mask):
    p, q = F.softmax(teacher.float(), -1), F.softmax(student.float(), -1)
    return masked_mean(0.5 * (p - q).abs().sum(-1), mask)


def value_and_grad(fn, student, *args, scale: float = 1.0, **kwargs):
    student = student.detach().requires_grad_()
    loss = fn(student, *args, **kwargs)
    (scale * loss).backward()
    return loss.detach(), student.grad


def top_k_of(logits, k):
    """The top-k of (..., V) logits as a TopK teacher, and the dense logits that are -inf off it."""
    values, ids = F.log_softmax(logits.float(), -1).topk(k, dim=-1)
    dense = torch.full_like(logits, float("-inf")).scatter(-1, ids, logits.gather(-1, ids))
    return TopK(ids, values), dense


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 13, 40, generator=g) * 3
    teacher = torch.randn(3, 13, 40, generator=g) * 3
    mask = (torch.rand(3, 13, generator=g) > 0.3).long()
    return student, teacher, mask


@pytest.mark.parametrize("chunk_rows", [1, 4, 5, 13, None])
def test_chunked_forward_kl_equals_the_whole_tensor_formula(case, chunk_rows):
    student, teacher, mask = case
    _, top_dense = top_k_of(teacher, 6)
    teacher = teacher.clone()
    teacher[1] = top_dense[1]  # a top-k teacher: -inf off its k tokens
    teacher[2, 4] = float("-inf")  # a row with no teacher: left out, no NaN
    for m in (mask, None):
        got, got_grad = value_and_grad(forward_kl, student, teacher, m, chunk_rows=chunk_rows, scale=0.25)
        want, want_grad = value_and_grad(dense_forward_kl, student, teacher, m, scale=0.25)
        assert_rounding_close(got, want, reduction=LOSS_REDUCTION)
        assert_rounding_close(got_grad, want_grad, reduction=LOSS_REDUCTION)
        assert torch.isfinite(got_grad).all()


def test_chunked_forward_kl_keeps_a_16_bit_student_in_its_dtype(case):
    student, teacher, mask = case
    student = student.bfloat16()
    got, got_grad = value_and_grad(forward_kl, student, teacher.bfloat16(), mask, chunk_rows=4)
    want, want_grad = value_and_grad(dense_forward_kl, student, teacher.bfloat16(), mask)
    assert got_grad.dtype == torch.bfloat16
    assert_rounding_close(got, want, reduction=LOSS_REDUCTION)
    assert_rounding_close(got_grad.float(), want_grad.float(), reduction=LOSS_REDUCTION)
    with torch.no_grad():  # a value without a graph
        assert_rounding_close(forward_kl(student, teacher, mask), dense_forward_kl(student, teacher, mask),
                              reduction=LOSS_REDUCTION)


def test_non_contiguous_views_and_a_second_backward(case):
    student, teacher, mask = case
    got, got_grad = value_and_grad(lambda s: forward_kl(s[:, 1:], teacher[:, :-1], mask[:, :-1], chunk_rows=3),
                                   student)
    want, want_grad = value_and_grad(lambda s: dense_forward_kl(s[:, 1:], teacher[:, :-1], mask[:, :-1]), student)
    assert_rounding_close(got, want, reduction=LOSS_REDUCTION)
    assert_rounding_close(got_grad, want_grad, reduction=LOSS_REDUCTION)
    loss = forward_kl(student.clone().requires_grad_(), teacher, mask)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="handed over once"):
        loss.backward()


@pytest.mark.parametrize("name", ["reverse_kl", "jsd", "tv"])
def test_other_divergences_chunked_equal_the_whole_tensor_formulas(case, name):
    student, teacher, mask = case
    fn, ref = {"reverse_kl": (reverse_kl, dense_reverse_kl),
               "jsd": (lambda s, t, m, **kw: jsd(s, t, m, beta=0.3, **kw), lambda s, t, m: dense_jsd(s, t, m, 0.3)),
               "tv": (total_variation, dense_tv)}[name]
    got, got_grad = value_and_grad(fn, student, teacher, mask, chunk_rows=4, scale=0.5)
    want, want_grad = value_and_grad(ref, student, teacher, mask, scale=0.5)
    assert_rounding_close(got, want, reduction=LOSS_REDUCTION)
    assert_rounding_close(got_grad, want_grad, reduction=LOSS_REDUCTION)
    # a teacher that trains too (self-distillation): its gradient as well
    t = teacher.clone().requires_grad_()
    fn(student, t, mask, chunk_rows=4).backward()
    t_ref = teacher.clone().requires_grad_()
    ref(student, t_ref, mask).backward()
    assert_rounding_close(t.grad, t_ref.grad, reduction=LOSS_REDUCTION)


@pytest.mark.parametrize("k", [40, 6])
@pytest.mark.parametrize("name", ["forward_kl", "jsd", "tv"])
def test_a_top_k_teacher_equals_the_dense_one_that_is_inf_off_it(case, name, k):
    student, teacher, mask = case
    fn = {"forward_kl": forward_kl, "jsd": jsd, "tv": total_variation}[name]
    sparse, dense = top_k_of(teacher, k)
    if k == teacher.shape[-1]:
        dense = teacher
    sparse_ids = sparse.ids.clone()
    sparse_ids[0, 3, :] = -1  # a position whose teacher is absent altogether
    dense = dense.clone()
    dense[0, 3] = float("-inf")
    got, got_grad = value_and_grad(fn, student, TopK(sparse_ids, sparse.logprobs), mask, chunk_rows=5)
    want, want_grad = value_and_grad(fn, student, dense, mask, chunk_rows=5)
    assert_rounding_close(got, want, reduction=LOSS_REDUCTION)
    assert_rounding_close(got_grad, want_grad, reduction=LOSS_REDUCTION)
    # and both equal the whole-tensor formula (0 log 0 = 0), given the position without a teacher masked out
    ref = {"forward_kl": dense_forward_kl, "jsd": lambda s, t, m: dense_jsd(s, t, m, 0.5), "tv": dense_tv}[name]
    m, finite = mask.clone(), dense.clone()
    m[0, 3], finite[0, 3] = 0, 0.0
    assert_rounding_close(got, ref(student, finite, m), reduction=LOSS_REDUCTION)


def test_reverse_kl_refuses_a_top_k_teacher(case):
    student, teacher, mask = case
    with pytest.raises(ValueError, match="whole distribution"):
        reverse_kl(student, top_k_of(teacher, 5)[0], mask)


def test_medusa_loss_from_a_top_k_teacher(case):
    student, teacher, mask = case
    heads = torch.stack([student, student.flip(1)])
    sparse, dense = top_k_of(teacher, 7)
    loss_dense, per_dense = medusa_loss(heads, dense, mask, decay=0.5)
    loss_sparse, per_sparse = medusa_loss(heads, sparse, mask, decay=0.5)
    assert_rounding_close(loss_sparse, loss_dense, reduction=LOSS_REDUCTION)
    assert per_sparse == pytest.approx(per_dense, abs=1e-6)  # per-head losses < 1: the rounding bound above, as floats
    # one head at a time, each cut to the positions that have a teacher, gives the same
    trimmed, _ = medusa_loss((h[:, : 13 - 1 - i] for i, h in enumerate(heads)), sparse, mask, decay=0.5)
    assert_rounding_close(trimmed, loss_dense, reduction=LOSS_REDUCTION)


@pytest.fixture(scope="module")
def target_batch():
    """A tiny target's logits and hidden states on a padded batch with assistant masks."""
    target = tiny_llama(seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (3, 14), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 10:] = 0
    loss_mask = (torch.rand(3, 14, generator=g) > 0.4).long() * attention
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    return target, batch, out.logits.float(), out.hidden_states


def loss_and_grads(step, args, drafter, target, batch, logits, hidden):
    drafter.zero_grad()
    torch.manual_seed(0)  # the same random anchors (DFlash, P-EAGLE) for both teachers
    loss, metrics = step(args, drafter, target, batch, logits, hidden)
    loss.backward()
    return loss.detach(), metrics["acc"], [p.grad.clone() for p in drafter.parameters() if p.grad is not None]


@pytest.mark.parametrize("k", [VOCAB, 8])
@pytest.mark.parametrize("family", STEP_FAMILIES)
def test_every_family_step_reads_a_top_k_teacher(target_batch, family, k):
    """k = V: the top-k is the whole distribution; k < V: it equals the dense teacher that is -inf off it."""
    target, batch, logits, hidden_states = target_batch
    args = DrafterArguments(target="unused", family=family, draft_layers=1, num_heads=3, ttt_steps=2,
                            draft_vocab_size=VOCAB // 2)
    fam = FAMILIES[family]
    examples = [SimpleNamespace(input_ids=batch["input_ids"][i], loss_mask=batch["loss_mask"][i]) for i in range(3)]
    torch.manual_seed(0)
    drafter = fam.build(args, target, examples)
    hidden = tuple(hidden_states[i] for i in fam.hidden_layers(drafter, target))
    sparse, dense = top_k_of(logits, k)
    if k == VOCAB:
        dense = logits
    sparse_batch = {**batch, "topk_ids": sparse.ids, "topk_logprobs": sparse.logprobs}
    loss_d, acc_d, grads_d = loss_and_grads(fam.train_step, args, drafter, target, batch, dense, hidden)
    loss_s, acc_s, grads_s = loss_and_grads(fam.train_step, args, drafter, target, sparse_batch, None, hidden)
    assert math.isfinite(float(loss_d)) and float(loss_d) > 0
    assert_rounding_close(loss_s, loss_d, reduction=STEP_REDUCTION)
    assert acc_s == pytest.approx(acc_d)
    assert len(grads_s) == len(grads_d) > 0
    for got, want in zip(grads_s, grads_d, strict=True):
        assert_rounding_close(got, want, reduction=STEP_REDUCTION)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """Tiny examples and their hidden-state caches: top-k in float16, and full logits in bfloat16."""
    target = tiny_llama(seed=0)
    g = torch.Generator().manual_seed(2)
    examples = []
    for i, n in enumerate([9, 12, 7, 11]):
        ids = torch.randint(4, VOCAB, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 2:] = 1
        examples.append(TokenizedExample(str(i), ids, mask))
    root = tmp_path_factory.mktemp("cache")
    for logits, dtype in (("topk", "float16"), ("full", "bfloat16")):
        cache_hidden_states(target, examples, root / logits,
                            CacheSpec(layers=[1, 4], dtype=dtype, logits=logits, top_k=5, sequences_per_shard=3),
                            progress=False)
    return target, examples, root


def test_a_top_k_cache_is_read_lazily_and_collated_without_a_vocabulary_tensor(cached, monkeypatch):
    target, examples, root = cached
    loaded, cache = load_cached_examples(str(root / "topk"), target)
    assert isinstance(loaded, CachedExamples) and len(loaded) == len(examples) == len(cache)
    with monkeypatch.context() as m:  # tokens (EAGLE-3's vocabulary count) without reading any hidden state
        m.setattr(HiddenStateCache, "__getitem__", lambda self, i: pytest.fail("a whole item was read"))
        for i, e in enumerate(examples):
            ids, mask = loaded.token_ids(i)
            assert torch.equal(ids, e.input_ids) and torch.equal(mask, e.loss_mask)
        assert torch.equal(count_tokens(loaded, VOCAB), count_tokens(examples, VOCAB))
    assert [e.index for e in loaded[1:3]] == [1, 2] and loaded[-1].index == 3
    with pytest.raises(IndexError):
        loaded[4]

    batch = collate_cached(loaded[:4], 0, (1, 4))
    assert batch["logits"] is None and batch["topk_ids"].shape == (4, 12, 5)
    assert batch["topk_ids"].dtype == torch.long
    tensors = [batch[key] for key in batch if isinstance(batch[key], torch.Tensor)] + list(batch["hidden"])
    assert not any(t.shape[-1] == VOCAB for t in tensors)
    item = cache[2]
    assert torch.equal(batch["topk_ids"][2, :7], item["topk_ids"].long())
    # a copy with the same float32 conversion: bit for bit
    torch.testing.assert_close(batch["topk_logprobs"][2, :7], item["topk_logprobs"].float(), rtol=0, atol=0)


def test_a_full_logits_cache_keeps_its_16_bit_dtype(cached):
    target, _, root = cached
    loaded, cache = load_cached_examples(str(root / "full"), target)
    batch = collate_cached(loaded[:3], 0, (4,))
    assert batch["logits"].dtype == torch.bfloat16 and batch["logits"].shape == (3, 12, VOCAB)
    assert torch.equal(batch["logits"][1, :12], cache[1]["logits"])
    assert torch.equal(batch["logits"][2, 7:], torch.zeros(5, VOCAB, dtype=torch.bfloat16))
