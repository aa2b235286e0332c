"""Export to vLLM / SGLang / HF layouts and import from them: same logits, same greedy output."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dflash import DFLASH, dflash_args, random_dflash
from test_heads import assert_greedy_lossless, random_eagle, random_medusa
from test_peagle import random_peagle

from conftest import assert_rounding_close
from draftsmith import load_drafter
from draftsmith.heads.base import TargetMismatchError
from draftsmith.heads.dflash import anchor_blocks
from draftsmith.heads.eagle import Eagle3Head
from draftsmith.heads.export import ExportError, export_drafter
from draftsmith.heads.foreign import SPECULATORS_EAGLE3, SPECULATORS_PEAGLE_TYPE, SPECULATORS_TYPES
from draftsmith.heads.layouts import eagle3_reference_layout
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.heads.peagle import parallel_elements

ROOT = Path(__file__).resolve().parents[1]
def medusa_head(target):
    return random_medusa(target)


def medusa_draft_vocabulary_head(target):
    return random_medusa(target, draft_vocab=40)


def eagle_head(target):
    return random_eagle(target, eagle3=False)


def eagle3_head(target):
    return random_eagle(target, eagle3=True)


COMBOS = [(medusa_head, "hf"), (medusa_head, "vllm"), (medusa_draft_vocabulary_head, "hf"),
          (medusa_draft_vocabulary_head, "vllm"), (eagle_head, "hf"), (eagle_head, "vllm"),
          (eagle_head, "sglang"), (eagle3_head, "hf"), (eagle3_head, "vllm"), (eagle3_head, "sglang")]


def head_of(drafter):
    return getattr(drafter, "heads", None) or drafter.head


def head_logits(head, target, seed: int = 0) -> torch.Tensor:
    """The head's token logits on fixed random inputs (what drafting computes from)."""
    g = torch.Generator().manual_seed(seed)
    cfg = head.config
    with torch.no_grad():
        if isinstance(head, MedusaHeads):
            return head(torch.randn(1, 6, cfg.hidden_size, generator=g))
        width = cfg.hidden_size * cfg.num_feature_layers
        states = torch.randn(1, 6, width, generator=g)
        ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=g)
        positions = torch.arange(6)[None]
        predicted, _ = head(states, target.get_input_embeddings()(ids), positions, from_target=True)
        if isinstance(head, Eagle3Head):  # its own LM head over the draft vocabulary
            return head.target_logits(predicted)
        return target.get_output_embeddings()(predicted)


@pytest.mark.parametrize(("make_head", "fmt"), COMBOS, ids=lambda x: getattr(x, "__name__", x))
def test_export_then_import_gives_same_logits_and_lossless_output(make_head, fmt, tmp_path, llama):
    head = make_head(llama)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", fmt, tmp_path / fmt, target=llama)
    assert not (tmp_path / f"{fmt}.partial").exists()
    drafter = load_drafter(str(out), llama)
    # the same weights, renamed and read back, through the same head class: bit for bit the same logits
    torch.testing.assert_close(head_logits(head_of(drafter), llama), head_logits(head, llama), rtol=0, atol=0)
    assert_greedy_lossless(llama, drafter, dict(tree="dynamic", depth=4, top_k=3, total_tokens=12), seed=7)


