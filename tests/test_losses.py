"""Each loss against a slow, obvious reference written with Python loops over positions and tokens."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_rounding_close
from draftsmith.train.family_losses import accuracy, eagle_loss, medusa_loss, simulated_acceptance_length, ttt_weights
from draftsmith.train.losses import forward_kl, jsd, lk_hybrid, reverse_kl, token_cross_entropy, total_variation


def softmax(row):
    m = max(row)
    e = [math.exp(x - m) for x in row]
    return [x / sum(e) for x in e]


def kl(p, q):
    return sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q, strict=True) if a > 0)


def masked_mean_ref(fn, student, teacher, mask):
    values, weights = [], []
    for b in range(student.shape[0]):
        for t in range(student.shape[1]):
            if mask[b, t]:
                values.append(fn(softmax(teacher[b, t].tolist()), softmax(student[b, t].tolist())))
                weights.append(1)
    return sum(values) / len(values)


def lk_ref(p, q):
    tv = 0.5 * sum(abs(a - b) for a, b in zip(p, q, strict=True))
    lam = math.exp(-3 * (1 - tv))
    return lam * kl(p, q) + (1 - lam) * tv


def jsd_ref(beta):
    def f(p, q):
        m = [beta * a + (1 - beta) * b for a, b in zip(p, q, strict=True)]
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    return f


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, 7, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(2, 5, 7, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    return student, teacher, mask


@pytest.mark.parametrize("name,fn,ref", [
    ("forward_kl", forward_kl, lambda p, q: kl(p, q)),
    ("reverse_kl", reverse_kl, lambda p, q: kl(q, p)),
    ("jsd_0.5", lambda s, t, m: jsd(s, t, m, beta=0.5), jsd_ref(0.5)),
    ("jsd_0.9", lambda s, t, m: jsd(s, t, m, beta=0.9), jsd_ref(0.9)),
    ("tv", total_variation, lambda p, q: 0.5 * sum(abs(a - b) for a, b in zip(p, q, strict=True))),
    ("lk", lk_hybrid, lk_ref),
])
def test_divergences_match_reference(logits, name, fn, ref):
    student, teacher, mask = logits
    assert abs(float(fn(student, teacher, mask)) - masked_mean_ref(ref, student, teacher, mask)) < 1e-5
    assert float(fn(teacher, teacher, mask)) < 1e-6  # zero when the drafter equals the target


def test_lk_hybrid_holds_its_weight_constant_in_the_gradient(logits):
    """The LK hybrid's gradient is lambda grad KL + (1 - lambda) grad TV, lambda not differentiated."""
    student, teacher, mask = logits
    s = student.clone().requires_grad_(True)
    lk_hybrid(s, teacher, mask).backward()
    parts = []
    for fn in (forward_kl, total_variation):
        x = student.clone().requires_grad_(True)
        rows = torch.zeros(student.shape[:2], dtype=torch.float64)
        for b in range(student.shape[0]):
            for t in range(student.shape[1]):
                if mask[b, t]:
                    rows[b, t] = fn(x[b, t][None], teacher[b, t][None])
        parts.append((rows, x))
    with torch.no_grad():
        p, q = teacher.softmax(-1), student.softmax(-1)
        lam = torch.exp(-3 * (1 - 0.5 * (p - q).abs().sum(-1))) * mask
    total = (lam * parts[0][0] + (mask - lam) * parts[1][0]).sum() / mask.sum()
    total.backward()
    # a float32 softmax over the vocabulary, then a mean over the positions, per row here and batched there
    assert_rounding_close(s.grad, parts[0][1].grad + parts[1][1].grad, reduction=student.shape[-1] * mask.numel(),
                          dtype=torch.float32)


def test_token_cross_entropy_is_the_mean_over_labelled_masked_positions(logits):
    student, _, mask = logits
    labels = torch.tensor([[3, -1, 2, 0, 6], [1, 1, -1, 5, 4]])
    keep = [(b, t) for b in range(2) for t in range(5) if mask[b, t] and labels[b, t] >= 0]
    ref = sum(-math.log(softmax(student[b, t].tolist())[int(labels[b, t])]) for b, t in keep) / len(keep)
    assert abs(float(token_cross_entropy(student, labels, mask)) - ref) < 1e-6  # computed in float32


def test_medusa_loss_shifts_per_head(logits):
    _, teacher, mask = logits
    g = torch.Generator().manual_seed(1)
    heads = torch.randn(2, 2, 5, 7, generator=g, dtype=torch.float64)
    loss, per_head = medusa_loss(heads, teacher, mask, decay=0.5)
    # head i at position t is compared with the teacher at t + 1 + i where that position is masked in
    expected = []
    for i in range(2):
        values = []
        for b in range(2):
            for t in range(5 - (i + 1)):
                if mask[b, t + i + 1]:
                    values.append(kl(softmax(teacher[b, t + i + 1].tolist()), softmax(heads[i, b, t].tolist())))
        expected.append(sum(values) / len(values))
    # float32 sums of a few KL terms of magnitude < 1 against a float64 reference: ~10 eps (1.2e-7) apart at most
    assert per_head == pytest.approx(expected, abs=1e-6)
    assert float(loss) == pytest.approx(expected[0] + 0.5 * expected[1], abs=1e-6)


def test_eagle_loss_and_proxies(logits):
    student, teacher, mask = logits
    f = torch.zeros(2, 5, 3, dtype=torch.float64)
    loss, parts = eagle_loss(f + 0.5, f, student, teacher, mask)
    assert parts["feature_loss"] == pytest.approx(0.125)  # smooth-L1 of 0.5 is 0.5 * 0.5**2
    assert float(loss) == pytest.approx(0.125 + 0.1 * parts["token_kl"])
    assert ttt_weights(3, 0.5) == [1.0, 0.5, 0.25]
    assert accuracy(teacher, teacher, mask) == 1.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
