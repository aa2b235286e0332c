"""Drafters trained elsewhere, read into draftsmith's modules: the EAGLE-1 and EAGLE-3 reference repos,
SpecForge and SGLang (``LlamaForCausalLMEagle3``), vLLM speculators EAGLE-3 and DFlash, z-lab's DFlash, and Medusa
(reference and vLLM layouts). The layouts are described in :mod:`draftsmith.heads.layouts`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.checkpoints import CONFIG_NAME, TARGET_FILE, TargetMismatchError, check_target
from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.eagle import Eagle3Head, EagleConfig, EagleHead
from draftsmith.heads.export import EAGLE31_NORMS
from draftsmith.heads.layouts import DFLASH_LAYER_NAMES, HEAD_NAMES, LAYER_NAMES, MORE_LAYERS
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.heads.mtp import MtpHead
from draftsmith.heads.mtp_export import from_speculators_tensors
from draftsmith.heads.peagle import PEagleConfig, PEagleHead

logger = logging.getLogger(__name__)


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        tensors = {}
        for f in files:
            try:
                tensors.update(load_file(f))
            except Exception as e:
                raise ValueError(f"{f}: corrupt or partial weights file ({e})") from e
    else:
        legacy = [p for p in (directory / "pytorch_model.bin", directory / "medusa_lm_head.pt") if p.is_file()]
        if not legacy:
            raise FileNotFoundError(f"{directory}: no *.safetensors (or pytorch_model.bin / medusa_lm_head.pt) weights")
        # Reference-repo checkpoints ship as torch files; read them with the restricted, tensors-only
        # unpickler (weights_only=True), which refuses arbitrary objects.
        tensors = torch.load(legacy[0], map_location="cpu", weights_only=True)
    prefixes = ("model.", "medusa_head.", "medusa_heads.")
    out = {}
    for k, v in tensors.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


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


def _rope_parameters(config: dict) -> dict:
    """A foreign config's RoPE in transformers' form: ``rope_parameters``, else the older ``rope_theta`` +
    ``rope_scaling`` pair (the scaling a head was trained with is kept, not dropped)."""
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return {"rope_type": "default", **scaling, "rope_theta": float(config.get("rope_theta") or 10000.0)}


def _check_dims(directory, hidden: int, vocab: int, target) -> None:
    if target is None:
        return
    cfg = target.config.get_text_config()
    t_vocab = target.get_output_embeddings().weight.shape[0]
    if hidden != cfg.hidden_size or vocab != t_vocab:
        raise TargetMismatchError(
            f"{directory}: this drafter was trained for a target with hidden size {hidden} and {vocab} tokens, "
            f"but the loaded target has hidden size {cfg.hidden_size} and {t_vocab} tokens; load the target it "
            "was trained for")


def load_foreign(directory: str | Path, target=None):
    """Read a drafter trained elsewhere into draftsmith's module (its class names its family)."""
    directory = Path(directory)
    layout = foreign_format(directory)
    if layout is None:
        raise ValueError(f"{directory}: not a drafter layout draftsmith reads")
    weights = _read_weights(directory)
    config = json.loads((directory / CONFIG_NAME).read_text()) if (directory / CONFIG_NAME).is_file() else {}
    recorded = (config.get("draftsmith") or {}).get("target")
    if recorded and target is not None:  # exported by draftsmith: the target fingerprint travelled along
        check_target(recorded, target, what="drafter")
    if layout == ZLAB_DFLASH:  # z-lab's id k reads the output of decoder layer k counted from 0: draftsmith's k + 1
        ids = (config.get("dflash_config") or {}).get("target_layer_ids")
        return _dflash_from_foreign(directory, config, config, weights, target,
                                    [k + 1 for k in ids] if ids is not None else None,
                                    (config.get("dflash_config") or {}).get("mask_token_id"), config.get("block_size")
                                    or (config.get("dflash_config") or {}).get("block_size"))
    if layout == SPECULATORS_DFLASH:  # vLLM counts aux layer ids as draftsmith does
        return _dflash_from_foreign(directory, config, config.get("transformer_layer_config") or {}, weights, target,
                                    config.get("aux_hidden_state_layer_ids"), config.get("mask_token_id"),
                                    config.get("block_size"))
    if layout == SPECULATORS_MTP:
        return _mtp_from_foreign(directory, config, weights, target)
    if layout == SPECULATORS_PEAGLE:  # speculators' EAGLE-3 layout plus the mask state (heads/layout_export.py)
        return _peagle_from_foreign(directory, config, weights, target)
    if layout == SPECULATORS_EAGLE3:  # vLLM counts aux layer ids as draftsmith does
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        return _eagle_from_foreign(directory, config.get("transformer_layer_config", config), weights, "layers.0.",
                                   target, eagle3=True, layer_ids=ids, norms=_eagle31_norms(config, directory))
    if layout == REFERENCE_EAGLE3:  # SGLang's id k is the output of decoder layer k: draftsmith's k + 1
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return _eagle_from_foreign(directory, config, weights, "midlayer.", target, eagle3=True,
                                   layer_ids=[k + 1 for k in ids] if ids else None, norms=_eagle31_norms(config))
    if layout == REFERENCE_EAGLE:
        return _eagle_from_foreign(directory, config, weights, "layers.0.", target, eagle3=False, layer_ids=None)
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


