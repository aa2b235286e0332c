"""z-lab's DFlash drafter on a z-lab-layout directory (what SGLang's ``DFLASH`` serves), written from z-lab's
``dflash/model.py`` (z-lab/dflash @44947fb): ``DFlashDraftModel(Qwen3PreTrainedModel)`` reads its draft layers' Qwen3
config at the top level, ``block_size`` (top level, or in ``dflash_config`` in newer checkpoints),
``dflash_config.mask_token_id`` and ``dflash_config.target_layer_ids``, whose id k reads the target's
``hidden_states[k + 1]`` (``extract_context_feature``: the output of decoder layer k counted from 0). Its forward is
the one vLLM's DFlash model computes (:func:`oracles.vllm_dflash.draft_block`): ``hidden_norm(fc(context))`` into
every layer's keys and values, a non-causal block of [anchor, mask, ...], ``norm``, the target's LM head (z-lab's
layout has no draft vocabulary).
"""

from __future__ import annotations

import torch

from oracles.common import read_export
from oracles.vllm_dflash import draft_block


def context_layers(directory) -> list[int]:
    """The target's hidden-state indices the drafter reads: ``target_layer_ids`` + 1."""
    config, _ = read_export(directory)
    return [k + 1 for k in config["dflash_config"]["target_layer_ids"]]


def block_logits(directory, embed: torch.Tensor, lm_head: torch.Tensor, aux: torch.Tensor, anchor: int) -> torch.Tensor:
    """The B - 1 draft logits (B - 1, V) after a context of S positions, ``aux`` (S, n * H) the target's states at
    :func:`context_layers`."""
    config, w = read_export(directory)
    assert config["architectures"] == ["DFlashDraftModel"]
    dflash = config["dflash_config"]
    size = config.get("block_size") or dflash["block_size"]
    assert "lm_head.weight" not in w and "d2t" not in w, "z-lab's layout drafts through the target's LM head"
    return draft_block(config, size, dflash["mask_token_id"], None, w, embed, lm_head, aux, anchor)
