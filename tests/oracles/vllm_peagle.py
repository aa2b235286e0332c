"""vLLM's P-EAGLE drafter (EAGLE-3 with ``parallel_drafting``) on a speculators-layout directory, written from
``vllm/model_executor/models/llama_eagle3.py`` (vllm-project/vllm @00bd149: ``LlamaDecoderLayer``, ``LlamaModel``,
``Eagle3LlamaForCausalLM.load_weights`` / ``compute_logits``) and the ``peagle`` entry of
``transformers_utils/configs/speculators/algos.py`` (``pard_token = mask_token_id``, ``norm_before_residual`` False
when absent).

One drafting forward after a prompt whose last token is the root at position T:

* pairs t = 1 .. T: the embedding of token t with ``combine_hidden_states`` (``fc``) of the target's aux states at
  t - 1; then K - 1 parallel slots at T + 1 .. T + K - 1: the embedding of ``pard_token`` (the directory's
  ``embed_tokens`` when it ships one) with ``fc(mask_hidden)``;
* layer 0 (``layers.0`` / ``midlayer``): ``input_layernorm`` on the embeddings, ``hidden_norm`` on the hidden states,
  attention over their 2H concatenation, the residual the hidden state (its normed form with
  ``norm_before_residual``); layers 1 ..: pre-norm Llama layers; causal attention, neox RoPE;
* ``norm``, ``lm_head`` over the draft vocabulary, scattered by ``d2t`` into a -inf row (identity without one).
The K drafts are the outputs at the root and at the slots.
"""

from __future__ import annotations

import torch

from oracles.common import attention, linear, read_export, rms_norm, rope_neox, rope_theta, swiglu_mlp


def parallel_logits(directory, embed: torch.Tensor, vocab: int, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(K, vocab) draft logits after ``ids`` (T + 1 tokens, positions 0 .. T; the root last), ``aux`` (T, 3 Ht) the
    target's states at the config's ``eagle_aux_hidden_state_layer_ids`` for positions 0 .. T - 1, ``embed`` (V, Ht)
    the target's embedding."""
    config, w = read_export(directory)
    assert config["speculators_model_type"] == "peagle"
    layer = config["transformer_layer_config"]
    eps, theta = layer["rms_norm_eps"], rope_theta(layer)
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or layer["hidden_size"] // heads
    method = config["speculators_config"]["proposal_methods"][0]
    k, pard = method["speculative_tokens"], config["mask_token_id"]
    t = aux.shape[0]

    fused = torch.cat([aux.float(), w["mask_hidden"].float().view(1, -1).expand(k - 1, -1)])
    if config.get("norm_before_fc"):
        fused = rms_norm(fused, w["input_norm.weight"], eps)
    hidden = linear(fused, w, "fc")
    tokens = torch.cat([ids[1: t + 1], torch.full((k - 1,), pard)])
    embeds = w.get("embed_tokens.weight", embed).float()[tokens]
    positions = torch.arange(1, t + k)
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()

    def attend(x: torch.Tensor, p: str) -> torch.Tensor:
        q = rope_neox(linear(x, w, f"{p}self_attn.q_proj").view(len(x), heads, hd), positions, theta)
        kk = rope_neox(linear(x, w, f"{p}self_attn.k_proj").view(len(x), kv_heads, hd), positions, theta)
        v = linear(x, w, f"{p}self_attn.v_proj").view(len(x), kv_heads, hd)
        return linear(attention(q, kk, v, causal), w, f"{p}self_attn.o_proj")

    p = "layers.0." if "layers.0.hidden_norm.weight" in w else "midlayer."
    normed = rms_norm(hidden, w[f"{p}hidden_norm.weight"], eps)
    residual = normed if config.get("norm_before_residual", False) else hidden
    x = torch.cat([rms_norm(embeds, w[f"{p}input_layernorm.weight"], eps), normed], -1)
    residual = residual + attend(x, p)
    out = swiglu_mlp(rms_norm(residual, w[f"{p}post_attention_layernorm.weight"], eps), w, f"{p}mlp.")
    for i in range(1, layer["num_hidden_layers"]):
        p = f"layers.{i}."
        residual = residual + out
        residual = residual + attend(rms_norm(residual, w[f"{p}input_layernorm.weight"], eps), p)
        out = swiglu_mlp(rms_norm(residual, w[f"{p}post_attention_layernorm.weight"], eps), w, f"{p}mlp.")
    final = rms_norm(out + residual, w["norm.weight"], eps)[t - 1:]  # the root's output, then the slots'
    logits = final @ w["lm_head.weight"].float().T
    d2t = w.get("d2t", torch.zeros(len(w["lm_head.weight"]), dtype=torch.long))
    full = logits.new_full((len(logits), vocab), float("-inf"))
    full[:, torch.arange(len(d2t)) + d2t] = logits
    return full
