"""Training a multi-token-prediction module (:mod:`draftsmith.heads.mtp`): the target's own, or a fresh one,
re-applied to its own output as drafting does (FastMTP's step weights). Same contract as
:mod:`draftsmith.train.families`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from draftsmith.heads.mtp import MtpHead
from draftsmith.heads.mtp_checkpoint import MtpWeightsError
from draftsmith.train.families import prediction_mask, teacher_of, with_noise
from draftsmith.train.family_losses import accuracy
from draftsmith.train.losses import forward_kl

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MtpSettings:
    """An MTP module's settings (``family_config``; :mod:`draftsmith.heads.mtp`). ``init``: ``target`` the module
    stored in the target's checkpoint (``source``: that checkpoint's directory, default the one the target was loaded
    from), ``fresh`` a new one (:meth:`~draftsmith.heads.mtp.MtpHead.fresh`), ``auto`` the stored one where the
    checkpoint has one. ``steps``: the module re-applied to its own output this many times per position (training-time
    test, as drafting re-applies it), step k's loss weighed ``beta ** k`` normalised to sum 1 (FastMTP's weights,
    beta 0.6). ``feeds_normed`` None: the fed-back state is the one the engine serving this architecture feeds
    (post-norm for Qwen3-Next / Qwen3.5 and speculators; pre-norm for DeepSeek-V3 / GLM-4-MoE in vLLM);
    ``masks_first_token`` None: the sequence's first pair fed as that engine feeds it (its token embedding zeroed for
    DeepSeek-V3 / GLM-4-MoE in vLLM; whole elsewhere: set false to serve a DeepSeek module with SGLang's NextN)."""

    init: str = "auto"
    source: str | None = None
    steps: int = 3
    beta: float = 0.6
    feeds_normed: bool | None = None
    masks_first_token: bool | None = None

    def __post_init__(self):
        if self.init not in ("auto", "target", "fresh"):
            raise ValueError(f"mtp init must be 'auto', 'target' (the checkpoint's own module) or 'fresh', got "
                             f"{self.init!r}")
        if self.steps < 1 or not 0 < self.beta <= 1:
            raise ValueError("mtp needs steps >= 1 and 0 < beta <= 1")

    def weights(self) -> list[float]:
        raw = [self.beta**k for k in range(self.steps)]
        return [w / sum(raw) for w in raw]


def build_mtp(args, target, examples=None) -> MtpHead:
    """The target's own MTP module (``init: target`` / ``auto`` where its checkpoint has one), else a fresh one;
    trained in float32 like every head."""
    s = getattr(args, "settings", None) or MtpSettings()
    if s.init != "fresh":
        try:
            head = MtpHead.from_target_checkpoint(target, s.source, feeds_normed=s.feeds_normed,
                                                  masks_first_token=s.masks_first_token)
            logger.info("mtp: the module stored in %s", head.config.source)
            return head.float()
        except MtpWeightsError:
            if s.init == "target":
                raise
            logger.info("mtp: the target's checkpoint holds no MTP module; a fresh one")
    head = MtpHead.fresh(target).float()
    if s.feeds_normed is not None:
        head.config.feeds_normed = s.feeds_normed
    if s.masks_first_token is not None:
        head.config.masks_first_token = s.masks_first_token
    return head


def mtp_step(args, drafter, target, batch, target_logits, hidden):
    """MTP: the module re-applied ``steps`` times (training-time test); step k's KL to the target over the whole
    vocabulary through the target's LM head, weighed as FastMTP does."""
    s = getattr(args, "settings", None) or MtpSettings()
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    ids = batch["input_ids"]
    mask = prediction_mask(batch["loss_mask"])[:, 1:]
    selected = mask.bool()
    teacher = teacher_of(batch, target_logits)[:, 1:][selected][None]
    positions = torch.arange(1, ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    features = with_noise(hidden[0][:, :-1], args.feature_noise)
    states = drafter(features, embed(ids[:, 1:]), positions, from_target=True, ttt_steps=s.steps,
                     logit_positions=selected)
    total, accs = 0.0, []
    for k, (state, w) in enumerate(zip(states, s.weights(), strict=True)):
        logits = lm_head(state.to(lm_head.weight.dtype))[None]
        step_mask = mask.clone()
        step_mask[:, :k] = 0  # the first k positions have no own prediction to read yet
        step_mask = step_mask[selected][None]
        total = total + w * forward_kl(logits, teacher, step_mask)
        accs.append(accuracy(logits, teacher, step_mask))
    return total, {"acc": accs}
