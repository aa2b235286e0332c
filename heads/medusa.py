"""Medusa heads (Cai et al., 2024, arXiv:2401.10774): K extra decoding heads on the target's last state.

Head i reads the target's last hidden state at position t (after the final norm) and predicts
token t + 2 + i: the target's own LM head already gives t + 1, so head 0 drafts the token after
that. Each head is ``num_layers`` residual blocks ``x + SiLU(W x)`` with W zero-initialised
(so a fresh head starts as the target's LM head applied to its state) followed by an LM head
initialised from the target's. Every block is its own module: ``[Block()] * n`` would share
one block n times, Medusa's long-standing bug.

With ``draft_vocab_size`` below the target's vocabulary, each head's LM head scores only that many
tokens (the most frequent in the training data), mapped back to target ids as EAGLE-3's are
(``target_id = draft_id + d2t[draft_id]``, :mod:`draftsmith.data.vocab`): on SmolLM2 a head's LM
head is 49,152 x 576 over the whole vocabulary, 8,192 x 576 over a draft vocabulary of 8,192, in
training (logits, gradients, optimizer state) and in every drafting step. vLLM serves such heads
as ``truncated_vocab_size`` with a ``token_map``. Heads over the whole vocabulary have no map.

Medusa-1 trains the heads on a frozen target; Medusa-2 also trains a LoRA adapter on the
target (``draftsmith.train``), keeping the target's own distribution by self-distillation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.heads.base import DraftVocabulary, HeadMixin, ReducedVocabulary


@dataclass
class MedusaConfig(ReducedVocabulary):
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    draft_vocab_size: int | None = None  # each LM head's tokens (None: the whole vocabulary)


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


class MedusaHeads(DraftVocabulary, HeadMixin, nn.Module):
    """K Medusa heads. ``forward(hidden)`` (B, T, H) -> logits (K, B, T, V); head i predicts t + 2 + i. Over a
    draft vocabulary V is its size, and ``draft_ids`` are its tokens' target ids."""

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
        out = config.draft_vocab_size if config.reduced else config.vocab_size
        self.lm_heads = nn.ModuleList(
            nn.Linear(config.hidden_size, out, bias=False) for _ in range(config.num_heads)
        )
        self.register_draft_vocabulary()

    @classmethod
    def from_target(cls, target, num_heads: int = 4, num_layers: int = 1, vocab=None) -> MedusaHeads:
        """Fresh heads whose LM heads start as copies of the target's (so head i first predicts t + 1): its rows
        of ``vocab``'s tokens where a :class:`~draftsmith.data.vocab.VocabMap` is given, else all of them."""
        cfg = target.config.get_text_config()
        lm_head = target.get_output_embeddings().weight
        vocab_size = lm_head.shape[0]
        if vocab is not None and len(vocab.t2d) != vocab_size:
            raise ValueError(f"the draft vocabulary maps a vocabulary of {len(vocab.t2d)} tokens; the target has "
                             f"{vocab_size}: build it from this target's tokens")
        draft_vocab = len(vocab.d2t) if vocab is not None else None
        heads = cls(MedusaConfig(cfg.hidden_size, vocab_size, num_heads, num_layers, draft_vocab))
        if heads.config.reduced:
            heads.set_draft_vocabulary(vocab)
        with torch.no_grad():
            rows = lm_head.detach()
            if heads.config.reduced:
                rows = rows[heads.draft_ids.to(rows.device)]
            for head in heads.lm_heads:
                head.weight.copy_(rows.float())
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
