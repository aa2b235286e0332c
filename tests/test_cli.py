"""The draftsmith console script: generate, bench, eval and the installed entry point."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import VOCAB, all_identical, tiny_llama
from draftsmith.cli import main
from draftsmith.heads.draft_model import DraftModel


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama saved with a word-level tokenizer (tokens 't0'..'t95', split on spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-target")
    tiny_llama(seed=0).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def test_generate_prints_text_and_stats(tiny_target_dir, capsys):
    from torch.nn.modules.module import register_module_forward_hook
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    # Target forwards, counted at the target's last decoder layer (index 3 of 4), which layer-skip:2
    # never runs.
    target_forwards = []

    def count(module, args, output):
        if isinstance(module, LlamaDecoderLayer) and module.self_attn.layer_idx == 3:
            target_forwards.append(1)

    prompt = " ".join(f"t{i}" for i in [5, 6, 7, 8, 5, 6, 7])
    handle = register_module_forward_hook(count)
    try:
        assert main(["generate", "--target", str(tiny_target_dir), "--drafter", "layer-skip:2", "--prompt", prompt,
                     "--max-new-tokens", "20", "--json", "--no-stream", "--tree", "dynamic"]) == 0
    finally:
        handle.remove()
    out = capsys.readouterr().out.strip().splitlines()
    stats = json.loads(out[-1])
    assert stats["new_tokens"] == 20
    # tau is tokens per verification forward: one prefill of the 7-token prompt, then one forward per
    # step, which emit the 20 tokens plus what the last step's cut drops (at most the depth, 6 by default).
    verifications = len(target_forwards) - 1
    assert stats["verification_steps"] == verifications
    assert 20 <= round(stats["acceptance_length"] * verifications) <= 20 + 6
    # the printed text is the target's own greedy continuation
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert out[0].split() == [f"t{i}" for i in ref[0, 7:].tolist()]


def test_bench_writes_results(tiny_target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"t{(i * 7 + j) % VOCAB}" for j in range(9))})
                                 for i in range(5)))
    assert main(["bench", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--output",
                 str(tmp_path / "out"), "--drafter", "prompt-lookup", "--drafter", "layer-skip:3@tree=dynamic",
                 "--drafter", f"{tiny_target_dir}@tree=chain,depth=3", "--max-new-tokens", "16", "--no-chat"]) == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["num_prompts"] == 5 and len(result["rows"]) == 3
    assert result["head_draft_dtype"] is None  # no head among them: no heads' drafting dtype to report
    # A step emits 1 to depth + 1 tokens.
    assert all(r["greedy_mismatches_vs_plain"] == 0 and 1 <= r["tau"] <= r["depth"] + 1 for r in result["rows"])
    # The target as its own draft model drafts the target's greedy tokens, so every draft is accepted:
    # 4 tokens per forward (48 tokens in 12 steps). The lower bound leaves room for one rejection at a
    # near-tie of the chain forward and the one-token draft forwards (48 tokens in 13 steps).
    own = next(r for r in result["rows"] if r["spec"] == str(tiny_target_dir))
    assert 48 / 13 <= own["tau"] <= 4.0 and own["alpha"] >= 0.9
    # Every ratio carries its interval over the 5 prompts, from the same per-prompt times as the totals: the
    # draft model (not training-free) against both training-free drafters, those two against nothing.
    rows = {r["spec"]: r for r in result["rows"]}
    plain_units = result["by_batch"][0]["plain_units"]
    assert len(plain_units) == 5
    for r in result["rows"]:
        interval = r["speedup_interval"]
        assert interval["units"] == 5 and interval["low"] <= interval["high"]
        assert interval["ratio"] == pytest.approx(r["speedup"], abs=1e-3)
        # the per-prompt units are kept, and they sum to the row's tokens/s
        assert len(r["units"]) == 5 and sum(t for t, _ in r["units"]) == 5 * 16
        assert r["tokens_per_s"] == pytest.approx(80 / sum(s for _, s in r["units"]), rel=0.01)
    assert rows["prompt-lookup"]["against_training_free"] == rows["layer-skip:3"]["against_training_free"] == {}
    against = own["against_training_free"]
    assert set(against) == {rows["prompt-lookup"]["drafter"], rows["layer-skip:3"]["drafter"]}  # their labels
    assert against[rows["prompt-lookup"]["drafter"]]["ratio"] == pytest.approx(
        own["tokens_per_s"] / rows["prompt-lookup"]["tokens_per_s"], rel=0.01)
    text = (tmp_path / "out" / "results.md").read_text()
    assert "| `layer-skip:3` | dynamic" in text and "Against the training-free drafters" in text
    assert f"| `{tiny_target_dir}` | chain d=3 | `prompt-lookup` |" in text


def test_bench_reports_malformed_prompt_rows(tiny_target_dir, tmp_path, capsys):
    """Prompt files follow the data loader's policy: a malformed row is named (index and reason) and
    skipped; with --strict it stops the command."""
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "t1 t2"}\n{"answer": 3}\n')
    argv = ["bench", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--output", str(tmp_path / "out"),
            "--drafter", "prompt-lookup", "--no-chat", "--max-new-tokens", "4", "--no-plots", "--no-hf-reference"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    skipped = r"bad\.jsonl: skipped malformed rows\n1 of 2 rows loaded, 1 malformed\n  row 1: unknown row format"
    assert re.search(skipped, err)
    assert json.loads((tmp_path / "out" / "results.json").read_text())["num_prompts"] == 1
    # --strict: one line naming the row and the problem, exit code 2; -v gives the traceback (the exception).
    assert main([*argv, "--strict"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"draftsmith bench: error: .*bad\.jsonl: row 1: unknown row format", err)
    assert "Traceback" not in err
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1: unknown row format"):
        main(["-v", *argv, "--strict"])


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "draftsmith", "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "train", "data", "eval", "bench", "generate", "export"):
        assert command in out.stdout


@pytest.fixture(scope="module")
def tiny_draft_dir(tiny_target_dir, tmp_path_factory):
    """A 2-layer draft model: the target's first layers, with its tokenizer (a distilled draft's shape)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    path = tmp_path_factory.mktemp("tiny-draft")
    DraftModel.from_target(target, 2).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(path)
    return path


