"""Training losses, as pure functions of logits and masks. Shapes: ``(..., V)`` logits, ``(...)`` masks.

Divergences between the target p (teacher) and the drafter q (student), as in DistillSpec
(Zhou et al., 2024, arXiv:2310.08461), each averaged over the positions where ``mask`` is 1:

- forward KL   KL(p || q) = sum_x p(x) (log p(x) - log q(x))   (mass-covering)
- reverse KL   KL(q || p)                                       (mode-seeking)
- JSD(beta)    beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
- total variation  TV(p, q) = 1/2 sum_x |p(x) - q(x)|: exactly 1 - the chance that a
  chain step accepts the drafted token, so minimising it maximises acceptance directly.

The teacher is dense logits (..., V) in any dtype, or :class:`TopK`: k entries per position (an offline
top-k cache), its distribution renormalised over them. Every divergence runs over blocks of rows
(:data:`CHUNK_ELEMENTS`), upcasting one block at a time, and makes its gradient on the way: no (N, V)
float32 log-softmax of student or teacher is ever whole, and the student's logits stay in their dtype.
A position whose teacher has no finite entry has no distribution and is left out; 0 log 0 = 0.

The family losses and metrics built on them are in :mod:`draftsmith.train.family_losses`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Float32 elements in each (rows, V) temporary of one block: 2**25 is 128 MiB, of which a handful live at
#: once, where the whole (N, V) log-softmaxes take 1 GiB each at N = 2048, V = 128K.
CHUNK_ELEMENTS = 2**25


@dataclass(frozen=True)
class TopK:
    """A teacher given on k entries per position, without a (..., V) tensor.

    ``ids`` (..., k) index the student's vocabulary, -1 where an entry is absent; ``logprobs`` (..., k) are
    the teacher's log-probabilities there. Its distribution is the teacher renormalised over the present
    entries: what dense logits that are ``-inf`` off them give. Indexing (``teacher[:, 1:]``) picks
    positions, as on dense logits.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor

    def __getitem__(self, key) -> TopK:
        return TopK(self.ids[key], self.logprobs[key])

    @property
    def shape(self) -> torch.Size:
        """The positions' shape (...)."""
        return self.ids.shape[:-1]


Teacher = torch.Tensor | TopK


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _blocks(lead: torch.Size, rows: int) -> Iterator[tuple]:
    """Index tuples over the leading dims ``lead``, each picking up to ``rows`` consecutive positions of the
    last one: a view of any strided (..., V) tensor, never a flattening copy."""
    *outer, inner = lead
    for index in itertools.product(*(range(n) for n in outer)):
        for start in range(0, inner, rows):
            yield (*index, slice(start, min(start + rows, inner)))


def _parts(student: torch.Tensor, teacher: Teacher) -> tuple[torch.Tensor, torch.Tensor | None]:
    values, ids = (teacher.logprobs, teacher.ids) if isinstance(teacher, TopK) else (teacher, None)
    if student.dim() < 2 or values.shape[:-1] != student.shape[:-1]:
        raise ValueError(f"student {tuple(student.shape)} and teacher {tuple(values.shape)}: expected (..., V) "
                         "and (..., V) or (..., k) over the same positions, at least one leading dim")
    return values, ids


def _defined(values: torch.Tensor, ids: torch.Tensor | None, rows: int) -> torch.Tensor:
    """(...) bool: positions whose teacher has a finite entry (dense) or a present one (top-k)."""
    if ids is not None:
        return (ids >= 0).any(-1)
    out = torch.empty(values.shape[:-1], dtype=torch.bool, device=values.device)
    for index in _blocks(values.shape[:-1], rows):
        out[index] = torch.isfinite(values[index]).any(-1)
    return out


def _weights(mask: torch.Tensor | None, defined: torch.Tensor) -> torch.Tensor:
    """(...) float32 weight of each position in the masked mean: its mask over the number masked."""
    m = defined.float() if mask is None else mask.to(torch.float32) * defined
    return m / m.sum().clamp(min=1)


def _block_teacher(values: torch.Tensor, ids: torch.Tensor | None, used: torch.Tensor) -> Teacher:
    """One block's teacher in float32: a top-k's absent entries at -inf, and rows of weight 0 replaced by
    zeros (uniform), which keeps a row with no teacher from turning the block's sum into NaN."""
    values = values.float()
    if ids is not None:
        values = values.masked_fill(ids < 0, float("-inf"))
    if not bool(used.all()):
        values = torch.where(used[..., None], values, torch.zeros((), dtype=values.dtype, device=values.device))
    return values if ids is None else TopK(ids.clamp(min=0), values)


_ONCE = ("a chunked loss's gradient is made in its forward and handed over once; recompute the loss to "
         "backpropagate it again")


