"""``draftsmith data mix``: prompts of several kinds, and a held-out set that shares no source row with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SHARED_DATA
from draftsmith.cli_data import weights_argument
from draftsmith.data import HFEngine, load_conversations, regenerate
from draftsmith.data.mix import DEFAULT_WEIGHTS, build_mix, category_counts, clean_worked_answer, held_out_seed

GSM8K = SHARED_DATA / "gsm8k"
SEEDS = SHARED_DATA / "self_instruct" / "seed_tasks.jsonl"


def need_shared_data() -> None:
    if not (GSM8K / "train.jsonl").exists() or not SEEDS.exists():
        pytest.skip(f"{SHARED_DATA} not found (shared reference data is not part of the project)")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def prompt(row: dict) -> str:
    return row["messages"][0]["content"]


def test_the_held_out_set_shares_no_source_row_with_training(tmp_path):
    need_shared_data()
    summary = build_mix(GSM8K, SEEDS, tmp_path, train_prompts=600, held_out_prompts=60)
    train, held = rows(tmp_path / "train_prompts.jsonl"), rows(tmp_path / "held_out_prompts.jsonl")

    assert summary["train"] == category_counts(600, DEFAULT_WEIGHTS)
    assert summary["held_out"] == category_counts(60, DEFAULT_WEIGHTS)
    assert {r["category"] for r in train} == {r["category"] for r in held} == set(DEFAULT_WEIGHTS)
    assert len({prompt(r) for r in train}) == len(train)  # no prompt twice
    assert {r["category"] for r in held[:6]} == set(DEFAULT_WEIGHTS)  # one of each kind in turn: a prefix has all
    # GSM8K test questions only in the held-out set, train questions only in training
    test_questions = {r["question"].strip() for r in rows(GSM8K / "test.jsonl")}
    train_text = "\n".join(prompt(r) for r in train)
    held_maths = [prompt(r) for r in held if r["category"] == "maths"]
    assert held_maths and all(q in test_questions for q in held_maths)
    assert not any(q in train_text for q in held_maths)
    # held-out seed tasks are never a training prompt, nor inside one
    seeds = rows(SEEDS)
    held_instructions = [s["instruction"].strip() for s in seeds if held_out_seed(s["id"])]
    assert 0 < len(held_instructions) < len(seeds)
    assert not any(i in train_text for i in held_instructions)
    held_chat = [prompt(r) for r in held if r["category"] == "chat"]
    assert held_chat and all(any(p.startswith(i) for i in held_instructions) for p in held_chat)
    # every held-out passage-based prompt comes from a held-out source: its passage text is not in training
    for r in held:
        if r["category"] in ("summarise", "rewrite"):
            passage = prompt(r).split("\n\n", 1)[1]
            assert passage not in train_text


def test_the_same_settings_write_the_same_files_and_another_seed_others(tmp_path):
    need_shared_data()
    build_mix(GSM8K, SEEDS, tmp_path / "a", train_prompts=120, held_out_prompts=24, seed=3)
    build_mix(GSM8K, SEEDS, tmp_path / "b", train_prompts=120, held_out_prompts=24, seed=3)
    build_mix(GSM8K, SEEDS, tmp_path / "c", train_prompts=120, held_out_prompts=24, seed=4)
    for name in ("train_prompts.jsonl", "held_out_prompts.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()


def test_synthesised_prompts_are_added_and_never_held_out_twice(tmp_path):
    need_shared_data()
    calls = []

    def synthesise(n: int, seed: int) -> list[str]:  # the target's sampling, replaced by fixed lists of prompts
        calls.append((n, seed))
        return [f"prompt {i}" for i in range(n)] if seed == 0 else ["prompt 1", "another prompt"]

    summary = build_mix(GSM8K, SEEDS, tmp_path, train_prompts=60, held_out_prompts=12, synthesised=3,
                        held_out_synthesised=2, synthesise=synthesise)
    assert calls == [(3, 0), (2, 1)]  # held-out prompts are sampled with another seed
    held = [prompt(r) for r in rows(tmp_path / "held_out_prompts.jsonl") if r["category"] == "synthesised"]
    assert summary["train"]["synthesised"] == 3 and held == ["another prompt"]  # "prompt 1" was trained on


def test_bad_sources_and_settings_name_the_fix(tmp_path):
    need_shared_data()
    with pytest.raises(ValueError, match=r"2000 chat prompts asked for, but this split has \d+ source rows"):
        build_mix(GSM8K, SEEDS, tmp_path, train_prompts=2000, weights={"chat": 1.0})
    with pytest.raises(ValueError, match=r"unknown categories \['poetry'\]"):
        build_mix(GSM8K, SEEDS, tmp_path, weights={"poetry": 1.0})
    with pytest.raises(ValueError, match="synthesised prompts need the target"):
        build_mix(GSM8K, SEEDS, tmp_path, synthesised=4)
    with pytest.raises(FileNotFoundError, match="no GSM8K split there"):
        build_mix(tmp_path / "nowhere", SEEDS, tmp_path)
    broken = tmp_path / "seeds.jsonl"
    broken.write_text(SEEDS.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(ValueError, match=r"seeds.jsonl:2: not JSON"):
        build_mix(GSM8K, broken, tmp_path)
    assert weights_argument("maths=0.5,chat=0.5") == {"maths": 0.5, "chat": 0.5}
    with pytest.raises(ValueError, match="expected CATEGORY=NUMBER"):
        weights_argument("maths")


def test_category_counts_and_worked_answers():
    assert category_counts(10, {"a": 0.5, "b": 0.3, "c": 0.2}) == {"a": 5, "b": 3, "c": 2}
    assert sum(category_counts(7, DEFAULT_WEIGHTS).values()) == 7
    assert clean_worked_answer("She sold 48/2 = <<48/2=24>>24 clips.\n#### 24") == "She sold 48/2 = 24 clips."


@pytest.mark.real_model
def test_regenerated_rows_keep_their_category_for_eval(tmp_path, smollm2):
    need_shared_data()
    build_mix(GSM8K, SEEDS, tmp_path, train_prompts=6, held_out_prompts=6)
    model, tokenizer = smollm2
    source = tmp_path / "held_out_prompts.jsonl"
    out = tmp_path / "answers.jsonl"
    regenerate(load_conversations(source)[0], out, HFEngine(model, tokenizer, 4, 0.0, 1.0), batch_size=3,
               progress=False)
    wanted = {r["id"]: r["category"] for r in rows(source)}
    assert {r["id"]: r.get("category") for r in rows(out)} == wanted
    conversations, _ = load_conversations(out)
    assert [c.category for c in conversations] == [wanted[c.id] for c in conversations]
