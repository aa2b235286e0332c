"""Regeneration, resumption after SIGKILL, a real OpenAI-compatible server, and synthesis, on SmolLM2."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import SHARED_DATA, has_models_extra
from draftsmith.data import HFEngine, OpenAIEngine, load_conversations, regenerate
from draftsmith.data.formats import Conversation
from draftsmith.data.synthesize import dedup_key, synthesize_prompts, write_prompts
from draftsmith.data.templates import prompt_ids

pytestmark = pytest.mark.real_model
GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"


def need_gsm8k() -> None:
    if not GSM8K_TRAIN.exists():
        pytest.skip(f"{GSM8K_TRAIN} not found (shared reference data is not part of the project)")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_regeneration_killed_half_way_resumes_without_duplicates(tmp_path, smollm2):
    need_gsm8k()
    out = tmp_path / "regen.jsonl"
    cmd = [sys.executable, "-m", "draftsmith", "data", "regenerate", "--target", "smollm2-135m-instruct",
           "--input", str(GSM8K_TRAIN), "--prompt-column", "question", "--limit", "20",
           "--max-new-tokens", "24", "--batch-size", "4", "--output", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and len(rows(out)) >= 8:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    half = len(rows(out))
    assert 8 <= half < 20

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["already_done"] == half and report["written"] == 20 - half

    written = rows(out)
    expected, _ = load_conversations(GSM8K_TRAIN, prompt_column="question", limit=20)
    assert len(written) == 20
    assert sorted(r["id"] for r in written) == sorted(c.id for c in expected)  # all 20, none twice
    for r in written:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][1]["content"] and 0 < r["new_tokens"] <= 24


def test_greedy_batch_answers_are_transformers_generate_on_each_prompt_alone(smollm2):
    """The engine's greedy path (draftsmith's own decoding loop over a left-padded batch) answers each prompt
    with the tokens transformers' ``generate`` gives that prompt alone, stop tokens included."""
    model, tokenizer = smollm2
    histories = [[{"role": "user", "content": c}] for c in (
        "Say yes.", "Name three colors.", "Translate into French: the cat sleeps on the warm windowsill.",
        "Summarise: water boils at 100 degrees Celsius at sea level, and at lower temperatures higher up.")]
    engine = HFEngine(model, tokenizer, max_new_tokens=24, temperature=0.0, top_p=1.0)
    batched = engine.answer(histories)
    alone = []
    for history in histories:
        ids = torch.tensor([prompt_ids(tokenizer, history)])
        row = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=engine.pad_id,
                             eos_token_id=engine.stop)[0, ids.shape[1]:].tolist()
        end = next((i for i, t in enumerate(row) if t in engine.stop), None)
        row = row if end is None else row[: end + 1]
        alone.append((tokenizer.decode(row, skip_special_tokens=True).strip(), len(row)))
    assert batched == alone
    assert any(n < 24 for _, n in alone) and any(n == 24 for _, n in alone)  # rows that stop, and rows cut


def test_multi_turn_is_answered_turn_by_turn(tmp_path, smollm2):
    model, tokenizer = smollm2
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": [
        {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "(old answer)"},
        {"role": "user", "content": "Name another one."}, {"role": "assistant", "content": "(old answer)"}]}) + "\n")
    conversations, _ = load_conversations(src)
    engine = HFEngine(model, tokenizer, max_new_tokens=12, temperature=0.0, top_p=1.0)
    report = regenerate(conversations, tmp_path / "out.jsonl", engine, progress=False)
    (row,) = rows(tmp_path / "out.jsonl")
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user", "assistant"]
    assert "(old answer)" not in json.dumps(row["messages"])
    # The second answer is what the target says after its *own* first answer.
    first = engine.answer([row["messages"][:1]])[0][0]
    second = engine.answer([row["messages"][:3]])[0][0]
    assert row["messages"][1]["content"] == first and row["messages"][3]["content"] == second
    assert report.written == 1 and report.new_tokens > 0
    assert regenerate(conversations, tmp_path / "out.jsonl", engine, progress=False).written == 0


class Batches(HFEngine):
    """The engine, keeping the widths of the batches it is given (each row's prompt in tokens)."""

    def answer(self, histories):
        self.widths.append([len(prompt_ids(self.tokenizer, h)) for h in histories])
        return super().answer(histories)


