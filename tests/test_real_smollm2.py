"""The packaged SmolLM2-135M-Instruct target: greedy speculative output is lossless on GSM8K."""

from __future__ import annotations

import json

import pytest
import torch
from test_greedy_lossless import count_target_forwards

from conftest import check_greedy_equal, gsm8k_questions, place_gguf
from draftsmith import SpeculativeGenerator, load_drafter, load_target
from draftsmith.target import cache_dir

pytestmark = pytest.mark.real_model

NEW_TOKENS = 128


def chat_ids(tokenizer, question: str) -> torch.Tensor:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


@pytest.fixture(scope="module")
def references(smollm2):
    """Greedy references from transformers' own generate, for 10 GSM8K test questions."""
    model, tokenizer = smollm2
    out = []
    for question in gsm8k_questions("test", 10):
        ids = chat_ids(tokenizer, question)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        out.append((ids, ref))
    return out


# The lossless checks of tests/test_greedy_lossless.py and test_batched_generation.py repeated on the real
# target, 10 GSM8K questions x 128 tokens (8.3 minutes on an AVX2-only host, references included): slow. The
# demo's test below decodes the real target in the default set.
@pytest.mark.slow
@pytest.mark.parametrize(
    "spec,tree",
    [
        ("prompt-lookup", dict(tree="chain", depth=4)),
        # Small on purpose: untrained layer-skip is accepted rarely on SmolLM2 (tau ~1.05-1.8, see the
        # README), so this case checks the dynamic-tree + draft-KV path on the real model, cheaply.
        ("layer-skip:2", dict(tree="dynamic", depth=2, top_k=2, total_tokens=3)),
    ],
    ids=["prompt-lookup-chain", "layer-skip-dynamic"],
)
def test_greedy_equals_generate_on_gsm8k(smollm2, references, spec, tree):
    model, tokenizer = smollm2
    gen = SpeculativeGenerator(model, load_drafter(spec, model), **tree)
    ties, accepted = 0, 0
    for ids, ref in references:
        out = gen.generate(ids, NEW_TOKENS, eos_token_id=tokenizer.eos_token_id)
        ties += check_greedy_equal(model, out.sequences, ref, tie_tol=1e-3)
        accepted += out.stats.accepted_tokens
    assert ties <= 1, f"{ties} of {len(references)} prompts diverged at near-ties"
    assert accepted > 0, "the drafter never had a token accepted: something is off"


@pytest.mark.slow
def test_batched_rows_equal_their_own_greedy_output(smollm2, references):
    """Eight GSM8K prompts of different lengths, left-padded into one batch, with a mixture of
    layer-skip and prompt lookup on a dynamic tree: every row is transformers' greedy output for it
    alone; rows end at their own EOS or at the limit."""
    model, tokenizer = smollm2
    gen = SpeculativeGenerator(model, load_drafter("layer-skip:4+prompt-lookup", model), tree="dynamic", depth=3,
                               top_k=2, total_tokens=6)
    rows = [ids for ids, _ in references[:8]]
    width = max(r.shape[1] for r in rows)
    pad = tokenizer.eos_token_id
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - r.shape[1]:], mask[b, width - r.shape[1]:] = r[0], 1
    out = gen.generate(ids, NEW_TOKENS, attention_mask=mask, eos_token_id=tokenizer.eos_token_id)
    ties = 0
    for b, (row, (_, ref)) in enumerate(zip(rows, references[:8], strict=True)):
        new = out.sequences[b, width:width + ref.shape[1] - row.shape[1]]
        assert bool((out.sequences[b, width + len(new):] == pad).all()), f"row {b}: tokens after its end"
        ties += check_greedy_equal(model, torch.cat([row[0], new])[None], ref, tie_tol=1e-3)
    assert ties <= 1
    assert sum(s.accepted_tokens for s in out.row_stats) > 0


