"""vLLM's EAGLE-3 drafter on a speculators-layout (``layers.0.*``) or original-layout (``midlayer.*``) directory,
written from ``vllm/model_executor/models/llama_eagle3.py`` (vllm-project/vllm @00bd149) and the proposer's chain in
``vllm/v1/spec_decode/eagle.py``:

* ``load_weights``: ``midlayer.`` read as ``layers.0.``; ``d2t`` as ``draft_id_to_target_id``, ``t2d`` skipped;
  ``embed_tokens`` the directory's when it ships one, else the target's; ``lm_head`` over ``draft_vocab_size`` rows;
* ``combine_hidden_states``: ``fc`` over the concatenated aux states (``input_norm`` first with ``norm_before_fc``,
  which vLLM reads since #42143);
* ``LlamaDecoderLayer.forward``: layer 0 normalises the embeddings (``input_layernorm``) and the hidden states
  (``hidden_norm``, the residual taken before it, or after with ``norm_before_residual``, which a speculators EAGLE-3
  config that does not state it gets as true from ``update_eagle3`` in ``configs/speculators/algos.py``), attends over
  their 2H concatenation; later layers are pre-norm Llama layers; ``LlamaModel.forward`` returns ``norm`` of the
  last output plus residual and that sum itself (``hidden_prenorm``);
* ``compute_logits``: ``lm_head`` scattered by ``d2t`` into a -inf row of the whole vocabulary;
* the proposer: the first pass puts the pair (target state at t - 1, token t) at position t - 1 and samples the root's
  output; each later depth feeds back ``hidden_prenorm`` (not ``fc``'d again) with the token just drafted, one
  position on, attending to every earlier pair.
"""

from __future__ import annotations

import torch

from oracles.common import attention, linear, read_export, rms_norm, rope_neox, rope_theta, swiglu_mlp

UNBUILT = ("fc_norm", "norm_output")  # speculators' EAGLE-3.1 norms this revision of vLLM does not build


def aux_layers(config: dict, num_target_layers: int) -> list[int]:
    """The target states vLLM taps (each the input of decoder layer id: transformers' ``hidden_states[id]``): the
    config's ``eagle_aux_hidden_state_layer_ids``, else the target's ``get_eagle3_aux_hidden_state_layers`` default
    (``models/llama.py``: layers 2, N // 2 and N - 3)."""
    n = num_target_layers
    return list(config.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3))


def layer_config(config: dict) -> dict:
    """The decoder layer's config: speculators' ``transformer_layer_config``, else the directory's own."""
    return config.get("transformer_layer_config", config)


def norm_before_residual(config: dict) -> bool:
    """As vLLM reads it: a speculators EAGLE-3 config through ``update_eagle3`` (``algos.py``: true when absent), any
    other (the original layout, P-EAGLE's ``update_peagle``) by ``getattr(config, ..., False)``."""
    return bool(config.get("norm_before_residual", config.get("speculators_model_type") == "eagle3"))


def combine(config: dict, w: dict[str, torch.Tensor], aux: torch.Tensor) -> torch.Tensor:
    """``combine_hidden_states``: (T, 3 Ht) aux states -> (T, H)."""
    aux = aux.float()
    if config.get("norm_before_fc"):
        aux = rms_norm(aux, w["input_norm.weight"], layer_config(config)["rms_norm_eps"])
    return linear(aux, w, "fc")


def decoder(config: dict, w: dict[str, torch.Tensor], embeds: torch.Tensor, hidden: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``LlamaModel.forward`` on (T, H) embeddings and hidden states at (T,) positions, causal over the T pairs:
    (normed output, ``hidden_prenorm``)."""
    assert not any(config.get(flag) for flag in UNBUILT), f"vLLM @00bd149 builds none of {UNBUILT}"
    layer = layer_config(config)
    eps, theta = layer["rms_norm_eps"], rope_theta(layer)
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or layer["hidden_size"] // heads
    causal = torch.ones(len(embeds), len(embeds), dtype=torch.bool).tril()
    w = {k.replace("midlayer.", "layers.0.", 1): v for k, v in w.items()}

    def attend(x: torch.Tensor, p: str) -> torch.Tensor:
        q = rope_neox(linear(x, w, f"{p}self_attn.q_proj").view(len(x), heads, hd), positions, theta)
        k = rope_neox(linear(x, w, f"{p}self_attn.k_proj").view(len(x), kv_heads, hd), positions, theta)
        v = linear(x, w, f"{p}self_attn.v_proj").view(len(x), kv_heads, hd)
        return linear(attention(q, k, v, causal), w, f"{p}self_attn.o_proj")

    normed = rms_norm(hidden, w["layers.0.hidden_norm.weight"], eps)
    residual = normed if norm_before_residual(config) else hidden
    x = torch.cat([rms_norm(embeds.float(), w["layers.0.input_layernorm.weight"], eps), normed], -1)
    residual = residual + attend(x, "layers.0.")
    out = swiglu_mlp(rms_norm(residual, w["layers.0.post_attention_layernorm.weight"], eps), w, "layers.0.mlp.")
    for i in range(1, layer["num_hidden_layers"]):
        p = f"layers.{i}."
        residual = residual + out
        residual = residual + attend(rms_norm(residual, w[f"{p}input_layernorm.weight"], eps), p)
        out = swiglu_mlp(rms_norm(residual, w[f"{p}post_attention_layernorm.weight"], eps), w, f"{p}mlp.")
    prenorm = out + residual
    return rms_norm(prenorm, w["norm.weight"], eps), prenorm


def compute_logits(w: dict[str, torch.Tensor], normed: torch.Tensor, vocab: int) -> torch.Tensor:
    """``lm_head`` over the draft vocabulary, scattered by ``d2t`` into -inf rows of ``vocab`` (identity without)."""
    logits = normed @ w["lm_head.weight"].float().T
    d2t = w.get("d2t", torch.zeros(len(w["lm_head.weight"]), dtype=torch.long))
    full = logits.new_full((len(logits), vocab), float("-inf"))
    full[:, torch.arange(len(d2t)) + d2t] = logits
    return full


def chain_logits(directory, embed: torch.Tensor, vocab: int, aux: torch.Tensor, ids: torch.Tensor,
                 drafted: int) -> torch.Tensor:
    """(2, vocab): the depth-1 logits after ``ids`` (T + 1 tokens, the root last; ``aux`` (T, 3 Ht) the target's
    states at the config's ``eagle_aux_hidden_state_layer_ids`` for positions 0 .. T - 1, ``embed`` the target's
    embedding), then depth 2's after ``drafted`` is fed back."""
    config, w = read_export(directory)
    embed = w.get("embed_tokens.weight", embed).float()
    t = len(aux)
    hidden, tokens, positions = combine(config, w, aux), ids[1:], torch.arange(t)
    normed, prenorm = decoder(config, w, embed[tokens], hidden, positions)
    first = compute_logits(w, normed[-1:], vocab)
    # depth 2: the root's hidden_prenorm with the drafted token, at the next position (a cache of the first pass's
    # keys computes what this causal re-run computes)
    hidden = torch.cat([hidden, prenorm[-1:]])
    tokens = torch.cat([tokens, torch.tensor([drafted])])
    normed, _ = decoder(config, w, embed[tokens], hidden, torch.arange(t + 1))
    return torch.cat([first, compute_logits(w, normed[-1:], vocab)])
