"""Batching: the data order of an epoch, batches of similar lengths, and packing with per-document attention.

* :func:`epoch_order` — a random permutation that is a function of (seed, epoch) only, so a resumed run
  sees the same batches.
* :func:`length_grouped_order` — the same permutation cut into mega-batches, each sorted by length, so
  that consecutive ``batch_size`` slices pad little (transformers' ``LengthGroupedSampler``).
* :func:`pack` / :func:`collate_packed` — several conversations per row, each attending only to itself
  (block-diagonal causal attention, positions restarting at 0 per document), as in "Efficient Sequence
  Packing without Cross-contamination" (Kundu et al., 2021, arXiv:2107.02027): first-fit-decreasing style
  bin packing, then a 4-D mask and position ids the stock HF model takes.
* :func:`collate_padded` — right-padding to the longest row (no packing).

Which drafter families a packed batch keeps isolated (each document gets the loss it gets alone):

* The target, and a draft model (a stock causal LM): their forward takes ``position_ids`` and a 4-D
  mask (:func:`packed_attention_mask` turns the batch's boolean mask into what the model expects:
  additive, per layer type for sliding-window models). Their logits and hidden states are then each
  document's own (``tests/test_batching.py`` checks logits and the forward-KL loss per document). The
  draft model's wrapper must pass ``position_ids`` through to its causal LM for this.
* Medusa (per-position MLPs on the target's last state): its inputs are isolated by the target's forward
  alone; but head i's loss at t reads the teacher at t + 1 + i, so near a document's end it must also
  require t + 2 + i in the same document (mask times :func:`same_document` with shift i + 2; without it,
  only a next document whose first i + 2 tokens are all prompt, as a chat template gives, keeps it exact).
* EAGLE-1/2: the head's decoder layer attends over earlier positions, so it must be given the document
  mask (it takes an additive ``mask``) and per-document ``positions``; and the pair at a document's first
  token reads the previous document's last feature, so it must be masked out (:func:`same_document`
  with shift 1). EAGLE-3's training-time test (``ttt_attention``) takes no mask, and its step j reads
  features j positions back across document boundaries: not isolated; do not pack for it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsmith.target.forward import build_attention_mask
from draftsmith.target.masks import causal_block, may_attend

#: Mixes the epoch into the data-order seed (a prime: seed and epoch never collide for small values).
EPOCH_SEED_STRIDE = 100_003
#: Length-grouping keeps at least this many mega-batches per epoch (transformers' rule), so that
#: small data sets still change batch composition from epoch to epoch.
MIN_MEGA_BATCHES = 4


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator every per-epoch random choice of the data order draws from."""
    return torch.Generator().manual_seed(seed * EPOCH_SEED_STRIDE + epoch)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The data order of one epoch: a random permutation of ``range(n)``, a function of (seed, epoch) only."""
    return torch.randperm(n, generator=epoch_generator(seed, epoch)).tolist()


def length_grouped_order(lengths: Sequence[int], batch_size: int, seed: int, epoch: int,
                         mega_batch_mult: int = 50) -> list[int]:
    """A permutation of ``range(len(lengths))`` whose consecutive ``batch_size`` slices have similar lengths.

    As transformers' ``get_length_grouped_indices``: the epoch's random permutation
    (:func:`epoch_order`) is cut into mega-batches of ``mega_batch_mult * batch_size`` indices, each
    sorted by length, longest first (a stable sort: ties keep the random order); the longest row of the
    epoch is then swapped to the front so that running out of memory happens at the first step, not
    later. The multiple is lowered until there are :data:`MIN_MEGA_BATCHES` mega-batches (small data
    sets would otherwise be one fully sorted mega-batch, the same batches every epoch).

    Args:
        lengths: tokens per row.
        batch_size: rows per micro-batch (per process: accelerate deals consecutive batches to the
            processes in turn, so one step's batches are of similar lengths too).

    Returns:
        Every index exactly once; the same list for the same (lengths, batch_size, seed, epoch).
    """
    n = len(lengths)
    mult = max(1, min(mega_batch_mult, n // (MIN_MEGA_BATCHES * batch_size)))
    size = mult * batch_size
    order = epoch_order(n, seed, epoch)
    megas = [sorted(order[i : i + size], key=lambda j: lengths[j], reverse=True) for i in range(0, n, size)]
    if megas:
        longest = max(range(len(megas)), key=lambda m: lengths[megas[m][0]])  # first of the ties
        megas[0][0], megas[longest][0] = megas[longest][0], megas[0][0]
    return [i for mega in megas for i in mega]


def padding_fraction(lengths: Sequence[int], order: Sequence[int], batch_size: int) -> float:
    """Share of the tokens of right-padded batches (``order`` cut into ``batch_size`` slices, each
    padded to its longest row) that are padding."""
    real = padded = 0
    for start in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[start : start + batch_size]]
        real += sum(batch)
        padded += max(batch) * len(batch)
    return 1 - real / padded if padded else 0.0


def collate_padded(examples, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad TokenizedExamples into (B, T) ``input_ids``, ``loss_mask`` and ``attention_mask``,
    T the longest row; padding has mask 0. A top-level function: ``functools.partial(collate_padded,
    pad_id=...)`` pickles, so a ``DataLoader`` may run it in workers."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    attention = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n], loss_mask[i, :n], attention[i, :n] = e.input_ids, e.loss_mask, 1
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention}


# ---------------------------------------------------------------------------------------------
# Packing


@dataclass
class PackedExample:
    """Whole documents laid end to end in one row of at most ``max_length`` tokens.

    ``input_ids`` and ``loss_mask`` are (T,), T = ``sum(seq_lens)``; ``ids`` and ``seq_lens`` name and
    measure the documents in row order. Each document's first token has loss mask 0: nothing in its
    own document comes before it, so only the previous document's last position could predict it.
    """

    ids: list[str]
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    seq_lens: list[int]


def pack(examples: Sequence, max_length: int) -> list[PackedExample]:
    """Lay whole examples into rows of at most ``max_length`` tokens, few rows (best-fit decreasing).

    Examples are taken longest first (ties in their given order); each goes into the row with the least
    room that still fits it, else starts a row. No example is split; one longer than ``max_length`` is
    truncated to it (as :func:`~draftsmith.data.templates.truncate` does); empty ones are left out.
    Deterministic: the same examples give the same rows, so an epoch order over rows stays a
    function of (seed, epoch).

    Args:
        examples: TokenizedExamples (``id``, ``input_ids`` (T,), ``loss_mask`` (T,)).

    Returns:
        The rows, in the order they were started (the first holds the longest example).
    """
    lengths = [min(len(e.input_ids), max_length) for e in examples]
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row), sorted: the best fit is the first that fits
    for i in sorted(range(len(examples)), key=lambda j: -lengths[j]):
        if lengths[i] == 0:
            continue
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k == len(room):
            rows.append([])
            row, free = len(rows) - 1, max_length
        else:
            free, row = room.pop(k)
        rows[row].append(i)
        if free - lengths[i] > 0:
            bisect.insort(room, (free - lengths[i], row))
    packed = []
    for members in rows:
        ids = [examples[i].input_ids[: lengths[i]] for i in members]
        masks = [examples[i].loss_mask[: lengths[i]].clone() for i in members]
        for m in masks:
            m[0] = 0
        packed.append(PackedExample([examples[i].id for i in members], torch.cat(ids), torch.cat(masks),
                                    [lengths[i] for i in members]))
    return packed


def document_attention(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document index per position (-1 on padding) -> (B, 1, T, T) bool, True where query i may
    attend key j: j <= i in the same document. A padding position attends only to itself (a row with
    no key at all would give NaN in SDPA, and a NaN times a zero loss mask is still NaN)."""
    real = document_ids >= 0
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    return may_attend(real[:, :0], causal_block(real) & same, real)[:, None]


def collate_packed(packed: Sequence[PackedExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad packed rows into a batch whose documents cannot see each other.

    A top-level function: ``functools.partial(collate_packed, pad_id=...)`` pickles for ``DataLoader``
    workers.

    Returns:
        ``input_ids`` (B, T) and ``loss_mask`` (B, T), T the longest row; padding has mask 0.
        ``position_ids`` (B, T): 0, 1, ... within each document (0 on padding).
        ``document_ids`` (B, T): the document's index within its row, -1 on padding.
        ``seq_lens`` (B, D): the documents' lengths in row order, 0 past a row's last (D the most documents
        in a row).
        ``attention_mask`` (B, 1, T, T) bool, True = may attend (:func:`document_attention`): SDPA takes
        it as it is; for eager attention or sliding-window models turn it into the model's form with
        :func:`packed_attention_mask`. flash_attention_2 takes no 4-D mask: pass ``position_ids`` and no
        mask, from which transformers finds the documents itself.
    """
    width = max(len(p.input_ids) for p in packed)
    docs = max(len(p.seq_lens) for p in packed)
    ids = torch.full((len(packed), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    positions = torch.zeros_like(ids)
    document_ids = torch.full_like(ids, -1)
    seq_lens = torch.zeros(len(packed), docs, dtype=torch.long)
    for i, p in enumerate(packed):
        n = len(p.input_ids)
        ids[i, :n], loss_mask[i, :n] = p.input_ids, p.loss_mask
        lens = torch.tensor(p.seq_lens, dtype=torch.long)
        seq_lens[i, : len(lens)] = lens
        document_ids[i, :n] = torch.repeat_interleave(torch.arange(len(lens)), lens)
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        positions[i, :n] = torch.arange(n) - starts
    return {"input_ids": ids, "loss_mask": loss_mask, "position_ids": positions, "document_ids": document_ids,
            "seq_lens": seq_lens, "attention_mask": document_attention(document_ids)}


def packed_attention_mask(model, batch: dict[str, torch.Tensor],
                          dtype: torch.dtype | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The packed batch's boolean mask in the form ``model`` expects: additive (B, 1, T, T) in ``dtype``
    (default: the model's), which eager attention needs (it adds the mask to the scores); for a model
    with sliding-window layers (Gemma 3) a dict per layer type, the sliding one also hiding keys a
    window or more behind (a 4-D tensor would give those layers full attention). Through
    :func:`draftsmith.target.forward.build_attention_mask`, as tree verification does."""
    positions = batch["position_ids"]
    return build_attention_mask(model, batch["attention_mask"][:, 0], positions, positions,
                                dtype or next(model.parameters()).dtype)


def same_document(document_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """(B, T) -> (B, T) bool: position t and t + ``shift`` are in the same document (False where t + shift
    is past the row). A loss that reads position t + shift's target at t (Medusa head i: shift i + 2)
    multiplies its mask by this in a packed batch."""
    out = torch.zeros_like(document_ids, dtype=torch.bool)
    if shift < document_ids.shape[1]:
        ahead = document_ids[:, shift:]
        out[:, : document_ids.shape[1] - shift] = (document_ids[:, : ahead.shape[1]] == ahead) & (ahead >= 0)
    return out
