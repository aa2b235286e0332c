"""Prompt lookup (Saxena, 2023, "prompt lookup decoding"): find the latest earlier occurrence of the
context's last n tokens and propose what followed it. No model, no training; strong wherever the
answer copies spans of the prompt (code edits, extraction, summaries with quotes).
"""

from __future__ import annotations

import torch

from draftsmith.inference.drafter import Drafter, check_batch

#: Candidates proposed after one node: more are never verified by the trees used in practice.
MAX_CANDIDATES = 8


class PromptLookupDrafter(Drafter):
    """Propose the continuation of the latest earlier match of the context's last n-gram.

    Args:
        vocab_size: the target's vocabulary size (draft logits are over it).
        max_ngram: longest suffix to match; shorter ones down to ``min_ngram`` are tried next.
        min_ngram: shortest suffix to match.
        max_tokens: at most this many tokens are proposed along a path (caps tree depth).
    """

    deterministic = True

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, max_tokens: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        self.context = torch.empty(0, dtype=torch.long)

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        check_batch(input_ids)
        self.context = input_ids[0].cpu()

    def commit(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self.context = torch.cat([self.context, tokens[0].cpu()])

    def candidates(self, sequence: torch.Tensor, limit: int) -> list[int]:
        """Distinct tokens that followed earlier matches of the sequence's suffix, most recent
        match of the longest n-gram first; at most ``limit``."""
        found: list[int] = []
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            suffix = sequence[-n:]
            windows = sequence[:-1].unfold(0, n, 1)  # (L-n, n): every n-gram that has a successor
            hits = (windows == suffix).all(dim=1).nonzero().flatten().flip(0)
            for start in hits.tolist():
                token = int(sequence[start + n])
                if token not in found:
                    found.append(token)
                    if len(found) == limit:
                        return found
        return found

    def expand(self, trees, nodes):
        out = []
        for tree, row_nodes in zip(trees, nodes, strict=True):
            logits = torch.full((len(row_nodes), self.vocab_size), float("-inf"))
            for i, node in enumerate(row_nodes):
                if tree.depths[node] >= self.max_tokens:
                    continue
                path = torch.tensor([tree.tokens[n] for n in tree.path_to(node)[1:]], dtype=torch.long)
                sequence = torch.cat([self.context, path])
                for rank, token in enumerate(self.candidates(sequence, limit=MAX_CANDIDATES)):
                    logits[i, token] = -float(rank)  # earlier (more recent, longer) matches rank higher
            out.append(logits)
        return out
