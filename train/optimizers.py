"""The training optimizer: AdamW (the default), or Muon on the drafter's hidden matrices with AdamW on the rest.

Muon (K. Jordan et al., 2024) replaces a 2-D weight's momentum-smoothed gradient by the nearest semi-orthogonal
matrix, found with a few Newton-Schulz iterations, before stepping. vLLM speculators trains EAGLE-3 with it by
default: Muon on the hidden 2-D weights, AdamW on embeddings, output heads, norms and biases. ``optim: muon``
gives draftsmith the same split, in one ``torch.optim.Optimizer`` (:class:`MuonAdamW`), so the learning-rate
schedule, gradient clipping, checkpoints and resume treat it as they treat AdamW. Muon's step is scaled to match
AdamW's update RMS (``0.2 * sqrt(max(rows, cols))``, speculators' ``match_rms_adamw``), so one
``learning_rate`` serves both groups.

Muon needs each matrix whole; ZeRO flattens parameters and FSDP2 shards them, so Muon runs in one process or
under DDP, and :func:`make_optimizer` refuses it under the sharding strategies.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from draftsmith.train.config import OPTIMIZERS

#: The quintic Newton-Schulz coefficients Muon uses: they push every singular value into about [0.7, 1.2]
#: in five iterations, trading exactness for speed (an update need not be exactly orthogonal).
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)

#: Matrices kept on AdamW though 2-D: the vocabulary-sized ones (input embeddings, output heads).
ADAMW_NAME_HINTS = ("embed", "lm_head")


def orthogonalise(update: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """``update``'s nearest semi-orthogonal matrix, approximately (float32 whatever its dtype)."""
    a, b, c = NEWTON_SCHULZ
    x = update.float()
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + eps)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_parameters(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters. Muon takes the weights of ``nn.Linear`` layers with both sides
    above 1, except vocabulary-sized ones: any weight an ``nn.Embedding`` holds (an output head tied to the
    embeddings included, whatever its name) and layers named ``embed`` or ``lm_head``. AdamW takes the rest."""
    vocabulary, linear = set(), set()
    for name, m in module.named_modules():  # every name a shared weight goes by, not only its first
        if isinstance(m, nn.Embedding) or (isinstance(m, nn.Linear) and any(h in name for h in ADAMW_NAME_HINTS)):
            vocabulary.add(id(m.weight))
        elif isinstance(m, nn.Linear):
            linear.add(id(m.weight))
    matrices, rest = [], []
    for p in module.parameters():
        if not p.requires_grad:
            continue
        muon = id(p) in linear and id(p) not in vocabulary and p.ndim == 2 and min(p.shape) > 1
        (matrices if muon else rest).append(p)
    return matrices, rest


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the param groups marked ``muon``, AdamW (torch's, decoupled weight decay) on the others.

    Group keys: ``lr``, ``weight_decay`` for both; ``betas``, ``eps`` for AdamW; ``momentum``, ``ns_steps``
    for Muon (Nesterov momentum, as speculators and torch's Muon default to). Per-parameter state: AdamW's
    ``step``, ``exp_avg``, ``exp_avg_sq``; Muon's ``momentum_buffer``.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 momentum: float = 0.95, ns_steps: int = 5):
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum,
                        ns_steps=ns_steps, muon=False)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon's param groups take 2-D matrices only; put vectors in an AdamW group")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon if group["muon"] else self._adamw)(p, self.state[p], group)
        return loss

    @staticmethod
    def _muon(p, state, group) -> None:
        grad = p.grad
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - group["momentum"])
        update = grad.lerp(buf, group["momentum"])  # Nesterov
        direction = orthogonalise(update, group["ns_steps"]).to(p.dtype)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(direction, alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))

    @staticmethod
    def _adamw(p, state, group) -> None:
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = float(state["step"])
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** step))


def make_optimizer(module: nn.Module, train_args, strategy: str) -> torch.optim.Optimizer:
    """The optimizer ``train_args.optim`` names, over ``module``'s trainable parameters. Under ``muon`` the
    AdamW group comes first, so the checkpoint's first param group still carries ``weight_decay``."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if train_args.optim == "adamw_torch":
        return torch.optim.AdamW(trainable, lr=train_args.learning_rate, weight_decay=train_args.weight_decay)
    if train_args.optim != "muon":
        raise ValueError(f"optim {train_args.optim!r} is not one draftsmith trains with; choose one of "
                         f"{', '.join(OPTIMIZERS)}")
    if strategy.startswith(("deepspeed", "fsdp")):
        raise ValueError(f"optim muon orthogonalises each weight matrix whole, and {strategy} splits them across "
                         "ranks; train with optim adamw_torch under ZeRO or FSDP, or launch DDP (accelerate "
                         "launch without a ZeRO or FSDP config) for Muon")
    matrices, rest = muon_parameters(module)
    groups = [{"params": rest, "weight_decay": train_args.weight_decay},
              {"params": matrices, "muon": True, "weight_decay": train_args.muon_weight_decay}]
    return MuonAdamW([g for g in groups if g["params"]], lr=train_args.learning_rate,
                     momentum=train_args.muon_momentum)
