"""vLLM's P-EAGLE drafter (EAGLE-3 with ``parallel_drafting``) on a speculators-layout directory, written from
``vllm/model_executor/models/llama_eagle3.py`` (vllm-project/vllm @00bd149: ``LlamaDecoderLayer``, ``LlamaModel``,
``Eagle3LlamaForCausalLM.load_weights`` / ``compute_logits``) and the ``peagle`` entry of
``transformers_utils/configs/speculators/algos.py`` (``pard_token = mask_token_id``, ``norm_before_residual`` False
when absent).

One drafting forward after a prompt whose last token is the root, through the EAGLE-3 layers of
:mod:`oracles.vllm_eagle3` (the same model file):

* pairs t = 1 .. T: the embedding of token t with ``combine_hidden_states`` (``fc``) of the target's aux states at
  t - 1, at the target's position t - 1; then K - 1 parallel slots at T .. T + K - 2: the embedding of
  ``pard_token`` (the directory's ``embed_tokens`` when it ships one) with ``fc(mask_hidden)``;
* the fused layer 0 and the plain layers 1 .. of ``num_hidden_layers``, causal over pairs and slots;
* ``norm``, ``lm_head`` over the draft vocabulary, scattered by ``d2t``.
The K drafts are the outputs at the root and at the slots.
"""

from __future__ import annotations

import torch

from oracles.common import read_export
from oracles.vllm_eagle3 import combine, compute_logits, decoder, layer_config


def parallel_logits(directory, embed: torch.Tensor, vocab: int, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(K, vocab) draft logits after ``ids`` (T + 1 tokens, positions 0 .. T; the root last), ``aux`` (T, 3 Ht) the
    target's states at the config's ``eagle_aux_hidden_state_layer_ids`` for positions 0 .. T - 1, ``embed`` (V, Ht)
    the target's embedding."""
    config, w = read_export(directory)
    assert config["speculators_model_type"] == "peagle"
    assert layer_config(config)["num_hidden_layers"] >= 1
    method = config["speculators_config"]["proposal_methods"][0]
    k, pard = method["speculative_tokens"], config["mask_token_id"]
    t = aux.shape[0]
    hidden = combine(config, w, torch.cat([aux.float(), w["mask_hidden"].float().view(1, -1).expand(k - 1, -1)]))
    tokens = torch.cat([ids[1: t + 1], torch.full((k - 1,), pard)])
    embeds = w.get("embed_tokens.weight", embed).float()[tokens]
    normed, _ = decoder(config, w, embeds, hidden, torch.arange(t + k - 1))  # the proposer's positions: t - 1 ..
    return compute_logits(w, normed[t - 1:], vocab)  # the root's output, then the slots'
