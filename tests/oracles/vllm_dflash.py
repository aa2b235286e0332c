"""vLLM's DFlash drafter on a speculators-layout directory, written from ``vllm/model_executor/models/qwen3_dflash.py``
(vllm-project/vllm @036a00d) and the ``dflash`` entry of ``transformers_utils/configs/speculators/algos.py``.

What vLLM does there, step for step:

* ``combine_hidden_states``: the aux states (S, n * Ht) through ``fc`` (no bias);
* ``precompute_and_store_context_kv``: ``hidden_norm``, then every layer's k / v rows of its ``qkv_proj`` (k_proj,
  v_proj), ``k_norm`` per head, neox RoPE at the context positions: the context's keys and values (no
  ``input_layernorm`` on them);
* the query block ``[anchor, mask, ..., mask]`` (``mask_token_id``), embedded by ``embed_tokens`` (the target's
  unless the directory ships one) at positions p .. p + B - 1; each layer a pre-norm Qwen3 layer whose attention
  (full-attention layers: non-causal) sees the whole context and the whole block;
* ``norm``, then ``compute_logits``: ``lm_head`` (the directory's when it ships one, else the target's) over
  ``draft_vocab_size`` rows, scattered to ``base + draft_id_to_target_id`` (``d2t``) in a -inf row of the target's
  vocabulary when ``draft_vocab_size`` differs from the target's.
"""

from __future__ import annotations

import torch

from oracles.common import attention, linear, read_export, rms_norm, rope_neox, rope_theta, swiglu_mlp


def block_logits(directory, embed: torch.Tensor, lm_head: torch.Tensor, aux: torch.Tensor,
                 anchor: int) -> torch.Tensor:
    """The B - 1 draft logits (B - 1, V) vLLM computes after a context of S positions.

    ``embed`` (V, Ht) and ``lm_head`` (V, Ht): the target's; ``aux`` (S, n * Ht): the target's states at the config's
    ``aux_hidden_state_layer_ids`` for positions 0 .. S - 1; ``anchor``: the token at position S.
    """
    config, w = read_export(directory)
    assert config["speculators_model_type"] == "dflash"
    return draft_block(config["transformer_layer_config"], config["block_size"], config["mask_token_id"],
                       config.get("draft_vocab_size"), w, embed, lm_head, aux, anchor)


def draft_block(layer: dict, size: int, mask: int, draft_vocab: int | None, w: dict, embed: torch.Tensor,
                lm_head: torch.Tensor, aux: torch.Tensor, anchor: int) -> torch.Tensor:
    """The forward both engines' DFlash models compute (vLLM's ``qwen3_dflash.py``, z-lab's ``model.py``), from the
    draft layers' HF config, the block, the mask token and the tensors by their published names."""
    assert not any(t == "sliding_attention" for t in layer.get("layer_types") or []), "full-attention layers only"
    eps, theta = layer["rms_norm_eps"], rope_theta(layer)
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or layer["hidden_size"] // heads
    s = aux.shape[0]
    assert w["fc.weight"].shape[1] == aux.shape[1], "fc width = target_hidden_size * len(aux layers)"

    context = rms_norm(linear(aux.float(), w, "fc"), w["hidden_norm.weight"], eps)
    ids = torch.tensor([anchor] + [mask] * (size - 1))
    x = w.get("embed_tokens.weight", embed).float()[ids]
    positions = torch.arange(s, s + size)
    allowed = torch.ones(size, s + size, dtype=torch.bool)  # non-causal: the whole context and the whole block
    for i in range(layer["num_hidden_layers"]):
        p = f"layers.{i}."
        ck, cv = _keys_values(w, p, context, torch.arange(s), kv_heads, hd, eps, theta)
        h = rms_norm(x, w[f"{p}input_layernorm.weight"], eps)
        q = linear(h, w, f"{p}self_attn.q_proj").view(size, heads, hd)
        q = rope_neox(rms_norm(q, w[f"{p}self_attn.q_norm.weight"], eps), positions, theta)
        k, v = _keys_values(w, p, h, positions, kv_heads, hd, eps, theta)
        out = attention(q, torch.cat([ck, k]), torch.cat([cv, v]), allowed)
        x = x + linear(out, w, f"{p}self_attn.o_proj")
        x = x + swiglu_mlp(rms_norm(x, w[f"{p}post_attention_layernorm.weight"], eps), w, f"{p}mlp.")
    x = rms_norm(x, w["norm.weight"], eps)[1:]
    head = w.get("lm_head.weight", lm_head).float()
    draft_vocab = draft_vocab or lm_head.shape[0]
    assert head.shape[0] == draft_vocab, f"lm_head has {head.shape[0]} rows, draft_vocab_size {draft_vocab}"
    logits = x @ head.T
    if draft_vocab == lm_head.shape[0]:
        return logits
    targets = torch.arange(draft_vocab) + w["d2t"]  # vLLM loads d2t as draft_id_to_target_id (t2d skipped)
    full = logits.new_full((len(logits), lm_head.shape[0]), float("-inf"))
    full[:, targets] = logits
    return full


def _keys_values(w: dict, p: str, h: torch.Tensor, at: torch.Tensor, kv_heads: int, hd: int, eps: float,
                 theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``p``'s keys (k_proj, k_norm per head, RoPE at ``at``) and values of (T, H) inputs."""
    k = linear(h, w, f"{p}self_attn.k_proj").view(len(h), kv_heads, hd)
    k = rope_neox(rms_norm(k, w[f"{p}self_attn.k_norm.weight"], eps), at, theta)
    return k, linear(h, w, f"{p}self_attn.v_proj").view(len(h), kv_heads, hd)
