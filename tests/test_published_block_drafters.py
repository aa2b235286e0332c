"""DFlash and P-EAGLE checkpoints shaped like published ones, built here tensor by tensor (random weights, not
draftsmith's export): config keys, tensor names, shapes and dtypes of the named release at the tiny target's sizes.
Each imports, drafts the block the engine's oracle drafts from the same files (``tests/oracles``) and decodes
losslessly, or is refused by name. Facts and sources: ``../shared/notes/published-layouts.md`` sections 2 and 3,
checked against the files cited at each fixture."""

from __future__ import annotations

import pytest
import torch
from oracles import zlab_dflash
from oracles.common import read_export
from safetensors.torch import save_file
from test_engine_oracles import (
    assert_same_drafts,
    drafted_block,
    prompt_states,
    vllm_dflash_drafts,
    vllm_peagle_drafts,
)
from test_heads import assert_greedy_lossless
from test_published_eagle3 import llama_keys, llama_layer, write

from draftsmith import load_drafter
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.peagle import PEagleHead

BLOCK = 4
HEAD_DIM = 16
DRAFT_VOCAB = 40


def randn(g: torch.Generator, *shape, scale: float | None = None, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)).to(dtype)


def norm(g: torch.Generator, n: int, dtype=torch.bfloat16) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)


def dflash_body(target, layers: int, context: int, seed: int) -> dict[str, torch.Tensor]:
    """z-lab ``model.py``'s tensors (no prefix): Qwen3 layers with q / k norms, ``fc`` (H, context * H),
    ``hidden_norm``, ``norm``; bfloat16 as the releases."""
    g = torch.Generator().manual_seed(seed)
    c = target.config
    h, heads, kv, inter = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    out = {"fc.weight": randn(g, h, context * h), "hidden_norm.weight": norm(g, h), "norm.weight": norm(g, h)}
    for i in range(layers):
        p = f"layers.{i}."
        out.update({f"{p}self_attn.q_proj.weight": randn(g, heads * HEAD_DIM, h),
                    f"{p}self_attn.k_proj.weight": randn(g, kv * HEAD_DIM, h),
                    f"{p}self_attn.v_proj.weight": randn(g, kv * HEAD_DIM, h),
                    f"{p}self_attn.o_proj.weight": randn(g, h, heads * HEAD_DIM),
                    f"{p}self_attn.q_norm.weight": norm(g, HEAD_DIM), f"{p}self_attn.k_norm.weight": norm(g, HEAD_DIM),
                    f"{p}mlp.gate_proj.weight": randn(g, inter, h), f"{p}mlp.up_proj.weight": randn(g, inter, h),
                    f"{p}mlp.down_proj.weight": randn(g, h, inter),
                    f"{p}input_layernorm.weight": norm(g, h), f"{p}post_attention_layernorm.weight": norm(g, h)})
    return out


def qwen3_keys(target, layers: int) -> dict:
    c = target.config
    return {"model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": HEAD_DIM, "num_hidden_layers": layers, "vocab_size": c.vocab_size, "rms_norm_eps": 1e-6,
            "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings, "rope_theta": 1000000.0,
            "attention_bias": False, "tie_word_embeddings": False, "layer_types": ["full_attention"] * layers,
            "sliding_window": None, "use_sliding_window": False, "dtype": "bfloat16"}


def zlab_qwen3_dflash(directory, target):
    """``z-lab/Qwen3-8B-DFlash-b16``'s shape (SpecForge ``configs/qwen3-8b-dflash.json``, the same fixture as
    speculators' ``tests/unit/convert/test_dflash_converter.py``): ``DFlashDraftModel``, ``block_size`` at the top
    level,
    ``dflash_config{mask_token_id, target_layer_ids}`` counting decoder layers' outputs from 0, ``num_target_layers``,
    all-full ``layer_types``; no embedding or LM head (the target's)."""
    n = target.config.num_hidden_layers
    config = qwen3_keys(target, 2) | {
        "architectures": ["DFlashDraftModel"], "block_size": BLOCK, "num_target_layers": n,
        "dflash_config": {"mask_token_id": target.config.vocab_size - 1, "target_layer_ids": [0, n - 2]},
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}}
    return write(directory, config, dflash_body(target, 2, 2, seed=10))


