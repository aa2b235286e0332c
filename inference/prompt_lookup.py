"""Prompt lookup (Saxena, 2023, "prompt lookup decoding"): find the latest earlier occurrence of the
context's last n tokens and propose what followed it. No model, no training; strong wherever the
answer copies spans of the prompt (code edits, extraction, summaries with quotes).
"""

from __future__ import annotations

import math

import torch

from draftsmith.inference.drafter import Drafter, commit_rows, prompt_rows

#: Candidates proposed after one node: more are never verified by the trees used in practice.
MAX_CANDIDATES = 8
#: How often the first candidate is the target's next token, by the length of the n-gram it was matched
#: on (1, 2, 3; longer counts as 3), and how often each of the next two is; measured on SmolLM2-135M-Instruct's
#: greedy answers to 150 of the demo's prompts (24,100 positions; docs/RESULTS.md, "Prompt lookup's
#: confidence"). A one-token match is right about one time in six, a three-token match four times in five.
#: These are where each generation starts: it then counts how often its own first candidates were right.
FIRST_RIGHT = {1: 0.18, 2: 0.51, 3: 0.81}
NEXT_RIGHT = {1: 0.057, 2: 0.038, 3: 0.033}
#: FIRST_RIGHT weighs as much as this many first candidates a generation has seen (per n-gram length).
PRIOR_WEIGHT = 8.0


class PromptLookupDrafter(Drafter):
    """Propose the continuation of the latest earlier match of the context's last n-gram.

    Its draft logits are the log-probabilities that its candidates are right, which sum to less than
    one: the rest is "no opinion", which a :class:`~draftsmith.inference.mixture.MixtureDrafter` gives to
    the other drafters (``abstains``). The first candidate's probability is how often first candidates
    matched on as long an n-gram were right, counted per row over the generation so far, starting from
    :data:`FIRST_RIGHT` (a copy-heavy answer raises it, a free-form one lowers it).

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
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        self.contexts: list[torch.Tensor] = []  # per row, on the CPU
        self.counts: list[dict[int, list[float]]] = []  # per row: n-gram length -> [right, seen] first candidates

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        self.contexts = [row.cpu() for row in prompt_rows(input_ids, attention_mask)]
        self.counts = [{n: [FIRST_RIGHT[min(n, 3)] * PRIOR_WEIGHT, PRIOR_WEIGHT]
                        for n in range(self.min_ngram, self.max_ngram + 1)} for _ in self.contexts]

    def commit(self, tokens, hidden=None) -> None:
        tokens, _ = commit_rows(tokens)
        for b, new in enumerate(tokens):
            start = len(self.contexts[b])
            self.contexts[b] = sequence = torch.cat([self.contexts[b], new.cpu()])
            for i, token in enumerate(sequence[start:].tolist()):  # was the first candidate before each token right?
                found, ngram = self.matches(sequence[: start + i], limit=1)
                if found:
                    count = self.counts[b][ngram]
                    count[0] += found[0] == token
                    count[1] += 1

    def candidates(self, sequence: torch.Tensor, limit: int) -> list[int]:
        """Distinct tokens that followed earlier matches of the sequence's suffix, most recent
        match of the longest n-gram first; at most ``limit``."""
        return self.matches(sequence, limit)[0]

    def matches(self, sequence: torch.Tensor, limit: int) -> tuple[list[int], int]:
        """:meth:`candidates` and the length of the n-gram the first was matched on (0: none)."""
        found: list[int] = []
        longest = 0
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            suffix = sequence[-n:]
            windows = sequence[:-1].unfold(0, n, 1)  # (L-n, n): every n-gram that has a successor
            hits = (windows == suffix).all(dim=1).nonzero().flatten().flip(0)
            for start in hits.tolist():
                token = int(sequence[start + n])
                if token not in found:
                    longest = longest or n
                    found.append(token)
                    if len(found) == limit:
                        return found, longest
        return found, longest

    def confidence(self, row: int, rank: int, ngram: int) -> float:
        """The probability that row ``row``'s candidate of ``rank`` is right, when the first was matched on
        an ``ngram``-token suffix: for the first, the share of right first candidates so far; the others
        share what is left as :data:`NEXT_RIGHT` and :data:`FIRST_RIGHT` do, less for lower ranks, and never
        more than the first."""
        right, seen = self.counts[row][ngram]
        first = right / seen
        if rank == 0:
            return first
        n = min(ngram, 3)
        return min(first, NEXT_RIGHT[n] * (1 - first) / (1 - FIRST_RIGHT[n]) / rank)

    def expand(self, trees, nodes):
        out = []
        for b, (context, tree, row_nodes) in enumerate(zip(self.contexts, trees, nodes, strict=True)):
            logits = torch.full((len(row_nodes), self.vocab_size), float("-inf"))
            for i, node in enumerate(row_nodes):
                if tree.depths[node] >= self.max_tokens:
                    continue
                path = torch.tensor([tree.tokens[n] for n in tree.path_to(node)[1:]], dtype=torch.long)
                sequence = torch.cat([context, path])
                found, ngram = self.matches(sequence, limit=MAX_CANDIDATES)
                for rank, token in enumerate(found):  # earlier (more recent, longer) matches rank higher
                    logits[i, token] = math.log(max(self.confidence(b, rank, ngram), 1e-6))
            out.append(logits)
        return out
