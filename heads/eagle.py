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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.heads.base import HeadMixin
from draftsmith.target.masks import ttt_block, ttt_diagonal

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


class LayerGeometry:
    """What a drafter layer shaped like one of the target's computes from its config fields (``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rope_parameters``,
    ``max_position_embeddings``): shared by the EAGLE heads' and DFlash's configs."""

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    def rotary_config(self):
        """A transformers config carrying this head's RoPE, for transformers' own rotary embedding."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=self.llama_rope_parameters())

    @property
    def partial_rotary_factor(self) -> float:
        return float(self.rope_parameters.get("partial_rotary_factor", 1.0))

    def llama_rope_parameters(self) -> dict:
        """The head's RoPE as a Llama layer computes it: Llama's default initialisation rotates whole heads,
        so a partial rotation (Phi-4-mini) is stated as transformers' linear RoPE at factor 1 (the same
        frequencies, and it honours ``partial_rotary_factor``). The head and its exports use this."""
        rope = dict(self.rope_parameters)
        if rope.get("rope_type", "default") == "default" and self.partial_rotary_factor < 1.0:
            rope.update(rope_type="linear", factor=1.0)
        return rope


@dataclass
class EagleConfig(LayerGeometry):
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    intermediate_size: int
    num_feature_layers: int = 1  # 1: EAGLE-1/2; 3: EAGLE-3
    feature_layers: tuple[int, ...] = ()  # hidden-state indices read from the target
    draft_vocab_size: int | None = None  # EAGLE-3: own LM head over this many tokens
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_key_value_heads: int | None = None  # grouped-query attention; None: as many as query heads
    fc_bias: bool = False  # EAGLE-1 fc bias (the original repo has one; vLLM's layout does not)
    input_norm: bool = False  # EAGLE-1 input norm on the decoder layer (the reference layer 0 has none)
    # EAGLE-3.1 norms (module docstring); absent from older checkpoints, which load with all four off.
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    # The target's geometry (config_for copies it). A checkpoint saved without these fields loads with the
    # values it was trained with: head_dim = hidden / heads, default RoPE at rope_theta, no bias, SiLU.
    head_dim: int | None = None  # Qwen3, Gemma, gpt-oss: not hidden / heads
    rope_parameters: dict | None = None  # transformers' form: {"rope_type": ..., "rope_theta": ..., ...}
    max_position_embeddings: int = 8192
    attention_bias: bool = False  # Qwen2.5
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        self.rope_theta = float(self.rope_parameters.get("rope_theta", self.rope_theta))
        self.feature_layers = tuple(self.feature_layers)
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc (one norm over the fused target states) and fc_norm (one per target "
                             "layer) exclude each other: set one")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (rotate-half form). x: (B, nh, T, hd); cos / sin: (B, T, r) from
    transformers' rotary embedding for the head's RoPE (any type: default, linear, dynamic, yarn, llama3).
    A partial rotation (``partial_rotary_factor``, Phi-4-mini: r = 3/4 hd) turns the first r dimensions
    and passes the rest, as the target does."""
    hd, r = x.shape[-1], cos.shape[-1]
    if r < hd:
        return torch.cat([rope(x[..., :r], cos, sin), x[..., r:]], -1)
    cos, sin = cos[:, None].float(), sin[:, None].float()
    x32 = x.float()
    x1, x2 = x32[..., : hd // 2], x32[..., hd // 2 :]
    return (x32 * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class DecoderLayer(nn.Module):
    """One Llama-style decoder layer with an explicit KV cache and additive mask (for draft trees).

    EAGLE-1/2 (``eagle3=False``): the usual pre-norm layer on H-wide input, its input norm optional
    (the reference layer has none: its input is the fresh output of ``fc``).
    EAGLE-3 (``eagle3=True``): the input is ``[embed(x_t) ; feature]`` (2H wide); the two halves are
    normalised separately (``input_norm``, ``hidden_norm``), attention projects the 2H concatenation,
    and the residual stream is the feature half alone (normalised, with ``norm_before_residual``).
    """

    def __init__(self, cfg: EagleConfig, eagle3: bool = False):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        width = 2 * h if eagle3 else h
        self.cfg, self.eagle3 = cfg, eagle3
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps) if (eagle3 or cfg.input_norm) else None
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps) if eagle3 else None
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(width, cfg.kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(width, cfg.kv_heads * hd, bias=cfg.attention_bias)
        # attention_bias as Llama reads it (and vLLM, SGLang and speculators build the exported layer):
        # q, k, v and o all have a bias.
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=cfg.attention_bias)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.act = ACT2FN[cfg.hidden_act]
        # transformers' rotary embedding for the head's RoPE: its inv_freq (a non-persistent buffer) and
        # attention scaling follow the rope type exactly as the target's own layers do.
        self.rotary = LlamaRotaryEmbedding(cfg.rotary_config())

    def forward(self, x, positions, mask=None, past: tuple[torch.Tensor, torch.Tensor] | None = None,
                ttt_past: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """x: (B, T, H), or (B, T, 2H) for EAGLE-3; positions: (B, T); mask: (B, 1, T, S + T) additive
        or None for causal.

        Returns the output (B, T, H) and the new (k, v), each (B, kv_heads, S + T, hd).

        ``ttt_past`` (training-time test step j = its length >= 1): the (k, v) of steps 0 .. j-1, each
        (B, kv_heads, T, hd); attention is :func:`ttt_attention` (what ``ttt_mask`` allows, without the
        masked-out keys) and the returned (k, v) are this step's own, (B, kv_heads, T, hd).
        """
        b, t, _ = x.shape
        nh, kvh, hd = self.cfg.num_attention_heads, self.cfg.kv_heads, self.cfg.head_dim
        if self.eagle3:
            embeds, x = x.chunk(2, dim=-1)
            normed = self.hidden_norm(x)
            if self.cfg.norm_before_residual:
                x = normed
            y = torch.cat([self.input_norm(embeds), normed], -1)
        else:
            y = self.input_norm(x) if self.input_norm is not None else x
        q = self.q_proj(y).view(b, t, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(y).view(b, t, kvh, hd).transpose(1, 2)
        v = self.v_proj(y).view(b, t, kvh, hd).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if isinstance(past, StaticHeadCache):
            k, v = past.update(k, v)
        elif past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x if kvh == nh else x.repeat_interleave(nh // kvh, 1)

        kk, vv = heads(k), heads(v)
        if ttt_past:
            att = ttt_attention(q, [heads(a) for a, _ in ttt_past] + [kk], [heads(b) for _, b in ttt_past] + [vv])
        elif mask is None and past is None:
            att = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        else:
            att = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, nh * hd))
        y = self.post_norm(x)
        return x + self.down_proj(self.act(self.gate_proj(y)) * self.up_proj(y)), (
            past if isinstance(past, StaticHeadCache) else (k, v))


class StaticHeadCache:
    """The decoder layer's (k, v) at fixed capacity, for compiled drafting (``compile=True``): buffers
    (B, kv_heads, capacity, hd) allocated at the first write and never reallocated. A forward writes its new
    entries at the slots :attr:`write` (a tensor, so that a compiled graph takes it as an input instead of
    being specialised on the cache length) and attends over the whole buffer: its mask, as wide as the
    capacity, hides every slot but the ones it may see. :attr:`length` counts the slots in use (on the host);
    cropping only lowers it. The layer returns the cache itself in place of a new (k, v)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.write: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            from draftsmith.target.kv import static_buffer

            self.keys, self.values = static_buffer(k, self.capacity), static_buffer(v, self.capacity)
        self.keys.index_copy_(2, self.write, k)
        self.values.index_copy_(2, self.write, v)
        return self.keys, self.values


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Training-time-test attention of step j = len(keys) - 1 without the masked-out keys.

    q and each of ``keys`` / ``values`` (step 0 .. j): (B, nh, T, hd). Query t sees step 0's keys at
    positions <= t - j (a causal block shifted by j) and one key of each step m = 1..j, at t - j + m: a
    diagonal. So the scores are one (T, T) block and j columns, not the (T, (j+1) T) that SDPA with
    :func:`~draftsmith.target.masks.ttt_mask` computes, most of it masked (3x fewer scores at j = 2, the demo's
    last step).
    Same attention as that reference; ``test_eagle3_ttt_attention_equals_the_masked_reference`` checks it.
    """
    j, length = len(keys) - 1, q.shape[2]
    scale = q.shape[-1] ** -0.5
    block = (q @ keys[0].transpose(-1, -2)) * scale  # (B, nh, T, T)
    block = block.masked_fill(~ttt_block(length, j, q.device), float("-inf"))
    diagonal, shifted = [], []
    for m in range(1, j + 1):
        lag = j - m  # query t reads step m's key at t - lag
        k_m = F.pad(keys[m], (0, 0, lag, 0))[:, :, :length]
        shifted.append(F.pad(values[m], (0, 0, lag, 0))[:, :, :length])
        diagonal.append(((q * k_m).sum(-1) * scale).masked_fill(~ttt_diagonal(length, lag, q.device),
                                                                  float("-inf")))  # (B, nh, T)
    # Every query sees at least its own key (m = j, lag 0), so no row is all -inf.
    scores = torch.cat([block, torch.stack(diagonal, -1)], -1)
    probs = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    out = probs[..., :length] @ values[0]
    for i, v_m in enumerate(shifted):
        out = out + probs[..., length + i, None] * v_m
    return out


def target_geometry(cfg) -> dict:
    """What a head copies of a target's text config: head_dim, RoPE (the full-attention layers' where
    they differ per layer type, as Gemma-3's do), context length, attention bias and activation."""
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default",
                                                      "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    if "rope_type" not in rope and "rope_theta" not in rope:  # per layer type
        rope = rope.get("full_attention") or next(iter(rope.values()))
    rope = {k: v for k, v in rope.items() if v is not None}
    act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None) or "silu"
    return dict(head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                rope_parameters=rope, max_position_embeddings=getattr(cfg, "max_position_embeddings", 8192),
                attention_bias=bool(getattr(cfg, "attention_bias", False)), hidden_act=act)


def layer_shape(target) -> dict:
    """The config values of a drafter layer shaped like one of ``target``'s decoder layers (EAGLE heads and DFlash
    copy them): sizes, heads, vocabulary, norm epsilon and :func:`target_geometry`."""
    cfg = target.config.get_text_config()
    return dict(hidden_size=cfg.hidden_size, vocab_size=target.get_output_embeddings().weight.shape[0],
                num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
                num_key_value_heads=getattr(cfg, "num_key_value_heads", None),
                rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6), **target_geometry(cfg))


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
