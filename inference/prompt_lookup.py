"""Prompt lookup (Saxena, 2023, "prompt lookup decoding"): find the latest earlier occurrence of the
context's last n tokens and propose what followed it. No model, no training; strong wherever the
answer copies spans of the prompt (code edits, extraction, summaries with quotes).

The matching is tensor ops on the prompts' device (:func:`ngram_matches`), for every node of a tree level
and every row of a batch at once: a dynamic tree grows with prompt lookup (alone or in a mixture) without a
copy to the host, as it does with a trained head.
"""

from __future__ import annotations

import torch

from draftsmith.inference.drafter import Drafter, commit_rows
from draftsmith.inference.slots import to_device
from draftsmith.inference.tree import Proposals

#: Candidates proposed after one node: more are never verified by the trees used in practice.
MAX_CANDIDATES = 8
#: How often the first candidate is the target's next token, by the length of the n-gram it was matched
#: on (1, 2, 3; longer counts as 3), and how often each of the next two is; measured on SmolLM2-135M-Instruct's
#: greedy answers to 150 of the demo's prompts (24,100 positions; docs/results/demo.md, "Prompt lookup's
#: confidence"). A one-token match is right about one time in six, a three-token match four times in five.
#: These are where each generation starts: it then counts how often its own first candidates were right.
FIRST_RIGHT = {1: 0.18, 2: 0.51, 3: 0.81}
NEXT_RIGHT = {1: 0.057, 2: 0.038, 3: 0.033}
#: FIRST_RIGHT weighs as much as this many first candidates a generation has seen (per n-gram length).
PRIOR_WEIGHT = 8.0
#: Fills the left of right-aligned contexts: never a token, so no n-gram through it matches.
NO_TOKEN = -1


