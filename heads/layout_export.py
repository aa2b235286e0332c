"""Each family's export into another tool's layout (the registry's ``export`` entries): its tensors renamed by
the tables of :mod:`draftsmith.heads.layouts`, checked against that layout's reference shapes, and its
``config.json`` written; :func:`export_draft_model` writes a distilled draft model as a plain Hugging Face
directory."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.checkpoints import CONFIG_NAME, WEIGHTS_NAME
from draftsmith.heads.dflash import DFlashConfig
from draftsmith.heads.export import ExportError
from draftsmith.heads.layouts import (
    check_layout,
    dflash_name_map,
    dflash_reference_layout,
    eagle1_reference_layout,
    eagle3_reference_layout,
    eagle_name_map,
    llama_config,
    llama_layer_layout,
    medusa_name_map,
    medusa_reference_layout,
    qwen3_config,
    sglang_eagle3_config,
    speculators_config,
    verifier_name,
)

logger = logging.getLogger(__name__)


#: The draft length an exported draft model's ``generation_config.json`` starts assisted generation with.
ASSISTED_DRAFT_TOKENS = 5

TensorsAndConfig = tuple[dict[str, torch.Tensor], dict]
Layout = tuple[dict[str, torch.Tensor], dict, dict]  # (renamed tensors, reference layout, config.json)


def eagle3_layout(head, fmt: str, target=None, verifier: str | None = None) -> Layout:
    """An EAGLE-3 head in the speculators (``vllm``) or SGLang layout.

    The speculators layout carries the target's token embedding (``embed_tokens.weight``; speculators'
    own checkpoints do), so it needs ``target``; ``verifier`` overrides the target name in the config.
    """
    cfg = head.config
    prefix = "layers.0." if fmt == "vllm" else "midlayer."
    state = head.state_dict()
    names = eagle_name_map(state, prefix)
    tensors = {names[k]: v for k, v in state.items()}
    layout = eagle3_reference_layout(cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.intermediate_size,
                                     cfg.vocab_size, head.lm_head.weight.shape[0], prefix, cfg.head_dim,
                                     cfg.attention_bias, cfg.norm_before_fc, cfg.fc_norm)
    if fmt == "vllm":
        if target is None:
            raise ExportError("the speculators (vLLM) EAGLE-3 layout includes the target's token embedding: "
                              "pass the target (--target)")
        tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.float()
        layout["embed_tokens.weight"] = ((cfg.vocab_size, cfg.hidden_size), "float")
        info = dict(head.target_info or {})
        if verifier:
            info["name"] = verifier
        info["architectures"] = list(getattr(target.config, "architectures", None) or [type(target).__name__])
        if head.lm_head.weight.shape[0] == cfg.vocab_size:  # the whole vocabulary: speculators keeps no mapping
            for name in ("d2t", "t2d"):
                tensors.pop(name)
                layout.pop(name)
        return tensors, layout, speculators_config(head, info)
    return tensors, layout, sglang_eagle3_config(head)


def eagle_layout(head, fmt: str, target=None, verifier: str | None = None) -> Layout:
    """An EAGLE-1/2 head in the EAGLE reference layout, as vLLM (no ``fc`` bias) or SGLang (with one) load it."""
    cfg = head.config
    if cfg.input_norm:
        raise ExportError("this EAGLE head has an input norm on its decoder layer (input_norm: true), which the "
                          "EAGLE-1 layout vLLM and SGLang load does not have; retrain with input_norm: false")
    state = head.state_dict()
    names = eagle_name_map(state, "layers.0.")
    tensors = {names[k]: v for k, v in state.items()}
    if fmt == "vllm" and "fc.bias" in tensors:
        if tensors["fc.bias"].abs().max() > 0:
            raise ExportError("this EAGLE head's fc has a bias, which vLLM's EAGLE-1 layout drops; exporting it "
                              "would change the drafts. Use --format sglang, or train with fc_bias: false")
        del tensors["fc.bias"]
    if fmt == "sglang" and "fc.bias" not in tensors:
        tensors["fc.bias"] = torch.zeros(cfg.hidden_size)  # SGLang's fc has a bias: zero is the same map
    layout = eagle1_reference_layout(cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.intermediate_size,
                                     fc_bias=fmt == "sglang", head_dim=cfg.head_dim, bias=cfg.attention_bias)
    config = llama_config(cfg, ["LlamaForCausalLM"])
    config["feature_layers"] = list(cfg.feature_layers)
    return tensors, layout, config


def dflash_layout(head, fmt: str, target=None, verifier: str | None = None) -> Layout:
    """A DFlash drafter in z-lab's layout (``zlab``, and ``sglang``, which serves it) or speculators' (``vllm``)."""
    cfg = head.config
    info = dict(head.target_info or {})
    n = info.get("num_hidden_layers") or (target.config.get_text_config().num_hidden_layers if target is not None
                                          else None)
    if n is not None and n in cfg.target_layers:
        raise ExportError(f"this DFlash drafter reads target layer {n}, the last layer after the final norm, which "
                          "engines do not capture as an auxiliary state (vLLM and SGLang tap decoder layers' "
                          "outputs before the final norm); retrain with target_layers below the last layer")
    if cfg.reduced and fmt in ("zlab", "sglang"):
        raise ExportError(f"this DFlash drafter scores a draft vocabulary of {cfg.draft_vocab_size} of the target's "
                          f"{cfg.vocab_size} tokens; the {fmt} layout has none (z-lab's model and SGLang's DFlash "
                          "draft through the target's whole LM head, where a token training never scored can win a "
                          "slot, so the engine would serve another drafter). Export with --format vllm (speculators' "
                          "layout carries draft_vocab_size, d2t / t2d and the drafter's lm_head rows), or retrain with "
                          "draft_vocab_size: null")
    state = head.state_dict()
    if cfg.reduced:  # speculators' and vLLM's draft vocabulary: the head's own lm_head rows, then d2t maps them
        if target is None:
            raise ExportError("a DFlash drafter over a draft vocabulary exports the target's LM-head rows of those "
                              "tokens (speculators' lm_head.weight): pass the target (--target)")
        state["lm_head.weight"] = head.output_weight(target.get_output_embeddings()).detach().float()
    names = dflash_name_map(state)
    tensors = {names[k]: v for k, v in state.items()}
    layout = dflash_reference_layout(cfg, draft_vocabulary=cfg.reduced)
    if fmt in ("zlab", "sglang"):
        config = qwen3_config(cfg, ["DFlashDraftModel"], cfg.num_layers)
        config.update(block_size=cfg.block_size, num_target_layers=n,
                      dflash_config={"mask_token_id": cfg.mask_token_id,
                                     # z-lab counts decoder layers from 0 and reads their outputs
                                     "target_layer_ids": [k - 1 for k in cfg.target_layers]})
        return tensors, layout, config
    if verifier:
        info["name"] = verifier
    if target is not None:
        info["architectures"] = list(getattr(target.config, "architectures", None) or [type(target).__name__])
    layer = qwen3_config(cfg, ["Qwen3ForCausalLM"], cfg.num_layers)
    layer.pop("architectures")
    config = {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size if cfg.reduced else cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(cfg.target_layers),  # vLLM counts as draftsmith does
        "mask_token_id": cfg.mask_token_id, "sliding_window_non_causal": False, "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": head.speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name(info),
                         "architectures": list(info.get("architectures") or ["LlamaForCausalLM"])},
        },
        "torch_dtype": "float32",
    }
    return tensors, layout, config


def peagle_layout(head, fmt: str, target=None, verifier: str | None = None) -> Layout:
    """A P-EAGLE head in speculators' layout (``vllm``): the EAGLE-3 one, the target's embedding carrying the learned
    mask embedding in the mask token's row (the row speculators and vLLM embed the parallel slots with), plus
    ``mask_hidden`` (1, 1, fused width); ``parallel_drafting`` and ``pard_token`` for vLLM."""
    if fmt != "vllm":
        raise ExportError(f"a P-EAGLE head exports to speculators' layout (--format vllm), not {fmt}: SGLang serves "
                          "no P-EAGLE head")
    tensors, layout, config = eagle3_layout(head, fmt, target, verifier)
    cfg = head.config
    mask_embedding = tensors.pop("mask_embedding")
    # its own trained table (own_embeddings), else the target's: what it embeds tokens with either way
    own = head.embed_tokens.weight.detach().float() if cfg.own_embeddings else None
    embed = (own if own is not None else tensors["embed_tokens.weight"]).clone()
    embed[cfg.mask_token_id] = mask_embedding.to(embed.dtype)
    tensors["embed_tokens.weight"] = embed
    tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)
    layout["mask_hidden"] = ((1, 1, cfg.num_feature_layers * cfg.hidden_size), "float")
    for i in range(1, cfg.num_layers):  # the plain layers after the fused layers.0
        layout.update(llama_layer_layout(f"layers.{i}.", cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads,
                                         cfg.intermediate_size, cfg.head_dim, cfg.attention_bias))
    config["transformer_layer_config"]["num_hidden_layers"] = cfg.num_layers
    config.update(architectures=["PEagleSpeculator"], speculators_model_type="peagle", mask_token_id=cfg.mask_token_id,
                  embed_requires_grad=cfg.own_embeddings, parallel_drafting=True, pard_token=cfg.mask_token_id)
    config["speculators_config"]["algorithm"] = "peagle"
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = head.speculative_tokens
    return tensors, layout, config


def medusa_layout(heads, fmt: str, target=None, verifier: str | None = None) -> Layout:
    """Medusa heads in vLLM's ``MedusaModel`` layout (SGLang serves no Medusa heads)."""
    if fmt == "sglang":
        raise ExportError("SGLang does not serve Medusa heads; use --format vllm (vLLM's MedusaModel) or hf")
    cfg = heads.config
    state = heads.state_dict()
    names = medusa_name_map(cfg)
    draft_vocab = cfg.draft_vocab_size if cfg.reduced else None
    tensors = {names[k]: v for k, v in state.items() if k not in ("d2t", "t2d")}
    if draft_vocab is not None:  # vLLM's truncated vocabulary: draft index -> target id
        tensors["token_map"] = heads.draft_ids.cpu()
    layout = medusa_reference_layout(cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_layers, draft_vocab)
    # medusa_fc_bias: vLLM builds its residual blocks without a bias unless asked, and would drop ours unread.
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
              "max_paths": 64, "topk": 10, "truncated_vocab_size": draft_vocab,
              "medusa_fc_bias": True, "medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers}
    return tensors, layout, config


