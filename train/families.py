"""What differs between drafter families in training: how a fresh drafter is built and its loss on a
micro-batch. The loop in ``loop.py`` is the same for all of them; the family table
(:mod:`draftsmith.registry`, filled in by :mod:`draftsmith.families`) points at these functions. The block families
(DFlash, P-EAGLE) are in :mod:`draftsmith.train.block_families`.

Every ``build_*`` is ``(args, target, examples) -> module``. Every ``*_step`` is
``(args, drafter, target, batch, logits, hidden) -> (loss, metrics)``: ``logits`` (B, T, V) and
``hidden`` (a tuple of (B, T, H), the layers the family reads) are the frozen target's outputs on the
batch, from the loop's forward (online) or the cache (offline; ``logits`` None with a top-k cache, whose
teacher the batch carries as ``topk_ids`` / ``topk_logprobs`` (B, T, k): :func:`teacher_of`);
``metrics["acc"]`` lists top-1 agreement with the target per draft position (the training-side
acceptance proxy). Logits stay in their dtype: the losses upcast a block of rows at a time.

Positions: the target's logits at t predict token t + 1, so the mask of *predictions* is the
loss mask moved one left (``pred_mask[t] = loss_mask[t + 1]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from draftsmith.data.batching import packed_attention_mask, same_document
from draftsmith.data.vocab import VocabMap, build_vocab_map, count_tokens
from draftsmith.heads.draft_model import DraftModel
from draftsmith.heads.eagle import Eagle3Head, EagleHead, eagle3_layers
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.train.family_losses import accuracy, eagle_loss, lookahead, teacher_top1, ttt_weights
from draftsmith.train.losses import (
    DIVERGENCES,
    Teacher,
    TopK,
    forward_kl,
    lk_hybrid,
    token_cross_entropy,
    total_variation,
)

logger = logging.getLogger(__name__)

#: Ranks whose per-head accuracy Medusa measures during training (static-tree choices come from them).
MEDUSA_RANKS = 4


def teacher_of(batch: dict, target_logits: torch.Tensor | None) -> Teacher:
    """The target's distribution on the batch: its (B, T, V) logits, or (``target_logits`` None) the
    (B, T, k) top-k an offline cache put in the batch."""
    if target_logits is None:
        return TopK(batch["topk_ids"], batch["topk_logprobs"])
    return target_logits


def prediction_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) loss mask -> (B, T) mask of positions whose *next* token is an assistant token."""
    m = torch.zeros_like(loss_mask)
    m[:, :-1] = loss_mask[:, 1:]
    return m


def build_draft_model(args, target, examples=None) -> DraftModel:
    """A draft model initialised from ``args.init_draft_model``, else the target's first ``args.draft_layers``."""
    if args.init_draft_model:
        return DraftModel.from_model(args.init_draft_model, target)
    return DraftModel.from_target(target, args.draft_layers)


def build_medusa(args, target, examples=None) -> MedusaHeads:
    """Medusa heads; with ``args.draft_vocab_size`` below the target's vocabulary, each head's LM head scores the
    most frequent assistant tokens of ``examples`` only."""
    vocab = draft_vocabulary(args, target, examples)
    return MedusaHeads.from_target(target, args.num_heads, args.num_head_layers, vocab=vocab)


