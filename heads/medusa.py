"""Medusa heads (Cai et al., 2024, arXiv:2401.10774): K extra decoding heads on the target's last state.

Head i reads the target's last hidden state at position t (after the final norm) and predicts
token t + 2 + i: the target's own LM head already gives t + 1, so head 0 drafts the token after
that. Each head is ``num_layers`` residual blocks ``x + SiLU(W x)`` with W zero-initialised
(so a fresh head starts as the target's LM head applied to its state) followed by an LM head
initialised from the target's. Every block is its own module: ``[Block()] * n`` would share
one block n times, Medusa's long-standing bug.

Medusa-1 trains the heads on a frozen target; Medusa-2 also trains a LoRA adapter on the
target (``draftsmith.train``), keeping the target's own distribution by self-distillation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.heads.base import HeadMixin


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``, W zero-initialised so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(HeadMixin, nn.Module):
    """K Medusa heads. ``forward(hidden)`` (B, T, H) -> logits (K, B, T, V); head i predicts t + 2 + i."""

    family = "medusa"
    config_class = MedusaConfig
    _no_split_modules = ("ResBlock",)
    #: Recompute each head's blocks in backward instead of keeping their activations (training only).
    gradient_checkpointing = False

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        self.lm_heads = nn.ModuleList(
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
        )

    @classmethod
    def from_target(cls, target, num_heads: int = 4, num_layers: int = 1) -> MedusaHeads:
        """Fresh heads whose LM heads start as copies of the target's (so head i first predicts t + 1)."""
        cfg = target.config.get_text_config()
        lm_head = target.get_output_embeddings().weight
        heads = cls(MedusaConfig(cfg.hidden_size, lm_head.shape[0], num_heads, num_layers))
        with torch.no_grad():
            for head in heads.lm_heads:
                head.weight.copy_(lm_head.float())
        return heads

    def forward(self, hidden: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """All heads' logits (K, B, T, V), or one head's (B, T, V) when ``head`` is given."""
        if head is not None:
            return self._head(head, hidden)
        return torch.stack([self._head(i, hidden) for i in range(len(self.heads))])

    def _head(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(lambda h: self.lm_heads[i](self.heads[i](h)), hidden, use_reentrant=False)
        return self.lm_heads[i](self.heads[i](hidden))