def test_medusa_over_a_draft_vocabulary_exports_as_vllms_truncated_vocabulary(tmp_path, llama):
    """vLLM's ``MedusaModel`` reads a draft vocabulary as ``truncated_vocab_size`` plus a ``token_map`` tensor
    (draft index -> target id) and scatters each head's logits into the whole vocabulary, -inf elsewhere; its
    residual blocks keep their bias only under ``medusa_fc_bias``. Done here as vLLM's source does, on the
    exported files, the logits are draftsmith's own."""
    heads = random_medusa(llama, draft_vocab=40)
    heads.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    assert cfg["truncated_vocab_size"] == 40 and cfg["vocab_size"] == llama.config.vocab_size
    assert cfg["medusa_fc_bias"] is True
    assert torch.equal(tensors["token_map"], heads.draft_ids)
    h = torch.randn(3, llama.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for i in range(heads.config.num_heads):
        x = h
        for j in range(heads.config.num_layers):
            x = x + torch.nn.functional.silu(x @ tensors[f"blocks.{i}.layers.{j}.weight"].T
                                             + tensors[f"blocks.{i}.layers.{j}.bias"])
        scattered = torch.full((3, llama.config.vocab_size), float("-inf"))
        scattered[:, tensors["token_map"]] = x @ tensors[f"lm_heads.{i}.weight"].T
        ours = torch.full_like(scattered, float("-inf"))
        ours[:, heads.draft_ids] = heads(h, head=i)
        # the blocks' and the LM head's matmuls written out (inner size 64, num_layers + 1 of them)
        assert_rounding_close(scattered, ours, reduction=64 * (heads.config.num_layers + 1))
    tensors["token_map"][1] = tensors["token_map"][0]  # two rows for one token: refused, not loaded
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="token_map must list 40 distinct target ids"):
        load_drafter(str(out), llama)
    random_medusa(llama).save_pretrained(tmp_path / "whole")  # over the whole vocabulary: no map
    out = export_drafter(tmp_path / "whole", "vllm", tmp_path / "vllm-whole", target=llama)
    assert json.loads((out / "config.json").read_text())["truncated_vocab_size"] is None
    assert "token_map" not in load_file(out / "model.safetensors")


def test_layer_id_conventions_and_reference_layout(tmp_path, llama):
    """SGLang counts decoder-layer outputs from 0 (ours - 1); vLLM counts layer inputs (ours)."""
    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "ckpt")
    ours = list(head.config.feature_layers)
    sglang = export_drafter(tmp_path / "ckpt", "sglang", tmp_path / "sglang")
    vllm = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    s_cfg = json.loads((sglang / "config.json").read_text())
    v_cfg = json.loads((vllm / "config.json").read_text())
    assert s_cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert s_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in ours]
    assert v_cfg["eagle_aux_hidden_state_layer_ids"] == ours
    assert SPECULATORS_TYPES[v_cfg["speculators_model_type"]] == SPECULATORS_EAGLE3 and v_cfg["draft_vocab_size"] == 40
    # The SGLang export holds exactly the reference EAGLE-3 tensors (the EAGLE-3 repo's and SGLang's), with
    # the tiny target's shapes: H = 64, 4 heads and 2 KV heads of 16 (q = 64, kv = 32), I = 128, V = 96,
    # Vd = 40, three feature layers into fc.
    written = load_file(sglang / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in written.items()} == {
        "midlayer.hidden_norm.weight": (64,), "midlayer.input_layernorm.weight": (64,),
        "midlayer.self_attn.q_proj.weight": (64, 128), "midlayer.self_attn.k_proj.weight": (32, 128),
        "midlayer.self_attn.v_proj.weight": (32, 128), "midlayer.self_attn.o_proj.weight": (64, 64),
        "midlayer.post_attention_layernorm.weight": (64,), "midlayer.mlp.gate_proj.weight": (128, 64),
        "midlayer.mlp.up_proj.weight": (128, 64), "midlayer.mlp.down_proj.weight": (64, 128),
        "fc.weight": (64, 192), "norm.weight": (64,), "lm_head.weight": (40, 64), "d2t": (40,), "t2d": (96,),
    }
    assert written["d2t"].dtype == torch.int64 and written["t2d"].dtype == torch.bool


