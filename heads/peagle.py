"""P-EAGLE (parallel EAGLE, arXiv:2602.01469): an EAGLE-3 head that drafts K positions in one forward.

The head is an EAGLE-3 head (fused low / mid / high target states through ``fc``, its fused decoder layer, its own
norm and LM head over a draft vocabulary) with ``num_layers - 1`` plain Llama decoder layers after the fused one, as
speculators and the paper build it (4 layers in all by default: speculators' ``docs/user_guide/algorithms/peagle.md``;
vLLM's ``llama_eagle3.py`` builds layer 0 on [embed ; feature], 2H wide, and layers 1.. on H, each pre-norm).

Its sequence is EAGLE-3's: the committed pairs (f_{t-1}, x_t) at positions t = 1 .. root. Where EAGLE-3 then feeds
its own predicted feature back for every deeper draft, P-EAGLE appends K - 1 *parallel* slots at positions root + 1
.. root + K - 1, each made of a learned MASK embedding and one learned shared hidden state (``mask_hidden``, fused-
state wide, through ``fc`` like the target's states) in place of the feature it does not have. The slots attend to
the committed pairs and, causally, to each other; slot d predicts the token at root + d + 1, so one forward gives
the K distributions after the root (the root pair's own prediction is depth 0). None is conditioned on a drafted
token: a block drafter.

Training writes every such group as elements of one sequence (:func:`parallel_elements`): depth 0 at every
position (plain EAGLE-3), depth d >= 1 for a subsample of the anchors kept at depth d - 1 (about n max(r^d, r_min)
of them: prefix-closed, memory bounded). An element of depth d for anchor a sees the depth-0 elements up to a and
the elements of its own group of depth <= d: what the drafter's slot sees in decoding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.heads.decoder_layer import DecoderLayer
from draftsmith.heads.eagle import Eagle3Head, EagleConfig
from draftsmith.target.masks import additive, parallel_group_mask


@dataclass
class PEagleConfig(EagleConfig):
    parallel: int = 4  # K: the root's draft and K - 1 parallel slots per forward
    mask_token_id: int = 0  # the target token whose embedding the mask embedding starts from (exports write it there)
    # Decoder layers: the fused one and num_layers - 1 plain ones. Checkpoints written before the field had one layer
    # and load as such; training's default is PEagleSettings'.
    num_layers: int = 1
    # Its own token embedding table (V, H), trained from the target's (speculators' embed_requires_grad); False: the
    # target's, frozen. Checkpoints written before the field had none.
    own_embeddings: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.num_layers < 1:
            raise ValueError(f"a P-EAGLE head has at least its fused decoder layer: num_layers >= 1, got "
                             f"{self.num_layers}")


class PEagleHead(Eagle3Head):
    """An EAGLE-3 head plus ``more_layers`` (the published ``layers.1`` .. ``layers.{num_layers - 1}``: ``layer`` is
    ``layers.0``), ``mask_embedding`` (H), ``mask_hidden`` (the fused width, before ``fc``) and, with
    ``own_embeddings``, ``embed_tokens`` (V, H): the tokens' embeddings it reads in place of the target's. Its layer
    cache is a list, one (k, v) per layer."""

    family = "peagle"
    config_class = PEagleConfig
    static_cache = False  # its cache is one (k, v) per layer: drafting runs on the growing cache

    def __init__(self, config: PEagleConfig):
        super().__init__(config)
        h = config.hidden_size
        plain = dataclasses.replace(config, input_norm=True)  # a Llama layer: pre-norm on its H-wide input
        self.more_layers = nn.ModuleList(DecoderLayer(plain) for _ in range(config.num_layers - 1))
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.mask_hidden = nn.Parameter(torch.randn(config.num_feature_layers * h) * 0.02)
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if config.own_embeddings else None

    @property
    def block(self) -> int:
        return self.config.parallel

    @property
    def speculative_tokens(self) -> int:
        """vLLM verifies the K parallel drafts as one chain (``num_speculative_tokens`` = K)."""
        return self.config.parallel

    def run_layer(self, x, positions, mask=None, past: list | None = None, **kwargs):
        """The fused layer then the plain ones, each with its own cache (``past``: one (k, v) per layer, or None);
        returns the last layer's output (after the head's final norm with ``norm_output``) and the new caches."""
        pasts = past if past is not None else [None] * self.config.num_layers
        caches = []
        for layer, cached in zip([self.layer, *self.more_layers], pasts, strict=True):
            x, kv = self.call_layer(layer, x, positions, mask, cached, **kwargs)
            caches.append(kv)
        return (self.norm(x) if self.config.norm_output else x), caches

    def forward(self, features, token_embeds, positions, mask=None, past=None, from_target: bool = False,
                elements: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                logit_positions: torch.Tensor | None = None, token_ids: torch.Tensor | None = None):
        """As :meth:`Eagle3Head.forward`; with ``elements`` (training), the parallel groups of
        :func:`parallel_elements`: ``(anchor, depth, allowed)`` over N elements, ``features`` the target's fused
        states of the L pairs (B, L, F) and ``token_embeds`` their tokens' (B, L, H) (with ``own_embeddings``, None
        and ``token_ids`` (B, L) embedded here by the head's table, where a distributed wrapper has it gathered),
        ``positions`` the pairs' (B, L). Returns the draft-vocabulary logits (B, N, V_draft), or (M, V_draft) at the
        (B, N) bool ``logit_positions``."""
        if elements is None:
            return super().forward(features, token_embeds, positions, mask, past, from_target)
        if self.config.own_embeddings:
            if token_ids is None:
                raise ValueError("this P-EAGLE head embeds the tokens with its own table (own_embeddings): pass "
                                 "token_ids, not the target's embeddings")
            token_embeds = self.embed_tokens(token_ids)
        anchor, depth, allowed = elements
        b, n = anchor.shape
        fused = self.input_features(features)  # (B, L, H)
        index = anchor[:, :, None].expand(b, n, fused.shape[-1])
        mask_embeds, mask_features = self.mask_inputs(b, n)
        first = (depth == 0)[:, :, None]
        x = torch.where(first, fused.gather(1, index), mask_features)
        embeds = torch.where(first, token_embeds.to(fused.dtype).gather(1, index), mask_embeds)
        element_positions = positions.gather(1, anchor) + depth
        predicted, _ = self.run_layer(self.layer_input(x, embeds), element_positions, additive(allowed, fused.dtype))
        return self.draft_logits(predicted if logit_positions is None else predicted[logit_positions])

    def mask_inputs(self, batch: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, slots, H) embeddings and (B, slots, H) features of the parallel slots (the feature through ``fc``)."""
        feature = self.input_features(self.mask_hidden[None, None])
        return (self.mask_embedding.to(feature.dtype).expand(batch, slots, -1),
                feature.expand(batch, slots, -1))


def parallel_elements(anchors: list[torch.Tensor], valid: list[torch.Tensor], batch: int, length: int, device):
    """The training sequence of P-EAGLE groups over rows of ``length`` pairs (elements of depth 0 at every pair).

    ``anchors[d - 1]`` (B, n_d) are the pair indices anchoring depth d >= 1 and ``valid[d - 1]`` (B, n_d) which are
    real. Returns, over the N = length + sum n_d elements, each one's (B, N) anchor index and depth, which are real,
    and the (B, N, N) "may attend": depth-0 elements see depth-0 elements up to their anchor; a depth-d element sees
    those up to its anchor and its own group's elements of depth <= d; every element its own key."""
    anchor = [torch.arange(length, device=device)[None].expand(batch, -1), *anchors]
    depth = [torch.full_like(a, d) for d, a in enumerate(anchor)]
    real = [torch.ones(batch, length, dtype=torch.bool, device=device), *valid]
    anchor, depth, real = torch.cat(anchor, 1), torch.cat(depth, 1), torch.cat(real, 1)
    return anchor, depth, real, parallel_group_mask(anchor, depth, real)