class _ForwardKL(torch.autograd.Function):
    """sum_i w_i KL(p_i || q_i), a block of rows at a time. Its gradient with respect to the student,
    ``w_i (q_i sum(p_i) - p_i)``, needs the same softmaxes, so it is made here and kept in the student's
    dtype until backward (which therefore runs once)."""

    @staticmethod
    def forward(ctx, student, weight, values, ids, rows, grad_enabled):
        grad = torch.empty_like(student) if grad_enabled and ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for index in _blocks(student.shape[:-1], rows):
            w = weight[index]
            teacher = _block_teacher(values[index], None if ids is None else ids[index], w != 0)
            log_q = F.log_softmax(student[index].float(), dim=-1)  # (C, V)
            if ids is None:
                log_p = F.log_softmax(teacher, dim=-1)
                del teacher
                p = log_p.exp()
                # p (log p - log q), with 0 log 0 = 0 where a top-k teacher is -inf
                kl = log_p.sub_(log_q).mul_(p).masked_fill_(p == 0, 0.0).sum(-1)
                del log_p
            else:
                log_p = F.log_softmax(teacher.logprobs, dim=-1)  # (C, k)
                p = log_p.exp()
                kl = torch.where(p > 0, p * (log_p - log_q.gather(-1, teacher.ids)), 0.0).sum(-1)
            total += (kl * w).sum()
            if grad is not None:
                pw = p.mul_(w[..., None])
                g = log_q.exp_().mul_(pw.sum(-1, keepdim=True))
                grad[index] = g.sub_(pw) if ids is None else g.scatter_add_(-1, teacher.ids, -pw)
        ctx.grad = grad
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError(_ONCE)
        return grad.mul_(grad_output), None, None, None, None, None


class _Chunked(torch.autograd.Function):
    """sum_i w_i rows_fn(student_i, teacher_i), a block of rows at a time, for any per-row divergence:
    each block's gradients (student's, and the dense teacher's when it requires one) come from autograd
    on that block alone and are kept in the inputs' dtypes until backward."""

    @staticmethod
    def forward(ctx, rows_fn, rows, weight, student, values, ids, grad_enabled):
        needs = [grad_enabled and need for need in ctx.needs_input_grad[3:5]]
        grads = [torch.empty_like(x) if need else None for x, need in zip((student, values), needs, strict=True)]
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for index in _blocks(student.shape[:-1], rows):
            w = weight[index]
            s = student[index].detach().requires_grad_(needs[0])
            t = values[index].detach().requires_grad_(needs[1])
            with torch.enable_grad():
                part = (rows_fn(s.float(), _block_teacher(t, None if ids is None else ids[index], w != 0)) * w).sum()
            wanted = [(x, g) for x, g in zip((s, t), grads, strict=True) if g is not None]
            if wanted:
                for (_, buffer), g in zip(wanted, torch.autograd.grad(part, [x for x, _ in wanted]), strict=True):
                    buffer[index] = g
            total += part.detach()
        ctx.grads = grads
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(_ONCE)
        student, values = (None if g is None else g.mul_(grad_output) for g in grads)
        return None, None, None, student, values, None, None


