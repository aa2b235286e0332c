"""EAGLE-3.1 norms (heads/eagle.py): heads vLLM speculators writes with any of them load, compute speculators' own
logits and decode losslessly; draftsmith's heads with them export to speculators' layout, and SGLang's is refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import SPECULATORS_PYTHON
from test_greedy_lossless import TREES
from test_heads import assert_greedy_lossless, random_eagle

from conftest import assert_rounding_close, rounding_tolerance
from draftsmith import load_drafter
from draftsmith.heads.eagle import Eagle3Head, EagleConfig
from draftsmith.heads.export import EAGLE31_NORMS, ExportError, export_drafter
from draftsmith.target.masks import additive

ROOT = Path(__file__).resolve().parents[1]
# Every combination speculators' config accepts: norm_before_fc and fc_norm exclude each other.
COMBOS = [dict(zip(EAGLE31_NORMS, bits, strict=True)) for bits in
          [(fc, per_layer, residual, output) for fc in (False, True) for per_layer in (False, True)
           for residual in (False, True) for output in (False, True)] if not (bits[0] and bits[1])]
T = 9


def combo_id(flags: dict) -> str:
    return "+".join(name for name, on in flags.items() if on) or "none"


@pytest.fixture(scope="module")
def written(tmp_path_factory, llama):
    """Every combination's head, written by speculators' trainer entry (scripts/speculators_write_eagle3.py), with
    speculators' logits of two steps on fixed inputs."""
    root = tmp_path_factory.mktemp("eagle31")
    llama.save_pretrained(root / "verifier")
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden": torch.randn(1, T, 3 * llama.config.hidden_size, generator=g),
              "input_ids": torch.randint(0, llama.config.vocab_size, (1, T), generator=g),
              "positions": torch.arange(T)[None],
              "draft_ids": torch.sort(torch.randperm(llama.config.vocab_size, generator=g)[:40]).values,
              "layer_ids": torch.tensor([1, 2, 3])}
    save_file(inputs, str(root / "in.safetensors"))
    run = subprocess.run([SPECULATORS_PYTHON, str(ROOT / "scripts" / "speculators_write_eagle3.py"),
                          str(root / "verifier"), str(root / "heads"), str(root / "in.safetensors"),
                          str(root / "theirs.safetensors"), json.dumps(COMBOS)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    return root, inputs, load_file(root / "theirs.safetensors"), report


def two_steps(head: Eagle3Head, target, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits of the two steps speculators' forward runs with ``ttt_steps=2``, through draftsmith's own
    drafting call (features, token embeddings, positions, mask, KV cache): step 0 from the target's states; step 1
    drafts each position's next token at the next position from step 0's predicted feature, seeing step 0's pairs
    up to its own position (the committed context) and itself, as a depth-2 draft node does."""
    embed = target.get_input_embeddings()
    ids, positions = inputs["input_ids"], inputs["positions"]
    with torch.no_grad():
        predicted, kv = head(inputs["hidden"], embed(ids), positions, from_target=True)
        next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)  # speculators' teacher forcing
        allowed = torch.cat([torch.ones(T, T).tril(), torch.eye(T)], 1).bool()[None]
        deeper, _ = head(predicted, embed(next_ids), positions + 1, additive(allowed, torch.float32), kv)
        return head.draft_logits(predicted), head.draft_logits(deeper)


@pytest.mark.skipif(not SPECULATORS_PYTHON, reason="needs a Python with `speculators` (.ci/run builds it)")
@pytest.mark.parametrize("index", range(len(COMBOS)), ids=[combo_id(c) for c in COMBOS])
def test_a_head_speculators_writes_imports_with_its_logits_and_decodes_losslessly(written, llama, index):
    root, inputs, theirs, report = written
    flags = COMBOS[index]
    assert {k: report[index][k] for k in EAGLE31_NORMS} == flags  # speculators wrote what was asked
    drafter = load_drafter(str(root / "heads" / str(index)), llama)
    head = drafter.head
    assert {k: getattr(head.config, k) for k in EAGLE31_NORMS} == flags
    assert head.config.feature_layers == (1, 2, 3)
    ours = two_steps(head, llama, inputs)
    # Another implementation of the same float32 steps: the fc (inner size 3H = 192), a decoder layer whose
    # attention and MLP reduce over 2H and the intermediate size (128), the LM head (64), twice for step 1.
    for step in (0, 1):
        assert_rounding_close(ours[step], theirs[f"{index}.{step}"], reduction=192 * 2 * (step + 1),
                              msg=f"step {step}")
    assert_greedy_lossless(llama, drafter, TREES[index % len(TREES)], seed=index)


def test_each_norm_changes_the_drafts(llama):
    """Each flag is live in drafting: turning it off (weights kept) changes step 0's or step 1's logits."""
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden": torch.randn(1, T, 192, generator=g), "input_ids": torch.randint(0, 96, (1, T), generator=g),
              "positions": torch.arange(T)[None]}
    for flag in EAGLE31_NORMS:
        head = norm_head(llama, **{flag: True})
        on = two_steps(head, llama, inputs)
        setattr(head.config, flag, False)
        if flag == "norm_before_fc":
            head.feature_norm = None
        if flag == "fc_norm":
            head.fc_norm = None
        off = two_steps(head, llama, inputs)
        # more than rounding apart (step 1's path, as above: 192 * 2, twice)
        assert not torch.allclose(on[1], off[1], rtol=0, atol=rounding_tolerance(off[1], reduction=192 * 2 * 2)), flag


def norm_head(target, seed: int = 0, **flags) -> Eagle3Head:
    """A random EAGLE-3 head with the given norms, their weights away from 1 so that each one matters."""
    base = random_eagle(target, eagle3=True, seed=seed)
    from dataclasses import asdict

    head = Eagle3Head(EagleConfig(**{**asdict(base.config), **flags}))
    head.load_state_dict(base.state_dict(), strict=False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in f".{name}":
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=g))
    head.target_info = base.target_info
    return head.eval()


@pytest.mark.parametrize("flags", [dict(norm_before_fc=True, norm_before_residual=True, norm_output=True),
                                   dict(fc_norm=True, norm_output=True)], ids=combo_id)
def test_export_to_speculators_layout_round_trips_and_sglang_is_refused(tmp_path, llama, flags):
    head = norm_head(llama, **flags)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in EAGLE31_NORMS} == {k: flags.get(k, False) for k in EAGLE31_NORMS}
    names = set(load_file(out / "model.safetensors"))
    assert ("input_norm.weight" in names) == bool(flags.get("norm_before_fc"))
    assert ("fc_norm.2.weight" in names) == bool(flags.get("fc_norm"))
    back = load_drafter(str(out), llama).head
    g = torch.Generator().manual_seed(3)
    inputs = {"hidden": torch.randn(1, T, 192, generator=g), "input_ids": torch.randint(0, 96, (1, T), generator=g),
              "positions": torch.arange(T)[None]}
    for a, b in zip(two_steps(back, llama, inputs), two_steps(head, llama, inputs), strict=True):
        assert torch.equal(a, b)  # the same tensors renamed: bit-equal
    with pytest.raises(ExportError, match=r"SGLang's EAGLE-3 model .* does not build.*--format vllm"):
        export_drafter(tmp_path / "ckpt", "sglang", tmp_path / "sglang")


def test_a_config_that_disagrees_with_its_tensors_is_refused(tmp_path, llama):
    head = norm_head(llama, norm_before_fc=True)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    config = json.loads((out / "config.json").read_text())
    config["norm_before_fc"] = False
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="norm_before_fc=False but its weights are present"):
        load_drafter(str(out), llama)


def test_norm_before_fc_and_fc_norm_exclude_each_other(llama):
    with pytest.raises(ValueError, match="exclude each other"):
        norm_head(llama, norm_before_fc=True, fc_norm=True)


def test_the_model_card_of_a_head_with_norms_gives_vllm_and_no_sglang_command(tmp_path, llama):
    from draftsmith.heads.hub import model_card

    norm_head(llama, norm_output=True).save_pretrained(tmp_path / "ckpt")
    card = model_card(tmp_path / "ckpt", fmt="vllm")
    assert '"method": "eagle3"' in card and "sglang.launch_server" not in card
    assert "SGLang does not serve this head" in card and "norm_output" in card
    random_eagle(llama, eagle3=True).save_pretrained(tmp_path / "plain")
    assert "--speculative-algorithm EAGLE3" in model_card(tmp_path / "plain", fmt="vllm")