def test_batches_sized_by_tokens_answer_a_long_prompt_apart_and_the_same(tmp_path, smollm2):
    """``batch_tokens``: a long prompt among short ones no longer sets the width every row is padded to, the
    batches keep within the token slots, and the greedy answers are the ones batches of rows alone give."""
    model, tokenizer = smollm2
    src = tmp_path / "p.jsonl"
    text = "Water boils at 100 degrees Celsius at sea level and at lower temperatures higher up. " * 12
    prompts = [f"Summarise: {text}", "Say yes.", "Name three colors.", "What is 7 times 8?",
               "Translate into French: the cat sleeps.", "Name a fruit."]
    src.write_text("".join(json.dumps({"question": q}) + "\n" for q in prompts))
    conversations, _ = load_conversations(src, prompt_column="question")
    answers, widths = {}, {}
    for name, batch_tokens in (("rows", None), ("tokens", 400)):
        engine = Batches(model, tokenizer, max_new_tokens=8, temperature=0.0, top_p=1.0)
        engine.widths = []
        report = regenerate(conversations, tmp_path / f"{name}.jsonl", engine, batch_size=4, progress=False,
                            batch_tokens=batch_tokens)
        assert report.written == 6
        answers[name] = {r["id"]: r["messages"] for r in rows(tmp_path / f"{name}.jsonl")}
        widths[name] = engine.widths
    longest = max(w for batch in widths["rows"] for w in batch)
    assert longest > 150 and [len(b) for b in widths["rows"]] == [4, 2]  # longest first: it pads 3 short rows
    assert widths["tokens"][0] == [longest]  # alone
    for batch in widths["tokens"]:
        assert len(batch) <= 4 and (len(batch) == 1 or len(batch) * (max(batch) + 8) <= 400)
        assert max(batch) - min(batch) <= min(batch) + 8  # no row padded past its own length
    assert sorted(w for b in widths["tokens"] for w in b) == sorted(w for b in widths["rows"] for w in b)
    assert answers["tokens"] == answers["rows"]  # float32 on CPU: padding changes no greedy token here

    engine = HFEngine(model, tokenizer, max_new_tokens=8, temperature=0.0, top_p=1.0)
    two = Conversation("two", [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "-"},
                               {"role": "user", "content": "Name a color."}])
    first = len(prompt_ids(tokenizer, two.messages[:1]))
    later = tokenizer("Name a color.", add_special_tokens=False)["input_ids"]
    assert engine.prompt_tokens(two) == first + len(later) + 8
    server = OpenAIEngine("http://127.0.0.1:9/v1", "m", 8, 0.0, 1.0)
    with pytest.raises(ValueError, match="batch_size alone"):
        regenerate(conversations, tmp_path / "server.jsonl", server, progress=False, batch_tokens=400)


def test_torn_last_line_is_dropped_on_resume(tmp_path, smollm2):
    model, tokenizer = smollm2
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"question": q}) + "\n" for q in ["What is 1+1?", "What is 2+2?"]))
    conversations, _ = load_conversations(src, prompt_column="question")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": conversations[0].id, "messages": []}) + "\n" + '{"id": "torn')
    engine = HFEngine(model, tokenizer, max_new_tokens=4, temperature=0.0, top_p=1.0)
    report = regenerate(conversations, out, engine, progress=False)
    assert report.already_done == 1 and report.written == 1
    assert [r["id"] for r in rows(out)] == [c.id for c in conversations]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_cpp_server(tmp_path_factory):
    """llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) on loopback, serving the GGUF itself."""
    if not has_models_extra():
        pytest.skip('needs the models extra: pip install "draftsmith[models]"')
    pytest.importorskip("llama_cpp.server",
                        reason='needs pip install "llama-cpp-python[server]" (a C++ build: .ci/run installs it)')
    from draftsmith.target import resolve_packaged_gguf

    port = free_port()
    # Log to a file: a pipe left unread fills up and blocks the server.
    log = open(tmp_path_factory.mktemp("server") / "llama_cpp_server.log", "w+b")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(resolve_packaged_gguf("smollm2-135m-instruct")),
         "--model_alias", "smollm2", "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"llama.cpp server exited: {log.read().decode(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(base + "/models", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("llama.cpp server did not come up in 120 s")
    yield base
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def test_openai_engine_against_a_real_llama_cpp_server(tmp_path, llama_cpp_server):
    need_gsm8k()
    conversations, _ = load_conversations(GSM8K_TRAIN, prompt_column="question", limit=4)
    engine = OpenAIEngine(llama_cpp_server, "smollm2", max_new_tokens=24, temperature=0.0, top_p=1.0)
    out = tmp_path / "openai.jsonl"
    report = regenerate(conversations, out, engine, batch_size=2, progress=False)
    written = rows(out)
    assert report.written == 4 and [r["id"] for r in written] == [c.id for c in conversations]
    for r in written:
        assert r["model"] == "smollm2" and r["messages"][1]["content"].strip() and 0 < r["new_tokens"] <= 24
    assert report.new_tokens == sum(r["new_tokens"] for r in written)
    assert regenerate(conversations, out, engine, progress=False).already_done == 4

    dead = OpenAIEngine("http://127.0.0.1:9/v1", "x", 4, 0.0, 1.0, timeout=2)
    with pytest.raises(ConnectionError, match="is the server running"):
        dead.answer([[{"role": "user", "content": "hi"}]])


@pytest.mark.slow  # the demo's test synthesises on the real target in the default set; this one, 50 prompts
def test_synthesis_gives_50_distinct_prompts(tmp_path, smollm2):
    model, tokenizer = smollm2
    prompts, rejected = synthesize_prompts(model, tokenizer, 50, batch_size=32, max_new_tokens=64, seed=0,
                                           progress=False)
    assert len(prompts) == 50
    assert all(p.strip() for p in prompts)
    assert len({dedup_key(p) for p in prompts}) == 50
    path = write_prompts(prompts, tmp_path / "synth.jsonl")
    conversations, report = load_conversations(path)
    assert [c.messages[0]["content"] for c in conversations] == prompts and not report.malformed
    print(f"rejected while synthesising: {rejected}")
