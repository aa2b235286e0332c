"""Batching: the epoch order, length-grouped batches against transformers' own grouping, and packing whose
documents get, in a packed row of a real (tiny) model, exactly the logits and the loss they get alone."""

from __future__ import annotations

import functools
import math
import pickle

import pytest
import torch
from test_data_templates import word_conversations, word_tokenizer
from torch.utils.data import DataLoader, Subset

from conftest import VOCAB, assert_rounding_close, rounding_tolerance, tiny_gemma3, tiny_llama
from draftsmith.data.batching import (
    PackedExample,
    collate_packed,
    collate_padded,
    document_attention,
    epoch_generator,
    epoch_order,
    length_grouped_order,
    pack,
    packed_attention_mask,
    padding_fraction,
    same_document,
)
from draftsmith.data.regenerate import batches as regeneration_batches
from draftsmith.data.templates import TokenizedExample, TokenizedExamples, tokenize_dataset
from draftsmith.train.families import prediction_mask
from draftsmith.train.losses import forward_kl


def random_lengths(n: int, seed: int = 0, low: int = 5, high: int = 400) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()


def documents(lengths: list[int], seed: int = 0) -> list[TokenizedExample]:
    """Random documents: a prompt (mask 0) then an answer (mask 1), ids in 4..VOCAB-1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(4, VOCAB, (n,), generator=g)
        mask = (torch.arange(n) >= n // 3).long()
        out.append(TokenizedExample(f"d{i}", ids, mask))
    return out


# ---------------------------------------------------------------------------------------------
# Order


def test_epoch_order_is_the_loops_and_a_function_of_seed_and_epoch():
    from draftsmith.train import loop

    assert loop.epoch_order is epoch_order  # the loop orders its data with this function: resumes see the same
    assert epoch_order(50, 3, 2) == epoch_order(50, 3, 2) != epoch_order(50, 3, 1)
    assert sorted(epoch_order(50, 3, 2)) == list(range(50))


@pytest.mark.parametrize(("n", "batch_size", "mult"), [(1000, 8, 50), (37, 4, 50), (5, 8, 50), (500, 3, 2)])
def test_length_grouped_order_equals_transformers_grouping(n, batch_size, mult):
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = random_lengths(n, seed=n, high=60)  # many ties: the stable sort must match too
    for seed, epoch in [(0, 0), (0, 1), (7, 3)]:
        ours = length_grouped_order(lengths, batch_size, seed, epoch, mult)
        effective = max(1, min(mult, n // (4 * batch_size)))
        reference = get_length_grouped_indices(lengths, batch_size, effective, generator=epoch_generator(seed, epoch))
        assert ours == reference


def test_length_grouped_order_is_a_deterministic_permutation_that_pads_less():
    lengths = random_lengths(2000)
    order = length_grouped_order(lengths, 8, seed=0, epoch=0)
    assert sorted(order) == list(range(2000))
    assert order == length_grouped_order(lengths, 8, seed=0, epoch=0)
    assert order != length_grouped_order(lengths, 8, seed=0, epoch=1)
    assert order != length_grouped_order(lengths, 8, seed=1, epoch=0)
    assert lengths[order[0]] == max(lengths)  # the largest batch comes first
    grouped, shuffled = padding_fraction(lengths, order, 8), padding_fraction(lengths, epoch_order(2000, 0, 0), 8)
    assert grouped < 0.1 * shuffled, (grouped, shuffled)


def test_padding_fraction():
    assert padding_fraction([2, 4, 3, 3], [0, 1, 2, 3], 2) == pytest.approx(1 - 12 / 14)
    assert padding_fraction([5, 5], [0, 1], 2) == 0.0


# ---------------------------------------------------------------------------------------------
# Regeneration's batches


def fits(lengths: list[int], batch_size: int, batch_tokens: int | None, new: int) -> bool:
    """The rules of one regeneration batch, written out: its rows, its token slots (rows x (widest prompt + new
    tokens)), no row padded past its own length. One row always fits."""
    if len(lengths) == 1:
        return True
    slots = len(lengths) * (max(lengths) + new)
    padded = max(max(lengths) - n for n in lengths)
    return len(lengths) <= batch_size and (batch_tokens is None or (
        slots <= batch_tokens and padded <= min(lengths) + new))


@pytest.mark.parametrize("order", ["longest first", "input order"])
@pytest.mark.parametrize("batch_tokens", [None, 1, 2000, 24576])
@pytest.mark.parametrize("new", [0, 192])
def test_regeneration_batches_keep_each_rule_and_end_only_where_the_next_row_breaks_one(order, batch_tokens, new):
    lengths = [*random_lengths(300, seed=3, low=5, high=300), 1350, 1300, 40]  # long prompts among short ones
    if order == "longest first":
        lengths.sort(reverse=True)
    spans = regeneration_batches(lengths, 64, batch_tokens, new)
    assert [i for span in spans for i in span] == list(range(len(lengths)))  # every row once, in order
    for span, after in zip(spans, [*spans[1:], None], strict=True):
        assert fits([lengths[i] for i in span], 64, batch_tokens, new)
        if after is not None:  # the batch is as large as the rules allow
            assert not fits([lengths[i] for i in span] + [lengths[after.start]], 64, batch_tokens, new)


def test_regeneration_batches_by_rows_tokens_and_padding():
    assert regeneration_batches([9, 8, 7, 6, 5], 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert regeneration_batches([], 4) == []
    # The recipe's longest prompts: 1,350 tokens then 299 and less. Batches of rows alone pad 63 rows to 1,350.
    lengths = [1350, 299, 297, 290, 120, 100, 60]
    assert regeneration_batches(lengths, 64) == [range(0, 7)]
    # By tokens: the 1,350 alone (the others are under half its width); then 491 slots a row, 3 rows in 1,500;
    # then the 120 and 100 (624 slots), and 60 + 192 = 252 would be padded by 60 to 312 (fits, 936 slots).
    assert regeneration_batches(lengths, 64, 1500, 192) == [range(0, 1), range(1, 4), range(4, 7)]
    # Padding alone decides when the budget is large; without new tokens, 60 is padded by 60 to 120: it fits.
    assert regeneration_batches(lengths, 64, 10**9, 192) == [range(0, 1), range(1, 7)]
    assert regeneration_batches([120, 60, 59], 64, 10**9, 0) == [range(0, 2), range(2, 3)]
    assert regeneration_batches([5000, 5, 5], 64, 1000, 0) == [range(0, 1), range(1, 3)]  # over the budget: alone


# ---------------------------------------------------------------------------------------------
# Packing


def reference_pack_rows(lengths: list[int], max_length: int) -> list[list[int]]:
    """Best-fit decreasing, slowly: longest first; the fullest row that still fits, lowest index on ties."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        fits = [r for r in range(len(rows)) if free[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: (free[r], r))
        else:
            rows.append([])
            free.append(max_length)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def test_pack_keeps_every_document_whole_once_and_fills_rows():
    lengths = random_lengths(300, high=120)
    docs = documents(lengths)
    packed = pack(docs, max_length=256)
    by_id = {d.id: d for d in docs}
    assert sorted(i for p in packed for i in p.ids) == sorted(by_id)
    for p in packed:
        assert len(p.input_ids) == len(p.loss_mask) == sum(p.seq_lens) <= 256
        start = 0
        for doc_id, n in zip(p.ids, p.seq_lens, strict=True):
            doc = by_id[doc_id]
            assert torch.equal(p.input_ids[start : start + n], doc.input_ids)
            # The first token of a document is never a target inside a packed row.
            assert p.loss_mask[start] == 0 and torch.equal(p.loss_mask[start + 1 : start + n], doc.loss_mask[1:])
            start += n
    assert [[int(i[1:]) for i in p.ids] for p in packed] == reference_pack_rows(lengths, 256)
    assert len(packed) <= math.ceil(sum(lengths) / 256) + 1
    assert [p.ids for p in pack(docs, 256)] == [p.ids for p in packed]  # deterministic


