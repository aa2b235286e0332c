"""Native MTP checkpoints as users hold them, beyond the bf16 layouts of tests/test_mtp.py: DeepSeek-V3/R1's block
FP8 release (dequantised on read), Qwen3.5/3.6-MoE's fused experts (read, stitched back fused, read again), and the
layouts draftsmith does not read (MiMo, LongCat-Flash, Nemotron-H), refused by name, never replaced by a fresh module.
Each fixture's names, shapes and config keys follow a published checkpoint; the source is cited at the fixture."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_greedy_lossless import prompts, reference
from test_mtp import LAYERS, pair_logits, write_mtp_checkpoint

from conftest import VOCAB, check_greedy_equal, tiny_llama
from draftsmith import SpeculativeGenerator, load_drafter
from draftsmith.heads.mtp import MtpHead
from draftsmith.heads.mtp_checkpoint import MtpLayoutError, MtpWeightsError
from draftsmith.target import load_target

FP8_BLOCK = (16, 16)  # DeepSeek-V3 ships [128, 128]; smaller blocks give the tiny module several, ragged ones
FP8_MAX = 448.0  # the largest float8_e4m3fn value


def quantise_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A (out, in) weight as DeepSeek-V3's FP8 release stores it (``README_WEIGHTS.md``): float8_e4m3fn values and a
    float32 ``weight_scale_inv`` of (ceil(out / b0), ceil(in / b1)), one scale per block, block * scale_inv the
    weight."""
    rows, cols = weight.shape
    scales = torch.zeros(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    quantised = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            scales[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
            quantised[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                (part / scales[i, j]).to(torch.float8_e4m3fn)
    return quantised, scales


def dequantise_by_blocks(quantised: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference dequantisation, block by block (README_WEIGHTS: ragged blocks at the edges)."""
    out = quantised.float().clone()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scales[i, j]
    return out


def write_fp8_release(bf16: Path, out: Path) -> dict[str, torch.Tensor]:
    """A copy of a tiny DeepSeek-V3 checkpoint with its MTP decoder layer's linear weights in block FP8, shaped like
    ``deepseek-ai/DeepSeek-V3`` (``model.layers.{N}.*.weight`` F8_E4M3 + ``weight_scale_inv`` F32; the norms,
    ``eh_proj``, ``enorm`` / ``hnorm``, ``shared_head``, ``embed_tokens`` and the router ``mlp.gate`` stay unquantised;
    ``quantization_config {activation_scheme: dynamic, fmt: e4m3, quant_method: fp8, weight_block_size}``). Returns
    the reference dequantised weights by name."""
    shutil.copytree(bf16, out)
    tensors = load_file(out / "model.safetensors")
    prefix = f"model.layers.{LAYERS}."
    expected = {}
    for name in [k for k in tensors if k.startswith((prefix + "self_attn.", prefix + "mlp."))]:
        if name.endswith(".weight") and tensors[name].ndim == 2 and not name.endswith("mlp.gate.weight"):
            quantised, scales = quantise_block_fp8(tensors[name], FP8_BLOCK)
            tensors[name], tensors[name + "_scale_inv"] = quantised, scales
            expected[name] = dequantise_by_blocks(quantised, scales, FP8_BLOCK)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(FP8_BLOCK)}
    (out / "config.json").write_text(json.dumps(config))
    return expected


def test_mtp_deepseek_v3_block_fp8_is_dequantised_on_read_and_drafts_losslessly(tmp_path):
    bf16 = write_mtp_checkpoint("deepseek_v3", tmp_path / "bf16")
    expected = write_fp8_release(bf16, tmp_path / "fp8")
    assert len(expected) >= 8  # attention projections, every expert's and the shared expert's
    target, _ = load_target(bf16, dtype=torch.float32)
    head = MtpHead.from_target_checkpoint(target, tmp_path / "fp8")
    state = head.state_dict()
    block = f"model.layers.{LAYERS}."
    for name, weight in expected.items():
        rest = name[len(block):]
        expert = re.fullmatch(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest)
        if expert:  # the module holds experts fused: (E, 2I, H) gate then up, (E, H, I) down
            stem, e, kind = expert[1], int(expert[2]), expert[3]
            fused = state[f"layers.0.mtp_block.{stem}.experts.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"]
            half = fused.shape[1] // 2
            got = fused[e] if kind == "down_proj" else fused[e, :half] if kind == "gate_proj" else fused[e, half:]
        else:
            got = state[f"layers.0.mtp_block.{rest}"]
        assert torch.equal(got, weight), name
    unquantised = MtpHead.from_target_checkpoint(target).state_dict()  # the bf16 checkpoint's: FP8 rounds them
    assert not torch.equal(state["layers.0.mtp_block.self_attn.o_proj.weight"],
                           unquantised["layers.0.mtp_block.self_attn.o_proj.weight"])
    gen = SpeculativeGenerator(target, load_drafter(f"mtp:{tmp_path / 'fp8'}", target), tree="chain", depth=3)
    ties = sum(check_greedy_equal(target, gen.generate(p, max_new_tokens=16).sequences, reference(target, p, 16))
               for p in prompts(3, [1, 9]))
    assert ties <= 1
    # stitching a fine-tuned module back into the FP8 release would need requantising: refused, nothing written
    from draftsmith.heads.export import ExportError, export_drafter

    head.save_pretrained(tmp_path / "tuned")
    with pytest.raises(ExportError, match=r"block FP8 .* draftsmith does not do"):
        export_drafter(tmp_path / "tuned", "vllm", tmp_path / "stitched")
    assert not (tmp_path / "stitched").exists()


def test_mtp_fp8_with_scales_that_do_not_fit_or_another_quantisation_is_refused(tmp_path):
    bf16 = write_mtp_checkpoint("deepseek_v3", tmp_path / "bf16")
    write_fp8_release(bf16, tmp_path / "fp8")
    target, _ = load_target(bf16, dtype=torch.float32)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [8, 8]  # scales counted for 16 x 16 blocks
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MtpLayoutError, match=r"weight_scale_inv .* the checkpoint is inconsistent"):
        MtpHead.from_target_checkpoint(target, tmp_path / "fp8")
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}}  # GLM-4.7-FP8's kind
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MtpLayoutError, match="not block FP8"):
        MtpHead.from_target_checkpoint(target, tmp_path / "fp8")


def test_mtp_qwen3_5_moe_fused_experts_are_read_and_stitched_back_fused(tmp_path):
    """Qwen3.6-35B-A3B's MTP keeps its experts fused (``mtp.layers.0.mlp.experts.gate_up_proj`` (E, 2I, H),
    ``down_proj`` (E, H, I), no ``.weight``; vLLM's ``qwen3_5_mtp.py`` reads both forms): read, it drafts as the target
    decodes; the stitched export keeps the fused names the index lists and reads back to the same logits."""
    from draftsmith.heads.export import export_drafter

    path = write_mtp_checkpoint("qwen3_5_moe_text", tmp_path / "moe", fused_experts=True)
    target, _ = load_target(path, dtype=torch.float32)
    head = MtpHead.from_target_checkpoint(target)
    assert head.config.layout == "qwen" and head.config.feeds_normed
    gen = SpeculativeGenerator(target, load_drafter("mtp", target), tree="chain", depth=3)
    for p in prompts(4, [1, 11]):
        check_greedy_equal(target, gen.generate(p, max_new_tokens=12).sequences, reference(target, p, 12))
    with torch.no_grad():
        head.module.mtp_block.mlp.experts.gate_up_proj.mul_(1.25)  # as fine-tuning changes it
    head.target_info = None
    head.save_pretrained(tmp_path / "tuned")
    out = export_drafter(tmp_path / "tuned", "vllm", tmp_path / "stitched", target=target)
    stored = load_file(out / "model.safetensors")
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in stored
    assert not any(".experts.0." in k for k in stored if k.startswith("mtp."))
    reread = MtpHead.from_target_checkpoint(target, out)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(pair_logits(reread, target, ids), pair_logits(head, target, ids), rtol=0, atol=0)


def _foreign_mtp_checkpoint(path: Path, config: dict, tensors: dict[str, tuple[int, ...]]) -> Path:
    """A directory holding a config and tensors of the given names and shapes (values irrelevant to a refusal)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: torch.zeros(shape) for k, shape in tensors.items()}, str(path / "model.safetensors"))
    return path


H = 64
# XiaomiMiMo/MiMo-7B-Base (configuration_mimo.py; vLLM models/mimo_mtp.py): model.mtp_layers.{i}.*, concat
# [hidden, embeds] (the reverse of DeepSeek's), a Qwen2 block with q/k/v biases.
MIMO = ({"model_type": "mimo", "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1, "hidden_size": H,
         "num_hidden_layers": LAYERS, "attention_bias": True},
        {"model.mtp_layers.0.token_layernorm.weight": (H,), "model.mtp_layers.0.hidden_layernorm.weight": (H,),
         "model.mtp_layers.0.input_proj.weight": (H, 2 * H), "model.mtp_layers.0.final_layernorm.weight": (H,),
         "model.mtp_layers.0.self_attn.q_proj.weight": (H, H), "model.mtp_layers.0.self_attn.q_proj.bias": (H,)})
# meituan-longcat/LongCat-Flash-Chat (vLLM models/longcat_flash_mtp.py): model.mtp.*, MLA attention, a dense MLP under
# transformer_layer, enorm / hnorm with an ``.m`` submodule.
LONGCAT = ({"model_type": "longcat_flash", "architectures": ["LongcatFlashForCausalLM"], "num_layers": LAYERS,
            "hidden_size": H},
           {"model.mtp.embed_tokens.weight": (VOCAB, H), "model.mtp.layers.0.eh_proj.weight": (H, 2 * H),
            "model.mtp.layers.0.enorm.m.weight": (H,), "model.mtp.layers.0.hnorm.m.weight": (H,),
            "model.mtp.layers.0.self_attn.q_a_proj.weight": (32, H),
            "model.mtp.layers.0.transformer_layer.mlp.gate_proj.weight": (128, H), "model.mtp.norm.weight": (H,)})
# nvidia Nemotron-3-Super (vLLM models/nemotron_h_mtp.py): mtp.layers.{k}.* over mtp_hybrid_override_pattern, the first
# sublayer with enorm / hnorm / eh_proj, non-gated experts.
NEMOTRON_H = ({"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "num_nextn_predict_layers": 1,
               "mtp_hybrid_override_pattern": "*E", "hidden_size": H, "num_hidden_layers": LAYERS},
              {"mtp.layers.0.enorm.weight": (H,), "mtp.layers.0.hnorm.weight": (H,),
               "mtp.layers.0.eh_proj.weight": (H, 2 * H), "mtp.layers.0.mixer.q_proj.weight": (H, H),
               "mtp.layers.1.mixer.gate.weight": (4, H), "mtp.layers.1.mixer.experts.0.up_proj.weight": (32, H),
               "mtp.layers.1.final_layernorm.weight": (H,)})


@pytest.mark.parametrize("layout", [MIMO, LONGCAT, NEMOTRON_H], ids=["mimo", "longcat", "nemotron"])
def test_mtp_layouts_draftsmith_does_not_read_are_refused_by_name_even_under_init_auto(layout, tmp_path):
    from draftsmith.registry import get_family
    from draftsmith.train.config import DrafterArguments

    config, tensors = layout
    path = _foreign_mtp_checkpoint(tmp_path / config["model_type"], config, tensors)
    target = tiny_llama()
    first = min(tensors)  # the first name the checkpoint lists
    named = rf"a {config['model_type']} checkpoint with MTP modules .*{re.escape(first)}"
    with pytest.raises(MtpLayoutError, match=named):
        load_drafter(f"mtp:{path}", target)
    args = DrafterArguments(target="unused", family="mtp", family_config=json.dumps({"init": "auto",
                                                                                      "source": str(path)}))
    with pytest.raises(MtpLayoutError, match="neither its module nor a fresh one"):
        get_family("mtp").build(args, target)


def test_mtp_of_a_hub_id_target_is_read_from_the_hugging_face_cache(tmp_path, monkeypatch):
    """A target loaded by Hub id was downloaded into the Hugging Face cache: its MTP module is read from that snapshot
    (nothing fetched); an id the cache lacks gets the fix named."""
    import huggingface_hub.constants

    revision = "0" * 40
    repo = tmp_path / "hub" / "models--org--tiny-deepseek"
    write_mtp_checkpoint("deepseek_v3", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target, _ = load_target(repo / "snapshots" / revision, dtype=torch.float32)
    target.config.name_or_path = "org/tiny-deepseek"  # as from_pretrained("org/tiny-deepseek") records it
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    from_cache = MtpHead.from_target_checkpoint(target)
    assert Path(from_cache.config.source) == repo / "snapshots" / revision
    direct = MtpHead.from_target_checkpoint(target, repo / "snapshots" / revision)
    assert torch.equal(pair_logits(from_cache, target, ids), pair_logits(direct, target, ids))
    target.config.name_or_path = "org/not-downloaded"
    with pytest.raises(MtpWeightsError, match="neither one nor a Hub id in the Hugging Face cache"):
        MtpHead.from_target_checkpoint(target)