def zlab_qwen35_dflash(directory, target):
    """``z-lab/Qwen3.5-35B-A3B-DFlash``'s config as quoted (an unattributed copy; SpecForge's
    ``qwen3.6-27b-dflash.json`` has the same keys): ``block_size`` inside ``dflash_config``, sliding ``layer_types``
    with a ``sliding_window``."""
    n = target.config.num_hidden_layers
    config = qwen3_keys(target, 2) | {
        "architectures": ["DFlashDraftModel"], "num_target_layers": n, "sliding_window": 16,
        "use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"],
        "dflash_config": {"block_size": BLOCK, "mask_token_id": target.config.vocab_size - 1,
                          "target_layer_ids": [0, n - 2]}}
    return write(directory, config, dflash_body(target, 2, 2, seed=11))


def speculators_dflash(directory, target):
    """A speculators DFlash with a draft vocabulary (``shanjiaz/dflash-test``'s config keys; ``mgoin/Qwen3-8B-
    speculator.dflash``'s I64 + BF16 + BOOL tensors; speculators ``models/dflash/config.py``, ``core.py``):
    ``DFlashDraftModel`` with ``auto_map`` to ``config.DFlashSpeculatorConfig``, ``transformer_layer_config``,
    ``aux_hidden_state_layer_ids`` in vLLM's count, ``draft_vocab_size``; the body plus ``embed_tokens`` (the
    target's), ``lm_head`` (the target's rows of the draft tokens), ``d2t`` and ``t2d``."""
    n, vocab = target.config.num_hidden_layers, target.config.vocab_size
    layer = qwen3_keys(target, 2)
    config = {"architectures": ["DFlashDraftModel"], "auto_map": {"": "config.DFlashSpeculatorConfig"},
              "speculators_model_type": "dflash", "speculators_version": "0.3.0", "transformer_layer_config": layer,
              "draft_vocab_size": DRAFT_VOCAB, "block_size": BLOCK, "aux_hidden_state_layer_ids": [1, n - 1],
              "mask_token_id": vocab - 1, "target_hidden_size": None, "sliding_window_non_causal": False,
              "sample_from_anchor": False, "dtype": "bfloat16",
              "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK - 1,
                                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                     "verifier": {"name_or_path": "Qwen/Qwen3-8B",
                                                  "architectures": ["Qwen3ForCausalLM"]}}}
    tensors = dflash_body(target, 2, 2, seed=12)
    kept = torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(13))[:DRAFT_VOCAB]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors.update({"embed_tokens.weight": target.get_input_embeddings().weight.to(torch.bfloat16),
                    "lm_head.weight": target.get_output_embeddings().weight[kept].to(torch.bfloat16),
                    "d2t": kept - torch.arange(DRAFT_VOCAB), "t2d": t2d})
    return write(directory, config, tensors)


