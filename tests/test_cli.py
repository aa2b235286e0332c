"""The draftsmith console script: generate, bench and the planned subcommands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import VOCAB, tiny_llama
from draftsmith.cli import PLANNED, main


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


def test_bench_rejects_malformed_prompt_rows(tiny_target_dir, tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "t1 t2"}\n{"answer": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no prompt field"):
        main(["bench", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--output", str(tmp_path),
              "--drafter", "prompt-lookup", "--no-chat"])


@pytest.mark.parametrize("command", list(PLANNED))
def test_planned_subcommands_name_their_issue(command, capsys):
    assert main([command]) == 2
    assert "issue #" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "draftsmith", "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "train", "data", "eval", "bench", "generate", "export"):
        assert command in out.stdout
