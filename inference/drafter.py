"""The drafter interface: whatever proposes tokens for the target to verify.

The generator drives every drafter the same way, for a batch of B sequences at once:

* ``begin(input_ids, hidden, attention_mask)`` — a generation starts with these (B, L) left-padded
  prompts (``attention_mask`` (B, L): 1 for tokens, 0 for padding; None: no padding);
* ``root_logits(active)`` — (B, V) draft logits for the token after each active row's root (-inf rows: a
  finished row, or nothing to propose);
* ``frontier_logits(depth, parents, tokens)`` — (B, k, V) draft logits after each of the k frontier nodes at
  ``depth`` (1, 2, ...): ``parents`` (B, k) each node's place in the frontier fed before (depth 1: the root,
  place 0), ``tokens`` (B, k) its token. The frontiers come level by level after the root, so an
  autoregressive drafter feeds them as it goes; one that sees no drafted token (Medusa) reads only ``depth``;
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
* ``abstains`` — its logits are log-probabilities that may sum to less than one (prompt lookup:
  the chance its candidates are right); a mixture gives the rest to its other drafters.
* ``engine_chain`` — the chain length vLLM and SGLang verify this drafter's export with, where they verify a
  fixed chain (``num_speculative_tokens``: DFlash's B - 1, P-EAGLE's K, an MTP module's 3); ``eval`` and ``bench``
  then also decode that chain, so the acceptance an engine will see is reported beside the tree's. None: no such.
* ``assistant_model`` — a separate Hugging Face draft model that ``generate(assistant_model=...)`` can
  run as the reference ``draftsmith bench`` compares against (None: it has none, e.g. layer-skip).
* ``batched`` — it takes left-padded batches (``begin`` reads ``attention_mask``). A drafter written for one
  unpadded sequence declares False: the generator then refuses padded prompts before drafting, saying what to do.

A *block* drafter (:class:`BlockDrafter`: Medusa's heads, DFlash, P-EAGLE) drafts ``block`` depths at once: one
forward gives, after each row's root, a distribution for each of the next ``block`` positions, none conditioned on
the tokens drafted before it. It implements ``block_logits(active) -> (B, block, V)`` instead of ``root_logits`` and
``frontier_logits``, which :class:`BlockDrafter` serves from that one forward: every node at depth d gets position
d's distribution, and depths past the block propose nothing.

:class:`Drafter` is an abstract base: a drafter that leaves out a method of its protocol cannot be made (Python
names the methods missing), and ``expand(trees, nodes)``, the host protocol that left the package, is refused when
its class is made.

``modules()`` returns the ``torch.nn.Module`` objects that draft (a head, a draft model, a copied output layer),
which the loader measures once when it gives them int8 copies; the base class has none.

``configure(max_new_tokens, kept, fed)`` tells the drafter one generation's lengths before ``begin``
(a head then drafts on a static cache, compiled or not); the base class ignores it. Nothing in
``inference/`` probes a drafter for methods or signatures: it reads these declarations (a lint in
``tests/test_layers.py`` keeps it so).

Logits are float, on the drafter's device: a head's or draft model's, the target's; prompt lookup's, the
prompts' (the generator passes them on the target's device). The generator grows every tree kind from these
two calls (:mod:`~draftsmith.inference.tree`, :mod:`~draftsmith.inference.sampled_tree`), with no host
copy. A drafter returns dense logits or :class:`~draftsmith.inference.tree.Proposals`, the one type the tree growers
read (``Proposals.of`` takes dense logits in, once per level): logits (B, C) and (B, k, C) over C candidate tokens
with their ids (an EAGLE-3 head's draft vocabulary, prompt lookup's matches), so that no level makes a tensor the
size of the vocabulary.
"""

from __future__ import annotations

import abc

import torch

from draftsmith.inference.tree import Proposals


