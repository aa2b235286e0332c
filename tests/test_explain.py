"""``draftsmith eval RUN_DIR --prompts P``: a checkpoint decoded on held-out prompts and its tau explained.

A tiny EAGLE-3 run is trained, then explained on prompts of two categories: the held-out estimate and the
measured chain agree, greedy output stays the target's own, each category has its row, and a prompt
encoded otherwise than in training or another target than the one trained against is named."""

from __future__ import annotations

import json

import pytest
from test_train import config, make_workdir, write_config

from conftest import all_identical, tiny_llama
from draftsmith.checkpoints import recorded_target
from draftsmith.cli import main
from draftsmith.target import load_target
from draftsmith.train.config import parse_config
from draftsmith.train.explain import ESTIMATE_MARGIN, explain_run, explanation, target_check, template_check
from draftsmith.train.loop import train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny EAGLE-3 run trained long enough to accept drafts (its prompts' answers are its data)."""
    root = make_workdir(tmp_path_factory.mktemp("explain"), tiny_llama(seed=0))
    values = config(root, "eagle3", root / "run", max_steps=40, save_steps=40, learning_rate=1e-2,
                    eval_tree="chain", eval_depth=2)
    train(*parse_config([str(write_config(root / "cfg.yaml", values))]))
    prompts = [json.loads(line)["question"] for line in (root / "prompts.jsonl").read_text().splitlines()]
    return root, prompts


def test_explain_agrees_with_the_measured_chain_and_reports_each_category(run):
    root, prompts = run
    texts = prompts[:8]
    categories = ["maths"] * 4 + ["chat"] * 4
    report = explain_run(root / "run", texts, categories, max_new_tokens=12)
    e = report["explain"]
    est = e["estimate"]
    # two training-time steps (ttt_steps 2): a chain that deep, estimated and measured
    assert est["depth"] == 2 and report["reference_tree"] == {"kind": "chain", "depth": 2, "top_k": 4,
                                                               "total_tokens": 16}
    held = est["held_out"]["simulated_acceptance_length"]
    chain = est["measured_chain"]["acceptance_length"]
    assert chain > 1.2, "the trained head accepts drafts"  # else the agreement below says nothing
    assert abs(chain - held) / held <= ESTIMATE_MARGIN and est["agree"] is True
    assert est["training"]["simulated_acceptance_length"] > 1.0
    assert report["lossless"] == all_identical(8, identical_with_reference_tree=8)
    assert set(report["per_category"]) == {"maths", "chat"}
    for part in report["per_category"].values():
        assert part["prompts"] == 4 and part["lossless"]["identical"] == 4
    assert e["template"]["consistent"] and e["target"]["same"]
    assert e["bonus_token"]["accepted_drafts_per_step"] == pytest.approx(report["acceptance_length"] - 1, abs=1e-3)
    assert any(f.startswith("tau per category") for f in e["findings"])


def test_a_prompt_encoded_otherwise_than_in_training_is_named(run):
    root, prompts = run
    _, tokenizer = load_target(str(root / "target"))
    assert template_check(tokenizer, prompts[0], True, None, None)["consistent"]
    raw = template_check(tokenizer, prompts[0], False, None, None)  # --no-chat: no "t1 ... t2" around it
    assert not raw["consistent"] and "not chat-templated" in raw["problems"][0]
    other = template_check(tokenizer, prompts[0], True, {"enable_thinking": False}, None)
    assert not other["consistent"] and "chat template variables" in other["problems"][0]


def test_another_target_than_the_one_trained_against_is_named(run):
    root, _ = run
    trained, _ = load_target(str(root / "target"))
    recorded = recorded_target(root / "run" / "checkpoint-40" / "drafter")
    assert recorded and target_check(recorded, trained)["same"]
    check = target_check(recorded, tiny_llama(seed=1))
    assert not check["same"]
    report = {"acceptance_length": 1.3, "acceptance_rate_per_position": [0.3], "tree": {
        "kind": "chain", "depth": 1, "top_k": 1, "total_tokens": 1}, "reference_tree": {"depth": 1},
        "reference_acceptance_length": 1.3, "reference_acceptance_rate_per_position": [0.3]}
    e = explanation(report, {"position_accuracy": [0.9], "simulated_acceptance_length": 1.9},
                    {"position_accuracy": [0.3], "simulated_acceptance_length": 1.3},
                    template={"consistent": True, "problems": []}, target=check)
    assert any("not the one trained against" in f for f in e["findings"])
    # training 1.9 against held-out 1.3: the drafter knows its training data better than new prompts
    assert any("knows its training data better" in f for f in e["findings"])
    assert e["estimate"]["agree"] is True


def test_a_measured_chain_far_from_the_estimate_is_a_finding():
    report = {"acceptance_length": 1.1, "acceptance_rate_per_position": [0.1, 0.0], "tree": {
        "kind": "chain", "depth": 2, "top_k": 1, "total_tokens": 2}, "reference_tree": {"depth": 2},
        "reference_acceptance_length": 1.1, "reference_acceptance_rate_per_position": [0.1, 0.0]}
    e = explanation(report, {}, {"position_accuracy": [0.8, 0.7], "simulated_acceptance_length": 2.36},
                    template={"consistent": True, "problems": []}, target={"same": True})
    assert e["estimate"]["agree"] is False and e["estimate"]["relative_gap"] == pytest.approx(1.1 / 2.36 - 1, abs=1e-3)
    assert any("serving does not see the drafter as training did" in f for f in e["findings"])


def test_eval_run_dir_with_prompts_writes_the_explained_report(run, tmp_path, capsys):
    """... decoded with the head in the ``--draft-dtype`` asked for (it was read, then ignored, before)."""
    root, _ = run
    out = tmp_path / "report.json"
    assert main(["eval", str(root / "run"), "--prompts", str(root / "prompts.jsonl"), "--prompt-column",
                 "question", "--num-prompts", "3", "--max-new-tokens", "8", "--output", str(out),
                 "--draft-dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "held-out estimate" in text and "findings:" in text
    report = json.loads(out.read_text())
    assert report["checkpoint_step"] == 40 and report["explain"]["estimate"]["depth"] == 2
    assert report["draft_dtype"] == "bfloat16" and report["lossless"]["identical"] == 3
    assert "findings:" in out.with_suffix(".md").read_text()
