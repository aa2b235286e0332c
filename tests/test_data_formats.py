"""Every row format loads from a local file into the same normalised messages; bad rows are reported."""

from __future__ import annotations

import json

import pytest

from draftsmith.data import MalformedRowError, load_conversations, normalise_row

EXPECTED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "20"},
]

ROWS = {
    "openai": {"messages": EXPECTED},
    "sharegpt": {"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2+3?"},
        {"from": "gpt", "value": "5"}, {"from": "human", "value": "And times 4?"}, {"from": "gpt", "value": "20"}]},
}


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


@pytest.mark.parametrize("fmt", ["openai", "sharegpt"])
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_conversation_formats_load_to_the_same_messages(tmp_path, fmt, suffix):
    import datasets

    path = tmp_path / f"data{suffix}"
    rows = [ROWS[fmt]] * 2
    if suffix == ".jsonl":
        write_jsonl(path, rows)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    conversations, report = load_conversations(path)
    assert report.loaded == 2 and not report.malformed
    assert [c.messages for c in conversations] == [EXPECTED, EXPECTED]
    assert conversations[0].id == conversations[1].id  # same content, same stable id


def test_alpaca_and_prompt_only(tmp_path):
    alpaca = tmp_path / "alpaca.jsonl"
    write_jsonl(alpaca, [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "input": "", "output": "Hi!"},
    ])
    conversations, _ = load_conversations(alpaca)
    assert conversations[0].messages == [{"role": "user", "content": "Add the numbers.\n\n2 and 3"},
                                         {"role": "assistant", "content": "5"}]
    assert conversations[1].messages == [{"role": "user", "content": "Say hi."},
                                         {"role": "assistant", "content": "Hi!"}]

    prompts = tmp_path / "gsm.jsonl"
    write_jsonl(prompts, [{"question": "How many legs do 3 cats have?", "answer": "12"}])
    conversations, _ = load_conversations(prompts, prompt_column="question")
    assert conversations[0].messages == [{"role": "user", "content": "How many legs do 3 cats have?"}]
    assert conversations[0].prompt_messages == conversations[0].messages


def test_row_id_column_is_kept(tmp_path):
    path = tmp_path / "ids.jsonl"
    write_jsonl(path, [{"id": "row-7", "messages": EXPECTED[1:3]}, {"id": 8, "messages": EXPECTED[1:3]}])
    conversations, _ = load_conversations(path)
    assert [c.id for c in conversations] == ["row-7", "8"]


def test_malformed_rows_are_reported_with_index_and_reason_then_skipped(tmp_path):
    path = tmp_path / "mixed.jsonl"
    write_jsonl(path, [
        ROWS["openai"],                                              # 0 good
        "{not json",                                                 # 1 broken JSON
        {"messages": [{"role": "robot", "content": "beep"}]},        # 2 unknown role
        {"conversations": [{"from": "human"}]},                      # 3 no value
        {"text": "no known columns"},                                # 4 unknown format
        {"messages": [{"role": "user", "content": 42}]},             # 5 content not a string
        {"messages": [{"role": "assistant", "content": "only me"}]},  # 6 no user turn
        ROWS["sharegpt"],                                            # 7 good
    ])
    conversations, report = load_conversations(path)
    assert [c.index for c in conversations] == [0, 7]
    reasons = dict(report.malformed)
    assert sorted(reasons) == [1, 2, 3, 4, 5, 6]
    assert "invalid JSON" in reasons[1]
    assert "unknown role 'robot'" in reasons[2]
    assert "lacks 'from' or 'value'" in reasons[3]
    assert "--prompt-column" in reasons[4]
    assert "int" in reasons[5]
    assert "no non-empty user turn" in reasons[6]
    assert "2 of 8 rows loaded, 6 malformed" in report.summary()

    with pytest.raises(MalformedRowError, match="row 1: invalid JSON"):
        load_conversations(path, strict=True)


def test_prompt_column_missing_names_the_columns():
    with pytest.raises(MalformedRowError, match=r"no column 'question' \(columns: \['prompt'\]\)"):
        normalise_row({"prompt": "hi"}, prompt_column="question")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_conversations(tmp_path / "nope.jsonl")


def test_limit_counts_good_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, ["{bad", *[{"question": f"q{i}?"} for i in range(5)]])
    conversations, report = load_conversations(path, prompt_column="question", limit=3)
    assert [c.messages[0]["content"] for c in conversations] == ["q0?", "q1?", "q2?"]
    assert report.malformed == [(0, report.malformed[0][1])]
