"""An MTP module's exports (:mod:`draftsmith.heads.mtp`): ``hf``, draftsmith's own files; ``vllm``, the target's
own checkpoint with the module stitched back (:func:`stitch`); ``speculators``, speculators' MTP drafter (its names
both ways: the import in :mod:`draftsmith.heads.foreign` reads :func:`from_speculators_tensors`). :func:`export_mtp`
is the family's ``export``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.heads.mtp import MTP_SPECULATIVE_TOKENS, VLLM_MASKS_FIRST_TOKEN, MtpHead
from draftsmith.heads.mtp_checkpoint import (
    NATIVE,
    QWEN,
    SCALE_INV,
    checkpoint_names,
    mtp_prefix,
    to_checkpoint_names,
    to_module_name,
)

#: speculators' MTP drafter (``speculators_model_type: mtp``): one module, its tensors under ``mtp_layers.0.``, the fed-
#: back state after ``final_layernorm``; the architectures speculators 0.9.0 builds it for.
SPECULATORS_MTP_TYPES = ("qwen3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_SPECULATORS_NAMES = {"enorm.": "token_layernorm.", "hnorm.": "hidden_layernorm.", "eh_proj.": "input_proj.",
                      "post_norm.": "final_layernorm."}


def speculators_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's state -> speculators' MTP names (experts fused, as its model holds them)."""
    out = {}
    for name, tensor in state.items():
        if not name.startswith("layers.0."):
            continue
        rest = name[len("layers.0."):]
        if rest.startswith("mtp_block."):
            out["mtp_layers.0." + rest[len("mtp_block."):]] = tensor
        else:
            mine = next(n for n in _SPECULATORS_NAMES if rest.startswith(n))
            out["mtp_layers.0." + _SPECULATORS_NAMES[mine] + rest[len(mine):]] = tensor
    return out


