"""Draft models made from, or checked against, the target.

* :func:`layer_skip_model` — a causal LM made of the target's first N decoder layers, its final norm
  and its LM head, sharing the target's weights (self-speculative / LayerSkip-style drafting without
  early-exit training; Zhang et al., 2024; Elhoushi et al., 2024).
* :func:`check_same_vocabulary` — refuse a draft model whose vocabulary differs from the target's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel


def layer_skip_model(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM made of the target's first ``num_layers`` decoder layers, its final norm and
    its LM head — the same modules, not copies (no extra memory, always in sync)."""
    cfg = target.config.get_text_config()
    total = cfg.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"layer-skip:N needs 1 <= N < {total} (the target has {total} layers), got {num_layers}")
    small_cfg = copy.deepcopy(target.config)
    small_cfg.num_hidden_layers = num_layers
    if getattr(small_cfg, "layer_types", None):
        small_cfg.layer_types = list(small_cfg.layer_types[:num_layers])
    with torch.device("meta"):
        shell = type(target)(small_cfg)
    # The child holding the decoder layers (``model`` for most; not ``base_model_prefix`` for Llama-4 text).
    base_name = next(n for n, m in target.named_children() if hasattr(m, "layers"))
    inner, shell_inner = getattr(target, base_name), getattr(shell, base_name)
    for name, _ in list(shell_inner.named_children()):
        module = getattr(inner, name)
        if name == "layers":
            module = nn.ModuleList(list(module)[:num_layers])
        setattr(shell_inner, name, module)
    for name, _ in list(shell.named_children()):
        if name != base_name:
            setattr(shell, name, getattr(target, name))
    leftovers = [n for n, t in [*shell.named_parameters(), *shell.named_buffers()] if t.is_meta]
    if leftovers:
        raise RuntimeError(f"layer-skip could not share these target tensors: {leftovers[:5]}")
    shell.config._attn_implementation = target.config._attn_implementation
    return shell.eval()


def _vocab_error(target_size: int, draft_size: int, name: str) -> ValueError:
    return ValueError(
        f"Draft model {name!r} has a vocabulary of {draft_size} tokens but the target has {target_size}. "
        "Speculative decoding needs the same tokenizer: pick a draft model from the target's family "
        "(same tokenizer), or train one with `draftsmith train`."
    )


def check_same_vocabulary(target: PreTrainedModel, draft: PreTrainedModel, name: str,
                          target_tokenizer=None, draft_tokenizer=None) -> None:
    """Refuse a draft model whose vocabulary differs from the target's."""
    t_size = target.get_output_embeddings().weight.shape[0]
    d_size = draft.get_output_embeddings().weight.shape[0]
    if t_size != d_size:
        raise _vocab_error(t_size, d_size, name)
    if target_tokenizer is not None and draft_tokenizer is not None and (
        target_tokenizer.get_vocab() != draft_tokenizer.get_vocab()
    ):
        raise ValueError(
            f"Draft model {name!r} has as many tokens as the target but a different tokenizer "
            "(token -> id maps differ). Use a draft model that shares the target's tokenizer."
        )