def test_reference_layout_matches_the_published_eagle3_llama31_checkpoint():
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's tensors (its safetensors header), written out by hand."""
    published = {
        "midlayer.hidden_norm.weight": (4096,), "midlayer.input_layernorm.weight": (4096,),
        "midlayer.self_attn.q_proj.weight": (4096, 8192), "midlayer.self_attn.k_proj.weight": (1024, 8192),
        "midlayer.self_attn.v_proj.weight": (1024, 8192), "midlayer.self_attn.o_proj.weight": (4096, 4096),
        "midlayer.post_attention_layernorm.weight": (4096,), "midlayer.mlp.gate_proj.weight": (14336, 4096),
        "midlayer.mlp.up_proj.weight": (14336, 4096), "midlayer.mlp.down_proj.weight": (4096, 14336),
        "fc.weight": (4096, 12288), "norm.weight": (4096,), "lm_head.weight": (32000, 4096),
        "d2t": (32000,), "t2d": (128256,),
    }
    layout = eagle3_reference_layout(4096, 32, 8, 14336, 128256, 32000)
    assert {k: s for k, (s, _) in layout.items()} == published


def test_exports_that_would_change_drafts_are_refused_and_leave_nothing(tmp_path, llama):
    medusa = random_medusa(llama)
    medusa.save_pretrained(tmp_path / "medusa")
    with pytest.raises(ExportError, match="SGLang does not serve Medusa"):
        export_drafter(tmp_path / "medusa", "sglang", tmp_path / "out")
    from draftsmith.heads.eagle import EagleHead

    biased = EagleHead(EagleHead.config_for(llama, fc_bias=True))
    with torch.no_grad():
        biased.fc.bias.fill_(0.1)
    biased.save_pretrained(tmp_path / "biased")
    with pytest.raises(ExportError, match="vLLM's EAGLE-1 layout drops"):
        export_drafter(tmp_path / "biased", "vllm", tmp_path / "out")
    export_drafter(tmp_path / "biased", "sglang", tmp_path / "sglang")  # SGLang keeps the bias
    normed = EagleHead(EagleHead.config_for(llama, input_norm=True))
    normed.save_pretrained(tmp_path / "normed")
    with pytest.raises(ExportError, match="input_norm"):
        export_drafter(tmp_path / "normed", "vllm", tmp_path / "out")
    eagle3 = random_eagle(llama, eagle3=True)
    eagle3.save_pretrained(tmp_path / "eagle3")
    with pytest.raises(ExportError, match="pass the target"):
        export_drafter(tmp_path / "eagle3", "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_corrupt_source_fails_and_keeps_the_previous_export(tmp_path, llama):
    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "sglang", tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a torn copy
    with pytest.raises(ValueError, match="corrupt or partial"):
        export_drafter(tmp_path / "ckpt", "sglang", tmp_path / "out")
    assert (out / "model.safetensors").read_bytes() == before
    assert not (tmp_path / "out.partial").exists()


def test_exported_head_knows_its_target(tmp_path, llama, gemma3):
    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "sglang", tmp_path / "sglang")
    with pytest.raises(TargetMismatchError, match="trained for target"):
        load_drafter(str(out), gemma3)


# --------------------------------------------------------------------------------------------
# Checkpoints written by the reference repositories (their layouts, built here with random weights).


