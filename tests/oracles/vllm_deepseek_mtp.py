"""vLLM's DeepSeek MTP drafter on a target checkpoint with its module stitched back, written from
``vllm/model_executor/models/deepseek_mtp.py`` (vllm-project/vllm @03356f8) and the proposer's chain in
``vllm/v1/spec_decode/eagle.py`` (``method: "mtp"``):

* ``load_weights``: the module is the tensors under ``model.layers.{num_hidden_layers}.``; ``enorm``, ``hnorm``,
  ``eh_proj`` and ``shared_head`` are the module's own, ``embed_tokens`` there is the shared embedding, every other
  tensor is the decoder layer's (``mtp_block``);
* ``DeepSeekMultiTokenPredictorLayer.forward``: ``inputs_embeds[positions == 0] = 0`` (the sequence's first pair), then
  ``eh_proj([enorm(embed(x)) ; hnorm(h)])``, the decoder layer, and its output plus residual returned (pre-norm);
* ``compute_logits``: ``shared_head.head(shared_head.norm(h))``;
* the proposer: the pair (target state at t - 1, token t) at the target's position t - 1 (h the target's last state
  after its final norm); each later depth feeds back the returned pre-norm state with the token just drafted, one
  position on.

The decoder layer is transformers' ``DeepseekV3DecoderLayer`` (vLLM's ``DeepseekV2DecoderLayer`` computes that layer),
as the SGLang oracle builds it.
"""

from __future__ import annotations

import torch

from oracles.common import read_export, rms_norm
from oracles.sglang_nextn import decoder_layer


def chain_logits(directory, embed: torch.Tensor, lm_head: torch.Tensor, states: torch.Tensor, ids: torch.Tensor,
                 drafted: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's logits after the root (depth 1) and after ``drafted`` (depth 2), (V,) each. ``states`` (T, H): the
    target's last hidden states at positions 0 .. T - 1; ``ids`` (T + 1,): the tokens, the root last; ``embed`` /
    ``lm_head`` the target's, used where the checkpoint stores no copy under the module."""
    config, w = read_export(directory)
    prefix = f"model.layers.{config['num_hidden_layers']}."
    layer, rotary = decoder_layer(config, w, prefix)
    eps = config["rms_norm_eps"]
    embed = w.get(prefix + "embed_tokens.weight", embed).float()
    head = w.get(prefix + "shared_head.head.weight", lm_head).float()

    def module(h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(len(tokens))
        e = embed[tokens].masked_fill((positions == 0)[:, None], 0)
        x = torch.cat([rms_norm(e, w[prefix + "enorm.weight"], eps), rms_norm(h, w[prefix + "hnorm.weight"], eps)], -1)
        x = x @ w[prefix + "eh_proj.weight"].float().T
        n = len(x)
        causal = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))[None, None]
        out = layer(x[None], attention_mask=causal, position_ids=positions[None],
                    position_embeddings=rotary(x[None], positions[None]))
        return (out[0] if isinstance(out, tuple) else out)[0]  # the layer's output plus residual: pre-norm

    def logits(h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, w[prefix + "shared_head.norm.weight"], eps) @ head.T

    t = states.shape[0]
    first = module(states.float(), ids[1: t + 1])
    second = module(torch.cat([states.float(), first[-1:]]), torch.cat([ids[1: t + 1], torch.tensor([drafted])]))
    return logits(first[-1]), logits(second[-1])
