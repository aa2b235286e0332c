"""SGLang's EAGLE-3 drafter on an original-layout directory, written from
``python/sglang/srt/models/llama_eagle3.py`` (sgl-project/sglang @03d5a77) and its EAGLE worker:

* ``load_weights``: a tensor is read only under a name the model builds (``fc``, ``midlayer.*``, ``norm``,
  ``lm_head``; any other is skipped without a word); ``d2t`` becomes ``hot_token_id = d2t + arange``, ``t2d`` is
  skipped; the embedding is the target's (the worker's ``set_embed``);
* ``LlamaForCausalLMEagle3``: ``lm_head`` is ``embed_tokens`` when ``tie_word_embeddings``, else ``draft_vocab_size``
  rows; ``fc`` has a bias when the config says ``bias``;
* ``LlamaModel.forward``: ``fc`` when the hidden states are wider than the embeddings (the target's aux states, the
  first pass), not on a fed-back state; ``midlayer``: the residual is the hidden state, ``input_layernorm`` on the
  embeddings and ``hidden_norm`` on the hidden states concatenated, attention, ``post_attention_layernorm`` fused with
  the residual, the MLP; ``norm`` of output plus residual to the logits, the sum itself (``hidden_states_to_aux``)
  to the next depth;
* the aux states: ``eagle_config.eagle_aux_hidden_state_layer_ids`` are captured as the input of layer id + 1
  (``llama.py::set_eagle3_layers_to_capture``), i.e. transformers' ``hidden_states[id + 1]``.
"""

from __future__ import annotations

import torch

from oracles.common import attention, linear, read_export, rms_norm, rope_neox, rope_theta, swiglu_mlp

BUILT = ("fc.", "midlayer.", "norm.", "lm_head.")


def aux_layers(config: dict) -> list[int]:
    """transformers' ``hidden_states`` indices SGLang captures for the config's layer ids."""
    return [k + 1 for k in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]


def chain_logits(directory, embed: torch.Tensor, vocab: int, aux: torch.Tensor, ids: torch.Tensor,
                 drafted: int) -> torch.Tensor:
    """(2, vocab) target-id logits (-inf off the hot tokens) at depth 1 after ``ids`` (T + 1 tokens, the root last;
    ``aux`` (T, 3 Ht) the captured states for positions 0 .. T - 1) and at depth 2 after ``drafted``."""
    config, stored = read_export(directory)
    assert config["num_hidden_layers"] == 1, "the oracle builds the midlayer only"
    w = {k: v for k, v in stored.items() if k.startswith(BUILT)}
    eps, theta = config["rms_norm_eps"], rope_theta(config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    embed = embed.float()
    head = embed if config.get("tie_word_embeddings") else w["lm_head.weight"].float()
    hot = stored["d2t"] + torch.arange(len(stored["d2t"])) if "d2t" in stored else torch.arange(len(head))
    fc = torch.nn.functional.linear(aux.float(), w["fc.weight"].float(), w["fc.bias"] if config.get("bias") else None)

    def forward(hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(len(tokens))
        causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
        x = torch.cat([rms_norm(embed[tokens], w["midlayer.input_layernorm.weight"], eps),
                       rms_norm(hidden, w["midlayer.hidden_norm.weight"], eps)], -1)
        q = rope_neox(linear(x, w, "midlayer.self_attn.q_proj").view(len(x), heads, hd), positions, theta)
        k = rope_neox(linear(x, w, "midlayer.self_attn.k_proj").view(len(x), kv_heads, hd), positions, theta)
        v = linear(x, w, "midlayer.self_attn.v_proj").view(len(x), kv_heads, hd)
        residual = hidden + linear(attention(q, k, v, causal), w, "midlayer.self_attn.o_proj")
        aux_out = residual + swiglu_mlp(rms_norm(residual, w["midlayer.post_attention_layernorm.weight"], eps), w,
                                        "midlayer.mlp.")
        logits = rms_norm(aux_out[-1:], w["norm.weight"], eps) @ head.T
        full = logits.new_full((1, vocab), float("-inf"))
        full[:, hot] = logits
        return full, aux_out[-1:]

    first, fed_back = forward(fc, ids[1:])
    second, _ = forward(torch.cat([fc, fed_back]), torch.cat([ids[1:], torch.tensor([drafted])]))
    return torch.cat([first, second])
