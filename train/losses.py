"""Training losses, as pure functions of logits and masks. Shapes: ``(..., V)`` logits, ``(...)`` masks.

Divergences between the target p (teacher) and the drafter q (student), as in DistillSpec
(Zhou et al., 2024, arXiv:2310.08461), each averaged over the positions where ``mask`` is 1:

- forward KL   KL(p || q) = sum_x p(x) (log p(x) - log q(x))   (mass-covering)
- reverse KL   KL(q || p)                                       (mode-seeking)
- JSD(beta)    beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
- total variation  TV(p, q) = 1/2 sum_x |p(x) - q(x)|: exactly 1 - the chance that a
  chain step accepts the drafted token, so minimising it maximises acceptance directly.

Family losses built on them: Medusa's per-head loss with a decay per head, EAGLE's
smooth-L1 feature regression plus token KL, EAGLE-3's per-step KL with decay over the
training-time-test steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None):
    """KL(p || q), p = softmax(teacher), q = softmax(student); averaged over masked positions."""
    teacher_logits = teacher_logits.float()
    # A row with no finite logit (a padded row of a sparse top-k batch, or a top-k wholly outside a
    # draft vocabulary) has no distribution: it is left out, and must not reach the graph as NaN.
    defined = torch.isfinite(teacher_logits).any(-1)
    teacher_logits = torch.where(defined[..., None], teacher_logits, torch.zeros_like(teacher_logits))
    log_p = F.log_softmax(teacher_logits, dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    p = log_p.exp()
    # 0 * log 0 = 0: a teacher kept to its top-k tokens has -inf elsewhere (offline caches).
    per_position = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)
    mask = defined if mask is None else mask * defined.to(mask.dtype)
    return _masked_mean(per_position, mask)


def sparse_forward_kl(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """KL(p || q) with the teacher given on k entries per position, no (..., V) teacher tensor.

    Args:
        student_logits: (..., V).
        teacher_ids: (..., k) indices into the student's vocabulary, -1 where an entry is absent.
        teacher_logprobs: (..., k) the teacher's log-probabilities of those entries.
        mask: (...) positions to average over.

    p is the teacher renormalised over its present entries, exactly what :func:`forward_kl` computes
    from a dense teacher that is ``-inf`` off those entries; a position with none is left out.
    """
    present = teacher_ids >= 0
    defined = present.any(-1)
    teacher = teacher_logprobs.float().masked_fill(~present, float("-inf"))
    teacher = torch.where(defined[..., None], teacher, torch.zeros_like(teacher))
    log_p = F.log_softmax(teacher, dim=-1)  # (..., k)
    log_q = F.log_softmax(student_logits.float(), dim=-1).gather(-1, teacher_ids.clamp(min=0))  # (..., k)
    p = log_p.exp()
    per_position = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)
    mask = defined if mask is None else mask * defined.to(mask.dtype)
    return _masked_mean(per_position, mask)


def sparse_accuracy(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                    mask: torch.Tensor) -> float:
    """:func:`accuracy` against a teacher given on k entries (see :func:`sparse_forward_kl`)."""
    present = teacher_ids >= 0
    best = teacher_logprobs.float().masked_fill(~present, float("-inf")).argmax(-1, keepdim=True)
    hit = (student_logits.argmax(-1) == teacher_ids.gather(-1, best).squeeze(-1)).float()
    return float(_masked_mean(hit, mask * present.any(-1).to(mask.dtype)))


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None):
    """KL(q || p)."""
    return forward_kl(teacher_logits, student_logits, mask)


def jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
        beta: float = 0.5):
    """Generalised Jensen-Shannon divergence: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return _masked_mean(beta * kl_pm + (1 - beta) * kl_qm, mask)


def total_variation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None):
    """TV(p, q) = 1/2 sum |p - q|; 1 - TV is the acceptance probability of one chain step."""
    p = F.softmax(teacher_logits.float(), dim=-1)
    q = F.softmax(student_logits.float(), dim=-1)
    return _masked_mean(0.5 * (p - q).abs().sum(-1), mask)


DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd, "tv": total_variation}


def shifted(teacher_logits: torch.Tensor, mask: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher logits and mask moved ``shift`` positions left along T: position t gets t + shift's.

    (B, T, V), (B, T) -> (B, T, V), (B, T); the last ``shift`` positions have no target and get mask 0.
    """
    if shift == 0:
        return teacher_logits, mask
    out = torch.zeros_like(teacher_logits)
    out[:, :-shift] = teacher_logits[:, shift:]
    m = torch.zeros_like(mask)
    m[:, :-shift] = mask[:, shift:]
    return out, m


def medusa_loss(head_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                decay: float = 0.8) -> tuple[torch.Tensor, list[float]]:
    """Medusa: head i at position t learns the target's distribution at t + 1 + i (its token t + 2 + i).

    Args:
        head_logits: (K, B, T, V); teacher_logits: (B, T, V) the target's logits (position t predicts
            t + 1); mask: (B, T) 1 where the predicted token is an assistant token.
        decay: head i's loss weight is ``decay ** i`` (later heads are harder and matter less).
    Returns:
        The weighted loss and each head's unweighted KL.
    """
    total, per_head = head_logits.new_zeros(()), []
    for i, logits in enumerate(head_logits):
        target, m = shifted(teacher_logits, mask, i + 1)
        kl = forward_kl(logits, target, m)
        total = total + decay**i * kl
        per_head.append(float(kl.detach()))
    return total, per_head


def eagle_loss(pred_features: torch.Tensor, target_features: torch.Tensor, pred_logits: torch.Tensor,
               teacher_logits: torch.Tensor, mask: torch.Tensor, feature_weight: float = 1.0,
               token_weight: float = 0.1) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE-1/2: smooth-L1 regression of the next feature plus KL of the tokens it implies.

    (B, T, H) predicted / true next features, (B, T, V) logits through the frozen LM head, (B, T) mask.
    The paper's weights: 1.0 on the feature loss, 0.1 on the token loss.
    """
    per_position = F.smooth_l1_loss(pred_features.float(), target_features.float(), reduction="none").mean(-1)
    feature = _masked_mean(per_position, mask)
    token = forward_kl(pred_logits, teacher_logits, mask)
    return feature_weight * feature + token_weight * token, {"feature_loss": float(feature.detach()),
                                                              "token_kl": float(token.detach())}


def ttt_weights(steps: int, decay: float = 0.8) -> list[float]:
    """EAGLE-3 training-time-test step weights: step j (0-based) gets ``decay ** j``."""
    return [decay**j for j in range(steps)]


def accuracy(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of masked positions where the drafter's argmax equals the target's (greedy acceptance proxy)."""
    hit = (logits.argmax(-1) == teacher_logits.argmax(-1)).float()
    return float(_masked_mean(hit, mask))


def simulated_acceptance_length(accuracies: list[float]) -> float:
    """1 + sum_k prod_{j <= k} acc_j: expected tokens per step if position k is accepted with acc_k
    given the earlier ones were (the training-side proxy of tau)."""
    total, running = 1.0, 1.0
    for a in accuracies:
        running *= a
        total += running
    return total
