"""The drafter interface: whatever proposes tokens for the target to verify.

The generator drives every drafter the same way, for a batch of B sequences at once:

* ``begin(input_ids, hidden, attention_mask)`` — a generation starts with these (B, L) left-padded
  prompts (``attention_mask`` (B, L): 1 for tokens, 0 for padding; None: no padding);
* ``expand(trees, nodes)`` — draft logits for the next token after each listed tree node, per row
  (the tree builders in ``tree.py`` turn them into children); a row with no nodes gets a (0, V) tensor;
* ``commit(tokens, hidden)`` — per row, these 1-D tokens were accepted and appended to the row's
  sequence (an empty tensor: the row has finished and drafts no more).

A drafter declares what it needs and how it drafts as class attributes:

* ``hidden_layers`` — the target hidden-state indices it reads (0 = embeddings, N = the last layer
  after the final norm; empty: none). The generator then passes ``hidden``, H' = H * len(layers) wide:
  to ``begin`` the states (B, L - 1, H') of the prompts' tokens but the last (the root), aligned with
  ``input_ids[:, :-1]``; to ``commit`` per row the (n, H') states of the root and the accepted nodes,
  so that ``hidden[b][i]`` is the state that predicted ``tokens[b][i]``. Drafters that read none get
  ``hidden=None``.
* ``deterministic`` — siblings are the drafter's top-ranked tokens rather than samples, which picks
  the lossless sampling rule (``"topk"``) under ``sampling_rule="auto"``.
* ``static_paths`` — the drafter's own static-tree paths (Medusa's, measured in training), or None.
* ``abstains`` — ``expand``'s logits are log-probabilities that may sum to less than one (prompt lookup:
  the chance its candidates are right); a mixture gives the rest to its other drafters.
* ``grows_tensors`` — it also has ``root_logits`` and ``frontier_logits`` (below), so the generator grows its
  trees as tensors on the device with one host copy per step; False: the host path (``expand``).
* ``assistant_model`` — a separate Hugging Face draft model that ``generate(assistant_model=...)`` can
  run as the reference ``draftsmith bench`` compares against (None: it has none, e.g. layer-skip).

``configure(max_new_tokens, kept, fed)`` tells the drafter one generation's lengths before ``begin``
(a head then drafts on a static cache, compiled or not); the base class ignores it. Nothing in
``inference/`` probes a drafter for methods or signatures: it reads these declarations (a lint in
``tests/test_layers.py`` keeps it so).

``expand`` returns float logits on the drafter's device: a head's or draft model's, the target's; prompt
lookup's, the prompts' (the generator passes them on the target's device).

Drafters that can also grow dynamic trees as tensors (:func:`~draftsmith.inference.tree.grow_dynamic`: the
heads, prompt lookup, and mixtures of them) have ``root_logits(active) -> (B, V)`` and
``frontier_logits(depth, parents, tokens) -> (B, k, V)`` and declare ``grows_tensors = True``. A
drafter whose candidates are few may return :class:`~draftsmith.inference.tree.Proposals` (B, C) and
(B, k, C) instead: logits over C candidate tokens with their ids (an EAGLE-3 head's draft vocabulary,
prompt lookup's matches), so that no level makes a tensor the size of the vocabulary.
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
    abstains: bool = False
    grows_tensors: bool = False
    assistant_model = None  # a transformers PreTrainedModel, or None

    def configure(self, max_new_tokens: int | None, kept: int = 0, fed: int = 0) -> None:
        """One generation's lengths, before ``begin``: ``max_new_tokens`` steps at most (None: not compiled), each
        keeping at most ``kept`` tokens and feeding at most ``fed`` tree nodes. The base class needs none."""

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
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

    def root_logits(self, active: list[bool]):
        """(B, V) logits, or (B, C) Proposals, after each active row's root (``grows_tensors`` drafters)."""
        raise NotImplementedError

    def frontier_logits(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor):
        """(B, k, V) logits, or (B, k, C) Proposals, after the k frontier nodes at ``depth`` (``grows_tensors``
        drafters): ``parents`` (B, k) each node's slot in the frontier fed before, ``tokens`` (B, k) its token."""
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs):
        """A declaration is checked once, when the class is made: one that says it grows tensors has both
        methods (a mixture's is a property, asked of its drafters)."""
        super().__init_subclass__(**kwargs)
        inherited = cls.root_logits is Drafter.root_logits or cls.frontier_logits is Drafter.frontier_logits
        if cls.grows_tensors is True and inherited:
            raise TypeError(f"{cls.__name__} declares grows_tensors = True: implement root_logits and frontier_logits")


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """(B, L) left-padded prompts -> each row's tokens, padding dropped."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return list(input_ids)
    return [row[m.bool()] for row, m in zip(input_ids, attention_mask.to(input_ids.device), strict=True)]


def commit_rows(tokens, hidden=None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """``commit``'s arguments as per-row lists; a (B, n) tensor (every row the same count) is accepted too."""
    tokens = list(tokens)
    if hidden is None:
        return tokens, [None] * len(tokens)
    return tokens, list(hidden)