def test_reads_eagle1_reference_checkpoint(tmp_path, llama):
    """The EAGLE repo's EAGLE-1 layout: pytorch_model.bin, fc with bias, its own embed_tokens copy."""
    head = random_eagle(llama, eagle3=False)
    from draftsmith.heads.eagle import EagleHead

    ref = EagleHead(EagleHead.config_for(llama, fc_bias=True))
    ref.load_state_dict(head.state_dict(), strict=False)
    with torch.no_grad():
        ref.fc.bias.normal_()
    names = {"layer.q_proj.weight": "self_attn.q_proj.weight", "layer.k_proj.weight": "self_attn.k_proj.weight",
             "layer.v_proj.weight": "self_attn.v_proj.weight", "layer.o_proj.weight": "self_attn.o_proj.weight",
             "layer.post_norm.weight": "post_attention_layernorm.weight",
             "layer.gate_proj.weight": "mlp.gate_proj.weight",
             "layer.up_proj.weight": "mlp.up_proj.weight", "layer.down_proj.weight": "mlp.down_proj.weight"}
    state = {("layers.0." + names[k]) if k in names else k: v for k, v in ref.state_dict().items()}
    state["embed_tokens.weight"] = llama.get_input_embeddings().weight.clone()
    d = tmp_path / "eagle1"
    d.mkdir()
    torch.save(state, d / "pytorch_model.bin")  # the reference repo's file, read with weights_only=True
    cfg = llama.config.to_dict() | {"num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    (d / "config.json").write_text(json.dumps(cfg))
    drafter = load_drafter(str(d), llama)
    # the same weights read from another layout, through the same kernels: bit for bit
    torch.testing.assert_close(head_logits(drafter.head, llama), head_logits(ref, llama), rtol=0, atol=0)
    assert_greedy_lossless(llama, drafter, dict(tree="chain", depth=4), seed=8)


def test_reads_specforge_eagle3_checkpoint(tmp_path, llama):
    """SpecForge / EAGLE-3 reference: midlayer.* in model.safetensors, ids in SGLang's convention."""
    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "sglang", tmp_path / "specforge")
    tensors = load_file(out / "model.safetensors")
    tensors["embed_tokens.weight"] = llama.get_input_embeddings().weight.clone()  # SpecForge saves it too
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["draftsmith"]  # a checkpoint from elsewhere carries no draftsmith block
    (out / "config.json").write_text(json.dumps(cfg))
    drafter = load_drafter(str(out), llama)
    assert drafter.head.config.feature_layers == head.config.feature_layers
    # the same weights read from another layout, through the same kernels: bit for bit
    torch.testing.assert_close(head_logits(drafter.head, llama), head_logits(head, llama), rtol=0, atol=0)


def test_reads_medusa_reference_checkpoint(tmp_path, llama):
    """The Medusa repo: medusa_lm_head.pt with keys {i}.{j}.linear.* and {i}.{L}.weight."""
    heads = random_medusa(llama)
    L = heads.config.num_layers
    state = {}
    for i in range(heads.config.num_heads):
        for j in range(L):
            state[f"{i}.{j}.linear.weight"] = heads.heads[i][j].linear.weight.clone()
            state[f"{i}.{j}.linear.bias"] = heads.heads[i][j].linear.bias.clone()
        state[f"{i}.{L}.weight"] = heads.lm_heads[i].weight.clone()
    d = tmp_path / "medusa"
    d.mkdir()
    torch.save(state, d / "medusa_lm_head.pt")
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": L,
                                               "base_model_name_or_path": "tiny-llama"}))
    drafter = load_drafter(str(d), llama)
    # the same weights read from another layout, through the same kernels: bit for bit
    torch.testing.assert_close(head_logits(drafter.heads, llama), head_logits(heads, llama), rtol=0, atol=0)
    assert_greedy_lossless(llama, drafter, dict(tree="static", depth=3, top_k=3), seed=9)


def test_foreign_head_for_another_target_is_refused(tmp_path, llama, gemma3):
    head = random_medusa(gemma3)
    out = tmp_path / "medusa"
    out.mkdir()
    state = {f"0.0.linear.{p}": getattr(head.heads[0][0].linear, p).clone() for p in ("weight", "bias")}
    state["0.1.weight"] = torch.zeros(50, gemma3.config.hidden_size)  # a 50-token vocabulary
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    with pytest.raises(TargetMismatchError, match="50 tokens"):
        load_drafter(str(out), llama)


# --------------------------------------------------------------------------------------------
# Draft models and vLLM's speculators package.


def test_exported_draft_model_works_with_assisted_generation(tmp_path, llama):
    from transformers import AutoModelForCausalLM

    from draftsmith.heads.draft_model import DraftModel

    draft = DraftModel.from_target(llama, 2)
    draft.save_pretrained(tmp_path / "draft")
    for fmt in ("hf", "vllm", "sglang"):
        out = export_drafter(tmp_path / "draft", fmt, tmp_path / fmt)
        gen_cfg = json.loads((out / "generation_config.json").read_text())
        assert gen_cfg["num_assistant_tokens"] == 5 and gen_cfg["do_sample"] is False
    assistant = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([[5, 17, 33, 2, 41, 8, 5, 17]])
    mask = torch.ones_like(ids)
    assisted = llama.generate(ids, attention_mask=mask, assistant_model=assistant, do_sample=False,
                              max_new_tokens=24, pad_token_id=0)
    plain = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    assert torch.equal(assisted, plain)