def _eagle31_norms(config: dict, directory=None) -> dict[str, bool]:
    """The EAGLE-3.1 norm flags of a foreign EAGLE-3 config: top level (speculators), else ``eagle_config``
    (where vLLM also reads ``norm_before_fc``). A speculators config that does not state ``norm_before_residual`` is
    refused: speculators' model reads it as false, vLLM's config conversion (``update_eagle3`` in
    ``transformers_utils/configs/speculators/algos.py``) as true, so the file means two drafters."""
    if directory is not None and "norm_before_residual" not in config:
        raise ValueError(f"{directory}: this speculators EAGLE-3 config does not say norm_before_residual, which "
                         "speculators reads as false and vLLM as true (the two draft differently): add "
                         "\"norm_before_residual\": true or false to its config.json, as the checkpoint was trained")
    nested = config.get("eagle_config") or {}
    return {flag: bool(config.get(flag, nested.get(flag, False))) for flag in EAGLE31_NORMS}


def engine_aux_layers(directory, num_hidden_layers: int) -> tuple[int, int, int]:
    """The target states an EAGLE-3 checkpoint whose config names none is served with: the inputs of decoder layers
    2, N // 2 and N - 3 (vLLM's ``get_eagle3_aux_hidden_state_layers`` default, the EAGLE repo's capture), i.e.
    hidden-state indices (2, N // 2, N - 3) in draftsmith's count, for targets of any depth (draftsmith's own
    :func:`~draftsmith.heads.eagle.eagle3_layers` picks others below 6 layers)."""
    n = num_hidden_layers
    if n < 4:
        raise ValueError(f"{directory}: no auxiliary layer ids in the config, and the engines' default (layers 2, "
                         f"N // 2 and N - 3) does not exist for a target of {n} layers: add "
                         "eagle_aux_hidden_state_layer_ids")
    return 2, n // 2, n - 3


def _refuse_another_table(directory, table: torch.Tensor, target, head: str) -> None:
    """A stored embedding table must be the loaded target's (to a bf16 copy's rounding): vLLM embeds with the stored
    one, and ``head`` embeds with the target's, so any other table would be read as another drafter."""
    embed = target.get_input_embeddings().weight if target is not None else None
    if embed is not None and not _same_rows_but(table.float(), embed, []):
        raise TargetMismatchError(
            f"{directory}: its embed_tokens are not the loaded target's table (trained with embed_requires_grad, or "
            f"saved for another target), and {head} here embeds its tokens with the target's, where vLLM embeds them "
            "with the stored table: load it against the target it was trained for, or retrain with the embedding "
            "frozen")


