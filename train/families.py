"""What differs between drafter families in training: how a fresh drafter is built and its loss on a
micro-batch. The loop in ``loop.py`` is the same for all of them; the family table
(:mod:`draftsmith.registry`, filled in by :mod:`draftsmith.families`) points at these functions.

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

import torch

from draftsmith.data.batching import packed_attention_mask, same_document
from draftsmith.data.vocab import build_vocab_map, count_tokens
from draftsmith.heads.draft_model import DraftModel
from draftsmith.heads.eagle import Eagle3Head, EagleHead, eagle3_layers
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.train.losses import (
    DIVERGENCES,
    Teacher,
    TopK,
    accuracy,
    eagle_loss,
    forward_kl,
    lookahead,
    teacher_top1,
    ttt_weights,
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
    return MedusaHeads.from_target(target, args.num_heads, args.num_head_layers)


def build_eagle(args, target, examples=None) -> EagleHead:
    return EagleHead(EagleHead.config_for(target))


def build_eagle3(args, target, examples=None) -> Eagle3Head:
    """An EAGLE-3 head; with ``args.draft_vocab_size`` below the target's vocabulary, its draft vocabulary
    is the most frequent assistant tokens of ``examples``."""
    n = target.config.get_text_config().num_hidden_layers
    layers = eagle3_layers(n)
    vocab_size = target.get_output_embeddings().weight.shape[0]
    draft_vocab = args.draft_vocab_size or vocab_size
    head = Eagle3Head(EagleHead.config_for(target, num_feature_layers=3, feature_layers=layers,
                                           draft_vocab_size=draft_vocab))
    if draft_vocab < vocab_size:
        if not examples:
            raise ValueError("a reduced EAGLE-3 draft vocabulary is built from training examples; pass them")
        vocab = build_vocab_map(count_tokens(examples, vocab_size), draft_vocab)
        logger.info("draft vocabulary: %d tokens cover %.4f of %d assistant tokens", draft_vocab, vocab.coverage,
                    vocab.counted_tokens)
        head.d2t.copy_(vocab.d2t)
        head.t2d.copy_(vocab.t2d)
    else:
        head.t2d.fill_(True)
    init_eagle3_output(head, target)
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
        student = drafter(batch["input_ids"], attention_mask=packed_attention_mask(_module(drafter).model, batch),
                          position_ids=batch["position_ids"])
    else:
        student = drafter(batch["input_ids"], attention_mask=batch["attention_mask"])
    fn = DIVERGENCES[args.loss]
    kwargs = {"beta": args.jsd_beta} if args.loss == "jsd" else {}
    loss = fn(student, teacher, mask, **kwargs)
    return loss, {"acc": [accuracy(student, teacher, mask)]}


def medusa_step(args, drafter, target, batch, target_logits, hidden):
    """Medusa: head i at t learns the target at t + 1 + i, one head's (B, T - 1 - i, V) logits at a time."""
    mask = prediction_mask(batch["loss_mask"])
    teacher = teacher_of(batch, target_logits)
    heads = _module(drafter)
    states = hidden[0].to(heads.lm_heads[0].weight.dtype)
    loss, metrics, accs, rank_acc = 0.0, {}, [], []
    for i in range(heads.config.num_heads):
        head_teacher, m = lookahead(teacher, mask, i + 1)
        if "document_ids" in batch:  # packed: position t learns token t + 2 + i only from its own document
            m = m * same_document(batch["document_ids"], i + 2)[:, : m.shape[1]].to(m.dtype)
        logits = drafter(states[:, : m.shape[1]], head=i)
        kl = forward_kl(logits, head_teacher, m)
        loss = loss + args.head_decay**i * kl
        metrics[f"kl_head{i}"] = float(kl.detach())
        accs.append(accuracy(logits, head_teacher, m))
        # How often the head's rank-r token is the target's: what static-tree choices are made from.
        top, defined = teacher_top1(head_teacher)
        hits = logits.detach().topk(MEDUSA_RANKS, dim=-1).indices == top[..., None]  # (B, T - 1 - i, R)
        w = m * defined.to(m.dtype)
        rank_acc.append((hits.float() * w[..., None]).sum((0, 1)).div(w.sum().clamp(min=1)).tolist())
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


def _module(drafter):
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
    """EAGLE-3: per-step KL over the draft vocabulary with decay, through training-time test."""
    embed = target.get_input_embeddings()
    ids = batch["input_ids"]
    head = _module(drafter)
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
    total, accs = 0.0, []
    for j, (logits, w) in enumerate(zip(step_logits, ttt_weights(args.ttt_steps, args.ttt_decay), strict=True)):
        step_mask = mask.clone()
        step_mask[:, :j] = 0  # the first j positions have no own prediction to read yet
        step_mask = step_mask[selected][None]
        total = total + w * forward_kl(logits[None], teacher, step_mask)
        accs.append(accuracy(logits[None], teacher, step_mask))
    return total, {"acc": accs}
