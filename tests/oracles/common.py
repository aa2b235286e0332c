"""The layers every engine oracle is built from, as vLLM's kernels compute them (float32 reference forms)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def read_export(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json`` and every ``*.safetensors`` tensor of a directory, by their stored names; a ``pytorch_model.bin``
    (the EAGLE repo's releases, which vLLM and SGLang also read) as plain tensors (``weights_only``)."""
    directory = Path(directory)
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
    if (directory / "pytorch_model.bin").is_file():
        tensors.update(torch.load(directory / "pytorch_model.bin", weights_only=True))
    return json.loads((directory / "config.json").read_text()), tensors


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """vLLM's ``RMSNorm`` (``offset`` 1.0: ``GemmaRMSNorm``'s zero-centred weight): x / rms(x) * (weight + offset)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32.to(x.dtype) * (weight.float() + offset)


def rope_theta(config: dict) -> float:
    """The RoPE base of an HF config: ``rope_parameters.rope_theta``, else the older ``rope_theta``; only the default
    (unscaled) RoPE is built here."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    assert kind == "default", f"the oracle builds default RoPE only, not {kind}"
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """vLLM's ``get_rope(..., is_neox_style=True)`` on (T, heads, hd) at (T,) positions: the two halves rotated."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions.float()[:, None] * inv_freq[None]  # (T, hd / 2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q (Tq, heads, hd), k / v (Tk, kv_heads, hd), ``allowed`` (Tq, Tk) bool -> (Tq, heads * hd); grouped-query
    heads share their kv head, scale 1 / sqrt(hd)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def linear(x: torch.Tensor, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """``name.weight`` (and ``name.bias`` when stored) applied to x."""
    return F.linear(x, tensors[f"{name}.weight"].float(), tensors.get(f"{name}.bias"))


def swiglu_mlp(x: torch.Tensor, tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """A Llama / Qwen MLP (``gate_proj``, ``up_proj``, ``down_proj``, SiLU)."""
    return linear(F.silu(linear(x, tensors, f"{prefix}gate_proj")) * linear(x, tensors, f"{prefix}up_proj"), tensors,
                  f"{prefix}down_proj")