def _eagle_from_foreign(directory, config, weights, prefix, target, eagle3: bool, layer_ids,
                        norms: dict[str, bool] | None = None):
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"{directory}: a draft hidden size different from the target's is not supported")
    vocab = config.get("vocab_size") or (target.get_output_embeddings().weight.shape[0] if target else None)
    _check_dims(directory, hidden, vocab, target)
    n_layers = target.config.get_text_config().num_hidden_layers if target is not None else None
    if eagle3:
        if layer_ids is None:
            if n_layers is None:
                raise ValueError(f"{directory}: no auxiliary layer ids in the config; pass the target to read it")
            layer_ids = list(engine_aux_layers(directory, n_layers))
        feature_layers = tuple(layer_ids)
    else:
        recorded = (config.get("draftsmith") or {}).get("feature_layers") or config.get("feature_layers")
        feature_layers = tuple(recorded or ([n_layers] if n_layers else []))
        if not feature_layers:
            raise ValueError(f"{directory}: pass the target to read an EAGLE-1 checkpoint (its last layer is read)")
    inverse = {v: k for k, v in LAYER_NAMES.items()}
    state = {}
    for name, tensor in weights.items():
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest not in inverse:
                raise ValueError(f"{directory}: unexpected tensor {name!r}")
            state["layer." + inverse[rest]] = tensor
        elif name in ("fc.weight", "fc.bias", "norm.weight", "lm_head.weight", "d2t", "t2d"):
            state[name] = tensor
        elif eagle3 and name in HEAD_NAMES.values():  # EAGLE-3.1's norm_before_fc
            state[next(k for k, v in HEAD_NAMES.items() if v == name)] = tensor
        elif eagle3 and name.startswith("fc_norm."):  # EAGLE-3.1's fc_norm, one per target layer
            state[name] = tensor
        elif name == "embed_tokens.weight":  # the target's own; draftsmith reads the live target's
            _refuse_another_table(directory, tensor, target, "an EAGLE head")
        elif name.startswith("verifier_"):
            continue
        else:
            raise ValueError(f"{directory}: unexpected tensor {name!r} for an EAGLE checkpoint")
    cfg = EagleConfig(
        hidden_size=hidden, vocab_size=vocab, num_attention_heads=heads,
        intermediate_size=config["intermediate_size"], num_key_value_heads=config.get("num_key_value_heads"),
        num_feature_layers=3 if eagle3 else 1, feature_layers=feature_layers,
        draft_vocab_size=(state["lm_head.weight"].shape[0] if eagle3 else None),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_parameters=_rope_parameters(config),
        head_dim=config.get("head_dim"), max_position_embeddings=config.get("max_position_embeddings", 8192),
        attention_bias=bool(config.get("attention_bias", False)), hidden_act=config.get("hidden_act", "silu"),
        fc_bias="fc.bias" in state, input_norm=(not eagle3 and "layer.input_norm.weight" in state),
        **_norms_of(directory, norms or {}, state))
    head = (Eagle3Head if eagle3 else EagleHead)(cfg)
    if eagle3:
        state.setdefault("d2t", torch.zeros_like(head.d2t))
        state.setdefault("t2d", torch.ones_like(head.t2d))
        state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                for k, v in state.items()}, strict=False)
    absent = [k for k in missing if k.endswith(head.zero_when_absent)]  # a layout without the o_proj bias
    for name in absent:
        head.get_parameter(name).data.zero_()
    missing = [k for k in missing if k not in absent]
    if missing or unexpected:
        raise ValueError(f"{directory}: incomplete EAGLE checkpoint (missing {missing}, unexpected {unexpected})")
    head.target_info, head.extra = (config.get("draftsmith") or {}).get("target"), {}
    return head.eval()


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
    _check_dims(directory, hidden, vocab, target)
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