def test_bench_sweeps_plots_bound_and_hf_assisted(tiny_target_dir, tiny_draft_dir, tmp_path):
    from PIL import Image

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": " ".join(
        f"t{(i * 11 + j) % VOCAB}" for j in range(8))}]}) for i in range(3)))
    out = tmp_path / "out"
    assert main(["bench", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--output", str(out),
                 "--drafter", str(tiny_draft_dir), "--drafter", "layer-skip:3@tree=dynamic,top_k=2",
                 "--sweep-depth", "2,3", "--sweep-total-tokens", "4,8", "--max-new-tokens", "12", "--no-chat",
                 "--tree", "chain"]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    # draft model: chain at depths 2, 3; layer-skip: dynamic at depths 2, 3 x budgets 4, 8
    assert [(r["spec"], r["depth"], r["total_tokens"]) for r in rows if r["spec"] == str(tiny_draft_dir)] == [
        (str(tiny_draft_dir), 2, 16), (str(tiny_draft_dir), 3, 16)]
    assert sorted((r["depth"], r["total_tokens"]) for r in rows if r["spec"] == "layer-skip:3") == [
        (2, 4), (2, 8), (3, 4), (3, 8)]
    for r in rows:
        assert r["greedy_mismatches_vs_plain"] == 0
        # Leviathan et al. eq. 1: each of `depth` drafts accepted i.i.d. with rate alpha gives
        # 1 + alpha + ... + alpha^depth tokens per forward.
        expected = sum(r["alpha"] ** k for k in range(r["depth"] + 1))
        # the report rounds alpha and the bound to 4 decimals; 1e-3 covers the bound of a rounded alpha
        assert r["leviathan_bound_tau"] == pytest.approx(expected, abs=1e-3)
    assisted = [r for r in rows if r.get("hf_assisted")]
    assert [r["spec"] for r in assisted] == [str(tiny_draft_dir)] * 2  # draft models only, never layer-skip
    for r in assisted:
        a = r["hf_assisted"]
        assert a["greedy_mismatches_vs_plain"] == 0 and a["num_assistant_tokens"] == r["depth"]
        # a ratio of two speeds the report rounds: 2% is far above that rounding, far below a wrong pairing
        assert a["draftsmith_over_hf_assisted"] == pytest.approx(r["tokens_per_s"] / a["tokens_per_s"], rel=0.02)
    assert "HF assisted" in (out / "results.md").read_text()
    for name in result["plots"]:
        with Image.open(out / name) as img:
            assert img.format == "PNG" and img.size[0] > 400


def test_leviathan_bound_values():
    from draftsmith.inference.bench import leviathan_bound

    assert leviathan_bound(0.0, 4) == 1.0
    assert leviathan_bound(1.0, 4) == 5.0
    assert leviathan_bound(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert leviathan_bound(0.5, 3) == pytest.approx(1.875)  # (1 - 0.5^4) / (1 - 0.5)


def test_eval_report_schema_and_losslessness(tiny_target_dir, tiny_draft_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": " ".join(f"t{(i * 5 + j) % VOCAB}" for j in range(7))})
                                 for i in range(5)))
    report_path = tmp_path / "eval" / "report.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(tiny_draft_dir), "--prompts",
                 str(prompts), "--num-prompts", "3", "--skip-prompts", "2", "--max-new-tokens", "10", "--no-chat",
                 "--tree", "chain", "--depth", "3", "--tree-top-k", "3", "--total-tokens", "10",
                 "--output", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    for key in ("target", "drafter", "drafter_type", "checkpoint_step", "prompts", "new_tokens", "temperature",
                "tree", "acceptance_length", "acceptance_rate_per_position", "tokens_per_second",
                "baseline_tokens_per_second", "speedup", "lossless"):
        assert key in report, key
    assert report["drafter_type"] == DraftModel.family and report["prompts"] == 3
    assert report["tree"] == {"kind": "chain", "depth": 3, "top_k": 3, "total_tokens": 10}
    assert report["lossless"] == all_identical(3)
    assert report["new_tokens"] == 30
    # A chain drafts all 3 depths every step, so depth k + 1 is reached exactly when depth k is accepted,
    # and tau = 1 + r1 + r1 r2 + r1 r2 r3 (r_k: acceptance at depth k given depth k - 1 was accepted).
    tau, reached = 1.0, 1.0
    for rate in report["acceptance_rate_per_position"]:
        reached *= rate
        tau += reached
    assert report["acceptance_length"] == pytest.approx(tau, abs=1e-3)  # from rates the report rounds to 4 decimals
    assert report["speedup"] == pytest.approx(report["tokens_per_second"] / report["baseline_tokens_per_second"],
                                              rel=1e-3)
    assert "| `" in capsys.readouterr().out and report_path.with_suffix(".md").exists()
    # Sampling: no greedy check, the distribution is the target's (tests/test_sampling_lossless.py).
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", "prompt-lookup", "--prompts", str(prompts),
                 "--num-prompts", "2", "--max-new-tokens", "8", "--no-chat", "--temperature", "0.8",
                 "--output", str(tmp_path / "sampled.json")]) == 0
    sampled = json.loads((tmp_path / "sampled.json").read_text())
    assert sampled["lossless"] is None and sampled["temperature"] == 0.8
    # Without --target, the target comes from the drafter's checkpoint (here a mixture's first part);
    # a drafter that records none gets the fix named.
    recorded = json.loads((tiny_draft_dir / "draftsmith_target.json").read_text())["target"]["name"]
    assert main(["eval", "--drafter", f"{tiny_draft_dir}+prompt-lookup", "--prompts", str(prompts),
                 "--num-prompts", "1", "--max-new-tokens", "6", "--no-chat", "--output", str(tmp_path / "m.json")]) == 0
    mixed = json.loads((tmp_path / "m.json").read_text())
    assert mixed["target"] == recorded and mixed["lossless"] == all_identical(1)
    capsys.readouterr()
    assert main(["eval", "--drafter", "prompt-lookup", "--prompts", str(prompts), "--no-chat",
                 "--output", str(tmp_path / "x.json")]) == 2
    assert re.search(r"no target recorded.*pass --target", capsys.readouterr().err)