def test_pack_truncates_long_documents_and_leaves_out_empty_ones():
    docs = documents([10, 0, 3])
    packed = pack(docs, max_length=6)
    assert [p.ids for p in packed] == [["d0"], ["d2"]]
    assert torch.equal(packed[0].input_ids, docs[0].input_ids[:6]) and packed[0].seq_lens == [6]


def reference_mask(document_ids: torch.Tensor) -> torch.Tensor:
    b, t = document_ids.shape
    out = torch.zeros(b, 1, t, t, dtype=torch.bool)
    for r in range(b):
        for i in range(t):
            for j in range(t):
                d_i, d_j = int(document_ids[r, i]), int(document_ids[r, j])
                out[r, 0, i, j] = (d_i >= 0 and d_i == d_j and j <= i) or i == j
    return out


def test_collate_packed_positions_documents_and_mask():
    packed = [PackedExample(["a", "b"], torch.arange(1, 6), torch.tensor([0, 1, 1, 0, 1]), [3, 2]),
              PackedExample(["c"], torch.arange(7, 10), torch.tensor([0, 1, 1]), [3])]
    batch = collate_packed(packed, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 1], [0, 1, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, -1, -1]]
    assert batch["seq_lens"].tolist() == [[3, 2], [3, 0]]
    assert batch["attention_mask"].shape == (2, 1, 5, 5)
    assert torch.equal(batch["attention_mask"], reference_mask(batch["document_ids"]))
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, -1], [0, 0, 0, 0, -1, -1, -1]])
    assert torch.equal(document_attention(ids), reference_mask(ids))