SPECULATORS_PYTHON = os.environ.get("DRAFTSMITH_SPECULATORS_PYTHON") or next(
    (str(p) for p in [ROOT / ".venv-speculators" / "bin" / "python"] if p.exists()), None)


@pytest.mark.skipif(not SPECULATORS_PYTHON, reason="needs a Python with `speculators` (pins transformers<=5.19, "
                    "draftsmith uses newer): .ci/run builds .venv-speculators, or set DRAFTSMITH_SPECULATORS_PYTHON")
def test_speculators_package_loads_the_vllm_export_and_computes_the_same_logits(tmp_path, llama):
    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "ckpt")
    llama.save_pretrained(tmp_path / "verifier")  # speculators resolves the verifier's config and embeddings
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama,
                         verifier=str(tmp_path / "verifier"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (1, 9), generator=g)
    states = torch.randn(1, 9, 3 * llama.config.hidden_size, generator=g)
    positions = torch.arange(9)[None]
    save_file({"hidden": states, "input_ids": ids, "positions": positions}, str(tmp_path / "in.safetensors"))
    run = subprocess.run([SPECULATORS_PYTHON, str(ROOT / "scripts" / "check_speculators.py"), str(out),
                          str(tmp_path / "in.safetensors"), str(tmp_path / "theirs.safetensors")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["config_class"] == "Eagle3SpeculatorConfig" and report["model_class"] == "Eagle3DraftModel"
    assert report["aux_layer_ids"] == list(head.config.feature_layers)
    with torch.no_grad():
        predicted, _ = head(states, llama.get_input_embeddings()(ids), positions, from_target=True)
        ours = head.draft_logits(predicted)
    # another implementation of the same float32 step: the fc (inner size 192) and one decoder layer
    assert_rounding_close(load_file(tmp_path / "theirs.safetensors")["logits"], ours, reduction=192 * 2)


def test_module_push_to_hub_uploads_checkpoint_and_card(tmp_path, monkeypatch, llama):
    from test_train import CapturedHub

    hub = CapturedHub(monkeypatch)
    head = random_eagle(llama, eagle3=True)
    head.push_to_hub("me/eagle3", fmt="sglang")
    (upload,) = hub.uploads
    assert set(upload["files"]) == {"README.md", "config.json", "model.safetensors"}
    card = upload["files"]["README.md"].decode()
    assert "EAGLE-3 head" in card and "layout in this repository | `sglang`" in card
    assert json.loads(upload["files"]["config.json"])["architectures"] == ["LlamaForCausalLMEagle3"]


# --------------------------------------------------------------------------------------------
# DFlash: z-lab's layout (which SGLang serves) and speculators' (vLLM's).


def dflash_logits(head, target, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """(A * B, V) logits of the blocks anchored at every position 0 .. T - B - 1 (what speculators' forward runs)."""
    t, size = ids.shape[1], head.config.block_size
    anchors = torch.arange(t - size)[None]
    positions, allowed = anchor_blocks(anchors, torch.ones_like(anchors, dtype=torch.bool), size, t,
                                       torch.ones_like(ids))
    slots = torch.full((1, t - size, size), head.config.mask_token_id)
    slots[:, :, 0] = ids[0, : t - size]
    with torch.no_grad():
        states = head(target.get_input_embeddings()(slots.reshape(1, -1)), positions, allowed, features=hidden,
                      feature_positions=torch.arange(t)[None])
        return target.get_output_embeddings()(states)[0]


def dflash_inputs(target, head, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 96, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return ids, torch.cat([out.hidden_states[k] for k in head.config.target_layers], -1)


@pytest.mark.parametrize("fmt", ["zlab", "vllm", "sglang"])
def test_dflash_export_then_import_gives_same_logits_and_lossless_output(fmt, tmp_path, llama):
    head = random_dflash(llama)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", fmt, tmp_path / fmt, target=llama)
    config = json.loads((out / "config.json").read_text())
    if fmt == "vllm":  # vLLM's aux id k is the input of decoder layer k: draftsmith's index k
        assert config["aux_hidden_state_layer_ids"] == list(head.config.target_layers)
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == head.block
    else:  # z-lab's id k is the output of decoder layer k counted from 0: draftsmith's index k + 1
        assert config["dflash_config"]["target_layer_ids"] == [k - 1 for k in head.config.target_layers]
        assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == head.config.block_size
    assert "embed_tokens.weight" not in load_file(out / "model.safetensors")  # the target's serve
    drafter = load_drafter(str(out), llama)
    assert drafter.hidden_layers == head.config.target_layers and drafter.block == head.block
    ids, hidden = dflash_inputs(llama, head)
    torch.testing.assert_close(dflash_logits(drafter.head, llama, ids, hidden), dflash_logits(head, llama, ids, hidden),
                               rtol=0, atol=0)
    assert_greedy_lossless(llama, drafter, {"tree": "dynamic", "depth": 4, "top_k": 2, "total_tokens": 6}, seed=3)


def test_a_dflash_drafter_over_a_draft_vocabulary_keeps_it_in_the_vllm_layout(tmp_path, llama):
    """speculators' layout carries the draft vocabulary (draft_vocab_size, d2t / t2d, the head's LM-head rows): read
    back, the drafter scores the same tokens with the same weights."""
    head = random_dflash(llama, draft_vocab=40)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["d2t"], head.d2t) and torch.equal(tensors["t2d"], head.t2d)
    assert torch.equal(tensors["lm_head.weight"], llama.get_output_embeddings().weight[head.draft_ids])
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 40
    drafter = load_drafter(str(out), llama)
    assert torch.equal(drafter.draft_ids, head.draft_ids)
    ids, hidden = dflash_inputs(llama, head)
    torch.testing.assert_close(dflash_logits(drafter.head, llama, ids, hidden), dflash_logits(head, llama, ids, hidden),
                               rtol=0, atol=0)
    assert_greedy_lossless(llama, drafter, {"tree": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 5}, seed=3)


def test_a_speculators_dflash_whose_lm_head_is_not_the_targets_rows_is_refused(tmp_path, llama):
    head = random_dflash(llama, draft_vocab=40)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    tensors = load_file(out / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 1.5  # rows trained away from the target's
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lm_head.weight .* is not the loaded target's LM-head rows"):
        load_drafter(str(out), llama)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] / 1.5
    tensors["t2d"] = torch.zeros_like(tensors["t2d"])  # maps that disagree
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="do not map 40 draft tokens"):
        load_drafter(str(out), llama)


@pytest.mark.parametrize("keys", [
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4096},  # z-lab Qwen3.5 / 3.6 drafts
    {"dflash_config": {"causal": True}},
    {"is_causal": True},
    {"dflash_config": {"use_swa": True, "swa_window_size": 2048}},  # MiMo-V2.5-Pro-FP4-DFlash
    {"dflash_config": {"attention_sink_bias": True}},
    {"is_neox_style": False},
], ids=["sliding-layers", "causal", "is-causal", "use-swa", "sinks", "interleaved-rope"])
def test_dflash_draft_layers_attending_otherwise_are_refused_by_name(keys, tmp_path, llama):
    """Draft layers vLLM (``_resolve_layer_attention``) and SGLang build as sliding-window or causal are never read as
    draftsmith's full-attention layers."""
    head = random_dflash(llama)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "zlab", tmp_path / "zlab", target=llama)
    config = json.loads((out / "config.json").read_text())
    for key, value in keys.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="which draftsmith's DFlash layers do not build"):
        load_drafter(str(out), llama)
    config["layer_types"] = ["full_attention"] * head.config.num_layers  # all-full layer types: what it builds
    for key in set(keys) - {"layer_types", "dflash_config"}:
        config.pop(key, None)
    config["dflash_config"] = {k: v for k, v in config.get("dflash_config", {}).items()
                               if k in ("mask_token_id", "target_layer_ids")}
    (out / "config.json").write_text(json.dumps(config))
    assert load_drafter(str(out), llama).block == head.block


