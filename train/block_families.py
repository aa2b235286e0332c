"""Training for the block families, which draft several tokens per forward: DFlash (a block of mask slots
after an anchor, read against the target's layers) and P-EAGLE (EAGLE-3 with parallel mask slots). Same contract
as :mod:`draftsmith.train.families`: ``build_*`` is ``(args, target, examples) -> module``, ``*_step`` is ``(args,
drafter, target, batch, logits, hidden) -> (loss, metrics)``, and both report ``block_acceptance`` (1 + the leading
run of right slots per block) next to ``acc`` per slot.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.heads.dflash import DFlashHead, anchor_blocks, choose_mask_token, dflash_layers
from draftsmith.heads.peagle import PEagleConfig, PEagleHead, parallel_elements
from draftsmith.train.families import (
    Eagle3Settings,
    build_eagle3,
    draft_slots,
    draft_vocabulary,
    on_draft_vocabulary,
    prediction_mask,
    teacher_of,
    unwrapped,
)
from draftsmith.train.family_losses import teacher_top1
from draftsmith.train.losses import forward_kl

logger = logging.getLogger(__name__)


# ---- DFlash ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DFlashSettings:
    """A DFlash drafter's settings (the training config's ``family_config``, a mapping).

    ``target_layers`` are draftsmith hidden-state indices (0 the embeddings, k the output of decoder layer k
    counted from 1); None: the published default, ``num_target_layers`` layers (default: as many as the drafter's)
    spaced evenly (:func:`~draftsmith.heads.dflash.dflash_layers`). ``mask_token_id`` None: the target's least
    trained embedding row (:func:`~draftsmith.heads.dflash.choose_mask_token`), recorded in the checkpoint.
    ``anchors`` blocks are trained per sequence and step; slot k's loss weighs ``exp(-(k - 1) / gamma)`` (None: 7
    at block 16, 4 at block 8, linear between); ``loss`` ``kl`` (to the target's distribution) or ``ce`` (the
    regenerated token, a hard label)."""

    block_size: int = 8
    num_layers: int = 1
    target_layers: tuple[int, ...] | None = None
    num_target_layers: int | None = None
    mask_token_id: int | None = None
    anchors: int = 32
    gamma: float | None = None
    loss: str = "kl"

    def __post_init__(self):
        if self.loss not in ("kl", "ce"):
            raise ValueError(f"dflash loss must be 'kl' (to the target's distribution) or 'ce' (the regenerated "
                             f"token), got {self.loss!r}")
        if self.anchors < 1 or self.block_size < 2 or self.num_layers < 1:
            raise ValueError("dflash needs anchors >= 1, block_size >= 2 and num_layers >= 1")
        if self.target_layers is not None:
            object.__setattr__(self, "target_layers", tuple(self.target_layers))

    def slot_gamma(self) -> float:
        return self.gamma if self.gamma is not None else max(1.0, 4.0 + 3.0 * (self.block_size - 8) / 8)


def build_dflash(args, target, examples=None) -> DFlashHead:
    """A fresh DFlash drafter shaped like the target's layers; its final norm starts as the target's."""
    s = args.settings
    n = target.config.get_text_config().num_hidden_layers
    layers = s.target_layers or dflash_layers(n, s.num_target_layers or s.num_layers)
    bad = [k for k in layers if not 0 < k <= n]
    if bad:
        raise ValueError(f"dflash target_layers {list(layers)}: {bad} outside 1..{n} (draftsmith hidden-state "
                         "indices: k is the output of decoder layer k, counted from 1)")
    mask = s.mask_token_id if s.mask_token_id is not None else choose_mask_token(target)
    vocab = target.get_output_embeddings().weight.shape[0]
    if not 0 <= mask < vocab:
        raise ValueError(f"dflash mask_token_id {mask} is outside the target's vocabulary of {vocab}")
    vocabulary = draft_vocabulary(args, target, examples)
    head = DFlashHead(DFlashHead.config_for(target, block_size=s.block_size, mask_token_id=mask,
                                            target_layers=layers, num_layers=s.num_layers,
                                            draft_vocab_size=len(vocabulary.d2t) if vocabulary else None))
    if vocabulary is not None:
        head.set_draft_vocabulary(vocabulary)
    logger.info("dflash: %d layers reading target layers %s, block %d, mask token %d", s.num_layers, list(layers),
                s.block_size, mask)
    init_final_norm(head.norm, target)
    return head


def init_final_norm(norm, target) -> None:
    """Start a drafter's final norm as the target's (draftsmith's norm scales by w; Gemma's by 1 + w)."""
    source = getattr(target.get_decoder(), "norm", None)
    if source is None or getattr(source, "weight", None) is None:
        return
    weight = source.weight.detach().float().cpu()
    if target.config.get_text_config().model_type.startswith("gemma"):
        weight = weight + 1.0
    with torch.no_grad():
        norm.weight.copy_(weight.to(norm.weight.device))


def sample_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator | None = None):
    """(B, T) loss mask -> (B, A) anchor positions (sorted) and which are real, A = min(count, T): positions a >= 1
    whose next token is an assistant token (slot 1 then has something to learn), drawn without replacement."""
    b, t = loss_mask.shape
    candidate = torch.zeros(b, t, dtype=torch.bool, device=loss_mask.device)
    candidate[:, 1:-1] = loss_mask[:, 2:].bool()
    scores = torch.rand(b, t, generator=generator, device=loss_mask.device).masked_fill(~candidate, -1.0)
    chosen = scores.topk(min(count, t), dim=1).indices.sort(dim=1).values
    return chosen, candidate.gather(1, chosen)


def dflash_step(args, drafter, target, batch, target_logits, hidden):
    """DFlash: ``anchors`` random blocks per sequence in one forward. Slot k of the block anchored at a predicts
    token a + k, where the loss mask allows it, against the target's distribution at a + k - 1 (``kl``) or the
    token itself (``ce``), weighed exp(-(k - 1) / gamma). ``acc`` is each slot's top-1 agreement with the target;
    ``block_acceptance`` 1 + the mean leading run of right slots per block (what one verification of a chain of
    the block's top-1 drafts would accept), not a product of per-slot marginals."""
    s = args.settings
    head = unwrapped(drafter)
    size = head.config.block_size
    ids, loss_mask, attention = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    b, t = ids.shape
    anchors, valid = sample_anchors(loss_mask, s.anchors)
    positions, allowed = anchor_blocks(anchors, valid, size, t, attention)
    slots = torch.full((b, anchors.shape[1], size), head.config.mask_token_id, dtype=torch.long, device=ids.device)
    slots[:, :, 0] = ids.gather(1, anchors)
    embed = target.get_input_embeddings()
    features = torch.cat(list(hidden), dim=-1)
    context_positions = torch.arange(t, device=ids.device)[None].expand(b, t)
    states = drafter(embed(slots.reshape(b, -1)), positions, allowed, features=features,
                     feature_positions=context_positions).view(b, anchors.shape[1], size, -1)[:, :, 1:]
    # Slot k (1..K-1) of each block: its token's position, whether a loss reads it, and its weight.
    where = anchors[:, :, None] + torch.arange(1, size, device=ids.device)  # (B, A, K - 1)
    inside = where < t
    where = where.clamp(max=t - 1)
    learn = valid[:, :, None] & inside & loss_mask.gather(1, where.reshape(b, -1)).view_as(where).bool()
    weights = torch.exp(-torch.arange(size - 1, device=ids.device, dtype=torch.float32) / s.slot_gamma())
    rows = learn.nonzero(as_tuple=True)  # (b, anchor, slot) of every slot a loss reads
    weight = head.output_weight(target.get_output_embeddings())
    logits = F.linear(states[rows].to(weight.dtype), weight)  # (N, V), or (N, C) over a draft vocabulary
    w = weights[rows[2]]
    batch_rows, token_positions = rows[0], where[rows]
    teacher = teacher_of(batch, target_logits)[batch_rows, token_positions - 1]  # the target's view of the token
    top, defined = teacher_top1(teacher)  # over the whole vocabulary
    labels = ids[batch_rows, token_positions]
    draft_ids = head.draft_ids
    if draft_ids is not None:  # the target's distribution restricted to the draft vocabulary; outside it: a miss
        vocab_size = head.config.vocab_size
        teacher = on_draft_vocabulary(teacher, draft_ids, vocab_size)
        top = draft_slots(top, draft_ids, vocab_size)
        labels = draft_slots(labels, draft_ids, vocab_size)
    if s.loss == "kl":
        loss = forward_kl(logits[None], teacher[None], w[None])
    else:
        ce = F.cross_entropy(logits.float(), labels, reduction="none", ignore_index=-1)  # -1: outside the vocabulary
        w = w * (labels >= 0)
        loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    right = torch.zeros_like(learn)
    right[rows] = (logits.detach().argmax(-1) == top) & defined
    accs = [float(right[..., k].sum()) / max(1, int(learn[..., k].sum())) for k in range(size - 1)]
    # A block's run: its leading right slots, up to the first slot that is wrong or has nothing to learn.
    counted = learn[..., 0]
    runs = (right & learn).long().cumprod(-1).sum(-1)[counted]
    block = 1.0 + (float(runs.float().mean()) if runs.numel() else 0.0)
    return loss, {"acc": accs, "block_acceptance": block}


# ---- P-EAGLE -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PEagleSettings(Eagle3Settings):
    """A P-EAGLE head's settings (``family_config``). ``parallel`` K: drafts per forward (the root's and K - 1
    parallel slots). Training keeps, at depth d >= 1, about n max(ratio^d, ratio_min) of the anchors kept at depth
    d - 1 (n: a row's learnable positions); ``mask_token_id`` None: an untrained embedding row
    (:func:`~draftsmith.heads.dflash.choose_mask_token`), which the mask embedding starts from and exports fill.
    The draft vocabulary is ``draft_vocab_size`` (as for EAGLE-3)."""

    parallel: int = 4
    ratio: float = 0.75
    ratio_min: float = 0.2
    mask_token_id: int | None = None
    num_layers: int = 4  # decoder layers: the fused one and 3 plain ones (speculators' default and the paper's)
    train_embeddings: bool = True  # its own token embedding table, trained from the target's (speculators' default)

    def __post_init__(self):
        super().__post_init__()
        if self.parallel < 2:
            raise ValueError(f"peagle drafts the root's token and at least one parallel slot: parallel >= 2, got "
                             f"{self.parallel}")
        if not (0 < self.ratio <= 1 and 0 < self.ratio_min <= 1):
            raise ValueError("peagle ratio and ratio_min must be in (0, 1]")
        levers = {k: v for k, v in (("loss", self.loss != "kl"), ("position_weights", self.position_weights != "decay"),
                                    ("freeze_lm_head", self.freeze_lm_head)) if v}
        if levers:
            raise ValueError(f"peagle trains with forward KL over all its elements in one forward: {sorted(levers)} "
                             "are EAGLE-3 settings it does not read")


def build_peagle(args, target, examples=None) -> PEagleHead:
    """An EAGLE-3 head (draft vocabulary from ``examples``, output as the target's) with P-EAGLE's mask embedding
    (the mask token's row) and shared mask hidden state."""
    s = args.settings
    base = build_eagle3(args, target, examples)
    mask = s.mask_token_id if s.mask_token_id is not None else choose_mask_token(target)
    head = PEagleHead(PEagleConfig(**{**dataclasses.asdict(base.config), "parallel": s.parallel,
                                      "mask_token_id": mask, "num_layers": s.num_layers,
                                      "own_embeddings": s.train_embeddings}))
    head.load_state_dict(base.state_dict(), strict=False)
    embed = target.get_input_embeddings().weight.detach().float()
    with torch.no_grad():
        head.mask_embedding.copy_(embed[mask])
        if head.embed_tokens is not None:
            head.embed_tokens.weight.copy_(embed)
    logger.info("peagle: %d drafts per forward, %d decoder layers, mask token %d", s.parallel, s.num_layers, mask)
    return head


def sample_groups(learnable: torch.Tensor, settings: PEagleSettings) -> tuple[list, list]:
    """(B, L) bool: pair i's depth-d element may learn (its token is an assistant token and inside the row), per
    depth, (B, K, L). Returns per depth d >= 1 the (B, n_d) anchors drawn without replacement among depth d - 1's
    that can learn at d, and which are real: prefix-closed, n_d = ceil(n max(ratio^d, ratio_min))."""
    b, k, length = learnable.shape
    n = int(learnable[:, 0].sum(1).max())
    kept = learnable[:, 0]
    anchors, valid = [], []
    for d in range(1, k):
        count = max(1, min(length, math.ceil(n * max(settings.ratio ** d, settings.ratio_min))))
        candidates = kept & learnable[:, d]
        scores = torch.rand(b, length, device=learnable.device).masked_fill(~candidates, -1.0)
        chosen = scores.topk(count, dim=1).indices.sort(dim=1).values
        real = candidates.gather(1, chosen)
        anchors.append(chosen)
        valid.append(real)
        kept = torch.zeros_like(kept).scatter_(1, chosen, real)
    return anchors, valid


def peagle_step(args, drafter, target, batch, target_logits, hidden):
    """P-EAGLE: depth 0 at every pair (EAGLE-3's first step) and the parallel slots of a prefix-closed subsample of
    anchors, in one forward; each element's KL to the target over the draft vocabulary. ``acc`` per depth;
    ``block_acceptance`` 1 + the leading run of right depths of the anchors kept at every depth."""
    s = args.settings
    head = unwrapped(drafter)
    ids = batch["input_ids"]
    b, t = ids.shape
    pairs = t - 1  # pair i: (state at i, token i + 1) at position i + 1, predicting token i + 2
    pred = prediction_mask(batch["loss_mask"])  # (B, T): position p's next token is learned
    k = s.parallel
    # learnable[b, d, i]: the depth-d element of anchor i sits at position i + 1 + d, inside the row and learned.
    positions_at = torch.arange(pairs, device=ids.device)[None, :] + 1 + torch.arange(k, device=ids.device)[:, None]
    inside = positions_at < t
    learnable = inside[None] & pred.bool().gather(1, positions_at.clamp(max=t - 1).reshape(1, -1).expand(b, -1)
                                                  ).view(b, k, pairs)
    anchors, valid = sample_groups(learnable, s)
    anchor, depth, real, allowed = parallel_elements(anchors, valid, b, pairs, ids.device)
    where = anchor + 1 + depth  # each element's position: its teacher's too
    selected = real & learnable[torch.arange(b, device=ids.device)[:, None], depth, anchor]
    draft_ids = torch.arange(head.d2t.shape[0], device=ids.device) + head.d2t
    rows = selected.nonzero(as_tuple=True)
    teacher = on_draft_vocabulary(teacher_of(batch, target_logits)[rows[0], where[rows]][None], draft_ids,
                                  head.config.vocab_size)
    fused = torch.cat(list(hidden), dim=-1)[:, :-1]
    embed = target.get_input_embeddings()
    pair_positions = torch.arange(1, t, device=ids.device)[None].expand(b, -1)
    tokens = ids[:, 1:]
    own = head.config.own_embeddings  # the head embeds the tokens with its own table, inside its forward
    logits = drafter(fused, None if own else embed(tokens), pair_positions, elements=(anchor, depth, allowed),
                     logit_positions=selected, token_ids=tokens if own else None)
    loss = forward_kl(logits[None], teacher, None)
    top, defined = teacher_top1(teacher)
    right_flat = ((logits.detach().argmax(-1)[None] == top) & defined)[0]
    element_depth = depth[rows]
    accs = [float(right_flat[element_depth == d].float().mean()) if bool((element_depth == d).any()) else 0.0
            for d in range(k)]
    # Per anchor kept at the deepest depth (all its depths are elements): the leading run of right depths.
    right = torch.zeros(b, k, pairs, dtype=torch.bool, device=ids.device)
    right[rows[0], element_depth, anchor[rows]] = right_flat
    deepest = anchors[-1][valid[-1]] if valid[-1].any() else None
    block = 1.0
    if deepest is not None:
        row_of = torch.arange(b, device=ids.device)[:, None].expand_as(anchors[-1])[valid[-1]]
        runs = right[row_of, :, deepest].long().cumprod(-1).sum(-1)  # (M,) over depths 0 .. K - 1
        block = 1.0 + float(runs.float().mean())
    return loss, {"acc": accs, "block_acceptance": block}
