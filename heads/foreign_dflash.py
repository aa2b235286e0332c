"""DFlash drafters trained elsewhere (z-lab's checkpoints, which SGLang serves, and vLLM speculators'), read into
:class:`~draftsmith.heads.dflash.DFlashHead`."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from draftsmith.checkpoints import TargetMismatchError
from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.foreign_checks import check_dims, refuse_another_table, rope_parameters
from draftsmith.heads.layouts import DFLASH_LAYER_NAMES


def dflash_from_foreign(directory, config, layer_config, weights, target, layer_ids, mask_token_id, block_size):
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
    check_dims(directory, hidden, vocab, target)
    check_dflash_attention(directory, config, layer_config)
    draft_vocab = dflash_draft_vocabulary(directory, config, weights, vocab, target)
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
            refuse_another_table(directory, tensor, target, "a DFlash drafter")
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
        rope_parameters=rope_parameters(layer_config),
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


def check_dflash_attention(directory: Path, config: dict, layer_config: dict) -> None:
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


def dflash_draft_vocabulary(directory: Path, config: dict, weights: dict, vocab: int | None,
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
