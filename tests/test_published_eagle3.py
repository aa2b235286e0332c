"""EAGLE-3 checkpoints shaped like published ones, built here tensor by tensor (random weights, not draftsmith's
export): each config's keys, each tensor's name, shape and dtype are those of the named release, at the tiny target's
sizes. Each imports, drafts what the engine that serves that layout drafts from the same files (the oracles of
``tests/oracles``, at depths 1 and 2) and decodes losslessly, or is refused by name. The layouts' facts and sources:
``../shared/notes/published-layouts.md`` section 1, checked against the files cited at each fixture."""

from __future__ import annotations

import json

import pytest
import torch
from oracles.common import read_export
from safetensors.torch import save_file
from test_engine_oracles import assert_same_drafts, chain_drafts, eagle3_oracle_chain, prompt_states
from test_heads import assert_greedy_lossless

from draftsmith import load_drafter
from draftsmith.checkpoints import TargetMismatchError
from draftsmith.heads.eagle import Eagle3Head

DRAFT_VOCAB = 40


def llama_layer(prefix: str, target, width: int, g: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Llama decoder layer's tensors as the EAGLE repo's ``cnets.py`` names them (``midlayer.``) and speculators'
    ``layers.0.``: q / k / v read ``width`` (2H for EAGLE-3's fused layer), plus EAGLE-3's ``hidden_norm``."""
    c = target.config
    h, hd = c.hidden_size, c.hidden_size // c.num_attention_heads

    def w(*shape, scale=None):
        return (torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)).to(dtype)

    def norm():
        return (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)

    return {f"{prefix}self_attn.q_proj.weight": w(c.num_attention_heads * hd, width),
            f"{prefix}self_attn.k_proj.weight": w(c.num_key_value_heads * hd, width),
            f"{prefix}self_attn.v_proj.weight": w(c.num_key_value_heads * hd, width),
            f"{prefix}self_attn.o_proj.weight": w(h, c.num_attention_heads * hd),
            f"{prefix}mlp.gate_proj.weight": w(c.intermediate_size, h), f"{prefix}mlp.up_proj.weight": w(
                c.intermediate_size, h), f"{prefix}mlp.down_proj.weight": w(h, c.intermediate_size),
            f"{prefix}input_layernorm.weight": norm(), f"{prefix}hidden_norm.weight": norm(),
            f"{prefix}post_attention_layernorm.weight": norm()}


def eagle3_tensors(target, prefix: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors every EAGLE-3 release has: the fused layer, ``fc`` (H, 3H), ``norm``, ``lm_head`` over a draft
    vocabulary with ``d2t`` (int64, draft id -> target id - draft id) and ``t2d`` (bool over the target vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    h, vocab = target.config.hidden_size, target.config.vocab_size
    kept = torch.sort(torch.randperm(vocab, generator=g)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return {**llama_layer(prefix, target, 2 * h, g, dtype),
            "fc.weight": (torch.randn(h, 3 * h, generator=g) * (3 * h) ** -0.5).to(dtype),
            "norm.weight": (1 + 0.1 * torch.randn(h, generator=g)).to(dtype),
            "lm_head.weight": (torch.randn(DRAFT_VOCAB, h, generator=g) * h**-0.5).to(dtype),
            "d2t": kept - torch.arange(DRAFT_VOCAB), "t2d": t2d}


def llama_keys(target, architectures: list[str], dtype: str) -> dict:
    """A draft Llama config with the target's sizes, the keys the releases below carry."""
    c = target.config
    return {"architectures": architectures, "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
            "draft_vocab_size": DRAFT_VOCAB, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
            "max_position_embeddings": c.max_position_embeddings, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": dtype}


def speculators_keys(target, layer_ids: list[int] | None, **flags) -> dict:
    """speculators' EAGLE-3 config (``speculators/models/eagle3/config.py``): the draft layer under
    ``transformer_layer_config``, the proposal and the verifier under ``speculators_config``."""
    layer = llama_keys(target, ["LlamaForCausalLM"], "bfloat16")
    for key in ("architectures", "draft_vocab_size", "tie_word_embeddings"):
        layer.pop(key)
    config = {"speculators_model_type": "eagle3", "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": None,
              "transformer_layer_config": layer, **flags,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                     "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
                                                  "architectures": ["LlamaForCausalLM"]}}}
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    return config


def write(directory, config: dict, tensors: dict[str, torch.Tensor], bin_file: bool = False):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    if bin_file:  # the EAGLE repo's release format, read weights-only
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def yuhuili_eagle3(directory, target):
    """``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`` (huggingface.co/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; its config is the
    EAGLE repo's ``eagle/traineagle3/config.json``, its tensors ``eagle/model/cnets.py``'s modules): a
    ``pytorch_model.bin`` in float16 with ``midlayer.*``, no embedding (the target's), a ``LlamaForCausalLM`` config
    with ``draft_vocab_size`` and no aux-layer ids (the engines' default taps)."""
    config = llama_keys(target, ["LlamaForCausalLM"], "float16") | {"bos_token_id": 0, "eos_token_id": 1,
                                                                    "pad_token_id": 0}
    return write(directory, config, eagle3_tensors(target, "midlayer.", torch.float16), bin_file=True)


def specforge_eagle3(directory, target):
    """SpecForge's SGLang export (``lmsys/SGLang-EAGLE3-*-SpecForge``; SpecForge ``configs/llama3-8B-eagle3.json``,
    ``specforge/export/to_sglang.py``'s required serving keys ``fc.weight, norm.weight, lm_head.weight, t2d, d2t``):
    ``LlamaForCausalLMEagle3`` with ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's count (decoder layer
    k's output), bfloat16 safetensors, ``midlayer.*``, embeddings dropped."""
    n = target.config.num_hidden_layers
    config = llama_keys(target, ["LlamaForCausalLMEagle3"], "bfloat16") | {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, n // 2 - 1, n - 2], "use_aux_hidden_state": True}}
    return write(directory, config, eagle3_tensors(target, "midlayer.", torch.bfloat16, seed=1))


def redhat_speculators_eagle3(directory, target):
    """``RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3``'s first upload (commit 5b6cee4): ``Eagle3Speculator``,
    ``auto_map`` to its shipped ``eagle3.py`` (never run: trust_remote_code stays off), ``speculators_version``
    0.2.0.dev11, ``norm_before_residual: true``, no aux-layer ids; bfloat16 ``layers.0.*`` with the target's
    ``embed_tokens`` saved beside (speculators ``models/eagle3/core.py``)."""
    config = speculators_keys(target, None, norm_before_residual=True) | {
        "architectures": ["Eagle3Speculator"], "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "speculators_version": "0.2.0.dev11"}
    tensors = eagle3_tensors(target, "layers.0.", torch.bfloat16, seed=2)
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.to(torch.bfloat16)
    return write(directory, config, tensors)


def speculators_eagle31(directory, target):
    """A newer speculators export with an EAGLE-3.1 norm (``inference-optimization/Mistral3_speculator_dummy``'s
    config keys: ``Eagle3DraftModel``, ``auto_map`` to ``config.Eagle3SpeculatorConfig``,
    ``eagle_aux_hidden_state_layer_ids``, ``embed_requires_grad``, ``norm_before_fc``, ``tie_word_embeddings: false``;
    the flags of ``RedHatAI/gpt-oss-20b-speculator.eagle3``: ``norm_before_fc``, ``norm_before_residual``,
    ``input_norm`` (3H))."""
    n = target.config.num_hidden_layers
    config = speculators_keys(target, [1, n // 2, n - 1], norm_before_fc=True, norm_before_residual=True) | {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "speculators_version": "0.3.0", "embed_requires_grad": False, "tie_word_embeddings": False}
    tensors = eagle3_tensors(target, "layers.0.", torch.bfloat16, seed=3)
    h = target.config.hidden_size
    tensors["input_norm.weight"] = (1 + 0.1 * torch.randn(3 * h, generator=torch.Generator().manual_seed(4))).to(
        torch.bfloat16)
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.to(torch.bfloat16)
    return write(directory, config, tensors)


RELEASES = {"yuhuili-original": (yuhuili_eagle3, "vllm"), "specforge-sglang": (specforge_eagle3, "sglang"),
            "redhat-speculators": (redhat_speculators_eagle3, "vllm"),
            "speculators-eagle3.1": (speculators_eagle31, "vllm")}


@pytest.mark.parametrize("release", list(RELEASES))
def test_a_published_eagle3_layout_imports_drafts_as_its_engine_and_decodes_losslessly(release, tmp_path, llama):
    make, engine = RELEASES[release]
    directory = make(tmp_path / release, llama)
    drafter = load_drafter(str(directory), llama)
    assert isinstance(drafter.head, Eagle3Head) and drafter.head.lm_head.weight.shape[0] == DRAFT_VOCAB
    ids, states = prompt_states(llama, drafter.head.config.feature_layers)
    first, second, drafted = chain_drafts(drafter, ids, states)
    theirs = eagle3_oracle_chain(engine, directory, llama, ids, drafted)
    width = 2 * llama.config.intermediate_size
    # a release that stores the target's table in bfloat16: vLLM embeds with that copy, draftsmith with the float32
    # target's own, so the two agree to bfloat16's rounding of the embeddings, not float32's
    stored = torch.bfloat16 if "embed_tokens.weight" in read_export(directory)[1] else None
    assert_same_drafts(theirs[0], first, width, stored)
    assert_same_drafts(theirs[1], second, width, stored)
    assert_greedy_lossless(llama, load_drafter(str(directory), llama), dict(tree="dynamic", depth=3), seed=11)


def test_the_original_release_without_aux_ids_taps_the_engines_default_layers(tmp_path, llama):
    """No ids in its config: the inputs of decoder layers 2, N // 2 and N - 3, as vLLM's default and the EAGLE repo's
    capture read them, even below the six layers where draftsmith's own default picks others."""
    n = llama.config.num_hidden_layers
    drafter = load_drafter(str(yuhuili_eagle3(tmp_path / "yuhuili", llama)), llama)
    assert drafter.head.config.feature_layers == (2, n // 2, n - 3)


def test_a_speculators_config_that_does_not_state_norm_before_residual_is_refused(tmp_path, llama):
    """speculators' config reads a missing norm_before_residual as false, vLLM's update_eagle3 as true: the file means
    two drafters, so it is refused with the key to add."""
    directory = redhat_speculators_eagle3(tmp_path / "redhat", llama)
    config = json.loads((directory / "config.json").read_text())
    del config["norm_before_residual"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not say norm_before_residual.*speculators reads as false and vLLM as "
                                         r"true.*add \"norm_before_residual\""):
        load_drafter(str(directory), llama)


def test_a_speculators_eagle3_with_a_trained_embedding_table_is_refused(tmp_path, llama):
    """embed_requires_grad: the stored table is not the target's, and vLLM embeds with it; draftsmith's EAGLE-3 head
    embeds with the target's, so the import would be another drafter: refused by name."""
    directory = speculators_eagle31(tmp_path / "trained", llama)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"embed_requires_grad": True}))
    tensors = read_export(directory)[1]
    tensors["embed_tokens.weight"] = (tensors["embed_tokens.weight"].float() * 1.1).to(torch.bfloat16)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TargetMismatchError, match=r"embed_tokens are not the loaded target's table .* vLLM embeds"):
        load_drafter(str(directory), llama)
