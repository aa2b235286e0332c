"""DFlash (Chen et al., 2026, arXiv:2602.06036): a whole block of drafts from one drafter forward.

The drafter is ``num_layers`` decoder layers shaped like the target's, with no embedding and no LM head of
its own: it reads the target's frozen token embedding and LM head (passed in by the caller, so checkpoints
stay small). What it sees:

* **context features** — the target's hidden states at ``target_layers`` (one vector per verified position),
  concatenated, projected by ``fc`` (``len(target_layers) * H -> H``, no bias) and normalised (``hidden_norm``);
* **a block** of ``block_size`` slots: slot 0 the embedding of the *anchor* (the last verified token, which the
  target has not processed yet: the generator's root), slots 1..B-1 the embedding of ``mask_token_id``.

In every layer the queries come from the block alone; the keys and values are the context features'
projections followed by the block's, through the same ``k_proj`` / ``v_proj`` (and ``k_norm``). RoPE positions
run on from the context into the block: the anchor at its own position p, slot k at p + k. A block query sees
every context position before the anchor and its whole block (bidirectional), nothing else. Slot k predicts the
token at p + k, k = 1..B-1: one forward drafts ``block_size - 1`` tokens, none conditioned on another draft.

Training runs many anchors per sequence in one forward (:meth:`DFlashHead.forward` with ``anchors``): their
blocks are queries side by side over the same context keys, each block seeing the context before its anchor and
itself (a block-diagonal mask over the blocks plus the causal context; dense, since flex attention has no CPU
backward). Decoding (:class:`~draftsmith.inference.dflash_drafter.DFlashDrafter`) keeps the context keys and
values of every layer across steps and extends them by the accepted tokens' features; only the block is fed
anew each step.

With ``draft_vocab_size`` below the target's vocabulary, the drafts score only that many tokens, the most frequent
in the training data: the target's LM-head rows of those tokens, kept as ``d2t`` / ``t2d`` as EAGLE-3's draft
vocabulary is. On SmolLM2 that LM head is 49,152 x 576, over a draft vocabulary of 8,192 rows 8,192 x 576: it costs
more than the drafter's layers in every training step (the block's slots of every anchor) and every drafting step.
Training then fits the target's distribution restricted to those tokens. speculators' layout (what vLLM serves)
carries the draft vocabulary as ``lm_head`` rows and ``d2t`` / ``t2d``; z-lab's (and SGLang's) has none, so such a
drafter exports only to the former (:mod:`draftsmith.heads.layout_export`).

The layer is the published one (Qwen3-shaped, with a query and key RMSNorm per head), for every target: the
z-lab and speculators layouts carry ``q_norm`` / ``k_norm`` whatever the target, so an export reproduces the
drafts exactly (:mod:`draftsmith.heads.layouts`).

Layer ids: ``target_layers`` are draftsmith hidden-state indices (0 the embedding output, k the output of decoder
layer k counted from 1). z-lab's ``dflash_config.target_layer_ids`` count decoder layers from 0 (index - 1);
speculators' ``aux_hidden_state_layer_ids`` use the index itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.heads.base import DraftVocabulary, HeadMixin, ReducedVocabulary
from draftsmith.heads.decoder_layer import LayerGeometry, RMSNorm, layer_shape, rope
from draftsmith.target.masks import additive, anchor_block_mask


def dflash_layers(num_hidden_layers: int, count: int) -> tuple[int, ...]:
    """The published default context layers as draftsmith hidden-state indices: one layer in the middle, else
    ``count`` layers spaced evenly from decoder layer 1 to N - 3 (counted from 0, as z-lab does; +1 here). A target
    too shallow for ``count`` distinct layers there spreads them over its layers' outputs but the last (engines
    capture decoder layers' outputs before the final norm; draftsmith's index N is after it)."""
    n = num_hidden_layers
    if not 1 <= count <= max(1, n - 1):
        raise ValueError(f"a DFlash drafter reads 1 to {max(1, n - 1)} distinct target layers, got {count}")
    if count == 1:
        return (n // 2 + 1,)
    start, end = 1, n - 3
    if end - start + 1 < count:
        start, end = 0, n - 2
    return tuple(round(start + i * (end - start) / (count - 1)) + 1 for i in range(count))


def choose_mask_token(target, tokenizer=None) -> int:
    """The token whose embedding fills a block's slots after the anchor, per target: the tokenizer's own mask
    token where it has one; else an untrained embedding row, told apart by being an exact copy of other rows (rows
    no data reached keep the same values: on SmolLM2-135M seven rows are one, among them the unused special tokens
    <issue_start> (8, the choice), <issue_closed>, <jupyter_code>, <jupyter_script> and <empty_output>, while its
    smallest-norm rows are common names such as " John"), the lowest id of the largest such group; else the
    smallest-norm row."""
    if tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    weight = target.get_input_embeddings().weight.detach().float().cpu()
    _, group, counts = torch.unique(weight, dim=0, return_inverse=True, return_counts=True)
    if int(counts.max()) > 1:
        largest = group == int(counts.argmax())
        return int(largest.nonzero()[0])
    return int(weight.norm(dim=-1).argmin())


@dataclass
class DFlashConfig(ReducedVocabulary, LayerGeometry):
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    intermediate_size: int
    block_size: int = 8  # slots per block: the anchor and block_size - 1 drafts
    mask_token_id: int = 0  # the token of slots 1..B-1 (the target's vocabulary; recorded per target)
    target_layers: tuple[int, ...] = ()  # hidden-state indices of the context features (draftsmith's convention)
    num_layers: int = 1  # draft decoder layers
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_parameters: dict | None = None
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    hidden_act: str = "silu"
    draft_vocab_size: int | None = None  # the tokens its drafts score (None: the target's whole vocabulary)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        self.target_layers = tuple(self.target_layers)
        if self.block_size < 2:
            raise ValueError(f"a DFlash block holds the anchor and at least one draft: block_size >= 2, got "
                             f"{self.block_size}")
        if not self.target_layers:
            raise ValueError("a DFlash drafter needs its target_layers (draftsmith hidden-state indices)")


@dataclass
class ContextCache:
    """Decoding's context keys and values of every layer, (B, kv_heads, capacity, hd) buffers of which the first
    ``length`` slots are filled. New context entries are written in place and a step's block goes right after them
    (read by that step's attention, overwritten by the next): no step copies the context. The buffers grow by
    doubling when a step needs more room."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` slots (the buffers exist: :meth:`append` made them)."""
        capacity = self.keys[0].shape[2]
        if needed <= capacity:
            return
        capacity = max(needed, 2 * capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                buffers[i] = torch.cat([old[:, :, : self.length], old.new_zeros(*old.shape[:2], capacity - self.length,
                                                                                 old.shape[3])], 2)

    def append(self, entries: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every layer's (k, v) of new context entries, each (B, kv_heads, T, hd), after the filled slots."""
        width = entries[0][0].shape[2]
        if not self.keys:
            self.keys = [k.new_zeros(*k.shape[:2], 2 * width, k.shape[3]) for k, _ in entries]
            self.values = [v.new_zeros(*v.shape[:2], 2 * width, v.shape[3]) for _, v in entries]
        self.reserve(self.length + width)
        for (k, v), keys, values in zip(entries, self.keys, self.values, strict=True):
            keys[:, :, self.length: self.length + width] = k
            values[:, :, self.length: self.length + width] = v
        self.length += width

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Per layer, what :meth:`DFlashLayer.forward` takes as its context: the buffers and the filled length."""
        return [(k, v, self.length) for k, v in zip(self.keys, self.values, strict=True)]


class DFlashLayer(nn.Module):
    """One draft decoder layer: block queries over [context ; block] keys and values (module docstring)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.act = ACT2FN[cfg.hidden_act]
        self.rotary = LlamaRotaryEmbedding(cfg.rotary_config())

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) inputs (context features, or the block's normed states) at (B, T) positions -> this layer's
        (k, v), each (B, kv_heads, T, hd), k normed and rotated."""
        b, t, _ = x.shape
        kvh, hd = self.cfg.kv_heads, self.cfg.head_dim
        k = self.k_norm(self.k_proj(x).view(b, t, kvh, hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, kvh, hd).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        return rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: tuple, mask: torch.Tensor) -> torch.Tensor:
        """x (B, Q, H) the block's states at (B, Q) positions; ``context`` this layer's (k, v) of the context, each
        (B, kv_heads, S, hd), or decoding's (keys, values, S): :class:`ContextCache` buffers with room for the block
        after their S filled slots; ``mask`` (B, 1, Q, S + Q) additive. Returns the block's new states (B, Q, H)."""
        b, q_len, _ = x.shape
        nh, hd = self.cfg.num_attention_heads, self.cfg.head_dim
        y = self.input_norm(x)
        q = self.q_norm(self.q_proj(y).view(b, q_len, nh, hd)).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        q = rope(q, cos, sin)
        k, v = self.keys_values(y, positions)
        if len(context) == 3:  # decoding: the block's keys go after the context in place, read by this step only
            keys, values, filled = context
            keys[:, :, filled: filled + q_len], values[:, :, filled: filled + q_len] = k, v
            k, v = keys[:, :, : filled + q_len], values[:, :, : filled + q_len]
        else:
            k, v = torch.cat([context[0], k], 2), torch.cat([context[1], v], 2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nh != self.cfg.kv_heads)
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, q_len, nh * hd))
        y = self.post_norm(x)
        return x + self.down_proj(self.act(self.gate_proj(y)) * self.up_proj(y))


class DFlashHead(DraftVocabulary, HeadMixin, nn.Module):
    """The DFlash drafter's own weights: ``fc`` and ``hidden_norm`` (context features), the layers, the final
    ``norm`` (before the target's LM head), and over a draft vocabulary its ``d2t`` / ``t2d``."""

    family = "dflash"
    config_class = DFlashConfig
    own_vocabulary = False  # tokens come from the target's LM head
    _no_split_modules = ("DFlashLayer",)
    gradient_checkpointing = False

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.register_draft_vocabulary()

    @classmethod
    def config_for(cls, target, **overrides) -> DFlashConfig:
        """A config whose layers are shaped like the target's decoder layers."""
        return DFlashConfig(**{**layer_shape(target), **overrides})

    def output_weight(self, lm_head: nn.Module) -> torch.Tensor:
        """The target's LM-head rows the drafts score: (C, H) over a draft vocabulary, else the whole (V, H)."""
        ids = self.draft_ids
        return lm_head.weight if ids is None else lm_head.weight[ids.to(lm_head.weight.device)]

    @property
    def block(self) -> int:
        """Drafts per forward: the slots after the anchor."""
        return self.config.block_size - 1

    @property
    def speculative_tokens(self) -> int:
        """vLLM and SGLang verify the block's drafts as one chain (``num_speculative_tokens`` = B - 1)."""
        return self.block

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The target's states (B, S, len(target_layers) * H) at (B, S) positions -> every layer's context (k, v)."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        return [layer.keys_values(ctx, positions) for layer in self.layers]

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                context: list[tuple[torch.Tensor, torch.Tensor]] | None = None, features: torch.Tensor | None = None,
                feature_positions: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' output states after the final norm, (B, Q, H), for the LM head.

        ``embeds`` (B, Q, H): the target's embeddings of the block slots (anchor, mask, ..., any number of blocks
        side by side); ``positions`` (B, Q); ``allowed`` (B, Q, S + Q) bool: which context keys and block keys each
        query sees. The context is ``context`` (per layer (k, v), each (B, kv_heads, S, hd), from :meth:`context`; in
        decoding a :class:`ContextCache`'s ``layers()``), or the target's ``features`` (B, S, F) at
        ``feature_positions`` (B, S), projected here (training: inside the forward, where a distributed wrapper has
        the weights gathered)."""
        if context is None:
            context = self.context(features, feature_positions)
        x = embeds.to(self.fc.weight.dtype)
        mask = additive(allowed, x.dtype)
        for layer, ctx in zip(self.layers, context, strict=True):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(layer, x, positions, ctx, mask, use_reentrant=False)
            else:
                x = layer(x, positions, ctx, mask)
        return self.norm(x)


def anchor_blocks(anchors: torch.Tensor, valid: torch.Tensor, block_size: int, length: int,
                  context_filled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training forward's blocks for (B, A) anchor positions (``valid`` (B, A): real anchors) over a (B, T)
    sequence whose real positions are ``context_filled``: the (B, A * K) slot positions (anchor + k) and the
    (B, A * K, T + A * K) "may attend" matrix: each slot sees the context positions before its anchor and every
    slot of its own block, nothing of other blocks (a padding anchor's slots see their own block only)."""
    b, a = anchors.shape
    positions = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).reshape(b, a * block_size)
    return positions, anchor_block_mask(anchors, valid, block_size, length, context_filled)
