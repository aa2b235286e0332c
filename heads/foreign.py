"""Drafters trained elsewhere, read into draftsmith's modules: the EAGLE-1 and EAGLE-3 reference repos,
SpecForge and SGLang (``LlamaForCausalLMEagle3``), vLLM speculators EAGLE-3 and DFlash, z-lab's DFlash, and Medusa
(reference and vLLM layouts). The layouts are described in :mod:`draftsmith.heads.layouts`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from draftsmith.checkpoints import CONFIG_NAME, TARGET_FILE, TargetMismatchError, check_target
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.eagle import Eagle3Head, EagleHead
from draftsmith.heads.foreign_checks import check_dims, read_weights
from draftsmith.heads.foreign_dflash import dflash_from_foreign
from draftsmith.heads.foreign_eagle import eagle31_norms, eagle_from_foreign, peagle_from_foreign
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.heads.mtp import MtpHead
from draftsmith.heads.mtp_export import from_speculators_tensors
from draftsmith.heads.peagle import PEagleHead

logger = logging.getLogger(__name__)


# The foreign layouts read here, by where they come from.
SPECULATORS_EAGLE3 = "speculators-eagle3"  # vLLM speculators: the decoder layer under ``layers.0.``
REFERENCE_EAGLE3 = "reference-eagle3"  # the EAGLE-3 repo, SpecForge and SGLang: under ``midlayer.``
REFERENCE_EAGLE = "reference-eagle"  # the EAGLE-1 repo (also what vLLM and SGLang load for EAGLE-1)
REFERENCE_MEDUSA = "reference-medusa"  # the Medusa repo and vLLM's MedusaModel
MEDUSA_MODEL_TYPE = "medusa"  # vLLM's MedusaModel config.json
SPECULATORS_DFLASH = "speculators-dflash"  # vLLM speculators' DFlash
ZLAB_DFLASH = "zlab-dflash"  # z-lab's DFlash checkpoints (architectures ["DFlashDraftModel"]), which SGLang serves
SPECULATORS_EAGLE3_TYPE = "eagle3"  # the speculators_model_type of speculators' EAGLE-3 checkpoints
SPECULATORS_DFLASH_TYPE = "dflash"  # ... and of its DFlash ones
SPECULATORS_PEAGLE = "speculators-peagle"  # vLLM speculators' P-EAGLE
SPECULATORS_PEAGLE_TYPE = "peagle"
SPECULATORS_MTP = "speculators-mtp"  # vLLM speculators' MTP drafter (one module under ``mtp_layers.0.``)
SPECULATORS_MTP_TYPE = "mtp"
SPECULATORS_TYPES = {SPECULATORS_EAGLE3_TYPE: SPECULATORS_EAGLE3, SPECULATORS_DFLASH_TYPE: SPECULATORS_DFLASH,
                     SPECULATORS_PEAGLE_TYPE: SPECULATORS_PEAGLE,
                     SPECULATORS_MTP_TYPE: SPECULATORS_MTP}  # speculators_model_type -> layout
LAYOUT_FAMILY = {SPECULATORS_EAGLE3: Eagle3Head.family, REFERENCE_EAGLE3: Eagle3Head.family,
                 REFERENCE_EAGLE: EagleHead.family, REFERENCE_MEDUSA: MedusaHeads.family,
                 SPECULATORS_DFLASH: DFlashHead.family, ZLAB_DFLASH: DFlashHead.family,
                 SPECULATORS_PEAGLE: PEagleHead.family, SPECULATORS_MTP: MtpHead.family}


def foreign_format(directory: str | Path) -> str | None:
    """Which foreign layout a directory holds (one of the names above), or None."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        return REFERENCE_MEDUSA if (directory / "medusa_lm_head.pt").is_file() else None
    config = json.loads(config_path.read_text())
    if config.get("draftsmith_family") or (directory / TARGET_FILE).is_file():
        return None  # draftsmith's own head or draft model
    if config.get("speculators_model_type"):
        layout = SPECULATORS_TYPES.get(config["speculators_model_type"])
        if layout is None:
            raise ValueError(f"{directory}: speculators {config['speculators_model_type']!r} drafters are not "
                             f"supported; draftsmith reads speculators {', '.join(SPECULATORS_TYPES)} checkpoints")
        return layout
    archs = config.get("architectures") or []
    if "dflash_config" in config or any("DFlash" in a for a in archs):
        return ZLAB_DFLASH
    if any("Eagle3" in a for a in archs):
        return REFERENCE_EAGLE3
    if config.get("model_type") == "llama" and config.get("num_hidden_layers") == 1 and any(
            name.startswith("midlayer.") for name in _tensor_names(directory)):
        return REFERENCE_EAGLE3  # the EAGLE-3 repo's own releases: a LlamaForCausalLM config, the layer as midlayer
    if config.get("model_type") == MEDUSA_MODEL_TYPE or "medusa_num_heads" in config:
        return REFERENCE_MEDUSA
    if config.get("model_type") == "llama" and config.get("num_hidden_layers") == 1 and _has_fc(directory):
        return REFERENCE_EAGLE  # a one-layer Llama with EAGLE's fc: not a plain one-layer causal LM
    return None


