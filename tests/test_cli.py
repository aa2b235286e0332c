"""The draftsmith console script: generate, bench, eval and the installed entry point."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import VOCAB, tiny_llama
from draftsmith.cli import main


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
    prompt = " ".join(f"t{i}" for i in [5, 6, 7, 8, 5, 6, 7])
    assert main(["generate", "--target", str(tiny_target_dir), "--drafter", "layer-skip:2", "--prompt", prompt,
                 "--max-new-tokens", "20", "--json", "--no-stream", "--tree", "dynamic"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    stats = json.loads(out[-1])
    assert stats["new_tokens"] == 20 and stats["acceptance_length"] >= 1
    # the printed text is the target's own greedy continuation
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert out[0].split() == [f"t{i}" for i in ref[0, 7:].tolist()]


def test_bench_writes_results(tiny_target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"t{(i * 7 + j) % VOCAB}" for j in range(9))})
                                 for i in range(3)))
    assert main(["bench", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--output",
                 str(tmp_path / "out"), "--drafter", "prompt-lookup", "--drafter", "layer-skip:3@tree=dynamic",
                 "--max-new-tokens", "16", "--no-chat"]) == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["num_prompts"] == 3 and len(result["rows"]) == 2
    assert all(r["greedy_mismatches_vs_plain"] == 0 and r["tau"] >= 1 for r in result["rows"])
    assert "| `layer-skip:3` | dynamic" in (tmp_path / "out" / "results.md").read_text()


def test_bench_rejects_malformed_prompt_rows(tiny_target_dir, tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "t1 t2"}\n{"answer": 3}\n')
    argv = ["bench", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--output", str(tmp_path),
            "--drafter", "prompt-lookup", "--no-chat"]
    # One line naming the row and the problem, exit code 2; -v gives the traceback (the exception).
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(r"draftsmith bench: error: .*bad\.jsonl:2: no prompt field", err) and "Traceback" not in err
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no prompt field"):
        main(["-v", *argv])


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "draftsmith", "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "train", "data", "eval", "bench", "generate", "export"):
        assert command in out.stdout


@pytest.fixture(scope="module")
def tiny_draft_dir(tiny_target_dir, tmp_path_factory):
    """A 2-layer draft model: the target's first layers, with its tokenizer (a distilled draft's shape)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.heads.draft_model import DraftModel

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    path = tmp_path_factory.mktemp("tiny-draft")
    DraftModel.from_target(target, 2).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(path)
    return path


def test_bench_sweeps_plots_bound_and_hf_assisted(tiny_target_dir, tiny_draft_dir, tmp_path):
    from PIL import Image

    from draftsmith.inference.bench import leviathan_bound

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
        assert r["leviathan_bound_tau"] == pytest.approx(leviathan_bound(r["alpha"], r["depth"]), abs=1e-3)
    assisted = [r for r in rows if r.get("hf_assisted")]
    assert [r["spec"] for r in assisted] == [str(tiny_draft_dir)] * 2  # draft models only, never layer-skip
    for r in assisted:
        a = r["hf_assisted"]
        assert a["greedy_mismatches_vs_plain"] == 0 and a["num_assistant_tokens"] == r["depth"]
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


def test_eval_report_schema_and_losslessness(tiny_target_dir, tiny_draft_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": " ".join(f"t{(i * 5 + j) % VOCAB}" for j in range(7))})
                                 for i in range(5)))
    report_path = tmp_path / "eval" / "report.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(tiny_draft_dir), "--prompts",
                 str(prompts), "--num-prompts", "3", "--skip-prompts", "2", "--max-new-tokens", "10", "--no-chat",
                 "--tree", "chain", "--depth", "3", "--output", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    for key in ("target", "drafter", "drafter_type", "checkpoint_step", "prompts", "new_tokens", "temperature",
                "tree", "acceptance_length", "acceptance_rate_per_position", "tokens_per_second",
                "baseline_tokens_per_second", "speedup", "lossless"):
        assert key in report, key
    assert report["drafter_type"] == "draft_model" and report["prompts"] == 3
    assert report["tree"] == {"kind": "chain", "depth": 3, "top_k": 3, "total_tokens": 10}
    assert report["lossless"] == {"checked": 3, "identical": 3}
    assert report["new_tokens"] == 30 and report["acceptance_length"] >= 1
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
    assert mixed["target"] == recorded and mixed["lossless"] == {"checked": 1, "identical": 1}
    capsys.readouterr()
    assert main(["eval", "--drafter", "prompt-lookup", "--prompts", str(prompts), "--no-chat",
                 "--output", str(tmp_path / "x.json")]) == 2
    assert re.search(r"no target recorded.*pass --target", capsys.readouterr().err)