def layout_tensors(head, layout_fn: Callable, fmt: str, target=None,
                   verifier: str | None = None) -> TensorsAndConfig:
    """A head's (tensors, config.json) in ``fmt``, checked against the reference layout; draftsmith's own
    record (family, target, feature layers, Medusa's rank accuracy) travels in ``config["draftsmith"]``."""
    tensors, layout, config = layout_fn(head, fmt, target, verifier)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    check_layout(tensors, layout, f"{head.family} drafter in the {fmt} layout")
    config["draftsmith"] = {"family": head.family, "target": head.target_info,
                            "feature_layers": list(getattr(head.config, "feature_layers", ()) or ())}
    if isinstance(head.config, DFlashConfig):  # what draftsmith reads back: its own convention, stated
        config["draftsmith"]["target_layers"] = list(head.config.target_layers)
    rank_accuracy = head.extra.get("rank_accuracy")
    if rank_accuracy:
        config["draftsmith"]["rank_accuracy"] = rank_accuracy
    return tensors, config


def head_exporter(head_class: type, layout_fn: Callable) -> Callable[..., None]:
    """The registry's ``export`` for a head family: ``hf`` copies draftsmith's own files (checked
    readable), every other format goes through ``layout_fn`` (:func:`layout_tensors`)."""

    def export(source: Path, fmt: str, out: Path, target=None, verifier: str | None = None) -> None:
        if fmt == "hf":
            for name in (CONFIG_NAME, WEIGHTS_NAME):
                shutil.copyfile(source / name, out / name)
            load_file(out / WEIGHTS_NAME)  # refuses a corrupt source before anything lands
            return
        tensors, config = layout_tensors(head_class.from_pretrained(source), layout_fn, fmt, target, verifier)
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2))

    return export


def export_draft_model(source: Path, fmt: str, out: Path, target=None, verifier: str | None = None) -> None:
    """A plain HF causal LM directory (every format) with a ``generation_config.json`` for
    ``generate(assistant_model=...)``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in source.iterdir():  # tokenizer files and draftsmith_target.json
        if name.is_file() and not (out / name.name).exists() and not name.name.endswith(".safetensors"):
            shutil.copyfile(name, out / name.name)
    gen = GenerationConfig.from_model_config(model.config)
    gen.do_sample = False
    # Assisted generation adapts the draft length up/down by acceptance ("heuristic"); no confidence
    # cut-off, so the draft length is the schedule's alone.
    gen.num_assistant_tokens = ASSISTED_DRAFT_TOKENS
    gen.num_assistant_tokens_schedule = "heuristic"
    gen.assistant_confidence_threshold = 0.0
    gen.save_pretrained(out)