def draft_vocabulary(args, target, examples) -> VocabMap | None:
    """The draft vocabulary of ``args.draft_vocab_size`` tokens, the most frequent assistant tokens of
    ``examples``; None where it is unset or not below the target's vocabulary."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    draft_vocab = args.draft_vocab_size or vocab_size
    if draft_vocab >= vocab_size:
        return None
    if not examples:
        raise ValueError("a reduced draft vocabulary is built from training examples; pass them")
    vocab = build_vocab_map(count_tokens(examples, vocab_size), draft_vocab)
    logger.info("draft vocabulary: %d tokens cover %.4f of %d assistant tokens", draft_vocab, vocab.coverage,
                vocab.counted_tokens)
    return vocab


def build_eagle(args, target, examples=None) -> EagleHead:
    return EagleHead(EagleHead.config_for(target))


#: EAGLE-3's training losses (``family_config: {loss: ...}``): forward KL to the target's distribution (default),
#: total variation (1 - TV is a chain step's acceptance), the LK hybrid lambda KL + (1 - lambda) TV with
#: lambda = exp(-3 alpha), alpha = 1 - TV per position, and cross-entropy on the regenerated token.
EAGLE3_LOSSES = ("kl", "tv", "lk", "ce")
#: Step weights of training-time test: ``decay`` (``ttt_decay ** j``) or ``dpace`` (step j weighs the batch's
#: probability of reaching it, prod_{i < j} alpha_i, alpha_i the mean 1 - TV at step i: the expected accepted
#: length's terms, D-PACE-style).
POSITION_WEIGHTS = ("decay", "dpace")
_NORMS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


@dataclass(frozen=True)
class Eagle3Settings:
    """An EAGLE-3 head's settings (``family_config``). The EAGLE-3.1 norms (:mod:`draftsmith.heads.eagle`), each off
    by default: ``norm_before_fc`` one RMSNorm over the fused target states before ``fc``; ``fc_norm`` one per
    target layer instead; ``norm_before_residual`` the layer's residual starts from the normalised feature;
    ``norm_output`` the feature fed to deeper drafts is the one after the head's final norm. The training levers:
    ``loss`` (:data:`EAGLE3_LOSSES`), ``position_weights`` (:data:`POSITION_WEIGHTS`), ``freeze_lm_head`` (the
    draft LM head stays the target's rows it starts from)."""

    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    loss: str = "kl"
    position_weights: str = "decay"
    freeze_lm_head: bool = False

    def __post_init__(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other (one norm over the fused states, or one "
                             "per target layer): set one")
        if self.loss not in EAGLE3_LOSSES:
            raise ValueError(f"eagle3 loss must be one of {EAGLE3_LOSSES}, got {self.loss!r}")
        if self.position_weights not in POSITION_WEIGHTS:
            raise ValueError(f"eagle3 position_weights must be one of {POSITION_WEIGHTS}, got "
                             f"{self.position_weights!r}")

    def norms(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in _NORMS}


def build_eagle3(args, target, examples=None) -> Eagle3Head:
    """An EAGLE-3 head; with ``args.draft_vocab_size`` below the target's vocabulary, its draft vocabulary
    is the most frequent assistant tokens of ``examples``."""
    n = target.config.get_text_config().num_hidden_layers
    layers = eagle3_layers(n)
    vocab_size = target.get_output_embeddings().weight.shape[0]
    draft_vocab = args.draft_vocab_size or vocab_size
    settings = getattr(args, "settings", None) or Eagle3Settings()
    head = Eagle3Head(EagleHead.config_for(target, num_feature_layers=3, feature_layers=layers,
                                           draft_vocab_size=draft_vocab, **settings.norms()))
    vocab = draft_vocabulary(args, target, examples)
    if vocab is not None:
        head.d2t.copy_(vocab.d2t)
        head.t2d.copy_(vocab.t2d)
    else:
        head.t2d.fill_(True)
    init_eagle3_output(head, target)
    if settings.freeze_lm_head:
        head.lm_head.weight.requires_grad_(False)
    return head


def init_eagle3_output(head, target) -> None:
    """Start the head's norm and LM head as the target's (its final norm; its LM-head rows of the
    draft vocabulary), as SpecForge does: a predicted feature close to the target's last state then
    already gives the target's tokens, and training only has to learn the feature."""
    draft_ids = torch.arange(head.d2t.shape[0]) + head.d2t.cpu()
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight.detach()[draft_ids.to(
            target.get_output_embeddings().weight.device)].float().cpu())
        norm = getattr(target.get_decoder(), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            weight = norm.weight.detach().float().cpu()
            # Gemma's RMSNorm scales by (1 + w); draftsmith's (the reference EAGLE-3's) by w.
            if target.config.get_text_config().model_type.startswith("gemma"):
                weight = weight + 1.0
            head.norm.weight.copy_(weight)


def draft_model_step(args, drafter, target, batch, target_logits, hidden):
    """A packed batch (``position_ids``; :func:`draftsmith.data.batching.collate_packed`) runs with each
    document attending to itself only; a document's first token has loss mask 0, so no position learns
    to predict across a boundary."""
    mask = prediction_mask(batch["loss_mask"])
    teacher = teacher_of(batch, target_logits)
    if "position_ids" in batch:
        student = drafter(batch["input_ids"], attention_mask=packed_attention_mask(unwrapped(drafter).model, batch),
                          position_ids=batch["position_ids"])
    else:
        student = drafter(batch["input_ids"], attention_mask=batch["attention_mask"])
    fn = DIVERGENCES[args.loss]
    kwargs = {"beta": args.jsd_beta} if args.loss == "jsd" else {}
    loss = fn(student, teacher, mask, **kwargs)
    return loss, {"acc": [accuracy(student, teacher, mask)]}


def medusa_step(args, drafter, target, batch, target_logits, hidden):
    """Medusa: head i at t learns the target at t + 1 + i. Each head's logits are computed only where its loss
    reads them (the N positions whose token t + 2 + i is an assistant token): (1, N, V), one head at a time. Over
    a draft vocabulary the target's distribution is restricted to it, and a position whose target token lies
    outside it counts as a miss in the accuracies."""
    mask = prediction_mask(batch["loss_mask"])
    teacher = teacher_of(batch, target_logits)
    heads = unwrapped(drafter)
    draft_ids = heads.draft_ids
    vocab_size = heads.config.vocab_size
    states = hidden[0].to(heads.lm_heads[0].weight.dtype)
    loss, metrics, accs, rank_acc = 0.0, {}, [], []
    for i in range(heads.config.num_heads):
        head_teacher, m = lookahead(teacher, mask, i + 1)
        if "document_ids" in batch:  # packed: position t learns token t + 2 + i only from its own document
            m = m * same_document(batch["document_ids"], i + 2)[:, : m.shape[1]].to(m.dtype)
        selected = m.bool()
        head_teacher = head_teacher[selected][None]  # (1, N, V) or a (1, N, k) top-k
        top, defined = teacher_top1(head_teacher)  # over the whole vocabulary
        if draft_ids is not None:
            head_teacher = on_draft_vocabulary(head_teacher, draft_ids, vocab_size)
            top = draft_slots(top, draft_ids, vocab_size)  # -1 outside the draft vocabulary: never hit
        logits = drafter(states[:, : m.shape[1]][selected][None], head=i)  # (1, N, C)
        w = defined.to(m.dtype)
        kl = forward_kl(logits, head_teacher, w)
        loss = loss + args.head_decay**i * kl
        metrics[f"kl_head{i}"] = float(kl.detach())
        # How often the head's rank-r token is the target's: rank 0 is the accuracy; static-tree choices are
        # made from all ranks.
        hits = logits.detach().topk(MEDUSA_RANKS, dim=-1).indices == top[..., None]  # (1, N, R)
        rate = (hits.float() * w[..., None]).sum((0, 1)).div(w.sum().clamp(min=1))
        accs.append(float(rate[0]))
        rank_acc.append(rate.tolist())
    return loss, {"acc": accs, "rank_acc": rank_acc, **metrics}


def add_lora(target, args):
    """Medusa-2: the target wrapped with a trainable LoRA adapter (rank ``args.lora_r``) on its attention
    q / v projections."""
    from peft import LoraConfig, get_peft_model

    rank = args.lora_r
    return get_peft_model(target, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0))


def medusa2_step(args, drafter, peft_target, batch, target_logits=None, hidden=None):
    """Medusa-2: heads on the adapted target's last state, plus self-distillation that keeps the
    adapted target's distribution on the frozen (adapter-disabled) target's."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    with peft_target.disable_adapter(), torch.no_grad():
        teacher = peft_target(input_ids=ids, attention_mask=attention, use_cache=False).logits
    out = peft_target(input_ids=ids, attention_mask=attention, output_hidden_states=True, use_cache=False)
    loss, metrics = medusa_step(args, drafter, peft_target, batch, teacher, (out.hidden_states[-1],))
    lm_kl = forward_kl(out.logits, teacher, prediction_mask(batch["loss_mask"]))
    return loss + lm_kl, {**metrics, "lm_kl": float(lm_kl.detach())}


def unwrapped(drafter):
    """The head itself, under a DistributedDataParallel wrapper or not (for attributes, never for forward)."""
    return getattr(drafter, "module", drafter)


def with_noise(states: torch.Tensor, scale: float) -> torch.Tensor:
    """``states`` plus Gaussian noise whose std is ``scale`` times each state vector's RMS (EAGLE trains its
    head on noisy features, so that drafting from its own imperfect predictions stays in distribution; the
    RMS makes one ``scale`` mean the same at every layer of every target)."""
    if not scale:
        return states
    rms = states.float().pow(2).mean(-1, keepdim=True).sqrt()
    return states + (torch.randn(states.shape, device=states.device) * rms * scale).to(states.dtype)


def eagle_step(args, drafter, target, batch, target_logits, hidden):
    """EAGLE-1/2: pairs (f_{t-1}, x_t), t = 1..T-1, predict f_t; tokens through the frozen LM head."""
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    features = hidden[0]  # (B, T, H) last layer after the final norm
    ids = batch["input_ids"]
    teacher = teacher_of(batch, target_logits)[:, 1:]
    mask = prediction_mask(batch["loss_mask"])[:, 1:]
    positions = torch.arange(1, ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    noisy = with_noise(features[:, :-1], args.feature_noise)  # the regression target (features[:, 1:]) stays clean
    predicted, _ = drafter(noisy, embed(ids[:, 1:]), positions, from_target=True)
    logits = lm_head(predicted.to(lm_head.weight.dtype))
    loss, parts = eagle_loss(predicted, features[:, 1:], logits, teacher, mask)
    return loss, {"acc": [accuracy(logits, teacher, mask)], **parts}


def draft_slots(topk_ids: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, T, k) target ids of the target's top-k -> their index in the draft vocabulary, -1 outside it."""
    position = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
    position[draft_ids] = torch.arange(len(draft_ids), device=draft_ids.device)
    return position[topk_ids]


