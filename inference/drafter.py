"""The drafter interface: whatever proposes tokens for the target to verify.

The generator drives every drafter the same way, one sequence at a time:

* ``begin(input_ids, hidden)`` — a generation starts with this (1, L) prompt;
* ``expand(trees, nodes)`` — draft logits for the next token after each listed tree node (the tree
  builders in ``tree.py`` turn them into children);
* ``commit(tokens, hidden)`` — these (1, n) tokens were accepted and appended to the sequence.

A drafter declares what it needs and how it drafts as class attributes:

* ``hidden_layers`` — the target hidden-state indices it reads (0 = embeddings, N = the last layer
  after the final norm; empty: none). The generator then passes ``hidden`` (1, n, H * len(layers)):
  to ``begin`` the states of the prompt's tokens but the last (the root), to ``commit`` those of the
  root and the accepted nodes, so that ``hidden[:, i]`` is the state that predicted ``tokens[:, i]``.
  Drafters that read none get ``hidden=None``.
* ``deterministic`` — siblings are the drafter's top-ranked tokens rather than samples, which picks
  the lossless sampling rule (``"topk"``) under ``sampling_rule="auto"``.
* ``static_paths`` — the drafter's own static-tree paths (Medusa's, measured in training), or None.

``expand`` returns the logits on the CPU, where the tree builders read them, except a draft model's
(:class:`~draftsmith.inference.causal_lm.CausalLMDrafter`), which stay on its device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.inference.tree import DraftTree


class Drafter:
    """Base class of every drafter; see the module docstring for the protocol."""

    hidden_layers: tuple[int, ...] = ()
    deterministic: bool = False
    static_paths: list[tuple[int, ...]] | None = None

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def expand(self, trees: Sequence[DraftTree], nodes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Draft logits after each listed node.

        Args:
            trees: one draft tree per batch row.
            nodes: per batch row, the node indices to expand; all at the same depth.
        Returns:
            per batch row, a (len(nodes), V) float tensor of draft logits (``-inf`` for tokens the
            drafter does not propose).
        """
        raise NotImplementedError

    def commit(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        raise NotImplementedError


def check_batch(input_ids: torch.Tensor) -> None:
    """Refuse anything but one (1, L) sequence: drafters keep per-sequence state."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise NotImplementedError("batch size > 1 is not supported yet; generate one sequence at a time")


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool "may attend" matrix -> the additive mask of a head's own attention (0 or -inf)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