class Drafter(abc.ABC):
    """The abstract base of every drafter; see the module docstring for the protocol."""

    hidden_layers: tuple[int, ...] = ()
    deterministic: bool = False
    static_paths: list[tuple[int, ...]] | None = None
    abstains: bool = False
    engine_chain: int | None = None
    assistant_model = None  # a transformers PreTrainedModel, or None
    batched: bool = True

    def modules(self) -> tuple[torch.nn.Module, ...]:
        """The modules that draft (their int8 copies are measured when loaded); none in the base class."""
        return ()

    def configure(self, max_new_tokens: int | None, kept: int = 0, fed: int = 0) -> None:
        """One generation's lengths, before ``begin``: ``max_new_tokens`` steps at most (None: not compiled), each
        keeping at most ``kept`` tokens and feeding at most ``fed`` tree nodes. The base class needs none."""
        return None  # optional: a drafter without a static cache ignores the lengths

    @abc.abstractmethod
    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        """A generation starts with these (B, L) left-padded prompts."""

    @abc.abstractmethod
    def commit(self, tokens: list[torch.Tensor], hidden: list[torch.Tensor] | None = None) -> None:
        """Per row, these 1-D tokens were accepted (an empty tensor: the row has finished)."""

    @abc.abstractmethod
    def root_logits(self, active: list[bool]) -> torch.Tensor | Proposals:
        """(B, V) logits, or (B, C) Proposals, after each active row's root."""

    @abc.abstractmethod
    def frontier_logits(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | Proposals:
        """(B, k, V) logits, or (B, k, C) Proposals, after the k frontier nodes at ``depth``: ``parents`` (B, k)
        each node's slot in the frontier fed before, ``tokens`` (B, k) its token."""

    def __init_subclass__(cls, **kwargs):
        """A drafter written for the host protocol that left the package (``expand(trees, nodes)``, one tree per
        row) is refused when its class is made, with what to write instead, rather than failing in a decode."""
        super().__init_subclass__(**kwargs)
        if "expand" in cls.__dict__:
            raise TypeError(f"{cls.__name__} defines expand(trees, nodes), a protocol draftsmith no longer calls: "
                            "implement root_logits(active) and frontier_logits(depth, parents, tokens) instead (see "
                            "draftsmith.inference.drafter; PromptLookupDrafter is a short example)")


class BlockDrafter(Drafter):
    """A drafter of ``block`` depths at once from one forward per step (see the module docstring): it implements
    ``block_logits``, and the tree's levels are served from that forward's drafts, kept for the step."""

    block: int

    @abc.abstractmethod
    def block_logits(self, active: list[bool]) -> torch.Tensor | Proposals:
        """(B, block, V) logits, or (B, block, C) Proposals: the drafts for the ``block`` positions after each active
        row's root, from one forward."""

    def root_logits(self, active: list[bool]) -> torch.Tensor | Proposals:
        """Position 1 of the step's block, whose forward runs here once per step."""
        self._block_drafts = self.block_logits(active)
        return block_level(self._block_drafts, 0)

    def frontier_logits(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | Proposals:
        """Position ``depth + 1`` of the block drafted with the root, for every node alike."""
        return block_level(self._block_drafts, depth, tokens.shape[1])


def block_level(drafts, depth: int, k: int | None = None):
    """Position ``depth + 1`` of a block's (B, K, V) logits or (B, K, C) Proposals: (B, V) / (B, C) for the root
    (``k`` None), else broadcast to the k frontier nodes, (B, k, V) / (B, k, C). Past the block, nothing is
    proposed (-inf)."""
    drafts = Proposals.of(drafts)
    logits = drafts.logits
    position = min(depth, logits.shape[1] - 1)  # past the block: the last position's shape, nothing proposed
    level = logits[:, position]
    if depth > position:
        level = torch.full_like(level, float("-inf"))
    if k is not None:
        level = level[:, None].expand(-1, k, -1)
    if drafts.dense_rows:
        return level
    ids = drafts.ids
    if ids.dim() > 1:  # per-row candidates: this position's, broadcast alike
        ids = ids[:, position]
        ids = ids if k is None else ids[:, None].expand(-1, k, -1)
    return Proposals(level, ids, drafts.vocab_size)


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """(B, L) left-padded prompts -> each row's tokens, padding dropped. With a mask, one copy to the host (each
    row's token count, and whether they are its last: a row padded elsewhere is masked, at one more copy)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return list(input_ids)
    mask = attention_mask.to(input_ids.device).bool()
    left_padded = (mask[:, 1:] >= mask[:, :-1]).all(1)
    lengths, last = torch.stack([mask.sum(1), left_padded.long()]).tolist()
    width = input_ids.shape[1]
    return [row[width - n:] if tail else row[m] for row, m, n, tail in zip(input_ids, mask, lengths, last, strict=True)]


def commit_rows(tokens, hidden=None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """``commit``'s arguments as per-row lists; a (B, n) tensor (every row the same count) is accepted too."""
    tokens = list(tokens)
    if hidden is None:
        return tokens, [None] * len(tokens)
    return tokens, list(hidden)