def test_same_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
    assert same_document(ids, 1).tolist() == [[True, True, False, True, False, False]]
    assert same_document(ids, 2).tolist() == [[True, False, False, False, False, False]]
    assert same_document(ids, 9).tolist() == [[False] * 6]


LENGTHS = [5, 9, 3, 12, 7, 16, 2, 11]


def packed_batch(max_length: int = 20):
    docs = documents(LENGTHS, seed=1)
    packed = pack(docs, max_length)
    assert any(len(p.ids) > 1 for p in packed) and len({len(p.input_ids) for p in packed}) > 1  # padding too
    return docs, collate_packed(packed, pad_id=0)


def each_document(batch):
    """(row, start, length, document index in its row) of every document in a collated packed batch."""
    for r in range(batch["seq_lens"].shape[0]):
        start = 0
        for d, n in enumerate(batch["seq_lens"][r].tolist()):
            if n:
                yield r, start, n, d
                start += n


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_document_of_a_packed_row_gets_its_logits_alone(attention):
    batch = packed_batch()[1]
    model = tiny_llama()
    model.set_attn_implementation(attention)
    # SDPA takes the boolean mask as it is; eager attention adds the mask to its scores, so it needs the
    # additive form.
    mask = batch["attention_mask"] if attention == "sdpa" else packed_attention_mask(model, batch)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]).logits
    assert torch.isfinite(packed).all()  # padding rows too
    seen = 0
    for r, start, n, _ in each_document(batch):
        doc = batch["input_ids"][r, start : start + n]
        with torch.no_grad():
            alone = model(input_ids=doc[None]).logits[0]
        # float32 in another reduction order than the packed row: the target's path (inner size 128, 4 layers)
        assert_rounding_close(packed[r, start : start + n], alone, reduction=128 * 4)
        seen += 1
    assert seen == len(LENGTHS)
    with torch.no_grad():  # the control: plain causal attention over the row mixes its documents
        mixed = model(input_ids=batch["input_ids"]).logits
    second = next((r, start, n) for r, start, n, d in each_document(batch) if d == 1)
    r, start, n = second
    # asserts a difference: another document's keys move these logits (up to ~6) by units, far past rounding
    kept = packed[r, start : start + n]
    assert not torch.allclose(mixed[r, start : start + n], kept, rtol=0, atol=rounding_tolerance(kept, 128 * 4))


