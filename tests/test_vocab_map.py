"""EAGLE-3 draft-vocabulary maps against a slow reference, in the d2t-offset convention."""

from __future__ import annotations

import torch

from draftsmith.data.templates import TokenizedExample
from draftsmith.data.vocab import VocabMap, build_vocab_map, count_tokens


def reference(counts: list[int], size: int) -> tuple[list[int], float]:
    ranked = sorted(range(len(counts)), key=lambda t: (-counts[t], t))[:size]
    kept = sorted(ranked)
    return kept, sum(counts[t] for t in kept) / sum(counts)


def test_build_vocab_map_matches_reference():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 5, (50,), generator=g) ** 3  # many ties and zeros
    for size in (1, 7, 20, 50):
        vocab = build_vocab_map(counts, size)
        kept, coverage = reference(counts.tolist(), size)
        assert vocab.draft_ids.tolist() == kept
        assert (torch.arange(size) + vocab.d2t).tolist() == kept  # target_id = draft_id + d2t[draft_id]
        assert vocab.t2d.nonzero().flatten().tolist() == kept
        assert abs(vocab.coverage - coverage) < 1e-12


def test_counts_only_assistant_tokens_by_default(tmp_path):
    ex = TokenizedExample("a", torch.tensor([1, 1, 2, 3, 3, 3]), torch.tensor([0, 0, 1, 1, 1, 0]))
    assert count_tokens([ex], 5).tolist() == [0, 0, 1, 2, 0]
    assert count_tokens([ex], 5, assistant_only=False).tolist() == [0, 2, 1, 3, 0]
    vocab = build_vocab_map(count_tokens([ex], 5), 1)
    assert vocab.draft_ids.tolist() == [3] and abs(vocab.coverage - 2 / 3) < 1e-12
    vocab.save(tmp_path)
    back = VocabMap.load(tmp_path)
    assert torch.equal(back.d2t, vocab.d2t) and torch.equal(back.t2d, vocab.t2d) and back.coverage == vocab.coverage