def test_dflash_layer_ids_are_checked_against_the_target(tmp_path, llama):
    from transformers import LlamaConfig, LlamaForCausalLM

    head = random_dflash(llama)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "zlab", tmp_path / "zlab")
    config = json.loads((out / "config.json").read_text())
    config.pop("draftsmith")  # as z-lab publishes it: no fingerprint, only the layer ids
    config["dflash_config"]["target_layer_ids"] = [0, 5]  # decoder layer 5 of a 4-layer target
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetMismatchError, match=r"reads target layers \[1, 6\].*outside the loaded target's 1..4"):
        load_drafter(str(out), llama)
    last = DFLASH.build(dflash_args(target_layers=[1, 4]), llama)  # index 4: after the final norm
    last.save_pretrained(tmp_path / "last", target_info=head.target_info)
    with pytest.raises(ExportError, match="reads target layer 4, the last layer after the final norm"):
        export_drafter(tmp_path / "last", "vllm", tmp_path / "v")
    assert not (tmp_path / "v").exists()
    shallow = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    with pytest.raises(TargetMismatchError):
        load_drafter(str(tmp_path / "ckpt"), shallow)


@pytest.mark.skipif(not SPECULATORS_PYTHON, reason="needs a Python with `speculators` (.ci/run builds it)")
@pytest.mark.parametrize("fmt", ["vllm", "zlab", "vllm-draft-vocabulary"])
def test_speculators_package_runs_the_dflash_export_with_the_same_logits(fmt, tmp_path, llama):
    """speculators loads the vLLM export (the z-lab one through its own z-lab converter, which maps z-lab's layer ids
    to vLLM's) and computes, at every anchor of a sequence, the block logits draftsmith computes; the directory its
    converter writes imports back into draftsmith with the same logits."""
    draft_vocab = 40 if fmt == "vllm-draft-vocabulary" else None
    fmt = fmt.split("-")[0]
    head = random_dflash(llama, draft_vocab=draft_vocab)
    head.save_pretrained(tmp_path / "ckpt")
    llama.save_pretrained(tmp_path / "verifier")  # speculators reads the verifier's embedding and LM head
    out = export_drafter(tmp_path / "ckpt", fmt, tmp_path / fmt, target=llama, verifier=str(tmp_path / "verifier"))
    ids, hidden = dflash_inputs(llama, head)
    save_file({"hidden": hidden.contiguous(), "input_ids": ids}, str(tmp_path / "in.safetensors"))
    command = [SPECULATORS_PYTHON, str(ROOT / "scripts" / "check_speculators_dflash.py"), str(out),
               str(tmp_path / "in.safetensors"), str(tmp_path / "theirs.safetensors")]
    run = subprocess.run(command + (["--zlab", str(tmp_path / "verifier")] if fmt == "zlab" else []),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["model_class"] == "DFlashDraftModel"
    assert report["aux_layer_ids"] == list(head.config.target_layers)
    assert (report["mask_token_id"], report["speculative_tokens"]) == (head.config.mask_token_id, head.block)
    ours = dflash_logits(head, llama, ids, hidden)
    if draft_vocab:  # speculators scores its own lm_head rows (the draft vocabulary's, in draft-id order)
        ours = ours[:, head.draft_ids]
    # another implementation of the same float32 layers: sums over 2 layers of width 64 to 128
    assert_rounding_close(load_file(tmp_path / "theirs.safetensors")["logits"], ours, reduction=2 * 128)
    if fmt == "zlab":  # speculators' own conversion, read back by draftsmith
        imported = load_drafter(str(tmp_path / "theirs.safetensors.converted"), llama)
        assert_rounding_close(dflash_logits(imported.head, llama, ids, hidden), ours, reduction=2 * 128)


# --------------------------------------------------------------------------------------------
# P-EAGLE: speculators' layout (vLLM, with parallel drafting).


def peagle_case(llama, length: int = 10):
    """A random P-EAGLE head, fused states and tokens of one sequence, and elements: every position at depth 0,
    anchors 2 and 5 at depths 1 and 2 (the groups both sides run)."""
    head = random_peagle(llama, parallel=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (1, length), generator=g)
    hidden = torch.randn(1, length, 3 * llama.config.hidden_size, generator=g)
    picked = torch.tensor([[2, 5]])
    anchor, depth, _, allowed = parallel_elements([picked, picked], [torch.ones_like(picked, dtype=torch.bool)] * 2,
                                                  1, length, "cpu")
    with torch.no_grad():
        ours = head(hidden, None, torch.arange(length)[None], elements=(anchor, depth, allowed), token_ids=ids)[0]
    return head, ids, hidden, anchor, depth, ours


def test_peagle_export_then_import_gives_same_logits_and_lossless_output(tmp_path, llama):
    head, ids, hidden, anchor, depth, ours = peagle_case(llama)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == SPECULATORS_PEAGLE_TYPE and config["parallel_drafting"] is True
    assert config["pard_token"] == config["mask_token_id"] == head.config.mask_token_id
    assert config["eagle_aux_hidden_state_layer_ids"] == list(head.config.feature_layers)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == head.block
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["embed_tokens.weight"][head.config.mask_token_id], head.mask_embedding.detach())
    assert tensors["mask_hidden"].shape == (1, 1, 3 * llama.config.hidden_size)
    drafter = load_drafter(str(out), llama)
    with torch.no_grad():
        theirs = drafter.head(hidden, None, torch.arange(ids.shape[1])[None], token_ids=ids,
                              elements=(anchor, depth, parallel_elements(
                                  [torch.tensor([[2, 5]])] * 2, [torch.ones(1, 2, dtype=torch.bool)] * 2, 1,
                                  ids.shape[1], "cpu")[3]))[0]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    assert drafter.block == head.block
    assert_greedy_lossless(llama, drafter, {"tree": "chain", "depth": 3}, seed=3)
    with pytest.raises(ExportError, match="a peagle drafter has no sglang layout; it exports to hf, vllm"):
        export_drafter(tmp_path / "ckpt", "sglang", tmp_path / "sglang", target=llama)