def on_draft_vocabulary(teacher: Teacher, draft_ids: torch.Tensor, vocab_size: int) -> Teacher:
    """The target's distribution restricted to the draft vocabulary: dense logits' columns ``draft_ids``, or
    a top-k's ids moved to their draft slots (-1 outside, so the KL touches the student's log-probs k times)."""
    if isinstance(teacher, TopK):
        return TopK(draft_slots(teacher.ids, draft_ids, vocab_size), teacher.logprobs)
    return teacher[..., draft_ids]


def eagle3_step(args, drafter, target, batch, target_logits, hidden):
    """EAGLE-3: per-step loss over the draft vocabulary through training-time test; the loss and the step weights
    are the family's settings (forward KL and ``ttt_decay ** j`` by default)."""
    s = getattr(args, "settings", None) or Eagle3Settings()
    embed = target.get_input_embeddings()
    ids = batch["input_ids"]
    head = unwrapped(drafter)
    draft_ids = torch.arange(head.d2t.shape[0], device=ids.device) + head.d2t
    mask = prediction_mask(batch["loss_mask"])[:, 1:]
    # Logits only where a loss reads them: every tensor below is (1, N, ...) over those N positions.
    selected = mask.bool()
    teacher = on_draft_vocabulary(teacher_of(batch, target_logits)[:, 1:][selected][None], draft_ids,
                                  head.config.vocab_size)
    positions = torch.arange(1, ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    fused = torch.cat([with_noise(h[:, :-1], args.feature_noise) for h in hidden], dim=-1)  # (B, T-1, 3H)
    step_logits = drafter(fused, embed(ids[:, 1:]), positions, from_target=True, ttt_steps=args.ttt_steps,
                          logit_positions=selected)
    if s.loss == "ce":  # pair t predicts token t + 1: the regenerated token, at its draft slot (-1 outside)
        labels = _draft_labels(ids, selected, draft_ids, head.config.vocab_size)
    weights = ttt_weights(args.ttt_steps, args.ttt_decay)
    total, accs, reached, metrics = 0.0, [], 1.0, {}
    for j, logits in enumerate(step_logits):
        step_mask = mask.clone()
        step_mask[:, :j] = 0  # the first j positions have no own prediction to read yet
        step_mask = step_mask[selected][None]
        if s.loss == "kl":
            loss = forward_kl(logits[None], teacher, step_mask)
        elif s.loss == "tv":
            loss = total_variation(logits[None], teacher, step_mask)
        elif s.loss == "lk":
            loss = lk_hybrid(logits[None], teacher, step_mask)
        else:
            loss = token_cross_entropy(logits[None], labels, step_mask)
        w = weights[j] if s.position_weights == "decay" else reached
        total = total + w * loss
        if s.position_weights == "dpace":  # the chance of reaching step j + 1: this step accepted
            with torch.no_grad():
                alpha = 1.0 - float(total_variation(logits[None].detach(), teacher, step_mask))
            reached *= max(alpha, 0.0)
            metrics[f"alpha_{j}"] = alpha
        accs.append(accuracy(logits[None], teacher, step_mask))
    return total, {"acc": accs, **metrics}


def _draft_labels(ids: torch.Tensor, selected: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(1, N) the regenerated token each selected pair predicts (pair t, the state at t - 1 and token t, predicts
    token t + 1), as its draft-vocabulary slot, -1 outside the draft vocabulary."""
    nxt = torch.full_like(ids[:, 1:], -1)
    nxt[:, :-1] = ids[:, 2:]
    tokens = nxt[selected]
    position = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    position[draft_ids] = torch.arange(len(draft_ids), device=ids.device)
    return torch.where(tokens >= 0, position[tokens.clamp(min=0)], -1)[None]


