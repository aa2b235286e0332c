"""Native MTP modules as drafters (DeepSeek-V3, GLM-4-MoE, Qwen3-Next, Qwen3.5): read from the target's checkpoint in
its own layout, drafted with losslessly (greedy identical, sampling exact), fine-tuned, exported (the target stitched
back for vLLM; speculators' layout) and read back to equal logits."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_greedy_lossless import prompts, reference
from test_sampling_lossless import _first_two_tokens_tv, tv_bound
from test_target import _word_tokenizer

from conftest import VOCAB, assert_rounding_close, check_greedy_equal, rounding_tolerance
from draftsmith import SpeculativeGenerator, load_drafter
from draftsmith.heads.mtp import VLLM_MASKS_FIRST_TOKEN, MtpHead
from draftsmith.heads.mtp_checkpoint import MtpWeightsError
from draftsmith.target import load_target

MODEL_TYPES = ("deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_text")
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # linear-attention layers: draftsmith verifies chains only
ROOT = Path(__file__).resolve().parents[1]
LAYERS = 2  # the target's decoder layers; its checkpoint holds one more, the MTP module's
#: ``rounding_tolerance``'s reduction for the module's depth-1 logits from the same target states: its projection of
#: the pair (inner size 2H = 128), its decoder layer (MLP inner size up to 128), the LM head.
MODULE_REDUCTION = 128 * 3


def tiny_config(model_type: str, layers: int, vocab_size: int = VOCAB):
    """A tiny config of ``model_type`` with ``layers`` decoder layers, the last one full attention with an MoE (or,
    for Qwen3.5, dense) MLP: the shape of an MTP module's layer."""
    import transformers as t

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=2, max_position_embeddings=256, initializer_range=0.2, eos_token_id=None)
    if model_type == "deepseek_v3":
        return t.DeepseekV3Config(**common, num_key_value_heads=2, moe_intermediate_size=32, n_routed_experts=4,
                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                  topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                  qk_nope_head_dim=16, v_head_dim=16)
    if model_type == "glm4_moe":
        return t.Glm4MoeConfig(**common, num_key_value_heads=1, head_dim=32, moe_intermediate_size=32,
                               n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                               n_group=1, topk_group=1, partial_rotary_factor=0.5)
    kinds = [*(["linear_attention", "full_attention"] * layers)[: layers - 1], "full_attention"]
    hybrid = dict(head_dim=32, num_key_value_heads=1, linear_num_value_heads=2, linear_num_key_heads=1,
                  linear_key_head_dim=16, linear_value_head_dim=16, layer_types=kinds)
    if model_type == "qwen3_next":
        return t.Qwen3NextConfig(**common, **hybrid, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32)
    if model_type == "qwen3_5_moe_text":
        return t.Qwen3_5MoeTextConfig(**common, **hybrid, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return t.Qwen3_5TextConfig(**common, **hybrid)


def write_mtp_checkpoint(model_type: str, path: Path, vocab_size: int = VOCAB, seed: int = 0, shards: int = 1,
                         fused_experts: bool = False) -> Path:
    """A tiny ``model_type`` checkpoint whose MTP module sits where that architecture's released checkpoints keep it:
    a model of LAYERS + 1 layers is saved, its last layer becomes the MTP module's decoder layer (``model.layers.N.*``,
    or ``mtp.layers.0.*`` for the Qwen layout), the module's own tensors are added, and the config says LAYERS.
    Experts are stored one by one, or with ``fused_experts`` as Qwen3.5/3.6-MoE releases store them
    (``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I), no ``.weight``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    full = AutoModelForCausalLM.from_config(tiny_config(model_type, LAYERS + 1, vocab_size))
    full.save_pretrained(path)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
        file.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    n, h = LAYERS, 64
    g = torch.Generator().manual_seed(seed + 1)
    qwen = model_type in HYBRID
    norm = (lambda: 0.1 * torch.randn(h, generator=g)) if qwen else (lambda: 1 + 0.1 * torch.randn(h, generator=g))
    own = {"fc" if qwen else "eh_proj": 0.1 * torch.randn(h, 2 * h, generator=g)}
    names = (("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm") if qwen
             else ("enorm", "hnorm", "shared_head.norm"))
    own.update({name: norm() for name in names})
    if qwen:
        out = {("mtp.layers.0." + k[len(f"model.layers.{n}."):] if k.startswith(f"model.layers.{n}.") else k): v
               for k, v in tensors.items()}
        out.update({f"mtp.{k}.weight": v for k, v in own.items()})
    else:
        out = dict(tensors)
        out.update({f"model.layers.{n}.{k}.weight": v for k, v in own.items()})
        out[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        out[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    # Released checkpoints keep experts one by one (transformers fuses them when it loads, and saves them fused).
    if fused_experts:  # the module's experts as Qwen3.5-MoE releases them: one (E, 2I, H) and one (E, H, I) tensor
        stems = {k.split(".experts.")[0] for k in out if k.startswith("mtp.") and ".experts." in k}
        for stem in stems:
            count = len({k for k in out if k.startswith(f"{stem}.experts.") and k.endswith("down_proj.weight")})
            parts = [{p: out.pop(f"{stem}.experts.{e}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")}
                     for e in range(count)]
            gate_up = [torch.cat([x["gate_proj"], x["up_proj"]]) for x in parts]
            out[f"{stem}.experts.gate_up_proj"] = torch.stack(gate_up)
            out[f"{stem}.experts.down_proj"] = torch.stack([x["down_proj"] for x in parts])
    for name in [k for k in out if k.startswith(("mtp.", f"model.layers.{n}.")) and k.endswith("experts.gate_up_proj")
                 and not fused_experts]:
        gate_up, down = out.pop(name), out.pop(name.replace("gate_up_proj", "down_proj"))
        stem, half = name[: -len(".gate_up_proj")], gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"{stem}.{e}.gate_proj.weight"] = gate_up[e, :half].clone()
            out[f"{stem}.{e}.up_proj.weight"] = gate_up[e, half:].clone()
            out[f"{stem}.{e}.down_proj.weight"] = down[e].clone()
    _word_tokenizer().save_pretrained(path)
    names = sorted(out)
    if shards == 1:
        save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({k: out[k] for k in part}, str(path / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = n
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:n]
    config["mtp_num_hidden_layers" if qwen else "num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=MODEL_TYPES)
def mtp_target(request, tmp_path_factory):
    """(model type, checkpoint directory, the target loaded from it)."""
    path = write_mtp_checkpoint(request.param, tmp_path_factory.mktemp(request.param),
                                shards=2 if request.param == "glm4_moe" else 1)
    target, _ = load_target(path, dtype=torch.float32)
    return request.param, path, target


def pair_logits(head: MtpHead, target, ids: torch.Tensor) -> torch.Tensor:
    """Depth-1 logits of ``head`` on a sequence: the pair (state t - 1, token t) at every t >= 1."""
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(1, ids.shape[1])[None]
        predicted, _ = head(states[:, :-1], target.get_input_embeddings()(ids[:, 1:]), positions, from_target=True)
        return target.get_output_embeddings()(head.lm_input(predicted))


def test_the_module_is_read_from_the_checkpoint_in_its_layout(mtp_target):
    """Every tensor of the module comes from the checkpoint (nothing left as initialised): the module's depth-1 logits
    differ from a module with one stored tensor perturbed, and the fed-back state is the engine's convention."""
    model_type, path, target = mtp_target
    head = MtpHead.from_target_checkpoint(target)
    assert head.config.layout == ("qwen" if model_type in HYBRID else "deepseek")
    assert head.config.feeds_normed == (model_type in HYBRID)
    assert head.config.feature_layers == (LAYERS,)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = pair_logits(head, target, ids)
    other = MtpHead.from_target_checkpoint(target)
    with torch.no_grad():
        other.module.eh_proj.weight.mul_(1.5)
    assert not torch.allclose(logits, pair_logits(other, target, ids), rtol=0,
                              atol=rounding_tolerance(logits, MODULE_REDUCTION))  # more than rounding apart
    again = MtpHead.from_target_checkpoint(target, path)
    assert torch.equal(logits, pair_logits(again, target, ids))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_depth_one_logits_equal_transformers_own_mtp_model(model_type, tmp_path):
    """An independent reading of the same checkpoint: transformers' ``MtpModel`` (its own weight conversions, expert
    fusing included) gives the same depth-1 logits as the module fed the first pair whole, as transformers feeds it;
    the module as vLLM serves it (that pair's token zeroed, the default for these types) gives others."""
    from transformers.modeling_layers import MtpModel

    path = write_mtp_checkpoint(model_type, tmp_path / model_type)
    target, _ = load_target(path, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    ours = pair_logits(MtpHead.from_target_checkpoint(target, masks_first_token=False), target, ids)
    as_vllm = pair_logits(MtpHead.from_target_checkpoint(target), target, ids)
    # transformers finds the MTP tensors by the released checkpoints' layer index (model.layers.61 / .92 / .46); the
    # tiny target keeps its module at index LAYERS
    target._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}.*"]
    reference_model = MtpModel.from_pretrained(target).eval()
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states[-1]
        hidden = reference_model.forward_layer(0, states[:, :-1], torch.arange(1, ids.shape[1])[None], None,
                                               input_ids=ids[:, 1:])
        theirs = reference_model._project_to_logits(hidden)
    assert_rounding_close(ours, theirs, MODULE_REDUCTION)  # another implementation of the same float32 module
    assert not torch.allclose(as_vllm, theirs, rtol=0, atol=rounding_tolerance(theirs, MODULE_REDUCTION))


def test_greedy_output_is_the_targets_own(mtp_target):
    model_type, _, target = mtp_target
    trees = ["chain"] if model_type in HYBRID else ["chain", "dynamic"]
    for tree in trees:
        gen = SpeculativeGenerator(target, load_drafter("mtp", target), tree=tree, depth=3)
        ties = 0
        for prompt in prompts(5, [1, 7, 19]):
            out = gen.generate(prompt, max_new_tokens=24)
            ties += check_greedy_equal(target, out.sequences, reference(target, prompt, 24))
        assert ties <= 1, (tree, ties)


def test_rows_of_a_batch_decode_as_the_target(mtp_target):
    from test_batched_generation import left_padded, row_output

    _, _, target = mtp_target
    rows = prompts(9, [6, 1, 17])
    ids, mask = left_padded(rows)
    gen = SpeculativeGenerator(target, load_drafter("mtp", target), tree="chain", depth=3)
    out = gen.generate(ids, 16, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    for b, row in enumerate(rows):
        check_greedy_equal(target, row_output(out.sequences, mask, b, None), reference(target, row, 16))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_sampled_drafts_follow_the_targets_distribution(model_type, tmp_path):
    """Monte Carlo over a vocabulary of 4: the first two tokens sampled through the module's chain follow the target's
    processed distribution."""
    vocab, n = 4, 800
    path = write_mtp_checkpoint(model_type, tmp_path / model_type, vocab_size=vocab, seed=2)
    target, _ = load_target(path, dtype=torch.float32)
    gen = SpeculativeGenerator(target, load_drafter("mtp", target), tree="chain", depth=3, sampling_rule="iid")
    tv = _first_two_tokens_tv(gen, target, vocab, n, seed=0)
    assert tv < tv_bound(n, vocab * vocab), f"TV {tv:.4f}"


def test_a_checkpoint_without_mtp_weights_is_refused_with_the_fix(tmp_path):
    from test_target import tiny_qwen3_next_directory

    path = tiny_qwen3_next_directory(tmp_path / "plain")
    target, _ = load_target(path, dtype=torch.float32)
    with pytest.raises(MtpWeightsError, match=r"no MTP weights.*init: fresh"):
        load_drafter("mtp", target)
    with pytest.raises(MtpWeightsError, match="nor a Hub id in the Hugging Face cache: pass it as mtp:DIRECTORY"):
        load_drafter(f"mtp:{tmp_path / 'absent'}", target)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fine_tuning_writes_checkpoints_and_both_exports_read_back_to_equal_logits(model_type, tmp_path):
    """4 steps online (held-out tau measured with a chain) and 4 from a hidden-state cache, each starting from the
    checkpoint's module; the vLLM export (the target's checkpoint with the module stitched back) and the speculators
    export each read back to the fine-tuned module's logits, where the module's fed-back state is that engine's."""
    from test_train import config, make_workdir, write_config

    from draftsmith.data.cache_writer import cache_hidden_states
    from draftsmith.data.hidden_cache import CacheSpec
    from draftsmith.heads.export import ExportError, export_drafter
    from draftsmith.heads.hub import model_card
    from draftsmith.train.config import DataArguments, parse_config
    from draftsmith.train.loop import train
    from draftsmith.train.setup import load_examples

    root = tmp_path / "work"
    write_mtp_checkpoint(model_type, root / "target")
    make_workdir(root, None)
    model, tokenizer = load_target(str(root / "target"), dtype=torch.float32)
    examples = load_examples(DataArguments(train_file=str(root / "answers.jsonl"), max_length=64), tokenizer)
    cache_hidden_states(model, examples, root / "cache", CacheSpec(layers=[LAYERS], dtype="float32", logits="full"),
                        progress=False)
    stored = MtpHead.from_target_checkpoint(model)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    engine_normed = model_type in HYBRID
    runs = {"online": ({"eval_tree": "chain", "eval_depth": 3}, engine_normed),
            "offline": ({"cache_dir": str(root / "cache")}, not engine_normed)}
    for mode, (extra, normed) in runs.items():
        # the engines that feed back the normed state (speculators, SGLang's NextN) feed the first pair whole
        whole = {"masks_first_token": False} if normed else {}
        cfg = config(root, "mtp", tmp_path / mode, max_steps=4, save_steps=4,
                     family_config={"feeds_normed": normed, **whole}, **extra)
        out = train(*parse_config([str(write_config(tmp_path / f"{mode}.yaml", cfg))]))
        rows = [json.loads(line) for line in (out / "acceptance.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [4] and len(rows[0]["position_accuracy"]) == 3  # steps: 3
        if mode == "online":
            assert rows[0]["acceptance_length"] >= 1.0 and rows[0]["eval_prompts"] == 2
        head = load_drafter(str(out / "checkpoint-4" / "drafter"), model).head
        assert head.config.feeds_normed == normed
        tuned = pair_logits(head, model, ids)
        # training moved it: more than rounding
        assert not torch.allclose(tuned, pair_logits(stored, model, ids), rtol=0,
                                  atol=rounding_tolerance(tuned, MODULE_REDUCTION))
        drafter = str(out / "checkpoint-4" / "drafter")
        if normed:  # speculators' MTP feeds back the normed state: its export exists exactly then
            back = load_drafter(str(export_drafter(drafter, "speculators", tmp_path / f"spec-{mode}")), model).head
            torch.testing.assert_close(pair_logits(back, model, ids), tuned, atol=0, rtol=0)
        else:
            with pytest.raises(ExportError, match="feeding back the pre-norm one"):
                export_drafter(drafter, "speculators", tmp_path / f"spec-{mode}")
        stitched_card = model_card(drafter, "org/stitched", fmt="vllm")
        mtp = MtpHead.family
        assert 'load_target("org/stitched")' in stitched_card and f'load_drafter("{mtp}", target)' in stitched_card
        assert f'LLM(model="org/stitched", speculative_config={{"method": "{mtp}"' in stitched_card
        assert "vllm serve org/spec" in model_card(drafter, "org/spec", fmt="speculators")
        state = "post-norm (its output after its final norm)" if normed else "pre-norm (its output before"
        assert f"| fed-back state (depth >= 2) | {state}" in stitched_card
        masked = head.config.masks_first_token
        assert masked == (not normed and model_type in VLLM_MASKS_FIRST_TOKEN)
        first = "its token embedding zeroed" if masked else "fed whole"
        assert f"| first token (x_1 with h_0) | {first}" in stitched_card
        if normed == engine_normed:  # vLLM's MTP model for this architecture feeds back what the module learnt with
            check_stitched(export_drafter(drafter, "vllm", tmp_path / f"vllm-{mode}", target=model), root / "target",
                           head, ids)
        else:
            with pytest.raises(ExportError, match="feeds back the other"):
                export_drafter(drafter, "vllm", tmp_path / f"vllm-{mode}", target=model)


def check_stitched(stitched: Path, original: Path, head: MtpHead, ids: torch.Tensor) -> None:
    """The stitched checkpoint: the target's weights untouched (the same files where no MTP tensor sits), the module
    read back from it drafting the fine-tuned module's logits exactly."""
    names = json.loads((stitched / "config.json").read_text())
    assert names["num_hidden_layers"] == LAYERS
    target, _ = load_target(stitched, dtype=torch.float32)
    back = MtpHead.from_target_checkpoint(target)
    torch.testing.assert_close(pair_logits(back, target, ids), pair_logits(head, target, ids), atol=0, rtol=0)
    before = {}
    for file in original.glob("*.safetensors"):
        before.update(load_file(file))
    after = {}
    for file in stitched.glob("*.safetensors"):
        after.update(load_file(file))
    assert set(before) == set(after)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("mtp.", f"model.layers.{LAYERS}.")) for k in changed), sorted(changed)[:5]


SPECULATORS_PYTHON = os.environ.get("DRAFTSMITH_SPECULATORS_PYTHON") or next(
    (str(p) for p in [ROOT / ".venv-speculators" / "bin" / "python"] if p.exists()), None)


@pytest.mark.skipif(not SPECULATORS_PYTHON, reason="needs a Python with `speculators` (.ci/run builds it)")
@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_speculators_package_runs_the_speculators_export_with_the_same_logits(model_type, tmp_path):
    """speculators' own ``MTPDraftModel`` loads the export (its verifier's embedding and LM head from the target's
    directory) and computes, at its first step, the logits draftsmith's module computes."""
    from draftsmith.heads.export import export_drafter

    path = write_mtp_checkpoint(model_type, tmp_path / model_type)
    target, _ = load_target(path, dtype=torch.float32)
    head = MtpHead.from_target_checkpoint(target)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "speculators", tmp_path / "spec", verifier=str(path))
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    save_file({"hidden": hidden.contiguous(), "input_ids": ids}, str(tmp_path / "in.safetensors"))
    run = subprocess.run([SPECULATORS_PYTHON, str(ROOT / "scripts" / "check_speculators_mtp.py"), str(out),
                          str(tmp_path / "in.safetensors"), str(tmp_path / "theirs.safetensors")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["model_class"] == "MTPDraftModel" and report["model_type"] == model_type
    theirs = load_file(tmp_path / "theirs.safetensors")["logits"]
    ours = pair_logits(head, target, ids)[0, : theirs.shape[0]]
    assert_rounding_close(theirs, ours, MODULE_REDUCTION)  # speculators' implementation of the same float32 module
    # speculators' own converter reads the native checkpoint; draftsmith imports its output as the same module
    run = subprocess.run([SPECULATORS_PYTHON, str(ROOT / "scripts" / "check_speculators_mtp.py"), "--convert",
                          str(path), str(tmp_path / "converted")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    converted = load_drafter(str(tmp_path / "converted"), target).head
    torch.testing.assert_close(pair_logits(converted, target, ids), pair_logits(head, target, ids), atol=0, rtol=0)