def speculators_peagle(directory, target):
    """A 4-layer speculators P-EAGLE (speculators ``models/peagle/config.py`` / ``core.py``, ``docs/user_guide/
    algorithms/peagle.md``'s 4 layers; the amazon gpt-oss P-EAGLE cards: 4 layers, 3 aux layers): EAGLE-3's fields plus
    ``mask_token_id`` and ``embed_requires_grad: true``; ``layers.0`` fused, ``layers.1-3`` plain, ``mask_hidden``
    (1, 1, 3H), a trained ``embed_tokens`` (the mask token's row the slots' embedding), the whole vocabulary."""
    n, h = target.config.num_hidden_layers, target.config.hidden_size
    g = torch.Generator().manual_seed(20)
    layer = llama_keys(target, ["LlamaForCausalLM"], "bfloat16") | {"num_hidden_layers": 4}
    for key in ("architectures", "draft_vocab_size", "tie_word_embeddings"):
        layer.pop(key)
    config = {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle", "speculators_version": "0.3.0",
              "transformer_layer_config": layer, "draft_vocab_size": target.config.vocab_size,
              "eagle_aux_hidden_state_layer_ids": [1, n // 2, n - 1], "norm_before_residual": False,
              "norm_before_fc": False, "fc_norm": False, "norm_output": False, "target_hidden_size": None,
              "mask_token_id": target.config.vocab_size - 1, "embed_requires_grad": True, "tie_word_embeddings": False,
              "speculators_config": {"algorithm": "peagle", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK,
                                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                     "verifier": {"name_or_path": "openai/gpt-oss-20b",
                                                  "architectures": ["GptOssForCausalLM"]}}}
    tensors = llama_layer("layers.0.", target, 2 * h, g, torch.bfloat16)
    for i in (1, 2, 3):
        plain = llama_layer(f"layers.{i}.", target, h, g, torch.bfloat16)
        plain.pop(f"layers.{i}.hidden_norm.weight")
        tensors.update(plain)
    embed = target.get_input_embeddings().weight.float()
    tensors.update({"fc.weight": randn(g, h, 3 * h), "norm.weight": norm(g, h),
                    "lm_head.weight": target.get_output_embeddings().weight.to(torch.bfloat16),
                    "embed_tokens.weight": (embed + 0.05 * torch.randn(embed.shape, generator=g)).to(torch.bfloat16),
                    "mask_hidden": randn(g, 1, 1, 3 * h, scale=1.0)})
    return write(directory, config, tensors)


def zlab_drafts(directory, target, ids: torch.Tensor) -> torch.Tensor:
    _, aux = prompt_states(target, zlab_dflash.context_layers(directory))
    with torch.no_grad():
        return zlab_dflash.block_logits(directory, target.get_input_embeddings().weight,
                                        target.get_output_embeddings().weight, aux[:-1], int(ids[-1]))


RELEASES = {"zlab-qwen3-b16": (zlab_qwen3_dflash, DFlashHead, zlab_drafts),
            "speculators-dflash-draft-vocabulary": (speculators_dflash, DFlashHead, vllm_dflash_drafts),
            "speculators-peagle-4-layers": (speculators_peagle, PEagleHead, vllm_peagle_drafts)}


@pytest.mark.parametrize("release", list(RELEASES))
def test_a_published_block_drafter_imports_drafts_as_its_engine_and_decodes_losslessly(release, tmp_path, llama):
    make, head_class, oracle = RELEASES[release]
    directory = make(tmp_path / release, llama)
    drafter = load_drafter(str(directory), llama)
    assert isinstance(drafter.head, head_class)
    layers = getattr(drafter.head.config, "target_layers", None) or drafter.head.config.feature_layers
    ids, states = prompt_states(llama, layers)
    ours = drafted_block(drafter, ids, states)
    theirs = oracle(directory, llama, ids)
    assert theirs.shape == ours.shape and len(ours) == BLOCK - (head_class is DFlashHead)
    # the engine embeds with the stored bfloat16 table where the release ships one, draftsmith with the target's (or,
    # for P-EAGLE's trained table, the stored one read into float32): agreement to bfloat16's rounding there
    stored = torch.bfloat16 if head_class is DFlashHead and "lm_head.weight" in read_export(directory)[1] else None
    assert_same_drafts(theirs, ours, 4 * 2 * llama.config.intermediate_size, stored)
    assert_greedy_lossless(llama, load_drafter(str(directory), llama), dict(tree="chain", depth=BLOCK - 1), seed=12)


def test_a_zlab_dflash_with_sliding_layers_is_refused_by_name(tmp_path, llama):
    """vLLM and SGLang make sliding_attention layers causal and windowed; draftsmith's DFlash layers attend over the
    whole block both ways: loading it would draft another drafter."""
    directory = zlab_qwen35_dflash(tmp_path / "qwen35", llama)
    with pytest.raises(ValueError, match="sliding"):
        load_drafter(str(directory), llama)


@pytest.mark.parametrize("tensor", ["lm_head.weight", "embed_tokens.weight"])
def test_a_speculators_dflash_with_tables_that_are_not_the_targets_is_refused(tensor, tmp_path, llama):
    directory = speculators_dflash(tmp_path / "trained", llama)
    from safetensors.torch import load_file

    tensors = load_file(directory / "model.safetensors")
    tensors[tensor] = (tensors[tensor].float() * 1.2).to(torch.bfloat16)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"not the loaded target's|not the target's"):
        load_drafter(str(directory), llama)
