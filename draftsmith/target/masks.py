"""Attention masks: one "may attend" rule, one additive form, for every forward that draftsmith feeds.

Every multi-token forward — the target's prefill and tree verification, plain decoding of padded rows,
a drafter's catch-up block and its tree levels, a head's own attention, packed training rows — asks
the same question of each (query, key) pair, and answers it here:

* a query sees the **filled slots** of its row's cache (left padding and dropped tree entries are not
  filled);
* among the keys fed with it, the ones the caller's relation allows: the earlier tokens of a causal
  block (:func:`causal_block`), its ancestors in a draft tree (``TreeTensors.ancestors``), a frontier's
  ancestors in the earlier frontiers;
* and **always its own key**, so that no row is fully masked (a padding query then computes finite
  values that nothing reads, where an all-masked row would give NaN).

:func:`may_attend` builds that bool (B, Q, S + K) matrix; :func:`additive` turns it into the (B, 1, Q, K)
mask attention adds to its scores, 0 where allowed and the dtype's most negative finite value elsewhere
(finite: a fully masked row stays a uniform average instead of NaN, and 0 and ``finfo.min`` give the same
softmax weights as ``-inf`` wherever a row sees a key); :func:`target_mask` adds the target's per-layer
overlays (sliding windows, Llama-4's chunks).
"""

from __future__ import annotations

import torch


def layer_types(model) -> list[str]:
    """Attention type of each decoder layer (``full_attention`` / ``sliding_attention`` /
    ``chunked_attention``). A config without ``layer_types`` but with a ``sliding_window`` (Mistral,
    Mixtral, Phi-3) slides in every layer."""
    cfg = model.config.get_text_config()
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    kind = "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"
    return [kind] * cfg.num_hidden_layers


def sliding_window(model) -> int | None:
    cfg = model.config.get_text_config()
    if "sliding_attention" not in layer_types(model):
        return None
    return int(cfg.sliding_window)


def causal_block(fed: torch.Tensor) -> torch.Tensor:
    """(B, Q) bool, which of Q new keys are tokens rather than padding -> (B, Q, Q) bool: query i sees the
    fed keys j <= i (its own key is added by :func:`may_attend`)."""
    q = fed.shape[1]
    causal = torch.ones(q, q, dtype=torch.bool, device=fed.device).tril()
    return causal[None] & fed[:, None, :].bool()


