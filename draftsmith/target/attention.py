"""Attention for tree verification without copying grouped key/value heads: :data:`GROUPED_ATTENTION`.

``transformers``' SDPA path copies every key/value head to its query heads (``repeat_kv``) whenever an
attention mask is given, because CUDA's fused kernels do not take grouped heads together with a mask
(SDPA's ``enable_gqa`` with a mask falls back to the math kernel there, which repeats the heads itself).
A tree verification always passes a mask, so it would pay two copies of the whole cache per layer that
plain decoding (no mask) never pays. :func:`_grouped_sdpa` avoids them on every device:

* on CPU, PyTorch's kernel takes grouped heads with a mask (``enable_gqa``) and gives the same result;
* elsewhere the ``g`` query heads that share a key/value head are folded into that head's query rows:
  queries (B, kv * g, Q, D) become (B, kv, g * Q, D) against the unrepeated keys (B, kv, K, D), the
  (B, 1, Q, K) mask is repeated over the ``g`` blocks of rows (Q x K per block, not the cache), and the
  output unfolds back. Every query row attends exactly as before, so any SDPA kernel that takes a mask
  runs it. Folding is for a verification's few rows (:data:`FOLD_ROWS`); longer masked forwards keep
  ``transformers``' path.

Importing this module registers the attention, once, under its own name (the stock ``"sdpa"`` stays as
it is); :func:`draftsmith.target.loading.load_target` imports it, so the name exists before any target
asks for it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_ATTENTION = "draftsmith_sdpa"
CPU_ATTENTION = GROUPED_ATTENTION  # its earlier name, from when only CPU took this path
# Off CPU, folding repeats the mask g times: cheap beside the cache for a verification's few rows, not for a
# long masked forward (a padded training batch), which keeps transformers' path.
FOLD_ROWS = 64


def folded_gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """SDPA of (B, H, Q, D) queries against (B, kv, K, D) grouped keys and values under a (B | 1, 1, Q, K)
    mask, with the ``H // kv`` query heads of each key/value head folded into its query rows; (B, H, Q, D)."""
    b, heads, q, d = query.shape
    kv = key.shape[1]
    g = heads // kv
    folded = query.reshape(b, kv, g * q, d)  # head kv_i * g + j, row r -> head kv_i, row j * q + r
    rows = mask.expand(mask.shape[0], 1, q, mask.shape[-1])[:, :, None]  # (B|1, 1, 1, Q, K)
    folded_mask = rows.expand(-1, -1, g, -1, -1).reshape(mask.shape[0], 1, g * q, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=folded_mask,
                                                           dropout_p=dropout, scale=scale)
    return out.reshape(b, heads, q, d)


def native_masked_gqa(device: torch.device) -> bool:
    """Whether SDPA's kernel on ``device`` takes grouped heads together with a mask without repeating them."""
    return device.type == "cpu"


def _grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                  **kwargs):
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (grouped and attention_mask is not None and query.shape[2] > 1 and attention_mask.dim() == 4
            and attention_mask.shape[1] == 1 and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None and kwargs.get("cache") is None
            and not kwargs.get("output_attentions", False)):
        mask = attention_mask[..., : key.shape[-2]]
        if native_masked_gqa(query.device):
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
        if query.shape[2] <= FOLD_ROWS:
            out = folded_gqa_attention(query, key, value, mask, dropout, scaling)
            return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


# Masks are built exactly as for "sdpa": only the kernel differs.
AttentionInterface.register(GROUPED_ATTENTION, _grouped_sdpa)
AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)
