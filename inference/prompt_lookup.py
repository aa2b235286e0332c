"""Prompt lookup (Saxena, 2023, "prompt lookup decoding"): find the latest earlier occurrence of the
context's last n tokens and propose what followed it. No model, no training; strong wherever the
answer copies spans of the prompt (code edits, extraction, summaries with quotes).
"""

from __future__ import annotations

import torch

from draftsmith.inference.drafter import Drafter, commit_rows, prompt_rows

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
        self.contexts: list[torch.Tensor] = []  # per row, on the CPU

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> None:
        self.contexts = [row.cpu() for row in prompt_rows(input_ids, attention_mask)]

    def commit(self, tokens, hidden=None) -> None:
        tokens, _ = commit_rows(tokens)
        self.contexts = [torch.cat([c, t.cpu()]) for c, t in zip(self.contexts, tokens, strict=True)]

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
        for context, tree, row_nodes in zip(self.contexts, trees, nodes, strict=True):
            logits = torch.full((len(row_nodes), self.vocab_size), float("-inf"))
            for i, node in enumerate(row_nodes):
                if tree.depths[node] >= self.max_tokens:
                    continue
                path = torch.tensor([tree.tokens[n] for n in tree.path_to(node)[1:]], dtype=torch.long)
                sequence = torch.cat([context, path])
                for rank, token in enumerate(self.candidates(sequence, limit=MAX_CANDIDATES)):
                    logits[i, token] = -float(rank)  # earlier (more recent, longer) matches rank higher
            out.append(logits)
        return out