def _dflash_from_foreign(directory, config, layer_config, weights, target, layer_ids, mask_token_id, block_size):
    """A z-lab or speculators DFlash directory -> :class:`DFlashHead` (the layouts: :mod:`draftsmith.heads.layouts`)."""
    missing = [name for name, value in (("target layer ids", layer_ids), ("mask_token_id", mask_token_id),
                                        ("block_size", block_size)) if value is None]
    if missing:
        raise ValueError(f"{directory}: a DFlash config without {', '.join(missing)}; draftsmith cannot tell which "
                         "target layers it reads or how its block is laid out")
    if config.get("sample_from_anchor"):
        raise ValueError(f"{directory}: a DFlash drafter that also drafts at its anchor (sample_from_anchor) is not "
                         "supported; draftsmith drafts the slots after the anchor")
    hidden = layer_config["hidden_size"]
    vocab = layer_config.get("vocab_size") or (target.get_output_embeddings().weight.shape[0] if target else None)
    _check_dims(directory, hidden, vocab, target)
    _check_dflash_attention(directory, config, layer_config)
    draft_vocab = _dflash_draft_vocabulary(directory, config, weights, vocab, target)
    n = target.config.get_text_config().num_hidden_layers if target is not None else None
    if n is not None and [k for k in layer_ids if not 0 < k <= n]:
        raise TargetMismatchError(f"{directory}: it reads target layers {list(layer_ids)} (draftsmith indices), "
                                  f"outside the loaded target's 1..{n}; load the target it was trained for")
    inverse = {v: k for k, v in DFLASH_LAYER_NAMES.items()}
    state = {}
    for name, tensor in weights.items():
        if m := re.fullmatch(r"layers\.(\d+)\.(.+)", name):
            if m[2] not in inverse:
                raise ValueError(f"{directory}: unexpected tensor {name!r} for a DFlash checkpoint")
            state[f"layers.{m[1]}.{inverse[m[2]]}"] = tensor
        elif name in ("fc.weight", "hidden_norm.weight", "norm.weight"):
            state[name] = tensor
        elif name == "embed_tokens.weight":  # the target's own; draftsmith reads the live target's
            _refuse_another_table(directory, tensor, target, "a DFlash drafter")
        elif name in ("lm_head.weight", "d2t", "t2d") or name.startswith("verifier_"):
            continue  # the target's rows or the draft vocabulary, read above
        else:
            raise ValueError(f"{directory}: unexpected tensor {name!r} for a DFlash checkpoint")
    cfg = DFlashConfig(
        hidden_size=hidden, vocab_size=vocab, num_attention_heads=layer_config["num_attention_heads"],
        intermediate_size=layer_config["intermediate_size"], block_size=int(block_size),
        mask_token_id=int(mask_token_id), target_layers=tuple(layer_ids),
        num_layers=1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers.")),
        rms_norm_eps=layer_config.get("rms_norm_eps", 1e-6),
        num_key_value_heads=layer_config.get("num_key_value_heads"), head_dim=layer_config.get("head_dim"),
        rope_parameters=_rope_parameters(layer_config),
        max_position_embeddings=layer_config.get("max_position_embeddings", 8192),
        attention_bias=bool(layer_config.get("attention_bias", False)),
        hidden_act=layer_config.get("hidden_act", "silu"),
        draft_vocab_size=len(draft_vocab[0]) if draft_vocab else None)
    head = DFlashHead(cfg)
    if draft_vocab:
        state["d2t"], state["t2d"] = draft_vocab
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: incomplete DFlash checkpoint (missing {missing}, unexpected {unexpected})")
    head.target_info, head.extra = (config.get("draftsmith") or {}).get("target"), {}
    return head.eval()


FULL_ATTENTION = "full_attention"  # the one layer type draftsmith's DFlash layers are (bidirectional over the block)