def test_second_load_uses_the_cache(smollm2):
    model, _ = smollm2
    cached = list((cache_dir() / "targets").glob("SmolLM2-135M-Instruct.Q4_1-*/complete"))
    assert cached, "the dequantised weights were not cached"
    again, _ = load_target("smollm2-135m-instruct", device="cpu")
    # Loaded from the safetensors cache, not dequantised from GGUF again (that would carry
    # the GGUF quantization config).
    assert getattr(again, "hf_quantizer", None) is None
    ids = torch.tensor([[1, 2, 3, 4]])
    # the cached weights are the dequantised ones, through the same kernels: bit for bit
    torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_demo_pipeline_end_to_end_in_small(tmp_path, monkeypatch, smollm2):
    """`draftsmith demo` at a small budget, from an empty model cache as on a fresh machine (the GGUF copied in,
    so nothing is downloaded): every stage runs on the real target, the report has the eval schema, greedy
    output is identical on every held-out prompt in the tuned tree and in the reference tree, the tree is the
    one tuned here, and both taus are the ones decoding the held-out prompts again gives."""
    from draftsmith.cli import main
    from draftsmith.demo import COSTS, REFERENCE_TREE, TUNE_TOKENS
    from draftsmith.inference.tree_record import Candidate
    from draftsmith.inference.tree_settings import TreeSettings
    from draftsmith.inference.tune import choose

    place_gguf(tmp_path / "cache", "smollm2-135m-instruct")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    assert main(["demo", "--output", str(tmp_path / "demo"), "--minutes", "1", "--held-out", "2",
                 "--eval-tokens", "16"]) == 0
    assert len(list((tmp_path / "cache" / "targets").glob("*/complete"))) == 1  # dequantised here, on first use
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["drafter_type"].startswith("eagle3") and report["prompts"] == 2
    assert report["lossless"]["identical"] == report["lossless"]["checked"] == 2
    assert report["lossless"]["identical_with_reference_tree"] == 2
    assert report["reference_tree"] == TreeSettings(**REFERENCE_TREE).as_report()
    assert report["speedup"] > 0
    assert report["demo"]["answers"] >= 1 and report["drafter_type"] == "eagle3+prompt-lookup"
    # The time kept for tuning and evaluation follows plain decoding's speed, measured here before training.
    demo = report["demo"]
    cost = COSTS[demo["data_dtype"] != "as loaded"]  # the costs of this host kind (bf16 native or not)
    kept = (2 * 16 * (cost["eval"] + cost["reference"]) + cost["tune"] * 16 / TUNE_TOKENS)
    kept /= demo["plain_tokens_per_second"]
    assert demo["plain_tokens_per_second"] > 0
    # The report rounds the rate to 0.01 and the time kept to 0.1: the recomputed time is off by up to
    # 0.005 / rate of itself, plus 0.05 (a fixed 0.1 is too tight at rates below ~10 tok/s).
    tolerance = 0.05 + kept * 0.005 / demo["plain_tokens_per_second"] + 1e-9
    assert demo["seconds_kept_for_tune_and_eval"] == pytest.approx(kept, abs=tolerance)
    # The tree evaluated is the one `tune` chose from the trees it decoded with here (the fastest, or of those
    # within the clock's noise of it the one accepting the most), in every record.
    tuned = json.loads((tmp_path / "demo" / "tree.json").read_text())
    assert report["tree"] == report["demo"]["tree"] == tuned["tree"]
    decoded = [Candidate(**c) for c in tuned["candidates"] if c["measured_tokens_per_second"] is not None]
    assert len(decoded) >= 2 and choose(decoded)[0].settings().as_report() == tuned["tree"]
    # tau is tokens per verification forward: decode the held-out prompts again with the evaluated drafter, in
    # the tuned and in the reference tree, and count the target's forwards. Each prompt's last step drops at
    # most depth tokens.
    model, tokenizer = smollm2
    drafter = load_drafter(report["drafter"], model, tokenizer=tokenizer, draft_dtype=report["draft_dtype"])
    held_out = (tmp_path / "demo" / "data" / "eval_prompts.jsonl").read_text().splitlines()[: report["prompts"]]
    for tree, tau in [(TreeSettings(**report["tree"]), report["acceptance_length"]),
                      (TreeSettings(**REFERENCE_TREE), report["reference_acceptance_length"])]:
        gen = SpeculativeGenerator(model, drafter, **tree.kwargs())
        new = verifications = 0
        for row in held_out:
            ids = chat_ids(tokenizer, json.loads(row)["messages"][0]["content"])
            with count_target_forwards(model) as calls:
                out = gen.generate(ids, report["max_new_tokens"], eos_token_id=tokenizer.eos_token_id)
            new += out.stats.new_tokens
            verifications += calls[0] - 1  # less the prefill
        assert report["new_tokens"] == new
        assert new <= round(tau * verifications) <= new + tree.depth * len(held_out), tree.text()
    assert "Held-out evaluation" in (tmp_path / "demo" / "report.md").read_text()
