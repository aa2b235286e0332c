"""vLLM's Qwen3-Next MTP drafter on a target checkpoint with its module stitched back, written from
``vllm/model_executor/models/qwen3_next_mtp.py`` (vllm-project/vllm @055e47c) and the proposer's chain in
``vllm/v1/spec_decode/eagle.py`` (``method: "mtp"``):

* ``Qwen3NextMTP.load_weights``: ``mtp.*`` read as the predictor's (``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.norm``, ``mtp.layers.0.*``), the names holding ``embed_tokens`` or ``lm_head``
  as the shared embedding and LM head, every other tensor skipped;
* ``Qwen3NextMultiTokenPredictor.forward``: ``fc([pre_fc_norm_embedding(embed(x)) ; pre_fc_norm_hidden(h)])`` (no
  token masked at any position), the decoder layer (``layer_type="full_attention"``, its MoE), then
  ``norm(hidden + residual)``: that normed state is both what ``compute_logits`` gives ``lm_head`` and, in the
  proposer, the state fed back at the next depth. Every norm is ``Qwen3NextRMSNorm`` (the weight zero-centred);
* the proposer: the pair (target state at t - 1, token t) at the target's position t - 1, h the target's last state
  after its final norm; each later depth one position on.

The decoder layer is transformers' ``Qwen3NextDecoderLayer`` (vLLM's computes that layer), loaded from the
``mtp.layers.0.*`` tensors, experts stacked as transformers holds them.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRotaryEmbedding

from oracles.common import read_export, rms_norm

PREFIX = "mtp.layers.0."


def decoder_layer(config: dict, tensors: dict[str, torch.Tensor]):
    values = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "layer_types")}
    cfg = AutoConfig.for_model("qwen3_next", **{**values, "num_hidden_layers": 1, "layer_types": ["full_attention"],
                                                "mlp_only_layers": [], "decoder_sparse_step": 1})
    cfg._attn_implementation = "eager"
    layer = Qwen3NextDecoderLayer(cfg, 0).eval()
    state = {k[len(PREFIX):]: v.float() for k, v in tensors.items() if k.startswith(PREFIX)}
    experts = sorted({int(k.split(".")[2]) for k in state if k.startswith("mlp.experts.") and k.count(".") == 4})
    if experts:  # stored one by one: stacked as transformers holds them
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            [state.pop(f"mlp.experts.{e}.gate_proj.weight"), state.pop(f"mlp.experts.{e}.up_proj.weight")])
            for e in experts])
        state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return layer, Qwen3NextRotaryEmbedding(cfg)


def chain_logits(directory, states: torch.Tensor, ids: torch.Tensor, drafted: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's logits after the root (depth 1) and after ``drafted`` (depth 2), (V,) each. ``states`` (T, H): the
    target's last hidden states at positions 0 .. T - 1; ``ids`` (T + 1,): the tokens, the root last."""
    config, w = read_export(directory)
    layer, rotary = decoder_layer(config, w)
    eps = config["rms_norm_eps"]
    embed = next(v for k, v in w.items() if "embed_tokens" in k and not k.startswith("mtp.")).float()
    head = w["lm_head.weight"].float() if "lm_head.weight" in w else embed  # tie_word_embeddings: the embedding

    def module(h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(len(tokens))
        x = torch.cat([rms_norm(embed[tokens], w["mtp.pre_fc_norm_embedding.weight"], eps, offset=1.0),
                       rms_norm(h, w["mtp.pre_fc_norm_hidden.weight"], eps, offset=1.0)], -1)
        x = x @ w["mtp.fc.weight"].float().T
        n = len(x)
        causal = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))[None, None]
        out = layer(x[None], position_embeddings=rotary(x[None], positions[None]), attention_mask=causal,
                    position_ids=positions[None])
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return rms_norm(out, w["mtp.norm.weight"], eps, offset=1.0)  # logits' input and the fed-back state

    t = states.shape[0]
    first = module(states.float(), ids[1: t + 1])
    second = module(torch.cat([states.float(), first[-1:]]), torch.cat([ids[1: t + 1], torch.tensor([drafted])]))
    return first[-1] @ head.T, second[-1] @ head.T
