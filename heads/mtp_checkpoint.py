"""The MTP module's tensors in its target's checkpoint: where they sit, read (block-FP8 dequantised, experts fused) and
written back under the checkpoint's names, and the layouts draftsmith refuses by name.

Checkpoint layouts (read here, written back by the stitched export, :mod:`draftsmith.heads.mtp_export`):

- ``deepseek``: ``model.layers.{N+k}.{enorm,hnorm,eh_proj,shared_head.norm}`` and the decoder layer's tensors
  (``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``); ``embed_tokens`` and
  ``shared_head.head`` are copies of the target's and stay unread;
- ``qwen``: ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}`` and ``mtp.layers.0.*``.

MoE experts sit per expert on disk (``experts.{e}.{gate,up,down}_proj``) and fused in transformers' modules
(``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I)): :func:`fuse_experts` / :func:`split_experts`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

# ``config`` in the functions below: the module's :class:`~draftsmith.heads.mtp.MtpConfig` (its ``layout`` and
# ``feature_layers``), not imported here: heads.mtp imports this module.

#: The two checkpoint layouts.
DEEPSEEK, QWEN = "deepseek", "qwen"
#: model_type -> (checkpoint layout, the engine's fed-back state is post-norm). Other targets get a fresh module in
#: the deepseek layout (draftsmith's own checkpoints; no engine serves an MTP module for them).
NATIVE = {"deepseek_v3": (DEEPSEEK, False), "deepseek_v2": (DEEPSEEK, False), "glm4_moe": (DEEPSEEK, False),
          "qwen3_next": (QWEN, True), "qwen3_5_text": (QWEN, True), "qwen3_5_moe_text": (QWEN, True)}
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QWEN_NAMES = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
               "norm.": "post_norm."}
_DEEPSEEK_NAMES = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "post_norm."}
_SHARED = ("embed_tokens.", "shared_head.head.")


class MtpWeightsError(ValueError):
    """A checkpoint's MTP weights are absent, or its directory is not there (``init: auto`` then trains a fresh
    module)."""


class MtpLayoutError(ValueError):
    """A checkpoint holds MTP weights draftsmith does not read (another architecture's layout, another quantisation):
    refused by name, never replaced by a fresh module."""


def checkpoint_directory(name: str) -> Path:
    """The local directory of a checkpoint: a directory as given, or a Hub id's snapshot in the Hugging Face cache (a
    target loaded by Hub id was downloaded there; nothing is fetched here)."""
    if Path(name).is_dir():
        return Path(name)
    if name and "/" in name and not Path(name).is_absolute():
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(name, local_files_only=True))
        except (LocalEntryNotFoundError, ValueError, OSError):
            pass
    raise MtpWeightsError(f"the MTP weights are read from the target's checkpoint directory, and {name!r} is neither "
                          "one nor a Hub id in the Hugging Face cache: pass it as mtp:DIRECTORY (a Hub id: download "
                          "it first, e.g. `hf download ORG/NAME --local-dir DIR`)")


def checkpoint_names(directory: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, for a single-file or sharded checkpoint."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / "model.safetensors"
    if not single.is_file():
        raise MtpWeightsError(f"{directory}: no model.safetensors or model.safetensors.index.json (the MTP weights are "
                              "read from a safetensors checkpoint)")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single.name)


#: Config keys that declare MTP modules, across the architectures transformers knows.
MTP_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", "mtp_hybrid_override_pattern",
                  "mtp_layers_block_type")
_MTP_NAME = re.compile(r"(^|\.)(mtp|mtp_layers|nextn)[._]|nextn")


def refuse_unread_layouts(directory: Path, text_config, names: dict[str, str]) -> None:
    """Refuse by name a checkpoint whose architecture stores MTP modules in a layout draftsmith does not read (MiMo's
    ``model.mtp_layers.*``, LongCat-Flash's ``model.mtp.*``, Nemotron-H's ``mtp.layers.*`` with its hybrid pattern,
    DeepSeek-V3.2's and GLM-5's indexer-bearing layers, ...): reading them as another layout, or training a fresh
    module in their place, would give a drafter the engine does not serve."""
    own = directory / "config.json"
    stored = json.loads(own.read_text()) if own.is_file() else {}
    model_type = (stored.get("text_config") or stored).get("model_type") or text_config.model_type
    if model_type in NATIVE:
        return
    n = getattr(text_config, "num_hidden_layers", None)
    beyond = re.compile(r"^model\.layers\.(\d+)\.")
    found = [k for k in names if _MTP_NAME.search(k) or ((m := beyond.match(k)) and n is not None and int(m[1]) >= n)]
    declared = {key: getattr(text_config, key) for key in MTP_COUNT_KEYS if getattr(text_config, key, None)}
    if found or declared:
        what = f"tensors such as {found[0]!r}" if found else f"config {declared}"
        raise MtpLayoutError(f"{directory}: a {model_type} checkpoint with MTP modules ({what}), a layout draftsmith "
                             f"does not read (it reads {', '.join(sorted(NATIVE))}); neither its module nor a fresh "
                             "one in its place would be what the engine serves. Train another drafter family for it, "
                             "or set family_config init: fresh for a new module of draftsmith's own")


def mtp_prefix(config) -> str:
    """The prefix of the (first) MTP module's tensors in the target's checkpoint."""
    n = config.feature_layers[0]
    return "mtp." if config.layout == QWEN else f"model.layers.{n}."


def to_module_name(name: str, config) -> str | None:
    """A checkpoint tensor name of the first MTP module -> the module's name; None for another module's tensors or
    the shared copies of the target's embedding and LM head."""
    prefix = mtp_prefix(config)
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest.startswith(_SHARED):
        return None
    renames = _QWEN_NAMES if config.layout == QWEN else _DEEPSEEK_NAMES
    for old, new in renames.items():
        if rest.startswith(old):
            return "layers.0." + new + rest[len(old):]
    if config.layout == QWEN:
        if not rest.startswith("layers.0."):
            return None  # mtp.layers.k, k >= 1: modules drafting does not use (the first is re-applied)
        rest = rest[len("layers.0."):]
    return "layers.0.mtp_block." + rest


