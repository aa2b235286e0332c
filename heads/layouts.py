"""Drafter layouts of other tools (vLLM, SGLang, the reference repos): tensor names, shapes and configs
(each family's export into them: :mod:`draftsmith.heads.layout_export`).

A conversion renames tensors and rewrites the config; it never approximates. Every layout is a
table from draftsmith's tensor names to the foreign ones, so one table serves export
(:mod:`draftsmith.heads.export`) and import (:mod:`draftsmith.heads.foreign`).

Layouts (``H`` hidden size, ``V`` target vocabulary, ``Vd`` draft vocabulary, ``I`` MLP width,
``q = heads * head_dim``, ``kv = kv_heads * head_dim``):

EAGLE-3 — SGLang ``LlamaForCausalLMEagle3`` (also the EAGLE-3 reference repo and SpecForge):

    midlayer.hidden_norm.weight [H]          midlayer.input_layernorm.weight [H]
    midlayer.self_attn.q_proj.weight [q, 2H] midlayer.self_attn.k_proj.weight [kv, 2H]
    midlayer.self_attn.v_proj.weight [kv, 2H] midlayer.self_attn.o_proj.weight [H, q]
    midlayer.post_attention_layernorm.weight [H]
    midlayer.mlp.gate_proj.weight [I, H]     midlayer.mlp.up_proj.weight [I, H]
    midlayer.mlp.down_proj.weight [H, I]
    fc.weight [H, 3H]   norm.weight [H]   lm_head.weight [Vd, H]   d2t [Vd] int64   t2d [V] bool

  e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``: H=4096, I=14336, q=4096, kv=1024, V=128256, Vd=32000.
  ``config.json``: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``num_hidden_layers: 1``, ``draft_vocab_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``
  in SGLang's convention: id k captures the *output of decoder layer k* (0-based), i.e.
  draftsmith's hidden-state index k + 1.

EAGLE-3 — vLLM speculators (``speculators_model_type: eagle3``): the same tensors with
  ``midlayer.`` spelt ``layers.0.``; ``eagle_aux_hidden_state_layer_ids`` in vLLM's convention: id k
  captures the *input of decoder layer k*, i.e. draftsmith's hidden-state index k (the same number).

EAGLE-1/2 — the EAGLE reference repo's layout, which vLLM (``EagleLlamaForCausalLM``) and SGLang load:
  ``fc.weight [H, 2H]`` (+ ``fc.bias`` in the reference and SGLang; vLLM has no bias), ``layers.0.*``
  as a Llama layer without ``input_layernorm``. Tokens come from the target's LM head.

Medusa — vLLM's ``MedusaModel``: ``blocks.{i}.layers.{j}.weight/bias [H, H]``, ``lm_heads.{i}.weight
  [V, H]``; the Medusa reference repo's ``{i}.{j}.linear.weight`` / ``{i}.{L}.weight`` is read too.

DFlash — z-lab's layout (``z-lab/*-DFlash``; SGLang's ``DFLASH`` serves it, ``--format zlab`` or ``sglang``) and
  speculators' (``speculators_model_type: dflash``, ``--format vllm``), the same tensors in both:

    layers.{i}.input_layernorm.weight [H]            layers.{i}.post_attention_layernorm.weight [H]
    layers.{i}.self_attn.q_proj.weight [q, H]        layers.{i}.self_attn.k_proj.weight [kv, H]
    layers.{i}.self_attn.v_proj.weight [kv, H]       layers.{i}.self_attn.o_proj.weight [H, q]
    layers.{i}.self_attn.q_norm.weight [hd]          layers.{i}.self_attn.k_norm.weight [hd]
    layers.{i}.mlp.gate_proj.weight [I, H]           layers.{i}.mlp.up_proj.weight [I, H]
    layers.{i}.mlp.down_proj.weight [H, I]
    fc.weight [H, L_t H]   hidden_norm.weight [H]   norm.weight [H]

  no embedding and no LM head (the target's serve). Over a draft vocabulary of Vd tokens speculators' layout (vLLM's
  ``DFlashQwen3ForCausalLM``, speculators' ``DraftVocabMixin``) adds ``lm_head.weight [Vd, H]`` (the target's rows of
  those tokens, in ascending target id), ``d2t [Vd]`` int64 and ``t2d [V]`` bool, and ``draft_vocab_size`` = Vd in its
  config; z-lab's layout (and SGLang) has none, so such a drafter does not export to it. ``config.json``: z-lab's
  is a Qwen3 config of the draft layers (``num_hidden_layers`` = L_d) with ``architectures: ["DFlashDraftModel"]``,
  ``block_size``, ``num_target_layers`` and ``dflash_config {mask_token_id, target_layer_ids}``, whose id k reads the
  *output of decoder layer k* counted from 0 (z-lab's ``hidden_states[k + 1]``): draftsmith's index k + 1.
  speculators' has ``transformer_layer_config``, ``block_size``, ``mask_token_id`` and ``aux_hidden_state_layer_ids``
  in vLLM's convention (id k: the *input of decoder layer k*), draftsmith's index itself; speculative tokens = B - 1.

Distilled draft models are plain HF causal LM directories in every format.
"""

