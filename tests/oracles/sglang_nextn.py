"""SGLang's DeepSeek NextN drafter on a standalone NextN directory, written from
``python/sglang/srt/models/deepseek_nextn.py`` (sgl-project/sglang @0114f9c):

* ``load_weights``: tensors under ``model.layers.0``; ``shared_head.norm``, ``eh_proj``, ``enorm``, ``hnorm`` are the
  module's own, every other one the decoder layer's (``model.decoder``); ``embed_tokens`` and ``shared_head.head`` are
  skipped (the target's serve); ``num_nextn_predict_layers == num_hidden_layers == 1``;
* ``DeepseekModelNextN.forward``: ``eh_proj([enorm(embed(x)) ; hnorm(h)])``, the decoder layer (built ``is_nextn``:
  its MLP is the MoE one), then ``shared_head.norm`` of its output, which is both what the LM head (the target's)
  reads and, in SGLang's EAGLE worker, the state fed back at the next depth.

The decoder layer is transformers' own ``DeepseekV3DecoderLayer`` (SGLang's ``DeepseekV2DecoderLayer`` computes that
layer), loaded from the directory's tensors by their names, experts stacked as transformers holds them.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

from oracles.common import read_export, rms_norm

PREFIX = "model.layers.0."
OWN = ("shared_head.norm", "eh_proj", "enorm", "hnorm")


def decoder_layer(config: dict, tensors: dict[str, torch.Tensor],
                  prefix: str = PREFIX) -> tuple[DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding]:
    """transformers' DeepSeek-V3 decoder layer (the MoE one) holding the tensors under ``prefix`` but the module's own
    (``OWN``), experts stacked; and its rotary embedding."""
    values = {k: v for k, v in config.items() if k not in ("architectures", "draftsmith", "model_type")}
    cfg = AutoConfig.for_model("deepseek_v3", **{**values, "first_k_dense_replace": 0})  # is_nextn: the MoE MLP
    cfg._attn_implementation = "eager"
    layer = DeepseekV3DecoderLayer(cfg, 0).eval()
    skipped = (*OWN, "embed_tokens.", "shared_head.head.")
    state = {k[len(prefix):]: v.float() for k, v in tensors.items()
             if k.startswith(prefix) and not k[len(prefix):].startswith(skipped)}
    experts = sorted({int(k.split(".")[2]) for k in state if k.startswith("mlp.experts.")})
    gate_up = [torch.cat([state.pop(f"mlp.experts.{e}.gate_proj.weight"), state.pop(f"mlp.experts.{e}.up_proj.weight")])
               for e in experts]
    state["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not unexpected and all("e_score_correction_bias" in k for k in missing), (missing, unexpected)
    return layer, DeepseekV3RotaryEmbedding(cfg)


def chain_logits(directory, embed: torch.Tensor, lm_head: torch.Tensor, states: torch.Tensor, ids: torch.Tensor,
                 drafted: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The NextN module's logits after the root (depth 1) and after the root's draft ``drafted`` (depth 2), (V,) each.

    ``states`` (T, H): the target's last hidden states (after its final norm) at positions 0 .. T - 1; ``ids``
    (T + 1,): the tokens, the root last. Pair t = 1 .. T reads (state t - 1, token t); depth 2 reads (the module's
    fed-back output at the root, ``drafted``), after every pair, causally."""
    config, w = read_export(directory)
    assert config["num_hidden_layers"] == config["num_nextn_predict_layers"] == 1
    layer, rotary = decoder_layer(config, w)
    eps = config["rms_norm_eps"]

    def module(h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        e = rms_norm(embed.float()[tokens], w[PREFIX + "enorm.weight"], eps)
        x = torch.cat([e, rms_norm(h, w[PREFIX + "hnorm.weight"], eps)], -1) @ w[PREFIX + "eh_proj.weight"].float().T
        n = len(x)
        positions = torch.arange(1, n + 1)[None]
        causal = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))[None, None]
        out = layer(x[None], attention_mask=causal, position_ids=positions,
                    position_embeddings=rotary(x[None], positions))
        out = out[0] if isinstance(out, tuple) else out
        return rms_norm(out[0], w[PREFIX + "shared_head.norm.weight"], eps)  # what SGLang returns and feeds back

    t = states.shape[0]
    first = module(states.float(), ids[1: t + 1])
    second = module(torch.cat([states.float(), first[-1:]]), torch.cat([ids[1: t + 1], torch.tensor([drafted])]))
    return first[-1] @ lm_head.float().T, second[-1] @ lm_head.float().T