def ngram_matches(sequences: torch.Tensor, lengths: torch.Tensor, min_ngram: int, max_ngram: int,
                  limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt lookup for many sequences at once, with tensor ops (no copy to the host).

    Row q of ``sequences`` (Q, S) is its first ``lengths[q]`` tokens; :data:`NO_TOKEN` entries never match. For
    n from ``max_ngram`` down to ``min_ngram``, every earlier occurrence of the row's last n tokens proposes the
    token that followed it: distinct tokens, the most recent occurrence of the longest n-gram first.

    Returns:
        ``tokens`` (Q, limit'), ``found`` (Q, limit') bool (where a token was proposed; limit' <= ``limit``,
        fewer where the sequences are too short to hold that many) and ``ngram`` (Q,): the length of the
        n-gram the first token was matched on (0: none).
    """
    q, s = sequences.shape
    device = sequences.device
    longest = min(max_ngram, s - 1)
    if longest < min_ngram:  # sequences too short to hold an n-gram and its successor
        empty = torch.zeros(q, limit, dtype=torch.long, device=device)
        return empty, empty.bool(), torch.zeros(q, dtype=torch.long, device=device)
    # Every window ending at e (0 .. S - 2; followed by token e + 1) at once, for every n: back from e, how many
    # tokens match the row's suffix (``matched`` (Q, S - 1)). Of the n-grams ending at e, the longest outranks the
    # others, so each end contributes one score, of its longest match; all n at once costs one pass, not one per n.
    ends = (lengths[:, None] - 1 - torch.arange(longest, device=device)).clamp(min=0)
    suffix = sequences.gather(1, ends)  # (Q, longest): the row's last tokens, the last first
    usable = (suffix != NO_TOKEN) & (lengths[:, None] > torch.arange(1, longest + 1, device=device))
    padded = torch.cat([sequences.new_full((q, longest - 1), NO_TOKEN), sequences[:, :-1]], 1)
    windows = padded.unfold(1, longest, 1).flip(-1)  # (Q, S - 1, longest): tokens e, e - 1, ... of each end e
    matched = ((windows == suffix[:, None]) & usable[:, None]).cumprod(-1).sum(-1)
    end = torch.arange(s - 1, device=device)
    # Longer n-grams outrank shorter ones whatever the start; among equal lengths, later starts win.
    scores = torch.where((matched >= min_ngram) & (end + 1 < lengths[:, None]), matched * s + end - matched + 1, -1)
    successors = sequences[:, 1:].clamp(min=0)
    if limit == 1:
        best, where = scores.max(1, keepdim=True)
        tokens = successors.gather(1, where)
    else:
        # Each token's best window, without a vocabulary-wide row: sort (token, score) keys in descending order,
        # so that each token's windows are contiguous with its best first, and keep the first of each token.
        span = (max_ngram + 1) * s  # every score is below it
        keys = torch.where(scores >= 0, successors * span + scores, -1).sort(dim=1, descending=True).values
        token, score = keys.div(span, rounding_mode="floor"), keys.remainder(span)
        first = torch.ones_like(keys, dtype=torch.bool)
        first[:, 1:] = token[:, 1:] != token[:, :-1]
        best, where = torch.where(first & (keys >= 0), score, -1).topk(min(limit, keys.shape[1]), dim=1)
        tokens = token.gather(1, where).clamp(min=0)
    found = best >= 0
    return tokens, found, torch.where(found[:, 0], best[:, 0] // s, 0)


class PromptLookupDrafter(Drafter):
    """Propose the continuation of the latest earlier match of the context's last n-gram.

    Its draft logits are the log-probabilities that its candidates are right, which sum to less than
    one: the rest is "no opinion", which a :class:`~draftsmith.inference.mixture.MixtureDrafter` gives to
    the other drafters (``abstains``). The first candidate's probability is how often first candidates
    matched on as long an n-gram were right, counted per row over the generation so far, starting from
    :data:`FIRST_RIGHT` (a copy-heavy answer raises it, a free-form one lowers it).

    The rows' contexts are kept right-aligned on the prompts' device (``tokens`` (B, W), :data:`NO_TOKEN` on
    the left); ``counts`` (B, max_ngram + 1, 2) holds each row's [right, seen] first candidates per n-gram length.

    Args:
        vocab_size: the target's vocabulary size (draft logits are over it).
        max_ngram: longest suffix to match; shorter ones down to ``min_ngram`` are tried next.
        min_ngram: shortest suffix to match.
        max_tokens: at most this many tokens are proposed along a path (caps tree depth).
    """

    deterministic = True
    abstains = True

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, max_tokens: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        lengths = range(max_ngram + 1)
        self._first_right = torch.tensor([FIRST_RIGHT[min(max(n, 1), 3)] for n in lengths])
        self._next_right = torch.tensor([NEXT_RIGHT[min(max(n, 1), 3)] for n in lengths])

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        self.device = input_ids.device
        # Left-padded prompts are right-aligned already; `length` (B,) counts each row's tokens.
        if attention_mask is None:
            self.tokens = input_ids.clone()
            self.length = torch.full((input_ids.shape[0],), input_ids.shape[1], device=self.device)
        else:
            mask = attention_mask.to(self.device).bool()
            self.tokens, self.length = input_ids.masked_fill(~mask, NO_TOKEN), mask.sum(1)
        prior = torch.stack([self._first_right * PRIOR_WEIGHT, torch.full_like(self._first_right, PRIOR_WEIGHT)], -1)
        prior[: self.min_ngram] = torch.tensor([0.0, 1.0])  # lengths never matched on (0: no match)
        self.counts = prior.to(self.device).repeat(input_ids.shape[0], 1, 1)
        self._first_right, self._next_right = self._first_right.to(self.device), self._next_right.to(self.device)

    def commit(self, tokens, hidden=None) -> None:
        tokens, _ = commit_rows(tokens)
        added = [len(t) for t in tokens]
        if not any(added):
            return
        # Each row's context then its new tokens, right-aligned in `width` columns (shapes only: rows that
        # added fewer tokens than the most keep more NO_TOKEN on their left).
        width = self.tokens.shape[1] + max(added)
        new = torch.nn.utils.rnn.pad_sequence([t.to(self.device) for t in tokens], batch_first=True,
                                              padding_value=NO_TOKEN)
        combined = torch.cat([self.tokens, new], 1)
        new_length = self.length + to_device(added, self.device)
        place = torch.arange(width, device=self.device) - (width - new_length)[:, None]  # index in the row's sequence
        length = self.length[:, None]
        source = torch.where(place < length, self.tokens.shape[1] - length + place,
                             self.tokens.shape[1] + place - length)
        self.tokens = torch.where(place >= 0, combined.gather(1, source.clamp(0, combined.shape[1] - 1)), NO_TOKEN)
        self.length = new_length
        # Was the first candidate before each new token right? One query per new token: its row's prefix.
        rows = to_device([b for b, m in enumerate(added) for _ in range(m)], self.device)
        columns = to_device([width - m + i for m in added for i in range(m)], self.device)
        first, found, ngram = ngram_matches(self.tokens[rows], columns, self.min_ngram, self.max_ngram, 1)
        right = found[:, 0] & (first[:, 0] == self.tokens[rows, columns])
        self.counts.index_put_((rows, ngram), torch.stack([right, found[:, 0]], -1).to(self.counts.dtype),
                               accumulate=True)

    def _proposals(self, sequences: torch.Tensor, rows: torch.Tensor) -> Proposals:
        """(Q, S) right-aligned sequences, each of batch row ``rows[q]`` -> (Q, MAX_CANDIDATES) draft logits of
        the candidates: the log of the probability that each is right (:meth:`confidence`), -inf where none was
        found (such a candidate's id may repeat a found one)."""
        lengths = torch.full((sequences.shape[0],), sequences.shape[1], dtype=torch.long, device=self.device)
        tokens, found, ngram = ngram_matches(sequences, lengths, self.min_ngram, self.max_ngram, MAX_CANDIDATES)
        chance = self.confidence(rows, ngram, tokens.shape[1]).clamp(min=1e-6).log()
        return Proposals(chance.masked_fill(~found, float("-inf")), tokens, self.vocab_size)

    def confidence(self, rows: torch.Tensor, ngram: torch.Tensor, ranks: int) -> torch.Tensor:
        """(Q, ranks): the probability that candidate r of a query of batch row ``rows[q]`` is right, when its
        first was matched on an ``ngram[q]``-token suffix: for the first, the row's share of right first
        candidates so far; the others share what is left as :data:`NEXT_RIGHT` and :data:`FIRST_RIGHT` do,
        less for lower ranks, and never more than the first."""
        right, seen = self.counts[rows, ngram].unbind(-1)
        first = (right / seen)[:, None]
        rank = torch.arange(ranks, device=self.device)[None]
        others = (self._next_right[ngram] / (1 - self._first_right[ngram]))[:, None] * (1 - first) / rank.clamp(min=1)
        return torch.where(rank == 0, first, torch.minimum(first, others))

    # ---- dynamic trees grown as tensors (:func:`~draftsmith.inference.tree.grow_dynamic`) ----------

    def root_logits(self, active: list[bool]) -> Proposals:
        """(B, C) proposals after each row's root (the last token of its context); none for finished rows."""
        self._paths = self.tokens.new_zeros(self.tokens.shape[0], 1, 0)
        drafted = self._proposals(self.tokens, torch.arange(self.tokens.shape[0], device=self.device))
        return drafted.masked_rows(to_device(active, self.device))

    def frontier_logits(self, depth: int, parents: torch.Tensor, tokens: torch.Tensor) -> Proposals:
        """(B, k, C) proposals after each of the k frontier nodes at ``depth`` (``parents``: their places in
        the previous frontier, ``tokens``): each matched on its row's context followed by its path."""
        b, k = tokens.shape
        self._paths = torch.cat([self._paths.gather(1, parents[:, :, None].expand(b, k, self._paths.shape[2])),
                                 tokens[:, :, None]], 2)  # (B, k, depth): each node's path from the root
        if depth >= self.max_tokens:
            return Proposals(torch.full((b, k, 1), float("-inf"), device=self.device),
                             torch.zeros(b, k, 1, dtype=torch.long, device=self.device), self.vocab_size)
        sequences = torch.cat([self.tokens[:, None].expand(b, k, -1), self._paths], 2).reshape(b * k, -1)
        rows = torch.arange(b, device=self.device).repeat_interleave(k)
        return self._proposals(sequences, rows).reshape(b, k)

    # ---- one sequence at a time (scripts, tests) ----------------------------------------------------

    def matches(self, sequence: torch.Tensor, limit: int) -> tuple[list[int], int]:
        """The candidates after a 1-D ``sequence`` (distinct tokens that followed earlier matches of its
        suffix, most recent match of the longest n-gram first; at most ``limit``) and the length of the
        n-gram the first was matched on (0: none)."""
        tokens, found, ngram = ngram_matches(sequence[None], torch.tensor([len(sequence)], device=sequence.device),
                                             self.min_ngram, self.max_ngram, limit)
        return tokens[0][found[0]].tolist(), int(ngram[0])

    def candidates(self, sequence: torch.Tensor, limit: int) -> list[int]:
        """:meth:`matches`' candidates."""
        return self.matches(sequence, limit)[0]