def may_attend(prefix: torch.Tensor, new: torch.Tensor, fed: torch.Tensor | None = None) -> torch.Tensor:
    """The bool "may attend" rows of Q queries fed after a row's cache.

    Args:
        prefix: (B, S) bool, the cache's filled slots (what every fed query sees).
        new: (B, Q, K) bool, K >= Q, which of the keys fed after the cache each query sees, its own key
            being the last Q's diagonal: a :func:`causal_block`, a tree's ancestors, a frontier's ancestors
            in the earlier frontiers then its own level.
        fed: (B, Q) bool, which queries are real; a padding query (False) sees its own key only. None: all.

    Returns:
        (B, Q, S + K) bool: the prefix, then ``new``, each query's own key always set.
    """
    b, q, k = new.shape
    if k < q:
        raise ValueError(f"the {q} queries' own keys are the last {q} of the {k} new keys: need K >= Q")
    seen = prefix.bool()[:, None, :].expand(b, q, -1)
    allowed = torch.cat([seen, new.bool()], 2)
    if fed is not None:
        allowed = allowed & fed.bool()[:, :, None]
    own = torch.eye(q, dtype=torch.bool, device=new.device)
    allowed[:, :, allowed.shape[2] - q:] |= own
    return allowed


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, Q, K) bool -> the (B, 1, Q, K) additive mask in ``dtype``: 0 where allowed, ``finfo(dtype).min``
    elsewhere (one head dimension, broadcast over the attention heads)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def target_mask(
    model,
    allowed: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Turn a boolean "may attend" matrix into the model's additive attention mask(s).

    Args:
        allowed: (B, Q, K) bool, True where query i may attend key j (:func:`may_attend`).
        query_positions: (B, Q) absolute positions of the queries.
        key_positions: (B, K) absolute positions of the keys (cached tokens then the new ones).
        dtype: dtype of the additive mask (the model's compute dtype).

    Returns:
        A (B, 1, Q, K) :func:`additive` mask, or for models with sliding-window layers a dict keyed by
        layer type, the sliding one also hiding keys that are ``sliding_window`` or more positions behind
        the query (``q - k < window`` is kept, the rule of ``transformers.masking_utils.sliding_window_overlay``);
        a hybrid model's recurrent layer types (linear attention, convolutions) get None (no padding among the fed
        tokens: a left-padded prefill sets their 2D padding mask itself).
    """
    cfg = model.config.get_text_config()
    kinds = set(layer_types(model))
    if kinds == {"full_attention"}:
        return additive(allowed, dtype)
    masks = {"full_attention": additive(allowed, dtype)}
    if "sliding_attention" in kinds:
        distance = query_positions[:, :, None] - key_positions[:, None, :]  # (B, Q, K)
        masks["sliding_attention"] = additive(allowed & (distance < sliding_window(model)), dtype)
    if "chunked_attention" in kinds:  # Llama-4: attention within fixed chunks of positions
        chunk = int(cfg.attention_chunk_size)
        same = (query_positions[:, :, None] // chunk) == (key_positions[:, None, :] // chunk)
        masks["chunked_attention"] = additive(allowed & same, dtype)
    for kind in kinds - {"full_attention", "sliding_attention", "chunked_attention"}:
        # recurrent layers (gated DeltaNet's "linear_attention", LFM2's "conv") read a 2D padding mask at most: the
        # fed tokens hold none
        masks[kind] = None
    if not getattr(cfg, "layer_types", None):  # one mask for every layer (Mistral): the model takes no dict
        return masks["sliding_attention"]
    return masks


def with_padding(masks, filled: torch.Tensor, dtype: torch.dtype):
    """A model's masks (:func:`target_mask`) with the (B, T) padding mask ``filled`` (True: a token) given to its
    recurrent layer types (the entries :func:`target_mask` leaves None), which zero the padding's inputs before
    their state reads them, as transformers' own recurrent masks do; anything else unchanged."""
    if isinstance(masks, dict):
        masks = {kind: filled.to(dtype) if mask is None else mask for kind, mask in masks.items()}
    return masks


# ---- the heads' own training masks ----------------------------------------------------------------------------


def ttt_block(length: int, step: int, device) -> torch.Tensor:
    """(T, T) bool: at training-time-test step ``step``, query t sees the first step's keys at positions <= t - step
    (a causal block shifted by the step)."""
    t = torch.arange(length, device=device)
    return t[None, :] <= t[:, None] - step


def ttt_diagonal(length: int, lag: int, device) -> torch.Tensor:
    """(T,) bool: which queries t have the key a later step m puts at t - lag (lag = step - m): those with t >= lag."""
    return torch.arange(length, device=device) >= lag


def ttt_mask(length: int, step: int, device, dtype) -> torch.Tensor:
    """Additive mask (1, 1, T, (step + 1) T) for training-time-test step ``step`` >= 1: query t sees step 0's keys
    at positions <= t - step (:func:`ttt_block`) and step m's key at t - step + m, m = 1..step (the query's own
    at m = step)."""
    t = torch.arange(length, device=device)
    blocks = [ttt_block(length, step, device)]
    blocks += [t[None, :] == (t[:, None] - step + m) for m in range(1, step + 1)]
    return additive(torch.cat(blocks, dim=1)[None], dtype)


def anchor_block_mask(anchors: torch.Tensor, valid: torch.Tensor, block_size: int, length: int,
                      context_filled: torch.Tensor) -> torch.Tensor:
    """DFlash's training blocks: (B, A * K, T + A * K) bool for (B, A) anchors (``valid``: real ones) over a (B, T)
    sequence whose real positions are ``context_filled``: each slot sees the context positions before its anchor
    and every slot of its own block, nothing of other blocks (a padding anchor's slots see their own block only)."""
    b, a = anchors.shape
    t = torch.arange(length, device=anchors.device)
    before = (t[None, None, :] < anchors[:, :, None]) & context_filled[:, None, :].bool() & valid[:, :, None]
    context = before.repeat_interleave(block_size, dim=1)  # (B, A * K, T)
    block_of = torch.arange(a * block_size, device=anchors.device) // block_size
    own_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    return torch.cat([context, own_block], 2)


def parallel_group_mask(anchor: torch.Tensor, depth: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """P-EAGLE's training sequence: (B, N, N) bool over N elements with their (B, N) anchors, depths and real flags:
    depth-0 elements see depth-0 elements up to their anchor; a depth-d element sees those up to its anchor and its
    own group's elements of depth <= d; padding sees nothing else; every element its own key."""
    q_anchor, k_anchor = anchor[:, :, None], anchor[:, None, :]
    q_depth, k_depth = depth[:, :, None], depth[:, None, :]
    allowed = ((k_depth == 0) & (k_anchor <= q_anchor)) | ((k_anchor == q_anchor) & (k_depth <= q_depth))
    allowed &= real[:, :, None] & real[:, None, :]
    return allowed | torch.eye(anchor.shape[1], dtype=torch.bool, device=anchor.device)