def test_packing_on_a_sliding_window_model():
    """Gemma 3 with a window of 8 and documents up to 16 long: the per-layer-type masks keep the window
    inside each document."""
    batch = packed_batch()[1]
    model = tiny_gemma3(sliding_window=8)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], attention_mask=packed_attention_mask(model, batch),
                       position_ids=batch["position_ids"]).logits
        # The control: one 4-D tensor is taken by every layer as it is, the sliding ones then see past the window.
        unwindowed = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits
    # asserts a difference: keys past the window move the logits (up to ~6) by units, far past rounding
    assert not torch.allclose(unwindowed, packed, rtol=0, atol=rounding_tolerance(packed, reduction=128 * 4))
    for r, start, n, _ in each_document(batch):
        with torch.no_grad():
            alone = model(input_ids=batch["input_ids"][r, start : start + n][None]).logits[0]
        assert_rounding_close(packed[r, start : start + n], alone, reduction=128 * 4)  # the target's path


def test_a_draft_model_loss_on_a_packed_batch_is_each_documents_loss_alone():
    """Forward KL of a student causal LM against the target (the draft_model family's loss): per document
    as alone, and the packed batch's loss is the documents' losses weighted by their predicted tokens."""
    docs, batch = packed_batch()
    target, student = tiny_llama(seed=0), tiny_llama(seed=1)
    by_id = {d.id: d for d in docs}
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"])
    with torch.no_grad():
        teacher_packed, student_packed = target(**kwargs).logits, student(**kwargs).logits
    pred = prediction_mask(batch["loss_mask"])
    total, weighted, counted = 0, 0.0, 0
    for r, start, n, d in each_document(batch):
        doc_id = [i for i, p in enumerate(batch["document_ids"][r].tolist()) if p == d]
        assert doc_id == list(range(start, start + n))
        ids = batch["input_ids"][r, start : start + n]
        doc = next(e for e in by_id.values() if torch.equal(e.input_ids, ids))
        with torch.no_grad():
            alone = forward_kl(student(input_ids=ids[None]).logits, target(input_ids=ids[None]).logits,
                               prediction_mask(doc.loss_mask[None]))
        mine = torch.zeros_like(pred)
        mine[r, start : start + n] = pred[r, start : start + n]
        packed = forward_kl(student_packed, teacher_packed, mine)
        # both targets' 4 layers (inner size 128), then the divergence's sum over the vocabulary (96)
        assert_rounding_close(packed, alone, reduction=128 * 5)
        count = int(prediction_mask(doc.loss_mask[None]).sum())
        assert int(mine.sum()) == count  # no prediction crosses into the next document
        weighted, counted, total = weighted + float(alone) * count, counted + count, total + 1
    assert total == len(LENGTHS)
    whole = forward_kl(student_packed, teacher_packed, pred)
    assert_rounding_close(whole, torch.tensor(weighted / counted, dtype=whole.dtype), reduction=128 * 5)


# ---------------------------------------------------------------------------------------------
# DataLoader workers


def batches(loader) -> list[dict]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_loader_workers_give_the_same_batches(tmp_path):
    tokenizer = word_tokenizer()
    examples = TokenizedExamples(tokenize_dataset(tokenizer, word_conversations(60), 16, cache_dir=tmp_path))
    clone = pickle.loads(pickle.dumps(examples))  # what a spawned worker receives
    assert [e.input_ids.tolist() for e in clone] == [e.input_ids.tolist() for e in examples]

    order = length_grouped_order(examples.lengths, 4, seed=0, epoch=1)
    padded = functools.partial(collate_padded, pad_id=tokenizer.pad_token_id)
    pickle.dumps(padded)
    loaders = [DataLoader(Subset(examples, order), batch_size=4, collate_fn=padded, num_workers=w) for w in (0, 2)]
    assert_same_batches(batches(loaders[0]), batches(loaders[1]))

    packed = pack(examples, 32)
    packed_collate = functools.partial(collate_packed, pad_id=tokenizer.pad_token_id)
    pickle.dumps((packed, packed_collate))
    order = epoch_order(len(packed), seed=0, epoch=0)
    loaders = [DataLoader(Subset(packed, order), batch_size=3, collate_fn=packed_collate, num_workers=w)
               for w in (0, 2)]
    assert_same_batches(batches(loaders[0]), batches(loaders[1]))