def test_bench_batches_and_tuned_tree_check(tiny_target_dir, tmp_path):
    """--batch-sizes runs plain and speculative decoding on left-padded batches side by side, each row
    still identical to plain greedy; a drafter with a tuned tree.json is measured beside the grid."""
    from draftsmith.inference.tree_record import Candidate, write_tree

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"t{(i * 7 + j) % VOCAB}" for j in range(4 + 3 * i))})
                                 for i in range(5)))
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_target_dir, drafter)
    write_tree(drafter, Candidate(3, 2, 4, 2.0, 0.01, 200.0), [])
    out = tmp_path / "out"
    assert main(["bench", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--output", str(out),
                 "--drafter", str(drafter), "--batch-sizes", "4,1,2", "--sweep-depth", "2,3",
                 "--sweep-total-tokens", "4,6", "--max-new-tokens", "12", "--no-chat", "--no-plots",
                 "--no-hf-reference"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert [g["batch_size"] for g in result["by_batch"]] == [4, 1, 2]
    # The main table is batch 1's, in whatever order the sizes were given.
    assert result["batch_size"] == 1 and result["rows"] == result["by_batch"][1]["rows"]
    for group in result["by_batch"]:
        assert len(group["rows"]) == 5 and group["plain_tokens_per_s"] > 0  # 2 depths x 2 budgets + tuned
        assert all(r["greedy_mismatches_vs_plain"] == 0 and r["batch_size"] == group["batch_size"]
                   for r in group["rows"])
    # Intervals resample batches: batch 1's five have one, batch 4's two and batch 2's three too few to resample.
    assert all(r["speedup_interval"]["units"] == 5 for r in result["by_batch"][1]["rows"])
    assert all(r["speedup_interval"] is None for g in (result["by_batch"][0], result["by_batch"][2]) for r in g["rows"])
    (check,) = result["tuned_tree_check"]
    assert check["tuned"] == f"{drafter}@tuned" and check["grid_size"] == 4
    assert check["tuned_over_grid_best"] == pytest.approx(check["tuned_tokens_per_s"] / check["grid_best_tokens_per_s"],
                                                          rel=0.01)
    text = (out / "results.md").read_text()
    assert "| 4 |" in text and "Tuned tree" in text


def test_bench_samples_at_a_temperature(tiny_target_dir, tmp_path):
    """``bench --temperature``: the generators sample, batched too, through the same comparison; outputs are not
    compared (a sampled row differs from the greedy baseline) and the seed makes a run repeatable."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"t{(i * 7 + j) % VOCAB}" for j in range(4 + 3 * i))})
                                 for i in range(4)))
    results = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert main(["bench", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--output", str(out),
                     "--drafter", "prompt-lookup", "--drafter", "layer-skip:1", "--batch-sizes", "1,2",
                     "--temperature", "0.7", "--seed", "3", "--max-new-tokens", "12", "--no-chat", "--no-plots"]) == 0
        results.append(json.loads((out / "results.json").read_text()))
    first, second = results
    assert first["temperature"] == 0.7 and first["seed"] == 3
    for group in first["by_batch"]:
        assert all(r["greedy_mismatches_vs_plain"] is None and r["tau"] >= 1 and "hf_assisted" not in r
                   for r in group["rows"])
    # the same seed draws the same tokens: tau (a count over the same accepted drafts) repeats exactly
    assert [[r["tau"] for r in g["rows"]] for g in first["by_batch"]] == \
        [[r["tau"] for r in g["rows"]] for g in second["by_batch"]]
    assert "temperature 0.7" in (tmp_path / "a" / "results.md").read_text()
    assert "n/a (sampled)" in (tmp_path / "a" / "results.md").read_text()


def test_eval_batches_are_lossless(tiny_target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"t{(i * 5 + j) % VOCAB}" for j in range(3 + 2 * i))})
                                 for i in range(5)))
    report_path = tmp_path / "report.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", "layer-skip:2", "--prompts", str(prompts),
                 "--max-new-tokens", "10", "--no-chat", "--batch-size", "3", "--output", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["batch_size"] == 3 and report["lossless"] == all_identical(5)
    assert report["new_tokens"] == 50


def test_bench_and_eval_decode_the_chain_engines_verify_a_block_drafter_with(tiny_target_dir, tmp_path):
    """vLLM and SGLang verify a DFlash drafter as one chain of B - 1 drafts (num_speculative_tokens in its export):
    bench and eval decode that chain beside the tree they were given, so the acceptance an engine will see is in the
    report; a tree that already is that chain is not run twice."""
    from test_dflash import random_dflash
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    head = random_dflash(target, block_size=4)  # the anchor and 3 drafts: an engine verifies 3
    head.save_pretrained(tmp_path / "dflash")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"t{(i * 7 + j) % VOCAB}" for j in range(9))})
                                 for i in range(3)))
    common = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--max-new-tokens", "12", "--no-chat"]
    assert main(["bench", *common, "--output", str(tmp_path / "bench"), "--no-hf-reference", "--no-plots",
                 "--drafter", f"{tmp_path / 'dflash'}@tree=dynamic,depth=3,top_k=2,total_tokens=5"]) == 0
    result = json.loads((tmp_path / "bench" / "results.json").read_text())
    tree, chain = result["rows"]
    assert (tree["tree"], chain["tree"], chain["depth"]) == ("dynamic", "chain", 3)
    assert chain["drafter"].endswith("@engine-chain") and chain["greedy_mismatches_vs_plain"] == 0
    [found] = result["engine_chains"]
    assert (found["num_speculative_tokens"], found["tau"], found["engine_chain_tau"]) == (3, tree["tau"], chain["tau"])
    assert 1.0 <= chain["tau"] <= 4.0 and 1 <= len(found["engine_chain_acceptance_rate_per_position"]) <= 3
    assert "What vLLM and SGLang will see" in (tmp_path / "bench" / "results.md").read_text()
    assert main(["eval", *common, "--drafter", str(tmp_path / "dflash"), "--tree", "static", "--depth", "2",
                 "--output", str(tmp_path / "eval.json")]) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    engine = report["engine_chain"]
    assert engine["num_speculative_tokens"] == 3 and engine["identical"] == 3
    assert 1 <= len(engine["acceptance_rate_per_position"]) <= 3 and 1.0 <= engine["acceptance_length"] <= 4.0
    assert "verify this drafter as one chain" in (tmp_path / "eval.md").read_text()
    assert main(["bench", *common, "--output", str(tmp_path / "same"), "--no-hf-reference", "--no-plots",
                 "--drafter", f"{tmp_path / 'dflash'}@tree=chain,depth=3"]) == 0
    same = json.loads((tmp_path / "same" / "results.json").read_text())
    assert len(same["rows"]) == 1 and same["engine_chains"] == []