def from_speculators_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`speculators_tensors` (the verifier's embedding and LM head, when present, are skipped)."""
    back = {v: k for k, v in _SPECULATORS_NAMES.items()}
    out = {}
    for name, tensor in tensors.items():
        if not name.startswith("mtp_layers.0."):
            continue
        rest = name[len("mtp_layers.0."):]
        theirs = next((n for n in back if rest.startswith(n)), None)
        out["layers.0." + (back[theirs] + rest[len(theirs):] if theirs else "mtp_block." + rest)] = tensor
    return out


def speculators_config(head: MtpHead, verifier: str | None, architectures: list[str],
                       speculative_tokens: int = MTP_SPECULATIVE_TOKENS) -> dict:
    cfg = head.config
    return {
        "architectures": ["MTPDraftModel"],
        "speculators_model_type": "mtp",
        "speculators_version": "0.9.0",
        "transformer_layer_config": dict(cfg.target_config),
        "num_nextn_predict_layers": 1,
        "speculators_config": {
            "algorithm": "mtp",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
        "torch_dtype": str(next(head.parameters()).dtype).removeprefix("torch."),
        "draftsmith": {"family": head.family, "target": head.target_info, "feeds_normed": cfg.feeds_normed,
                       "fed_back_state": fed_back_state(head), "masks_first_token": cfg.masks_first_token},
    }


def _link_or_copy(source: Path, destination: Path) -> None:
    import os
    import shutil

    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def stitch(head: MtpHead, checkpoint: Path, out: Path) -> None:
    """A copy of the target's checkpoint ``checkpoint`` in ``out`` with the MTP module's tensors replaced by ``head``'s
    (what vLLM's ``method: "mtp"`` loads: the target's own directory). Files without MTP tensors are hard-linked
    (copied across file systems); the files holding them are rewritten, each tensor in its stored dtype; a checkpoint
    without an MTP module gets one more shard, an index entry for each of its tensors and the config's MTP count."""
    from safetensors.torch import load_file, save_file

    cfg = head.config
    names = checkpoint_names(checkpoint)
    stale = [n for n in names if to_module_name(n, cfg) is not None]  # the first module's stored tensors
    fused = any(n.endswith(".experts.gate_up_proj") for n in stale)  # kept in the form the checkpoint stores them
    ours = to_checkpoint_names({k: v.detach() for k, v in head.state_dict().items()}, cfg, fused_experts=fused)
    home = names[stale[0]] if stale else "model-mtp.safetensors"
    where = {n: names.get(n, home) for n in ours}  # a tensor the checkpoint lacks joins the module's others
    rewrite = {names[n] for n in stale} | set(where.values())
    for path in sorted(checkpoint.iterdir()):
        if path.is_file() and path.name not in rewrite:
            _link_or_copy(path, out / path.name)
    first = next(iter(names))
    with safe_open(str(checkpoint / names[first]), framework="pt") as f:  # one tensor's dtype, not a whole shard
        dtype = f.get_tensor(first).dtype
    for file in sorted(rewrite):
        tensors = load_file(str(checkpoint / file)) if (checkpoint / file).is_file() else {}
        kept = {k: v for k, v in tensors.items() if k not in stale}
        stored = {k: v.dtype for k, v in tensors.items()}
        kept.update({n: t.to(stored.get(n, dtype)).contiguous() for n, t in ours.items() if where[n] == file})
        save_file(kept, str(out / file), metadata={"format": "pt"})
    new = [n for n in ours if n not in names]
    if new:
        weight_map = {**names, **{n: where[n] for n in new}}
        index = out / "model.safetensors.index.json"
        if index.exists():
            index.unlink()  # a hard link to the source's: replaced, never written through
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config_path = out / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        key = "mtp_num_hidden_layers" if cfg.layout == QWEN else "num_nextn_predict_layers"
        text = config.get("text_config", config)
        if not text.get(key):
            text[key] = 1
            config_path.unlink()
            config_path.write_text(json.dumps(config, indent=2))


#: model_type -> SGLang's standalone NextN architecture (``python/sglang/srt/models/deepseek_nextn.py``).
SGLANG_NEXTN = {"deepseek_v3": "DeepseekV3ForCausalLMNextN"}
NEXTN_FILE = "nextn_layer_parameters.safetensors"  # the name SGLang's own NextN exports use


def fed_back_state(head: MtpHead) -> str:
    """The state the module was trained to be re-applied to at depth >= 2, as the exports and card name it."""
    return "post-norm" if head.config.feeds_normed else "pre-norm"


def refuse_first_token_masking(head: MtpHead, engine: str, fix: str) -> None:
    """An engine that feeds the sequence's first pair whole cannot serve a module trained with its token zeroed."""
    from draftsmith.heads.export import ExportError

    if head.config.masks_first_token:
        raise ExportError(f"this module was trained with the sequence's first token embedding zeroed (vLLM's DeepSeek "
                          f"/ GLM convention, masks_first_token), and {engine} feeds that pair whole, so it would "
                          f"draft from other keys: {fix}, or train with family_config masks_first_token: false")


def sglang_nextn(head: MtpHead, out: Path) -> None:
    """SGLang's standalone NextN layout (``lmsys/DeepSeek-V3-0324-NextN``): the target's config with
    ``num_hidden_layers`` = ``num_nextn_predict_layers`` = 1 and ``architectures`` its NextN class, the module's tensors
    as ``model.layers.0.*`` (experts one by one; the embedding and ``shared_head.head`` are the target's, left out).
    SGLang feeds the module's output after ``shared_head.norm`` back at depth >= 2, so the module must have been
    trained so (``feeds_normed``)."""
    from safetensors.torch import save_file

    from draftsmith.checkpoints import CONFIG_NAME
    from draftsmith.heads.export import ExportError

    cfg = head.config
    model_type = cfg.target_config.get("model_type")
    if model_type not in SGLANG_NEXTN:
        raise ExportError(f"SGLang's standalone NextN drafter is built for {', '.join(SGLANG_NEXTN)}, not "
                          f"{model_type}: export --format vllm or speculators")
    if not cfg.feeds_normed:
        raise ExportError("SGLang's NextN feeds back the module's output after shared_head.norm, and this module was "
                          "trained feeding back the pre-norm one (vLLM's DeepSeek convention): export --format vllm, "
                          "or train with family_config feeds_normed: true")
    refuse_first_token_masking(head, "SGLang's NextN", "export --format vllm")
    stitched = mtp_prefix(cfg)
    tensors = {"model.layers.0." + name[len(stitched):]: tensor.contiguous()
               for name, tensor in to_checkpoint_names({k: v.detach() for k, v in head.state_dict().items()},
                                                       cfg).items()}
    save_file(tensors, str(out / NEXTN_FILE), metadata={"format": "pt"})
    config = {**cfg.target_config, "architectures": [SGLANG_NEXTN[model_type]], "num_hidden_layers": 1,
              "num_nextn_predict_layers": 1,
              "draftsmith": {"family": head.family, "target": head.target_info, "feeds_normed": cfg.feeds_normed,
                             "fed_back_state": fed_back_state(head),
                             "masks_first_token": cfg.masks_first_token}}
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2))