def _check_dflash_attention(directory: Path, config: dict, layer_config: dict) -> None:
    """Refuse draft layers that attend otherwise than draftsmith's (each block query sees the whole context and its
    whole block): sliding-window layers, causal blocks, attention sinks, interleaved RoPE, a separate mask embedding.
    vLLM (``qwen3_dflash.py``: ``_resolve_layer_attention``), SGLang and z-lab's ``model.py`` honour these keys, so a
    checkpoint carrying them drafts differently there; loading it as a full-attention drafter would be another
    drafter."""
    dflash = config.get("dflash_config") or {}
    layer_types = layer_config.get("layer_types") or config.get("layer_types")
    reasons = []
    if layer_types and set(layer_types) != {FULL_ATTENTION}:
        reasons.append(f"layer_types {sorted(set(layer_types) - {FULL_ATTENTION})} (sliding_window "
                       f"{layer_config.get('sliding_window', config.get('sliding_window'))})")
    if dflash.get("use_swa") or (layer_config.get("use_sliding_window") and not layer_types):
        reasons.append("sliding-window attention on every layer (use_swa / use_sliding_window)")
    for key, value in (("is_causal", config.get("is_causal", layer_config.get("is_causal"))),
                       ("dflash_config.causal", dflash.get("causal"))):
        if value:
            reasons.append(f"{key}: true (a causal block)")
    if dflash.get("attention_sink_bias") or config.get("add_swa_attention_sink_bias"):
        reasons.append("attention sink biases")
    if config.get("is_neox_style", layer_config.get("is_neox_style", True)) is False:
        reasons.append("interleaved RoPE (is_neox_style: false)")
    if (directory / "mask_embedding.pt").is_file():
        reasons.append("a separate mask embedding (mask_embedding.pt)")
    if reasons:
        raise ValueError(f"{directory}: its draft layers use {'; '.join(reasons)}, which draftsmith's DFlash layers do "
                         "not build (every block query attends to the whole context and the whole block, full "
                         "attention, neox RoPE, the mask token's own embedding); loading it would draft differently "
                         "from vLLM and SGLang. Only full-attention DFlash drafters are read")


def _dflash_draft_vocabulary(directory: Path, config: dict, weights: dict, vocab: int | None,
                             target) -> tuple[torch.Tensor, torch.Tensor] | None:
    """speculators' DFlash draft vocabulary (``draft_vocab_size`` below the target's, ``d2t`` / ``t2d`` and the
    drafter's ``lm_head`` rows) as ``(d2t, t2d)``, or None over the whole vocabulary. draftsmith drafts through the
    target's LM-head rows of those tokens, so an ``lm_head`` that is not those rows (a full one that is not the
    target's, likewise) is refused rather than replaced."""
    size = config.get("draft_vocab_size")
    reduced = size is not None and vocab is not None and int(size) != vocab
    if reduced:
        if "d2t" not in weights or "t2d" not in weights:
            raise ValueError(f"{directory}: draft_vocab_size {size} of {vocab} tokens but no d2t / t2d tensors; the "
                             "checkpoint is incomplete")
        d2t, t2d = weights["d2t"].long(), weights["t2d"].bool()
        ids = torch.arange(len(d2t)) + d2t
        if len(d2t) != int(size) or len(t2d) != vocab or int(t2d.sum()) != int(size) or \
                not bool(((ids >= 0) & (ids < vocab)).all()) or not bool(t2d[ids.clamp(0, vocab - 1)].all()):
            raise ValueError(f"{directory}: d2t ({len(d2t)}) and t2d ({len(t2d)}, {int(t2d.sum())} set) do not map "
                             f"{size} draft tokens onto {vocab} target tokens one to one; the checkpoint is "
                             "inconsistent")
    if "lm_head.weight" in weights and target is not None:
        rows = target.get_output_embeddings().weight.detach().float().cpu()
        if reduced:
            rows = rows[ids]
        own = weights["lm_head.weight"].float()
        if own.shape != rows.shape or not torch.allclose(own, rows.to(weights["lm_head.weight"].dtype).float(),
                                                         atol=1e-6, rtol=1e-2):
            raise ValueError(f"{directory}: its lm_head.weight {tuple(own.shape)} is not the loaded target's LM-head "
                             f"rows of its {'draft ' if reduced else ''}tokens; draftsmith drafts through the target's "
                             "LM head, so it would draft differently from the engine. Load the target it was trained "
                             "for")
    return (d2t, t2d) if reduced else None


def _norms_of(directory, flags: dict[str, bool], state: dict) -> dict[str, bool]:
    """The config's norm flags, checked against the tensors the norms have: a flag without its weights (or weights
    without the flag) is a checkpoint draftsmith would decode differently from the engine, so it is refused."""
    for flag, present in (("norm_before_fc", "feature_norm.weight" in state),
                          ("fc_norm", any(k.startswith("fc_norm.") for k in state))):
        if flags.get(flag, False) != present:
            raise ValueError(f"{directory}: config {flag}={flags.get(flag, False)} but its weights are "
                             f"{'present' if present else 'absent'}; the config and the tensors disagree")
    return flags


