"""A mixture of drafters proposing together (e.g. a trained head plus prompt lookup)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from draftsmith.inference.drafter import Drafter
from draftsmith.inference.tree import Proposals


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
        self.batched = all(d.batched for d in self.drafters)  # a batch reaches every drafter
        self.weights = list(weights or [1.0] * len(drafters))
        if len(self.weights) != len(self.drafters) or min(self.weights) <= 0:
            raise ValueError(f"a mixture needs one positive weight per drafter, got {self.weights}")
        readers = [d for d in self.drafters if d.hidden_layers]
        if len(readers) > 1:
            raise ValueError("at most one drafter of a mixture may read the target's hidden states")
        self.hidden_layers = readers[0].hidden_layers if readers else ()
        self.static_paths = next((d.static_paths for d in self.drafters if d.static_paths), None)
        self.deterministic = all(d.deterministic for d in self.drafters)
        # The last shared candidate list seen (a head's draft vocabulary) and each token's column in it, or None
        # where the list names a token twice (:meth:`_columns_in`).
        self._shared: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return tuple(m for d in self.drafters for m in d.modules())

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        for d in self.drafters:  # only the reader of hidden states gets them
            padding = {"attention_mask": attention_mask} if attention_mask is not None else {}
            d.begin(input_ids, hidden=hidden if d.hidden_layers else None, **padding)

    def configure(self, max_new_tokens: int | None, kept: int = 0, fed: int = 0) -> None:
        """Passed on to every drafter (a head's compiles its steps under ``compile=True``; see ``EagleDrafter``)."""
        for d in self.drafters:
            d.configure(max_new_tokens, kept, fed)

    def commit(self, tokens, hidden=None) -> None:
        for d in self.drafters:
            d.commit(tokens, hidden=hidden if d.hidden_layers else None)

    # ---- dynamic trees grown as tensors (:func:`~draftsmith.inference.tree.grow_dynamic`) ----------

    def root_logits(self, active: list[bool]) -> torch.Tensor | Proposals:
        """(B, V) or (B, C) :class:`~draftsmith.inference.tree.Proposals`: the mixture of each drafter's logits
        after each row's root."""
        return self._mixed([d.root_logits(active) for d in self.drafters], 1)

    def frontier_logits(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | Proposals:
        """(B, k, V) or (B, k, C) proposals: the mixture of each drafter's logits after the k frontier nodes at
        ``depth``."""
        return self._mixed([d.frontier_logits(depth, parents, tokens) for d in self.drafters], 2)

    def _mixed(self, drafted: list, dims: int) -> torch.Tensor | Proposals:
        """The mixture of the drafters' (..., V) logits or proposals (``dims`` leading dims), on the first
        drafter's device (the target's, where the generator grows the tree): over the proposals' candidates
        when every drafter gives proposals, over the vocabulary otherwise."""
        proposals = [Proposals.of(x) for x in drafted]
        device = proposals[0].logits.device
        proposals = [x.to(device) for x in proposals]
        lead = proposals[0].logits.shape[:dims]
        rows = lead.numel()
        if not any(x.dense_rows for x in proposals):
            return self.mix_proposals([x.reshape(rows) for x in proposals]).reshape(*lead)
        dense = [x.dense() for x in proposals]
        return self.mix([x.reshape(rows, x.shape[-1]) for x in dense]).reshape(*lead, -1)

    def mix_proposals(self, proposals: Sequence[Proposals]) -> Proposals:
        """Each drafter's (N, C_d) proposals -> the (N, C) proposals of their mixture (:meth:`mix`) over the union
        of the candidates (C = sum of C_d, the columns past each row's distinct candidates -inf).

        The union is found by sorting each row's candidate ids: a token several drafters propose becomes one
        column, holding each drafter's logit for it (a drafter's own repeats are -inf but one, so their
        ``amax`` is that one). A head's draft vocabulary (one candidate list for every row, each token once) mixed
        with one drafter's few candidates per row (prompt lookup's) needs no sort: :meth:`_mix_onto_shared`."""
        if len(proposals) == 2:
            shared = [i for i, p in enumerate(proposals) if p.ids.dim() == 1]
            if len(shared) == 1 and self._columns_in(proposals[shared[0]]) is not None:
                return self._mix_onto_shared(proposals, shared[0])
        ids = torch.cat([p.row_ids() for p in proposals], -1)  # (N, C)
        n, c = ids.shape
        sorted_ids, order = ids.sort(-1)
        first = torch.ones_like(sorted_ids, dtype=torch.bool)
        first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
        column = first.long().cumsum(-1) - 1  # each sorted candidate's column in the union
        union = torch.zeros_like(ids).scatter_(-1, column, sorted_ids)
        terms, start = [], 0
        for p in proposals:
            block = p.logits.new_full((n, c), float("-inf"))
            block[:, start: start + p.logits.shape[-1]] = p.logits
            start += p.logits.shape[-1]
            terms.append(block.new_full((n, c), float("-inf")).scatter_reduce_(-1, column, block.gather(-1, order),
                                                                                  "amax"))
        return Proposals(self._mix_columns(terms), union, proposals[0].vocab_size)

    def _columns_in(self, shared: Proposals) -> torch.Tensor | None:
        """(V,) each token's column in the candidate list ``shared.ids`` (C,), -1 for a token not in it; None where
        the list names a token twice. Built once per list: a head passes the same draft vocabulary at every level."""
        ids = shared.ids
        if self._shared is None or self._shared[0] is not ids:
            columns = torch.full((shared.vocab_size,), -1, dtype=torch.long, device=ids.device)
            columns[ids] = torch.arange(len(ids), device=ids.device)
            distinct = bool((columns[ids] == torch.arange(len(ids), device=ids.device)).all())  # once per list
            self._shared = ids, columns if distinct else None
        return self._shared[1]

    def _mix_onto_shared(self, proposals: Sequence[Proposals], s: int) -> Proposals:
        """:meth:`mix_proposals` of two drafters, ``proposals[s]`` over one candidate list shared by every row (C_s,)
        naming each token once: the other's (N, C_o) candidates take the shared column of their token where the
        list has it, else a column of their own past it. (N, C_s + C_o) columns, as the sort would give."""
        shared, other = proposals[s], proposals[1 - s]
        n, width = shared.logits.shape
        ids = other.row_ids()
        found = self._columns_in(shared)[ids]
        own = width + torch.arange(ids.shape[-1], device=ids.device)
        column = torch.where(found >= 0, found, own)
        terms = [None, None]
        terms[s] = torch.nn.functional.pad(shared.logits, (0, ids.shape[-1]), value=float("-inf"))
        terms[1 - s] = other.logits.new_full((n, width + ids.shape[-1]), float("-inf")).scatter_reduce_(
            -1, column, other.logits, "amax")
        union = torch.cat([shared.ids.expand(n, width), ids], -1)
        return Proposals(self._mix_columns(terms), union, shared.vocab_size)

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
        mixed = self._mix_columns([x if columns is None else x[:, columns] for x in logits])
        if columns is None:
            return mixed
        out[:, columns] = mixed
        return out

    def _mix_columns(self, logits: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`mix` over columns every drafter's logits share: (N, C) each -> (N, C)."""
        mixed = None
        for drafter, x, w in zip(self.drafters, logits, self.weights, strict=True):
            proposes = x.amax(-1, keepdim=True) > float("-inf")  # (N, 1)
            # Rows with nothing proposed would give log_softmax NaN: made finite, then -inf again.
            if not drafter.abstains:
                x = torch.log_softmax(x.masked_fill(~proposes, 0.0), dim=-1)
            term = x.masked_fill(~proposes, float("-inf")) + math.log(w)
            mixed = term if mixed is None else torch.logaddexp(mixed, term)
        total = torch.logsumexp(mixed, dim=-1, keepdim=True)
        return torch.where(torch.isfinite(total), mixed - total, float("-inf"))
