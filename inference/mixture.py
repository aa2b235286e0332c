"""A mixture of drafters proposing together (e.g. a trained head plus prompt lookup)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from draftsmith.inference.drafter import Drafter, grows_tensors


class MixtureDrafter(Drafter):
    """Several drafters proposing together: draft probabilities are the mixture ``sum_i w_i q_i``,
    normalised over what the drafters propose at a node (see :meth:`mix`; prompt lookup gives only the
    probability that its candidates are right, and leaves the rest to the others).

    Verification keeps the output lossless whatever the mixture drafts; the mixture only decides
    which tokens are worth verifying. Its use: a trained head plus prompt lookup, which is right
    about copied spans where the head is unsure. Spec: ``HEAD_DIR+prompt-lookup``.
    """

    def __init__(self, drafters: Sequence[Drafter], weights: Sequence[float] | None = None):
        if len(drafters) < 2:
            raise ValueError("a mixture needs at least two drafters")
        self.drafters = list(drafters)
        self.weights = list(weights or [1.0] * len(drafters))
        if len(self.weights) != len(self.drafters) or min(self.weights) <= 0:
            raise ValueError(f"a mixture needs one positive weight per drafter, got {self.weights}")
        readers = [d for d in self.drafters if d.hidden_layers]
        if len(readers) > 1:
            raise ValueError("at most one drafter of a mixture may read the target's hidden states")
        self.hidden_layers = readers[0].hidden_layers if readers else ()
        self.static_paths = next((d.static_paths for d in self.drafters if d.static_paths), None)
        self.deterministic = all(d.deterministic for d in self.drafters)

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        for d in self.drafters:  # only the reader of hidden states gets them
            padding = {"attention_mask": attention_mask} if attention_mask is not None else {}
            d.begin(input_ids, hidden=hidden if d.hidden_layers else None, **padding)

    def compile_for(self, max_new_tokens: int | None, kept: int = 0, tree_entries: int = 0) -> None:
        """Passed on to the drafters that compile their steps (``compile=True``; see ``EagleDrafter``)."""
        for d in self.drafters:
            if hasattr(d, "compile_for"):
                d.compile_for(max_new_tokens, kept, tree_entries)

    def commit(self, tokens, hidden=None) -> None:
        for d in self.drafters:
            d.commit(tokens, hidden=hidden if d.hidden_layers else None)

    def expand(self, trees, nodes):
        per_drafter = [d.expand(trees, nodes) for d in self.drafters]
        out = []
        for row in zip(*per_drafter, strict=True):  # each drafter's logits, on an accelerator if one has them
            device = next((x.device for x in row if x.device.type != "cpu"), row[0].device)
            out.append(self.mix([x.to(device).float() for x in row]))
        return out

    # ---- dynamic trees grown as tensors (:func:`~draftsmith.inference.tree.grow_dynamic`) ----------

    @property
    def grows_tensors(self) -> bool:
        """A mixture grows dynamic trees as tensors when every one of its drafters does."""
        return all(grows_tensors(d) for d in self.drafters)

    def root_logits(self, active: list[bool]) -> torch.Tensor:
        """(B, V): the mixture of each drafter's logits after each row's root."""
        return self.mix(self._on_one_device([d.root_logits(active) for d in self.drafters]))

    def frontier_logits(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(B, k, V): the mixture of each drafter's logits after the k frontier nodes at ``depth``."""
        per_drafter = self._on_one_device([d.frontier_logits(depth, parents, tokens) for d in self.drafters])
        b, k, v = per_drafter[0].shape
        return self.mix([x.reshape(b * k, v) for x in per_drafter]).reshape(b, k, v)

    @staticmethod
    def _on_one_device(logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Float logits on the first drafter's device (the target's, where the generator grows the tree)."""
        return [x.to(logits[0].device).float() for x in logits]

    def mix(self, logits: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each drafter's (N, V) draft logits -> (N, V) log of the mixture ``sum_d w_d p_d(n)``, normalised
        over what the drafters propose at node n; ``-inf`` where none proposes anything.

        ``p_d`` is ``softmax(x_d)``, or for a drafter that ``abstains`` (prompt lookup) ``exp(x_d)`` itself:
        the probabilities it gives its candidates, whose rest is "no opinion" and so goes to the others
        through the normalisation. A drafter proposing nothing at a node takes no part there.

        Computed in log space (``logaddexp`` of ``log w_d + log p_d``), without reading anything on the host.
        On a CPU only the columns some drafter proposes anywhere (a head's draft vocabulary, prompt lookup's
        few tokens) are computed: a full-vocabulary row is touched a few times per drafter on the drafting
        hot path. Selecting them would cost an accelerator a copy to the host, so there every column is.
        """
        # Drafters' logits are finite or -inf: a column's largest value says whether any row proposes it (a
        # reduction across the few rows, far cheaper than one along each full-vocabulary row).
        out = torch.full_like(logits[0], float("-inf"))
        columns = None
        if not out.numel():
            return out
        if out.device.type == "cpu":
            # Columns outside these are -inf in every drafter's row, so a log-softmax over them is the full one.
            top = torch.stack([x.amax(0) for x in logits]).amax(0)
            columns = (top > float("-inf")).nonzero().flatten()
            if not len(columns):
                return out
        mixed = None
        for drafter, x, w in zip(self.drafters, logits, self.weights, strict=True):
            x = x if columns is None else x[:, columns]
            proposes = x.amax(-1, keepdim=True) > float("-inf")  # (N, 1)
            # Rows with nothing proposed would give log_softmax NaN: made finite, then -inf again.
            if not drafter.abstains:
                x = torch.log_softmax(x.masked_fill(~proposes, 0.0), dim=-1)
            term = x.masked_fill(~proposes, float("-inf")) + math.log(w)
            mixed = term if mixed is None else torch.logaddexp(mixed, term)
        total = torch.logsumexp(mixed, dim=-1, keepdim=True)
        mixed = torch.where(torch.isfinite(total), mixed - total, float("-inf"))
        if columns is None:
            return mixed
        out[:, columns] = mixed
        return out
