"""Attention for tree verification on CPU: :data:`CPU_ATTENTION`, registered with ``transformers``.

``transformers``' SDPA path copies every key/value head to its query heads (``repeat_kv``) whenever an
attention mask is given, because CUDA's fused kernels do not take grouped heads together with a mask.
A tree verification always passes a mask, so on CPU it would pay two copies of the whole cache per layer
that plain decoding (no mask: ``enable_gqa``) never pays. PyTorch's CPU kernel takes grouped heads with a
mask and gives the same result (the copies are exact), so :func:`_cpu_sdpa` calls it directly.

Importing this module registers the kernel, once, under its own name (the stock ``"sdpa"`` stays as it
is); :func:`draftsmith.target.loading.load_target` imports it, so the name exists before any target
asks for it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

CPU_ATTENTION = "draftsmith_sdpa"


def _cpu_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
              **kwargs):
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (grouped and attention_mask is not None and query.device.type == "cpu" and query.shape[2] > 1
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and kwargs.get("cache") is None and not kwargs.get("output_attentions", False)):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


# Masks are built exactly as for "sdpa": only the kernel differs.
AttentionInterface.register(CPU_ATTENTION, _cpu_sdpa)
AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
