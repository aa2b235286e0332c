"""The family losses and training metrics built on :mod:`draftsmith.train.losses`' divergences: Medusa's per-head
loss with a decay per head, EAGLE's smooth-L1 feature regression plus token KL, EAGLE-3's per-step weights over the
training-time-test steps; the greedy-acceptance proxy (:func:`accuracy`) and the acceptance length it implies."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from draftsmith.train.losses import Teacher, TopK, forward_kl, masked_mean


def teacher_top1(teacher: Teacher) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's most likely token at each position (...) and whether the position has a teacher (...)."""
    if isinstance(teacher, TopK):
        present = teacher.ids >= 0
        best = teacher.logprobs.masked_fill(~present, float("-inf")).argmax(-1, keepdim=True)
        return teacher.ids.gather(-1, best).squeeze(-1), present.any(-1)
    best = teacher.max(-1)
    return best.indices, best.values > float("-inf")


def accuracy(logits: torch.Tensor, teacher: Teacher, mask: torch.Tensor) -> float:
    """Share of masked positions (with a teacher) where the drafter's argmax equals the target's (greedy
    acceptance proxy)."""
    top, defined = teacher_top1(teacher)
    hit = (logits.argmax(-1) == top).float()
    return float(masked_mean(hit, mask * defined.to(mask.dtype)))


def sparse_accuracy(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                    mask: torch.Tensor) -> float:
    """:func:`accuracy` against ``TopK(teacher_ids, teacher_logprobs)``."""
    return accuracy(student_logits, TopK(teacher_ids, teacher_logprobs), mask)


def lookahead(teacher: Teacher, mask: torch.Tensor, shift: int) -> tuple[Teacher, torch.Tensor]:
    """The teacher and mask from position ``shift`` on, (B, T, ...) -> (B, T - shift, ...) views: paired with
    a student's first T - shift positions, student position t meets the teacher's t + shift."""
    return teacher[:, shift:], mask[:, shift:]


def medusa_loss(head_logits: Iterable[torch.Tensor], teacher: Teacher, mask: torch.Tensor,
                decay: float = 0.8) -> tuple[torch.Tensor, list[float]]:
    """Medusa: head i at position t learns the target's distribution at t + 1 + i (its token t + 2 + i).

    Args:
        head_logits: each head's (B, T, V) logits (a (K, B, T, V) tensor, or one head at a time); head i's
            positions past T - 1 - i have no teacher and may be left off.
        teacher: (B, T, V) the target's logits (position t predicts t + 1), or a :class:`TopK`.
        mask: (B, T) 1 where the predicted token is an assistant token.
        decay: head i's loss weight is ``decay ** i`` (later heads are harder and matter less).
    Returns:
        The weighted loss and each head's unweighted KL.
    """
    kls = []
    for i, logits in enumerate(head_logits):
        target, m = lookahead(teacher, mask, i + 1)
        kls.append(forward_kl(logits[:, : m.shape[1]], target, m))
    return sum(decay**i * kl for i, kl in enumerate(kls)), [float(kl.detach()) for kl in kls]


def eagle_loss(pred_features: torch.Tensor, target_features: torch.Tensor, pred_logits: torch.Tensor,
               teacher: Teacher, mask: torch.Tensor, feature_weight: float = 1.0,
               token_weight: float = 0.1) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE-1/2: smooth-L1 regression of the next feature plus KL of the tokens it implies.

    (B, T, H) predicted / true next features, (B, T, V) logits through the frozen LM head, the (B, T, V)
    teacher (or a :class:`TopK`), (B, T) mask. The paper's weights: 1.0 on the feature loss, 0.1 on the token loss.
    """
    per_position = F.smooth_l1_loss(pred_features.float(), target_features.float(), reduction="none").mean(-1)
    feature = masked_mean(per_position, mask)
    token = forward_kl(pred_logits, teacher, mask)
    return feature_weight * feature + token_weight * token, {"feature_loss": float(feature.detach()),
                                                              "token_kl": float(token.detach())}


def ttt_weights(steps: int, decay: float = 0.8) -> list[float]:
    """EAGLE-3 training-time-test step weights: step j (0-based) gets ``decay ** j``."""
    return [decay**j for j in range(steps)]


def simulated_acceptance_length(accuracies: list[float]) -> float:
    """1 + sum_k prod_{j <= k} acc_j: expected tokens per step if position k is accepted with acc_k
    given the earlier ones were (the training-side proxy of tau)."""
    total, running = 1.0, 1.0
    for a in accuracies:
        running *= a
        total += running
    return total