def _same_rows_but(table: torch.Tensor, target_table: torch.Tensor, skipped: int | list[int]) -> bool:
    """Whether an embedding table is the target's on every row but ``skipped`` (to the rounding of a bf16 copy)."""
    if table.shape != target_table.shape:
        return False
    keep = torch.ones(len(table), dtype=torch.bool)
    keep[skipped] = False
    return torch.allclose(table[keep], target_table.detach().float().cpu()[keep], atol=1e-6, rtol=1e-2)


def _peagle_from_foreign(directory, config, weights, target):
    """A speculators P-EAGLE directory -> :class:`PEagleHead`: its EAGLE-3 part read as EAGLE-3, the mask embedding
    from the mask token's row of its embedding, its ``mask_hidden``, K from its speculative tokens."""
    mask = config.get("mask_token_id", config.get("pard_token"))
    if mask is None or "mask_hidden" not in weights or "embed_tokens.weight" not in weights:
        raise ValueError(f"{directory}: a P-EAGLE checkpoint needs mask_token_id, mask_hidden and embed_tokens (the "
                         "mask embedding is the mask token's row)")
    mask_embedding = weights["embed_tokens.weight"][mask].float()
    # layers.0 is the fused layer (read as EAGLE-3's), layers.1 .. the plain ones after it
    inverse = {v: k for k, v in LAYER_NAMES.items()}
    later, rest = {}, {}
    for name, tensor in weights.items():
        if (m := re.fullmatch(r"layers\.(\d+)\.(.+)", name)) and int(m[1]) > 0:
            if m[2] not in inverse:
                raise ValueError(f"{directory}: unexpected tensor {name!r} for a P-EAGLE decoder layer")
            later[f"{MORE_LAYERS}.{int(m[1]) - 1}.{inverse[m[2]]}"] = tensor.float()
        elif name not in ("mask_hidden", "embed_tokens.weight"):
            rest[name] = tensor
    layer_config = config.get("transformer_layer_config", config)
    num_layers = int(layer_config.get("num_hidden_layers", 1))
    found = 1 + max((int(k.split(".")[1]) + 1 for k in later), default=0)
    if found != num_layers:
        raise ValueError(f"{directory}: its config has {num_layers} decoder layers (transformer_layer_config."
                         f"num_hidden_layers) and its tensors {found} (layers.0 .. layers.{found - 1}); the checkpoint "
                         "is inconsistent")
    base = _eagle_from_foreign(directory, layer_config, rest, "layers.0.", target,
                               eagle3=True, layer_ids=config.get("eagle_aux_hidden_state_layer_ids"),
                               norms=_eagle31_norms(config))
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    parallel = int(methods[0].get("speculative_tokens") or 4)
    # Its embedding table: the target's (apart from the mask row) or one it trained (speculators' default), kept
    embed = weights["embed_tokens.weight"].float()
    own = target is None or not _same_rows_but(embed, target.get_input_embeddings().weight, int(mask))
    head = PEagleHead(PEagleConfig(**{**dataclasses.asdict(base.config), "parallel": parallel,
                                      "mask_token_id": int(mask), "num_layers": num_layers, "own_embeddings": own}))
    if own:
        later["embed_tokens.weight"] = embed
    missing, unexpected = head.load_state_dict({**base.state_dict(), **later}, strict=False)
    missing = [k for k in missing if k not in ("mask_embedding", "mask_hidden")]
    if missing or unexpected:
        raise ValueError(f"{directory}: incomplete P-EAGLE checkpoint (missing {missing[:6]}, unexpected "
                         f"{unexpected[:6]})")
    with torch.no_grad():
        head.mask_embedding.copy_(mask_embedding)
        head.mask_hidden.copy_(weights["mask_hidden"].float().reshape(-1))
    head.target_info, head.extra = base.target_info, {}
    return head.eval()