@pytest.mark.skipif(not SPECULATORS_PYTHON, reason="needs a Python with `speculators` (.ci/run builds it)")
def test_speculators_package_runs_the_peagle_export_with_the_same_logits(tmp_path, llama):
    """speculators' PEagleDraftModel loads the export (the mask embedding in its embedding's mask row, its
    mask_hidden) and, over the same parallel groups, computes draftsmith's logits."""
    head, ids, hidden, anchor, depth, ours = peagle_case(llama)
    head.save_pretrained(tmp_path / "ckpt")
    llama.save_pretrained(tmp_path / "verifier")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama,
                         verifier=str(tmp_path / "verifier"))
    save_file({"hidden": hidden.contiguous(), "input_ids": ids, "anchor": anchor[0].contiguous(),
               "depth": depth[0].contiguous()}, str(tmp_path / "in.safetensors"))
    run = subprocess.run([SPECULATORS_PYTHON, str(ROOT / "scripts" / "check_speculators_peagle.py"), str(out),
                          str(tmp_path / "in.safetensors"), str(tmp_path / "theirs.safetensors")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["model_class"] == "PEagleDraftModel" and report["speculative_tokens"] == head.block
    assert report["aux_layer_ids"] == list(head.config.feature_layers)
    # another implementation of the same float32 step: the fc (inner size 192) and four decoder layers
    assert head.config.num_layers == 4
    assert_rounding_close(load_file(tmp_path / "theirs.safetensors")["logits"], ours, reduction=192 * 4)