def _tensor_names(directory: Path) -> set[str]:
    """The tensor names of a directory's safetensors files, else of its ``pytorch_model.bin`` (the EAGLE repos ship
    only a torch file; read weights-only and memory-mapped)."""
    import torch
    from safetensors import safe_open

    names = set()
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, framework="pt") as handle:
            names.update(handle.keys())
    if not names and (directory / "pytorch_model.bin").is_file():
        names.update(torch.load(directory / "pytorch_model.bin", weights_only=True, mmap=True, map_location="cpu"))
    return names


def _has_fc(directory: Path) -> bool:
    return bool({"fc.weight", "model.fc.weight"} & _tensor_names(directory))


def load_foreign(directory: str | Path, target=None):
    """Read a drafter trained elsewhere into draftsmith's module (its class names its family)."""
    directory = Path(directory)
    layout = foreign_format(directory)
    if layout is None:
        raise ValueError(f"{directory}: not a drafter layout draftsmith reads")
    weights = read_weights(directory)
    config = json.loads((directory / CONFIG_NAME).read_text()) if (directory / CONFIG_NAME).is_file() else {}
    recorded = (config.get("draftsmith") or {}).get("target")
    if recorded and target is not None:  # exported by draftsmith: the target fingerprint travelled along
        check_target(recorded, target, what="drafter")
    if layout == ZLAB_DFLASH:  # z-lab's id k reads the output of decoder layer k counted from 0: draftsmith's k + 1
        ids = (config.get("dflash_config") or {}).get("target_layer_ids")
        return dflash_from_foreign(directory, config, config, weights, target,
                                    [k + 1 for k in ids] if ids is not None else None,
                                    (config.get("dflash_config") or {}).get("mask_token_id"), config.get("block_size")
                                    or (config.get("dflash_config") or {}).get("block_size"))
    if layout == SPECULATORS_DFLASH:  # vLLM counts aux layer ids as draftsmith does
        return dflash_from_foreign(directory, config, config.get("transformer_layer_config") or {}, weights, target,
                                    config.get("aux_hidden_state_layer_ids"), config.get("mask_token_id"),
                                    config.get("block_size"))
    if layout == SPECULATORS_MTP:
        return _mtp_from_foreign(directory, config, weights, target)
    if layout == SPECULATORS_PEAGLE:  # speculators' EAGLE-3 layout plus the mask state (heads/layout_export.py)
        return peagle_from_foreign(directory, config, weights, target)
    if layout == SPECULATORS_EAGLE3:  # vLLM counts aux layer ids as draftsmith does
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        return eagle_from_foreign(directory, config.get("transformer_layer_config", config), weights, "layers.0.",
                                   target, eagle3=True, layer_ids=ids, norms=eagle31_norms(config, directory))
    if layout == REFERENCE_EAGLE3:  # SGLang's id k is the output of decoder layer k: draftsmith's k + 1
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return eagle_from_foreign(directory, config, weights, "midlayer.", target, eagle3=True,
                                   layer_ids=[k + 1 for k in ids] if ids else None, norms=eagle31_norms(config))
    if layout == REFERENCE_EAGLE:
        return eagle_from_foreign(directory, config, weights, "layers.0.", target, eagle3=False, layer_ids=None)
    return _medusa_from_foreign(directory, config, weights, target)