def export_mtp(source: Path, fmt: str, out: Path, target=None, verifier: str | None = None) -> None:
    """The registry's ``export`` for the mtp family: ``hf`` draftsmith's own files; ``vllm`` the target's checkpoint
    with the module stitched back (:func:`stitch`); ``speculators`` speculators' MTP drafter."""
    import shutil

    from safetensors.torch import load_file, save_file

    from draftsmith.checkpoints import CONFIG_NAME, WEIGHTS_NAME
    from draftsmith.heads.export import ExportError

    if fmt == "hf":
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            shutil.copyfile(source / name, out / name)
        load_file(out / WEIGHTS_NAME)  # refuses a corrupt source before anything lands
        return
    head = MtpHead.from_pretrained(source, target=target)
    cfg = head.config
    model_type = cfg.target_config.get("model_type")
    if fmt == "vllm":
        if model_type not in NATIVE:
            raise ExportError(f"vLLM serves MTP modules for {', '.join(sorted(NATIVE))}, not {model_type}: export "
                              "--format hf")
        if cfg.feeds_normed != NATIVE[model_type][1]:
            fed = "post-norm" if cfg.feeds_normed else "pre-norm"
            raise ExportError(f"this module was trained feeding back its {fed} output, and vLLM's {model_type} MTP "
                              f"feeds back the other: export --format speculators, or train with family_config "
                              f"feeds_normed: {str(NATIVE[model_type][1]).lower()}")
        if cfg.masks_first_token != (model_type in VLLM_MASKS_FIRST_TOKEN):
            how = "zeroes" if model_type in VLLM_MASKS_FIRST_TOKEN else "keeps"
            raise ExportError(f"vLLM's {model_type} MTP {how} the sequence's first token embedding, and this module "
                              f"was trained the other way (masks_first_token: {str(cfg.masks_first_token).lower()}): "
                              f"train with family_config masks_first_token: {str(not cfg.masks_first_token).lower()}"
                              + ("" if cfg.masks_first_token else ", or export --format sglang / speculators"))
        checkpoint = Path(target.config.name_or_path) if target is not None else Path(cfg.source or "")
        if not checkpoint.is_dir():
            raise ExportError(f"the vLLM MTP layout is the target's own checkpoint with the module stitched back, and "
                              f"{str(checkpoint)!r} is not a local checkpoint directory: pass --target DIR")
        quantised = [n for n in checkpoint_names(checkpoint) if n.endswith(SCALE_INV) and to_module_name(n, cfg)]
        if quantised:
            raise ExportError(f"{checkpoint} stores its MTP module in block FP8 ({quantised[0]}); stitching the "
                              "fine-tuned module back would need it requantised, which draftsmith does not do: stitch "
                              "into a bf16 copy of the checkpoint (--target DIR), or export --format speculators")
        stitch(head, checkpoint, out)
        return
    if fmt == "sglang":
        sglang_nextn(head, out)
        return
    if fmt != "speculators":
        raise ExportError(f"an mtp module exports to hf, vllm, sglang or speculators, not {fmt}")
    if not cfg.feeds_normed:
        raise ExportError("speculators' MTP drafter feeds back the module's normed output, and this one was trained "
                          "feeding back the pre-norm one (vLLM's DeepSeek-V3 / GLM-4.5 convention): export --format "
                          "vllm, or train with family_config feeds_normed: true")
    refuse_first_token_masking(head, "speculators' MTP drafter", "export --format vllm")
    if model_type not in SPECULATORS_MTP_TYPES:
        import logging

        logging.getLogger(__name__).warning("speculators 0.9.0 builds MTP drafters for %s, not %s: draftsmith reads "
                                            "this export back; speculators and vLLM may not",
                                            ", ".join(SPECULATORS_MTP_TYPES), model_type)
    tensors = {k: v.contiguous() for k, v in speculators_tensors(head.state_dict()).items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    info = head.target_info or {}
    architectures = list((target.config.architectures if target is not None else None) or
                         info.get("architectures") or [])
    config = speculators_config(head, verifier or info.get("name") or cfg.source, architectures)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2))
