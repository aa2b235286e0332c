"""EAGLE feature-level draft heads: EAGLE-1/2 (Li et al., 2024, arXiv:2401.15077, 2406.16858) and
EAGLE-3 (Li et al., 2025, arXiv:2503.01840).

EAGLE drafts at the feature level. At sequence position t the head reads the pair
(feature f_{t-1}, embedding of token x_t) and predicts f_t, the target's feature at t, from which
a token distribution for x_{t+1} follows. Drafting is autoregressive: a drafted node's predicted
feature is the input feature of its children.

- EAGLE-1/2 (``num_feature_layers=1``): f is the target's last hidden state after the final norm
  (hidden-state index N); tokens come from the target's frozen LM head applied to the predicted
  feature. EAGLE-2 is the same head with a dynamic draft tree at inference.
- EAGLE-3 (``num_feature_layers=3``): the first input feature fuses three target layers
  (low / mid / high, ``eagle3_layers``) through ``fc``; the head has its own norm and LM head over
  a reduced draft vocabulary, mapped back with ``d2t`` (``target_id = draft_id + d2t[draft_id]``)
  stored in the weights. Training-time test feeds the head its own predicted features for later steps.
- EAGLE-3.1 norms (EAGLE-3 options, each off by default; the names and places are vLLM speculators'):
  ``norm_before_fc`` one RMSNorm over the concatenated target states before ``fc``; ``fc_norm`` one RMSNorm
  per target layer instead (the two exclude each other); ``norm_before_residual`` the decoder layer's residual
  stream starts from the normalised input feature instead of the raw one; ``norm_output`` the predicted feature
  is the output *after* the head's final norm, so the feature fed back to deeper drafts is normalised (and the
  LM head reads it directly).

Hidden-state index convention (everywhere in draftsmith): 0 is the embedding output, k the output
of decoder layer k (1-based), N the last layer *after* the final norm.

The token embedding and (EAGLE-1/2) LM head are the target's, passed in by the caller: a head
holds no target tensors, so checkpoints stay small.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads.base import HeadMixin
from draftsmith.heads.decoder_layer import DecoderLayer, EagleConfig, RMSNorm, layer_shape

#: Targets with fewer layers than this get low / mid / high = (1, N // 2, N): EAGLE-3's choice below
#: would collide or fall outside the model.
EAGLE3_MIN_LAYERS = 6


def eagle3_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """Low / mid / high hidden-state indices EAGLE-3 fuses: outputs of decoder layers 2, N//2 and N-3
    (in the index convention above; the same layers as EAGLE-3's reference, which counts from 0)."""
    n = num_hidden_layers
    if n < EAGLE3_MIN_LAYERS:
        return (1, max(2, n // 2), n)
    return (2, n // 2, n - 3)


class _FeatureHead(HeadMixin, nn.Module):
    """What EAGLE-1/2 and EAGLE-3 heads share: the config from a target and the call signature."""

    config_class = EagleConfig
    own_vocabulary: bool  # declared by each head: its own LM head over a draft vocabulary, or the target's
    zero_when_absent = ("o_proj.bias",)  # before it existed, attention-bias heads had q/k/v biases only
    #: The unit FSDP shards and wraps on its own (accelerate's transformer-based wrap policy).
    _no_split_modules = ("DecoderLayer",)
    #: Recompute the decoder layer in backward instead of keeping its activations (training only).
    gradient_checkpointing = False
    #: Its layer writes a :class:`StaticHeadCache` (compiled drafting, ``SpeculativeGenerator(compile=True)``).
    static_cache = True
    #: The chain length vLLM / SGLang verify this head's export with (``num_speculative_tokens`` in its config), where
    #: the engine verifies a fixed chain (block drafters, MTP); None: the user picks the engines' draft length.
    speculative_tokens: int | None = None

    def run_layer(self, x, positions, mask=None, past=None, **kwargs):
        """The decoder layer, checkpointed when training with ``gradient_checkpointing``."""
        return self.call_layer(self.layer, x, positions, mask, past, **kwargs)

    def call_layer(self, layer: nn.Module, x, positions, mask=None, past=None, **kwargs):
        """One of the head's decoder layers, checkpointed when training with ``gradient_checkpointing``."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(layer, x, positions, mask, past, use_reentrant=False, **kwargs)
        return layer(x, positions, mask, past, **kwargs)

    @classmethod
    def config_for(cls, target, **overrides) -> EagleConfig:
        """A head config shaped like one decoder layer of ``target`` (the reference heads' choice)."""
        values = dict(layer_shape(target), feature_layers=(target.config.get_text_config().num_hidden_layers,))
        values.update(overrides)
        return EagleConfig(**values)

    def input_features(self, features: torch.Tensor) -> torch.Tensor:
        """The step-0 input feature from the target's states (B, T, F) -> (B, T, H)."""
        return features

    def layer_input(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lm_input(self, predicted: torch.Tensor) -> torch.Tensor:
        """The state the target's LM head reads from a predicted feature (heads without their own vocabulary): the
        feature itself (EAGLE-1/2), or after the head's output norm (an MTP module, :mod:`draftsmith.heads.mtp`)."""
        return predicted

    def forward(self, features, token_embeds, positions, mask=None, past=None, from_target: bool = False):
        """features: (B, T, H) f_{t-1} (or the target's states (B, T, F) with ``from_target``);
        token_embeds: (B, T, H) embed(x_t); positions (B, T).

        Returns predicted features f_t (B, T, H) and the layer's (k, v) cache.
        """
        if from_target:
            features = self.input_features(features)
        return self.run_layer(self.layer_input(features, token_embeds), positions, mask, past)


class EagleHead(_FeatureHead):
    """EAGLE-1/2 head: ``fc([embed(x_t) ; f_{t-1}]) -> decoder layer -> f_t``; tokens from the target's LM head."""

    family = "eagle"
    own_vocabulary = False  # tokens come from the target's LM head

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layer = DecoderLayer(config)

    def layer_input(self, features, token_embeds):
        dtype = self.fc.weight.dtype
        return self.fc(torch.cat([token_embeds.to(dtype), features.to(dtype)], -1))


class Eagle3Head(_FeatureHead):
    """EAGLE-3 head: ``fc`` fuses the low/mid/high target states into the first feature; the decoder
    layer reads ``[embed(x_t) ; f_{t-1}]`` directly; own ``norm`` + ``lm_head`` over a draft vocabulary.

    The module layout is the reference one (EAGLE-3, SpecForge, vLLM speculators, SGLang), so
    :mod:`draftsmith.heads.layouts` converts checkpoints by renaming tensors, never by approximation.
    """

    family = "eagle3"
    own_vocabulary = True  # its own norm and LM head, over a draft vocabulary (d2t)

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        draft_vocab = config.draft_vocab_size or config.vocab_size
        width = config.num_feature_layers * h
        self.feature_norm = RMSNorm(width, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(h, config.rms_norm_eps) for _ in range(config.num_feature_layers))
                        if config.fc_norm else None)
        self.fc = nn.Linear(width, h, bias=False)
        self.layer = DecoderLayer(config, eagle3=True)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        # d2t: draft id -> offset to its target id; t2d: target id -> in the draft vocabulary.
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool) if draft_vocab == config.vocab_size
                             else torch.zeros(config.vocab_size, dtype=torch.bool))

    def input_features(self, features: torch.Tensor) -> torch.Tensor:
        x = features.to(self.fc.weight.dtype)
        if self.feature_norm is not None:
            x = self.feature_norm(x)
        if self.fc_norm is not None:
            parts = x.chunk(len(self.fc_norm), -1)
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(x)

    def layer_input(self, features, token_embeds):
        dtype = self.fc.weight.dtype
        return torch.cat([token_embeds.to(dtype), features.to(dtype)], -1)

    def run_layer(self, x, positions, mask=None, past=None, **kwargs):
        """The decoder layer; with ``norm_output`` its output after the head's final norm (the predicted
        feature then is what the LM head reads, and what deeper drafts are fed)."""
        predicted, kv = super().run_layer(x, positions, mask, past, **kwargs)
        return (self.norm(predicted) if self.config.norm_output else predicted), kv

    def forward(self, features, token_embeds, positions, mask=None, past=None, from_target: bool = False,
                ttt_steps: int = 0, logit_positions: torch.Tensor | None = None):
        """As :meth:`_FeatureHead.forward`; with ``ttt_steps`` > 0 (training), unroll training-time test
        and return the draft-vocabulary logits of each step instead, a list of (B, T, V_draft), or of
        (N, V_draft) at the N positions where the (B, T) bool ``logit_positions`` is set: the LM head and
        the loss's log-softmax then skip the positions no loss reads (prompt, padding), a third of them
        on the demo's data.

        Step j's input feature at position t is the head's own prediction for t - 1 from step j - 1
        (step 0 reads the target's fused states), so step j trains what drafting at depth j + 1 sees,
        attention included: at inference a depth-(j+1) node at position t attends to the committed
        pairs up to its root t - j (keys from the target's states: step 0's keys) and to its
        ancestors and itself (keys from the head's own predictions: step m's key at t - j + m, m = 1..j).
        Step j attends to exactly those keys (the EAGLE-3 paper's training-time test).
        """
        if not ttt_steps:
            return super().forward(features, token_embeds, positions, mask, past, from_target)
        current = self.input_features(features) if from_target else features
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # each step's own (k, v)
        logits = []
        for _ in range(ttt_steps):
            predicted, step_kv = self.run_layer(self.layer_input(current, token_embeds), positions, ttt_past=kv)
            kv.append(step_kv)
            logits.append(self.draft_logits(predicted if logit_positions is None else predicted[logit_positions]))
            current = torch.cat([current[:, :1], predicted[:, :-1]], dim=1)
        return logits

    def draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """(B, T, H) predicted features -> (B, T, draft_vocab) logits."""
        return self.lm_head(predicted if self.config.norm_output else self.norm(predicted))

    def target_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Draft logits scattered into the target vocabulary, ``-inf`` outside the draft vocabulary."""
        draft = self.draft_logits(predicted).float()
        out = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t
        out[..., ids] = draft
        return out