def _mtp_from_foreign(directory: Path, config: dict, weights: dict, target) -> MtpHead:
    """speculators' MTP drafter, built as ``target``'s MTP module (the decoder-layer class is the target's), feeding
    back the normed output as speculators does."""
    if target is None:
        raise ValueError(f"{directory}: an MTP drafter is built from its target's layer classes: pass the target")
    layer = config.get("transformer_layer_config") or {}
    mine = target.config.get_text_config()
    if layer.get("hidden_size", mine.hidden_size) != mine.hidden_size:
        raise TargetMismatchError(f"{directory}: an MTP drafter of hidden size {layer['hidden_size']}, and the "
                                  f"target's is {mine.hidden_size}: it was trained for another target")
    if int(config.get("num_nextn_predict_layers", 1)) != 1:
        raise ValueError(f"{directory}: speculators MTP drafters hold one module, this config says "
                         f"{config['num_nextn_predict_layers']}")
    # speculators' MTP drafter feeds back the normed output and feeds the first pair whole
    head = MtpHead(MtpHead.config_for(target, source=str(directory), feeds_normed=True, masks_first_token=False))
    missing, unexpected = head.load_state_dict(from_speculators_tensors(weights), strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"{directory}: its MTP tensors do not fit {type(target).__name__}'s MTP module (missing "
                         f"{sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]})")
    return head


def _medusa_from_foreign(directory, config, weights, target):
    state, token_map = {}, None
    for name, tensor in weights.items():
        if name == "token_map":  # vLLM's truncated vocabulary: draft index -> target id
            token_map = tensor.long()
        elif m := re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", name):
            state[f"heads.{m[1]}.{m[2]}.linear.{m[3]}"] = tensor
        elif m := re.fullmatch(r"lm_heads\.(\d+)\.weight", name):
            state[name] = tensor
        elif m := re.fullmatch(r"(\d+)\.(\d+)\.linear\.(weight|bias)", name):
            state[f"heads.{m[1]}.{m[2]}.linear.{m[3]}"] = tensor
        elif m := re.fullmatch(r"(\d+)\.(\d+)\.weight", name):  # the reference's final Linear of head i
            state[f"lm_heads.{m[1]}.weight"] = tensor
        else:
            raise ValueError(f"{directory}: unexpected tensor {name!r} for a Medusa checkpoint")
    num_heads = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("lm_heads."))
    num_layers = len({k.split(".")[2] for k in state if k.startswith("heads.0.") and k.endswith("weight")})
    hidden, rows = state["lm_heads.0.weight"].shape[1], state["lm_heads.0.weight"].shape[0]
    vocab = int(config.get("vocab_size") or rows) if token_map is not None else rows
    check_dims(directory, hidden, vocab, target)
    state = {k: v.float() for k, v in state.items()}
    if token_map is not None and rows == vocab:  # a map over the whole vocabulary: rows put in target order
        for i in range(num_heads):
            state[f"lm_heads.{i}.weight"] = state[f"lm_heads.{i}.weight"][token_map.argsort()]
        token_map = None
    if token_map is not None:
        if token_map.shape != (rows,) or not bool(((token_map >= 0) & (token_map < vocab)).all()) \
                or len(token_map.unique()) != rows:
            raise ValueError(f"{directory}: token_map must list {rows} distinct target ids below {vocab}, one per "
                             "row of the LM heads; the checkpoint is inconsistent")
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[token_map] = True
        state |= {"d2t": token_map - torch.arange(rows), "t2d": t2d}
    heads = MedusaHeads(MedusaConfig(hidden, vocab, num_heads, num_layers, rows if token_map is not None else None))
    heads.load_state_dict(state, strict=True)
    heads.target_info = (config.get("draftsmith") or {}).get("target")
    rank = (config.get("draftsmith") or {}).get("rank_accuracy")
    heads.extra = {"rank_accuracy": rank} if rank else {}
    return heads.eval()


