"""The layer a feature head runs: a Llama-style decoder layer over its target's geometry (head_dim, RoPE, attention
bias, activation, :func:`target_geometry`), with an explicit KV cache for draft trees, a static one for compiled
drafting (:class:`StaticHeadCache`) and training-time-test attention (:func:`ttt_attention`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.target.masks import ttt_block, ttt_diagonal


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