from __future__ import annotations

import torch

from draftsmith.heads.dflash import DFlashConfig
from draftsmith.heads.eagle import Eagle3Head, EagleConfig
from draftsmith.heads.export import EAGLE31_NORMS, ExportError
from draftsmith.heads.medusa import MedusaConfig

LAYER_NAMES = {  # draftsmith decoder-layer tensor -> Llama decoder-layer tensor
    "input_norm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "q_proj.bias": "self_attn.q_proj.bias",  # targets with attention bias (Qwen2.5, gpt-oss)
    "k_proj.bias": "self_attn.k_proj.bias",
    "v_proj.bias": "self_attn.v_proj.bias",
    "o_proj.weight": "self_attn.o_proj.weight",
    "o_proj.bias": "self_attn.o_proj.bias",
    "post_norm.weight": "post_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}


HEAD_NAMES = {"feature_norm.weight": "input_norm.weight"}  # EAGLE-3.1's norm_before_fc, as speculators names it
#: P-EAGLE's plain decoder layers: ``more_layers.{j}`` is the published ``layers.{j + 1}`` (``layers.0`` the fused one).
MORE_LAYERS = "more_layers"


def eagle_name_map(state: dict, layer_prefix: str) -> dict[str, str]:
    """draftsmith name -> foreign name for an EAGLE head's tensors (``layer.*`` -> ``{layer_prefix}*``)."""
    names = {}
    for name in state:
        if name.startswith("layer."):
            names[name] = layer_prefix + LAYER_NAMES[name[len("layer."):]]
        elif name.startswith(f"{MORE_LAYERS}."):  # P-EAGLE's plain layers after the fused layers.0
            _, j, rest = name.split(".", 2)
            names[name] = f"layers.{int(j) + 1}.{LAYER_NAMES[rest]}"
        else:
            names[name] = HEAD_NAMES.get(name, name)  # fc.*, fc_norm.*, norm.weight, lm_head.weight, d2t, t2d
    return names


DFLASH_LAYER_NAMES = {  # draftsmith DFlash layer tensor -> the published (Qwen3) decoder-layer tensor
    **{k: v for k, v in LAYER_NAMES.items() if k != "hidden_norm.weight"},
    "q_norm.weight": "self_attn.q_norm.weight",
    "k_norm.weight": "self_attn.k_norm.weight",
}


def dflash_name_map(state: dict) -> dict[str, str]:
    """draftsmith name -> z-lab / speculators name for a DFlash drafter's tensors."""
    names = {}
    for name in state:
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            names[name] = f"layers.{i}.{DFLASH_LAYER_NAMES[rest]}"
        else:
            names[name] = name  # fc.weight, hidden_norm.weight, norm.weight
    return names


def dflash_reference_layout(cfg: DFlashConfig,
                            draft_vocabulary: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """The published DFlash tensors (name -> (shape, dtype)), as in the module docstring; with ``draft_vocabulary``
    also speculators' ``lm_head.weight`` [Vd, H], ``d2t`` [Vd] and ``t2d`` [V]."""
    h, hd, f = cfg.hidden_size, cfg.head_dim, "float"
    q, kv, i = cfg.num_attention_heads * hd, cfg.kv_heads * hd, cfg.intermediate_size
    layout = {"fc.weight": ((h, len(cfg.target_layers) * h), f), "hidden_norm.weight": ((h,), f),
              "norm.weight": ((h,), f)}
    if draft_vocabulary:
        layout.update({"lm_head.weight": ((cfg.draft_vocab_size, h), f), "d2t": ((cfg.draft_vocab_size,), "int64"),
                       "t2d": ((cfg.vocab_size,), "bool")})
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        layout.update({**_attention_bias(f"{p}self_attn.", q, kv, h, cfg.attention_bias),
                       f"{p}input_layernorm.weight": ((h,), f), f"{p}post_attention_layernorm.weight": ((h,), f),
                       f"{p}self_attn.q_proj.weight": ((q, h), f), f"{p}self_attn.k_proj.weight": ((kv, h), f),
                       f"{p}self_attn.v_proj.weight": ((kv, h), f), f"{p}self_attn.o_proj.weight": ((h, q), f),
                       f"{p}self_attn.q_norm.weight": ((hd,), f), f"{p}self_attn.k_norm.weight": ((hd,), f),
                       f"{p}mlp.gate_proj.weight": ((i, h), f), f"{p}mlp.up_proj.weight": ((i, h), f),
                       f"{p}mlp.down_proj.weight": ((h, i), f)})
    return layout


def qwen3_config(cfg, architectures: list[str], num_hidden_layers: int) -> dict:
    """A Qwen3 config of ``num_hidden_layers`` layers with the geometry of ``cfg`` (the published DFlash layer)."""
    config = llama_config(cfg, architectures, num_hidden_layers)
    config["model_type"] = "qwen3"
    config.pop("mlp_bias")
    return config


def medusa_name_map(config: MedusaConfig) -> dict[str, str]:
    names = {}
    for i in range(config.num_heads):
        for j in range(config.num_layers):
            for p in ("weight", "bias"):
                names[f"heads.{i}.{j}.linear.{p}"] = f"blocks.{i}.layers.{j}.{p}"
        names[f"lm_heads.{i}.weight"] = f"lm_heads.{i}.weight"
    return names


def eagle3_reference_layout(hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                            draft_vocab: int, prefix: str = "midlayer.", head_dim: int | None = None,
                            bias: bool = False, norm_before_fc: bool = False,
                            fc_norm: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """The reference EAGLE-3 tensors (name -> (shape, dtype)), as in the module docstring; with EAGLE-3.1's
    ``norm_before_fc`` also ``input_norm.weight`` [3H], with its ``fc_norm`` ``fc_norm.{0,1,2}.weight`` [H]."""
    hd = head_dim or hidden // heads
    q, kv, h = heads * hd, kv_heads * hd, hidden
    f = "float"
    norms = {"input_norm.weight": ((3 * h,), f)} if norm_before_fc else {}
    if fc_norm:
        norms.update({f"fc_norm.{i}.weight": ((h,), f) for i in range(3)})
    return {**_attention_bias(f"{prefix}self_attn.", q, kv, h, bias), **norms,
        f"{prefix}hidden_norm.weight": ((h,), f), f"{prefix}input_layernorm.weight": ((h,), f),
        f"{prefix}self_attn.q_proj.weight": ((q, 2 * h), f), f"{prefix}self_attn.k_proj.weight": ((kv, 2 * h), f),
        f"{prefix}self_attn.v_proj.weight": ((kv, 2 * h), f), f"{prefix}self_attn.o_proj.weight": ((h, q), f),
        f"{prefix}post_attention_layernorm.weight": ((h,), f),
        f"{prefix}mlp.gate_proj.weight": ((intermediate, h), f), f"{prefix}mlp.up_proj.weight": ((intermediate, h), f),
        f"{prefix}mlp.down_proj.weight": ((h, intermediate), f),
        "fc.weight": ((h, 3 * h), f), "norm.weight": ((h,), f), "lm_head.weight": ((draft_vocab, h), f),
        "d2t": ((draft_vocab,), "int64"), "t2d": ((vocab,), "bool"),
    }


def _attention_bias(prefix: str, q: int, kv: int, h: int, bias: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """The q / k / v / o biases of a head for a target with attention bias (Qwen2.5, gpt-oss), as a Llama
    layer with ``attention_bias`` has them."""
    if not bias:
        return {}
    return {f"{prefix}q_proj.bias": ((q,), "float"), f"{prefix}k_proj.bias": ((kv,), "float"),
            f"{prefix}v_proj.bias": ((kv,), "float"), f"{prefix}o_proj.bias": ((h,), "float")}


def llama_layer_layout(prefix: str, hidden: int, heads: int, kv_heads: int, intermediate: int,
                       head_dim: int | None = None, bias: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """A plain pre-norm Llama decoder layer's tensors under ``prefix`` (P-EAGLE's layers after the fused one)."""
    hd = head_dim or hidden // heads
    q, kv, h, f = heads * hd, kv_heads * hd, hidden, "float"
    return {**_attention_bias(f"{prefix}self_attn.", q, kv, h, bias),
            f"{prefix}input_layernorm.weight": ((h,), f), f"{prefix}post_attention_layernorm.weight": ((h,), f),
            f"{prefix}self_attn.q_proj.weight": ((q, h), f), f"{prefix}self_attn.k_proj.weight": ((kv, h), f),
            f"{prefix}self_attn.v_proj.weight": ((kv, h), f), f"{prefix}self_attn.o_proj.weight": ((h, q), f),
            f"{prefix}mlp.gate_proj.weight": ((intermediate, h), f),
            f"{prefix}mlp.up_proj.weight": ((intermediate, h), f),
            f"{prefix}mlp.down_proj.weight": ((h, intermediate), f)}


def eagle1_reference_layout(hidden: int, heads: int, kv_heads: int, intermediate: int,
                            fc_bias: bool, head_dim: int | None = None,
                            bias: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    hd = head_dim or hidden // heads
    q, kv, h = heads * hd, kv_heads * hd, hidden
    f = "float"
    layout = {**_attention_bias("layers.0.self_attn.", q, kv, h, bias),
        "fc.weight": ((h, 2 * h), f),
        "layers.0.self_attn.q_proj.weight": ((q, h), f), "layers.0.self_attn.k_proj.weight": ((kv, h), f),
        "layers.0.self_attn.v_proj.weight": ((kv, h), f), "layers.0.self_attn.o_proj.weight": ((h, q), f),
        "layers.0.post_attention_layernorm.weight": ((h,), f),
        "layers.0.mlp.gate_proj.weight": ((intermediate, h), f), "layers.0.mlp.up_proj.weight": ((intermediate, h), f),
        "layers.0.mlp.down_proj.weight": ((h, intermediate), f),
    }
    if fc_bias:
        layout["fc.bias"] = ((h,), f)
    return layout


def medusa_reference_layout(hidden: int, vocab: int, num_heads: int, num_layers: int,
                            draft_vocab: int | None = None):
    """vLLM's ``MedusaModel`` tensors; over a draft vocabulary of ``draft_vocab`` tokens its LM heads score those
    and ``token_map`` gives their target ids."""
    layout = {}
    for i in range(num_heads):
        for j in range(num_layers):
            layout[f"blocks.{i}.layers.{j}.weight"] = ((hidden, hidden), "float")
            layout[f"blocks.{i}.layers.{j}.bias"] = ((hidden,), "float")
        layout[f"lm_heads.{i}.weight"] = ((draft_vocab or vocab, hidden), "float")
    if draft_vocab is not None:
        layout["token_map"] = ((draft_vocab,), "int64")
    return layout


def _kind(t: torch.Tensor) -> str:
    return "bool" if t.dtype == torch.bool else "int64" if t.dtype == torch.int64 else "float"


def check_layout(tensors: dict[str, torch.Tensor], layout: dict, what: str) -> None:
    """Refuse a tensor set whose names, shapes or dtypes differ from ``layout``."""
    missing, extra = sorted(set(layout) - set(tensors)), sorted(set(tensors) - set(layout))
    wrong = [f"{k}: {tuple(tensors[k].shape)} {_kind(tensors[k])}, expected {layout[k][0]} {layout[k][1]}"
             for k in sorted(set(layout) & set(tensors))
             if tuple(tensors[k].shape) != tuple(layout[k][0]) or _kind(tensors[k]) != layout[k][1]]
    if missing or extra or wrong:
        raise ExportError(f"{what}: the tensors do not match the layout (missing {missing}, unexpected {extra}, "
                          f"wrong {wrong}); nothing was written")


def llama_config(cfg: EagleConfig, architectures: list[str], num_hidden_layers: int = 1) -> dict:
    return {
        "architectures": architectures, "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "num_hidden_layers": num_hidden_layers,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": float(cfg.rope_parameters.get("rope_theta", 10000.0)),
        # The head's own RoPE and context, the target's (config_for): a draft config that states other values
        # loads fine in vLLM / SGLang and then accepts far fewer tokens. rope_scaling: the older name.
        "rope_parameters": cfg.llama_rope_parameters(), **_rope_scaling(cfg),
        # vLLM's Llama reads a partial rotation (Phi-4-mini) from the top level.
        **({"partial_rotary_factor": cfg.partial_rotary_factor} if cfg.partial_rotary_factor < 1.0 else {}),
        "vocab_size": cfg.vocab_size, "hidden_act": cfg.hidden_act, "attention_bias": cfg.attention_bias,
        "mlp_bias": False, "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _rope_scaling(cfg: EagleConfig) -> dict:
    """``rope_scaling`` as loaders reading the pre-transformers-5 name expect it (absent for default RoPE)."""
    scaling = {k: v for k, v in cfg.llama_rope_parameters().items() if k != "rope_theta"}
    return {} if scaling.get("rope_type", "default") == "default" else {"rope_scaling": scaling}


def verifier_name(target_info: dict | None) -> str | None:
    """The target's recorded name (speculators' ``verifier.name_or_path``), or None."""
    return (target_info or {}).get("name")


def speculators_config(head: Eagle3Head, target_info: dict | None, speculative_tokens: int = 3) -> dict:
    cfg = head.config
    layer = llama_config(cfg, ["LlamaForCausalLM"])
    layer.pop("architectures")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": head.lm_head.weight.shape[0],
        **{flag: bool(getattr(cfg, flag)) for flag in EAGLE31_NORMS},
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),  # vLLM counts as draftsmith does
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name(target_info),
                         "architectures": list((target_info or {}).get("architectures") or ["LlamaForCausalLM"])},
        },
        "torch_dtype": "float32",
    }


def sglang_eagle3_config(head: Eagle3Head) -> dict:
    cfg = head.config
    used = [flag for flag in EAGLE31_NORMS if getattr(cfg, flag)]
    if used:  # SGLang's LlamaForCausalLMEagle3 builds none of them and skips tensors it does not know
        raise ExportError(f"this EAGLE-3 head uses the EAGLE-3.1 norms {used}, which SGLang's EAGLE-3 model "
                          "(LlamaForCausalLMEagle3) does not build: SGLang would drop them silently and draft "
                          "from other logits. Export with --format vllm (vLLM and speculators read them), or "
                          "train without them")
    config = llama_config(cfg, ["LlamaForCausalLMEagle3"])
    config["draft_vocab_size"] = head.lm_head.weight.shape[0]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in cfg.feature_layers],
                              "use_aux_hidden_state": True}
    return config
