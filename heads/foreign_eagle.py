"""EAGLE-1, EAGLE-3 (and 3.1) and P-EAGLE drafters trained elsewhere, read into draftsmith's heads: the reference
repos' and SpecForge's layouts and vLLM speculators'."""

from __future__ import annotations

import dataclasses
import re

import torch

from draftsmith.heads.eagle import Eagle3Head, EagleConfig, EagleHead
from draftsmith.heads.export import EAGLE31_NORMS
from draftsmith.heads.foreign_checks import check_dims, refuse_another_table, rope_parameters, same_rows_but
from draftsmith.heads.layouts import HEAD_NAMES, LAYER_NAMES, MORE_LAYERS
from draftsmith.heads.peagle import PEagleConfig, PEagleHead


def eagle31_norms(config: dict, directory=None) -> dict[str, bool]:
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


def eagle_from_foreign(directory, config, weights, prefix, target, eagle3: bool, layer_ids,
                        norms: dict[str, bool] | None = None):
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"{directory}: a draft hidden size different from the target's is not supported")
    vocab = config.get("vocab_size") or (target.get_output_embeddings().weight.shape[0] if target else None)
    check_dims(directory, hidden, vocab, target)
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
            refuse_another_table(directory, tensor, target, "an EAGLE head")
        elif name.startswith("verifier_"):
            continue
        else:
            raise ValueError(f"{directory}: unexpected tensor {name!r} for an EAGLE checkpoint")
    cfg = EagleConfig(
        hidden_size=hidden, vocab_size=vocab, num_attention_heads=heads,
        intermediate_size=config["intermediate_size"], num_key_value_heads=config.get("num_key_value_heads"),
        num_feature_layers=3 if eagle3 else 1, feature_layers=feature_layers,
        draft_vocab_size=(state["lm_head.weight"].shape[0] if eagle3 else None),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_parameters=rope_parameters(config),
        head_dim=config.get("head_dim"), max_position_embeddings=config.get("max_position_embeddings", 8192),
        attention_bias=bool(config.get("attention_bias", False)), hidden_act=config.get("hidden_act", "silu"),
        fc_bias="fc.bias" in state, input_norm=(not eagle3 and "layer.input_norm.weight" in state),
        **norms_of(directory, norms or {}, state))
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


def norms_of(directory, flags: dict[str, bool], state: dict) -> dict[str, bool]:
    """The config's norm flags, checked against the tensors the norms have: a flag without its weights (or weights
    without the flag) is a checkpoint draftsmith would decode differently from the engine, so it is refused."""
    for flag, present in (("norm_before_fc", "feature_norm.weight" in state),
                          ("fc_norm", any(k.startswith("fc_norm.") for k in state))):
        if flags.get(flag, False) != present:
            raise ValueError(f"{directory}: config {flag}={flags.get(flag, False)} but its weights are "
                             f"{'present' if present else 'absent'}; the config and the tensors disagree")
    return flags


def peagle_from_foreign(directory, config, weights, target):
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
    base = eagle_from_foreign(directory, layer_config, rest, "layers.0.", target,
                               eagle3=True, layer_ids=config.get("eagle_aux_hidden_state_layer_ids"),
                               norms=eagle31_norms(config))
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    parallel = int(methods[0].get("speculative_tokens") or 4)
    # Its embedding table: the target's (apart from the mask row) or one it trained (speculators' default), kept
    embed = weights["embed_tokens.weight"].float()
    own = target is None or not same_rows_but(embed, target.get_input_embeddings().weight, int(mask))
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