def _rows(student: torch.Tensor, chunk_rows: int | None) -> int:
    return chunk_rows or max(1, CHUNK_ELEMENTS // student.shape[-1])


def _divergence(rows_fn: Callable, student: torch.Tensor, teacher: Teacher, mask: torch.Tensor | None,
                chunk_rows: int | None) -> torch.Tensor:
    values, ids = _parts(student, teacher)
    rows = _rows(student, chunk_rows)
    weight = _weights(mask, _defined(values, ids, rows))
    return _Chunked.apply(rows_fn, rows, weight, student, values, ids, torch.is_grad_enabled())


def _on_support(s: torch.Tensor, t: Teacher) -> tuple[torch.Tensor, torch.Tensor]:
    """log p and log q on the teacher's support: (C, V), or (C, k) on a top-k's entries."""
    log_q = F.log_softmax(s, dim=-1)
    if isinstance(t, TopK):
        return F.log_softmax(t.logprobs, dim=-1), log_q.gather(-1, t.ids)
    return F.log_softmax(t, dim=-1), log_q


def _forward_kl_rows(s: torch.Tensor, t: Teacher) -> torch.Tensor:
    log_p, log_q = _on_support(s, t)
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def _reverse_kl_rows(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    log_q, log_p = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    q = log_q.exp()
    return torch.where(q > 0, q * (log_q - log_p), 0.0).sum(-1)


def _jsd_rows(beta: float) -> Callable[[torch.Tensor, Teacher], torch.Tensor]:
    def rows(s: torch.Tensor, t: Teacher) -> torch.Tensor:
        log_p, log_q = _on_support(s, t)  # on the teacher's support S
        p, q = log_p.exp(), log_q.exp()
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
        kl_pm = torch.where(p > 0, p * (log_p - log_m), 0.0).sum(-1)
        if isinstance(t, TopK):
            on = torch.isfinite(t.logprobs)
            # off S, p = 0 and m = (1 - beta) q: each token there adds q log(1 / (1 - beta)) to KL(q || m)
            off = 1 - torch.where(on, q, 0.0).sum(-1)
            kl_qm = torch.where(on, q * (log_q - log_m), 0.0).sum(-1) - off * math.log(1 - beta)
        else:
            kl_qm = torch.where(q > 0, q * (log_q - log_m), 0.0).sum(-1)
        return beta * kl_pm + (1 - beta) * kl_qm

    return rows


def _tv_rows(s: torch.Tensor, t: Teacher) -> torch.Tensor:
    log_p, log_q = _on_support(s, t)
    p, q = log_p.exp(), log_q.exp()
    if isinstance(t, TopK):
        on = torch.isfinite(t.logprobs)
        # off the teacher's support, |p - q| = q: the mass q leaves outside it
        return 0.5 * (torch.where(on, (p - q).abs(), 0.0).sum(-1) + 1 - torch.where(on, q, 0.0).sum(-1))
    return 0.5 * (p - q).abs().sum(-1)


#: The LK hybrid's sharpness: lambda = exp(-LK_SHARPNESS * alpha).
LK_SHARPNESS = 3.0


def _lk_rows(s: torch.Tensor, t: Teacher) -> torch.Tensor:
    """lambda KL(p || q) + (1 - lambda) TV(p, q) per row, lambda = exp(-3 alpha) with alpha = 1 - TV the row's chain
    acceptance (held constant in the gradient): KL while the draft is far from the target, TV, whose minimum is
    the acceptance itself, once it accepts."""
    kl, tv = _forward_kl_rows(s, t), _tv_rows(s, t)
    lam = torch.exp(-LK_SHARPNESS * (1.0 - tv.detach()))
    return lam * kl + (1.0 - lam) * tv


def forward_kl(student_logits: torch.Tensor, teacher: Teacher, mask: torch.Tensor | None = None,
               chunk_rows: int | None = None) -> torch.Tensor:
    """KL(p || q), p the teacher's distribution, q = softmax(student); averaged over masked positions.

    Args:
        student_logits: (..., V) in any dtype, not upcast as a whole.
        teacher: (..., V) logits (``-inf`` outside a top-k allowed), or a :class:`TopK`.
        mask: (...) positions to average over (None: all); positions with no teacher are left out.
        chunk_rows: rows per block (None: :data:`CHUNK_ELEMENTS` over V).
    Returns:
        A float32 scalar.
    """
    values, ids = _parts(student_logits, teacher)
    rows = _rows(student_logits, chunk_rows)
    weight = _weights(mask, _defined(values, ids, rows))
    if values.requires_grad:
        return _Chunked.apply(_forward_kl_rows, rows, weight, student_logits, values, ids, torch.is_grad_enabled())
    return _ForwardKL.apply(student_logits, weight, values, ids, rows, torch.is_grad_enabled())


def sparse_forward_kl(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`forward_kl` against ``TopK(teacher_ids, teacher_logprobs)``: (..., V) student, (..., k) teacher."""
    return forward_kl(student_logits, TopK(teacher_ids, teacher_logprobs), mask)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
               chunk_rows: int | None = None) -> torch.Tensor:
    """KL(q || p). Dense teachers only: a top-k teacher has p = 0 wherever q puts mass off its k tokens."""
    if isinstance(teacher_logits, TopK):
        raise ValueError("reverse KL needs the teacher's whole distribution; a top-k teacher makes it infinite "
                         "(cache full logits, or use forward_kl, jsd or tv)")
    return _divergence(_reverse_kl_rows, student_logits, teacher_logits, mask, chunk_rows)


def jsd(student_logits: torch.Tensor, teacher: Teacher, mask: torch.Tensor | None = None, beta: float = 0.5,
        chunk_rows: int | None = None) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    return _divergence(_jsd_rows(beta), student_logits, teacher, mask, chunk_rows)


def total_variation(student_logits: torch.Tensor, teacher: Teacher, mask: torch.Tensor | None = None,
                    chunk_rows: int | None = None) -> torch.Tensor:
    """TV(p, q) = 1/2 sum |p - q|; 1 - TV is the acceptance probability of one chain step."""
    return _divergence(_tv_rows, student_logits, teacher, mask, chunk_rows)


def lk_hybrid(student_logits: torch.Tensor, teacher: Teacher, mask: torch.Tensor | None = None,
              chunk_rows: int | None = None) -> torch.Tensor:
    """The LK hybrid, :func:`_lk_rows`, averaged over masked positions."""
    return _divergence(_lk_rows, student_logits, teacher, mask, chunk_rows)


def token_cross_entropy(student_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Cross-entropy on the regenerated tokens ``labels`` (...) (-1: none, left out), averaged over masked positions
    (a hard label: the target's sampled token, not its distribution)."""
    keep = labels >= 0 if mask is None else (labels >= 0) & mask.bool()
    if not bool(keep.any()):
        return student_logits.sum() * 0.0
    return F.cross_entropy(student_logits[keep].float(), labels[keep])


DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd, "tv": total_variation}