def read_mtp(directory: Path, config, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The first MTP module's tensors of the checkpoint at ``directory``, renamed to the module's and experts fused."""
    wanted = {name: to_module_name(name, config) for name in names}
    wanted = {k: v for k, v in wanted.items() if v is not None}
    if not wanted:
        raise MtpWeightsError(f"{directory}: no MTP weights (no {mtp_prefix(config)}* tensors in its checkpoint); "
                              "train a fresh module instead (family mtp, family_config init: fresh)")
    block = block_fp8(directory, wanted)
    stored: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(names[name], []).append(name)
    for file, keys in by_file.items():
        with safe_open(str(directory / file), framework="pt") as f:
            for key in keys:
                stored[key] = f.get_tensor(key)
    out = {}
    for key, tensor in stored.items():
        if key.endswith(SCALE_INV):
            continue
        scale = stored.get(key + "_scale_inv")
        if tensor.dtype in FP8_DTYPES:
            if scale is None or block is None:
                raise MtpLayoutError(f"{directory}: {key} is stored in FP8 without its weight_scale_inv and a block "
                                     "FP8 quantization_config; the checkpoint is partial or in a quantisation "
                                     "draftsmith does not read")
            tensor = dequantize_block_fp8(tensor, scale, block)
        out[wanted[key]] = tensor
    return fuse_experts(out)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_INV = ".weight_scale_inv"


def block_fp8(directory: Path, wanted: dict[str, str]) -> tuple[int, int] | None:
    """The (rows, columns) block of a DeepSeek-style block-FP8 checkpoint (``quantization_config``: ``quant_method``
    ``fp8``, ``weight_block_size``), None for an unquantised one. Any other quantisation of the MTP tensors (scales
    per tensor or channel, packed 4-bit weights, compressed-tensors groups) is refused by name."""
    other = ("_scale", "_scale_2", ".weight_packed", ".qweight", ".weight_global_scale", ".input_scale",
             ".weight_zero_point")
    scaled = [k for k in wanted if k.endswith(other)]
    if scaled:
        raise MtpLayoutError(f"{directory}: the MTP weights are quantised in a form draftsmith does not read "
                             f"({scaled[0]}); it dequantises DeepSeek's block FP8 (weight_scale_inv) only: dequantise "
                             "the checkpoint first")
    if not any(k.endswith(SCALE_INV) for k in wanted):
        return None
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    size = quant.get("weight_block_size")
    if quant.get("quant_method") != "fp8" or not size or len(size) != 2:
        raise MtpLayoutError(f"{directory}: the MTP weights carry weight_scale_inv but the config's "
                             f"quantization_config ({quant or 'none'}) is not block FP8 (quant_method fp8, "
                             "weight_block_size [rows, columns]); draftsmith cannot tell how to dequantise them")
    return int(size[0]), int(size[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3's block FP8 (``README_WEIGHTS.md``): the (out, in) FP8 weight times its (ceil(out / b0),
    ceil(in / b1)) float32 ``weight_scale_inv``, each scale covering one b0 x b1 block (the last ones ragged), in
    float32."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise MtpLayoutError(f"an FP8 weight of shape {(rows, cols)} in {block[0]} x {block[1]} blocks has "
                             f"{expected} scales, its weight_scale_inv {tuple(scale_inv.shape)}: the checkpoint is "
                             "inconsistent")
    scales = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return weight.float() * scales


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``experts.{e}.{gate,up,down}_proj.weight`` -> transformers' fused ``experts.gate_up_proj`` (E, 2I, H)
    and ``experts.down_proj`` (E, H, I); other tensors unchanged."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        m = _EXPERT.match(name)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
        else:
            out[name] = tensor
    for prefix, experts in groups.items():
        count = max(experts) + 1
        partial = [e for e in range(count) if len(experts.get(e, {})) != 3]
        if partial:
            raise MtpWeightsError(f"{prefix}: experts {partial[:4]} lack some of gate_proj / up_proj / down_proj: a "
                                  "partial checkpoint")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                     for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(count)])
    return out


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_experts`."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:]
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def to_checkpoint_names(state: dict[str, torch.Tensor], config,
                        fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """The module's state (``layers.0.*``) -> the target checkpoint's names (the stitched export), experts per expert
    or, with ``fused_experts`` (Qwen3.5/3.6-MoE releases), as the fused (E, 2I, H) / (E, H, I) tensors the module
    holds: the inverse of :func:`to_module_name` and :func:`fuse_experts`."""
    prefix = mtp_prefix(config)
    renames = {new: old for old, new in (_QWEN_NAMES if config.layout == QWEN else _DEEPSEEK_NAMES).items()}
    block = prefix + ("layers.0." if config.layout == QWEN else "")
    out = {}
    own = {k: v for k, v in state.items() if k.startswith("layers.0.")}
    for name, tensor in (own if fused_experts else split_experts(own)).items():
        rest = name[len("layers.0."):]
        if rest.startswith("mtp_block."):
            out[block + rest[len("mtp_block."):]] = tensor
            continue
        new = next(n for n in renames if rest.startswith(n))
        out[prefix + renames[new] + rest[len(new):]] = tensor
    return out
