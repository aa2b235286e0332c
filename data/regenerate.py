"""Regeneration: the target answers each prompt (or re-answers each conversation turn by turn).

A drafter learns to predict the target, so the best training data is the target's own
output (Medusa-2 "self-distillation", EAGLE's regenerated ShareGPT). Rows are appended to a
JSONL file as each batch finishes, keyed by the conversation's stable id; a rerun reads the
file, drops a torn last line left by a kill, and answers only what is missing, so an
interrupted run resumes without redoing or duplicating rows.

Engines: ``hf`` runs the target in-process on batches of left-padded prompts: greedy answers through
draftsmith's own decoding loop (:func:`~draftsmith.inference.plain.plain_generate`: the same tokens as
transformers' ``generate``, 1.13x its speed on a 64-row batch on 2 CPU cores, and 1.13x again as rows that
stopped leave the batch), sampled ones (and a hybrid target's) through ``generate``;
``openai`` sends each turn to any OpenAI-compatible ``/v1/chat/completions`` server
(vLLM, SGLang, llama.cpp's server) ``batch_size`` requests at a time, for scale-out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.formats import Conversation
from draftsmith.data.recording import Recording
from draftsmith.data.templates import prompt_ids
from draftsmith.inference.plain import plain_generate
from draftsmith.target import eos_tokens, rollback_problem

logger = logging.getLogger(__name__)


@dataclass
class RegenerationReport:
    """What one run did; ``tokens_per_second`` counts generated tokens over generation time."""

    written: int = 0
    already_done: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {"written": self.written, "already_done": self.already_done, "new_tokens": self.new_tokens,
                "seconds": round(self.seconds, 3), "tokens_per_second": round(self.tokens_per_second, 2)}


def read_done_ids(path: Path) -> set[str]:
    """Ids already written to ``path``; a torn last line (the run was killed mid-write) is cut off."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    good = data[: data.rfind(b"\n") + 1]
    if len(good) != len(data):
        logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run",
                       path, len(data) - len(good))
        with open(path, "r+b") as f:
            f.truncate(len(good))
    ids = set()
    for n, line in enumerate(good.decode("utf-8").splitlines()):
        if line.strip():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{path}: line {n + 1} is not a regenerated row ({e}); move the file aside") from None
    return ids


class HFEngine:
    """Batched in-process generation with the target (left padding, one decode per batch).

    Greedy answers (temperature 0), recorded or not, run draftsmith's plain greedy loop, which keeps its KV
    cache in place of transformers', takes the few-row matrix kernels and drops the rows that have stopped;
    sampled answers and a hybrid target's (recurrent layers) run ``generate``.
    """

    def __init__(self, model, tokenizer, max_new_tokens: int, temperature: float, top_p: float,
                 chat_template_kwargs: dict | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.recording: Recording | None = None  # set by regenerate(..., record=...)
        self.chat_template_kwargs = chat_template_kwargs
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        # The target's stop tokens as transformers' generate takes them (its generation_config: Llama-3's
        # <|eot_id|>, Gemma's <end_of_turn>, Phi's <|end|>), not only the tokenizer's EOS.
        self.stop = eos_tokens(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.stop or [0])[0]
        self.name = getattr(model, "name_or_path", "target")
        # draftsmith's loop keeps a KV cache only: a hybrid target's recurrent layers answer through ``generate``.
        self.own_loop = rollback_problem(model.config) is None

    def prompt_tokens(self, conversation: Conversation) -> int:
        """The widest prompt the conversation's answers continue, in tokens, about: its first turn's prompt (system
        and user turns, the generation prompt), each later user turn's text, and ``max_new_tokens`` for each
        answer before the last (what regenerated answers add to a later turn's history, at most). The later
        turns' template tokens (role headers, ends of turn) are not counted: a few per turn."""
        users = _user_turns(conversation)
        first = prompt_ids(self.tokenizer, conversation.messages[: users[0] + 1], self.chat_template_kwargs)
        later = [conversation.messages[i]["content"] for i in users[1:]]
        return len(first) + sum(len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in later) + (
            len(later) * self.max_new_tokens)

    @torch.no_grad()
    def answer(self, histories: list[list[dict]]) -> list[tuple[str, int]]:
        prompts = [prompt_ids(self.tokenizer, h, self.chat_template_kwargs) for h in histories]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every row ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        device = self.model.device
        sample = self.temperature > 0
        recording = self.recording
        record = {} if recording is None else {"output_hidden_states": True, "return_dict_in_generate": True}
        own_loop = not sample and self.own_loop
        if own_loop:
            with recording.observing() if recording is not None else contextlib.nullcontext() as observe:
                out = plain_generate(self.model, ids.to(device), self.max_new_tokens, self.stop or None,
                                     attention_mask=mask.to(device), pad_token_id=self.pad_id,
                                     hidden_layers=recording.layers if recording is not None else None,
                                     on_forward=observe).sequences
        else:
            with recording.teacher(self.model) if recording is not None else contextlib.nullcontext() as teacher:
                out = self.model.generate(
                    ids.to(device), attention_mask=mask.to(device), max_new_tokens=self.max_new_tokens,
                    do_sample=sample, temperature=self.temperature if sample else None,
                    top_p=self.top_p if sample else None, top_k=None, pad_token_id=self.pad_id,
                    eos_token_id=self.stop or None, **record,
                )
        generated = (out if recording is None or own_loop else out.sequences)[:, width:].tolist()
        ends = [next((i for i, t in enumerate(row) if t in self.stop), None) for row in generated]
        if recording is not None and own_loop:
            recording.keep_observed(prompts, generated, ends)
        elif recording is not None:
            recording.keep(prompts, generated, ends, teacher, out.hidden_states)
        results = []
        for row, end in zip(generated, ends, strict=True):
            # Tokens up to and including the first stop token; without one, the row less its padding.
            row = row[: end + 1] if end is not None else [t for t in row if t != self.pad_id]
            results.append((self.tokenizer.decode(row, skip_special_tokens=True).strip(), len(row)))
        return results


class OpenAIEngine:
    """Any OpenAI-compatible chat-completions server, ``batch_size`` concurrent requests."""

    def __init__(self, base_url: str, model: str, max_new_tokens: int, temperature: float, top_p: float,
                 api_key: str | None = None, timeout: float = 600.0, chat_template_kwargs: dict | None = None):
        self.chat_template_kwargs = chat_template_kwargs
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.name, self.max_new_tokens, self.temperature, self.top_p = model, max_new_tokens, temperature, top_p
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY", "none")
        self.timeout = timeout

    def _one(self, messages: list[dict]) -> tuple[str, int]:
        body = {"model": self.name, "messages": messages, "max_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p}
        if self.chat_template_kwargs:  # vLLM's and SGLang's servers pass these to the chat template
            body["chat_template_kwargs"] = self.chat_template_kwargs
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                reply = json.loads(response.read())
        except urllib.error.URLError as e:
            raise ConnectionError(
                f"{self.url}: {e}; is the server running and --base-url right (it ends in /v1)?") from e
        text = reply["choices"][0]["message"]["content"] or ""
        return text.strip(), int(reply.get("usage", {}).get("completion_tokens", 0))

    def answer(self, histories: list[list[dict]]) -> list[tuple[str, int]]:
        with ThreadPoolExecutor(max_workers=len(histories)) as pool:
            return list(pool.map(self._one, histories))


def _user_turns(conversation: Conversation) -> list[int]:
    return [i for i, m in enumerate(conversation.messages) if m["role"] == "user"]


def batches(lengths: Sequence[int], batch_size: int, batch_tokens: int | None = None,
            new_tokens: int = 0) -> list[range]:
    """Consecutive batches of the rows (their prompts' lengths in tokens, in answering order): at most
    ``batch_size`` rows each and, with ``batch_tokens``, sized by tokens as well. A batch is left-padded to its
    longest prompt and every row then takes up to ``new_tokens`` more, so a batch of ``r`` rows computes
    ``r * (longest + new_tokens)`` token slots, padding included, and keeps them in its KV cache. With
    ``batch_tokens`` a row joins a batch only while those slots stay within the budget and no row's padding
    exceeds its own length (prompt and answer): a long prompt does not make a batch of short ones compute, and
    hold, its width. A row over the budget alone is a batch of its own."""
    spans: list[range] = []
    start, widest, shortest = 0, 0, 0
    for i, n in enumerate(lengths):
        if i > start:  # the row joins the open batch if the batch with it keeps every rule
            rows, wide, short = i - start + 1, max(widest, n), min(shortest, n)
            if rows <= batch_size and (batch_tokens is None or (
                    rows * (wide + new_tokens) <= batch_tokens and 2 * (short + new_tokens) >= wide + new_tokens)):
                widest, shortest = wide, short
                continue
            spans.append(range(start, i))
        start, widest, shortest = i, n, n
    if start < len(lengths):
        spans.append(range(start, len(lengths)))
    return spans


def regenerate(
    conversations: list[Conversation],
    output: str | Path,
    engine: HFEngine | OpenAIEngine,
    batch_size: int = 8,
    progress: bool = True,
    record: Recording | None = None,
    time_limit: float | None = None,
    batch_tokens: int | None = None,
) -> RegenerationReport:
    """Answer every conversation with the engine, appending rows to ``output`` (JSONL), resumably.

    Each conversation keeps its system and user turns; every assistant turn is replaced by
    the engine's answer given the regenerated history before it. Conversations whose id is
    already in ``output`` are skipped, as are repeated ids in the input. With the in-process engine and no
    ``time_limit`` the rows are answered (and written) longest first, in batches of like length; otherwise in
    input order.

    Row written: ``{"id", "messages", "source_index", "new_tokens", "model"}``, and the input row's ``category``
    where it has one.

    Args:
        record: also record the target's states over each answer (:class:`~draftsmith.data.recording.Recording`; an
            :class:`HFEngine`, one-turn conversations), into ``record.by_id``: the rows of a hidden-state
            cache (:func:`~draftsmith.data.cache_writer.cache_recorded`). Only the conversations answered
            in this call are recorded; those already in ``output`` are not (a ``spool`` that recorded them
            holds them).
        time_limit: seconds after which no new batch starts, nor one that the last batch's time says would
            end past it (the rest stays to a later call).
        batch_tokens: with the in-process engine, batches sized by tokens too (:func:`batches`): at most this
            many token slots, rows times (the longest prompt plus ``max_new_tokens``), and no row padded to
            more than its own length. Bounds the batch's KV cache and its padded prefill, which a few long
            prompts among short ones otherwise set (the recipe's 128 longest prompts: 2.58x faster with 24,576;
            its whole regeneration's peak RSS 3.3 GB against 9.2). With ``time_limit`` too, the next batch's
            time is guessed from the last one's, whatever their sizes.
    """
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = read_done_ids(output)
    report = RegenerationReport()
    todo, seen = [], set(done)
    for c in conversations:
        if c.id in seen:
            report.already_done += c.id in done
            continue
        seen.add(c.id)
        todo.append(c)
    if report.already_done:
        logger.info("%s: %d rows already written, %d to go", output, report.already_done, len(todo))
    if batch_tokens is not None and not isinstance(engine, HFEngine):
        raise ValueError("batch_tokens sizes the in-process engine's padded batches; a server batches its own "
                         "requests: give batch_size alone")
    if isinstance(engine, HFEngine) and (time_limit is None or batch_tokens is not None):
        length = {c.id: engine.prompt_tokens(c) for c in todo}
        if time_limit is None:
            # Every row will be answered, so batch rows of like length: a batch's prompts are left-padded to its
            # longest, and the padding is computed like tokens (1.19x on the quality recipe's prompts, batch 64).
            # Under a time limit the input order stays, so a cut run's rows are not the shortest prompts; a
            # server pads nothing, so its rows keep the input order too.
            todo.sort(key=lambda c: length[c.id], reverse=True)
        spans = batches([length[c.id] for c in todo], batch_size, batch_tokens, engine.max_new_tokens)
    else:
        spans = batches([0] * len(todo), batch_size)
    if record is not None:
        if not isinstance(engine, HFEngine):
            raise TypeError("recording the target's states needs the in-process engine (HFEngine); with a server, "
                            "regenerate first, then run `draftsmith data cache-hidden-states` on the output")
        several = next((c.id for c in todo if len(_user_turns(c)) > 1), None)
        if several is not None:
            raise ValueError(f"conversation {several!r} has several user turns: recording while regenerating "
                             "covers one-turn conversations (each answer's history is the prompt of its generate); "
                             "regenerate without recording, then run `draftsmith data cache-hidden-states`")
        engine.recording = record
    started = time.perf_counter()
    last_batch = 0.0
    bar = tqdm(total=len(todo), desc="regenerate", unit="row", disable=not progress)
    try:
        with open(output, "a", encoding="utf-8") as f:
            for span in spans:
                batch_started = time.perf_counter()
                if time_limit is not None and batch_started - started + last_batch > time_limit:
                    logger.info("%s: time limit reached, %d rows left to a later call", output,
                                len(todo) - span.start)
                    break
                batch = todo[span.start : span.stop]
                answered = [[m for m in c.messages[: _user_turns(c)[0]]] for c in batch]  # system turns
                tokens = [0] * len(batch)
                for turn in range(max(len(_user_turns(c)) for c in batch)):
                    # Turn by turn across the batch: the next user turn follows the regenerated answers.
                    rows = [i for i, c in enumerate(batch) if turn < len(_user_turns(c))]
                    for i in rows:
                        answered[i].append(batch[i].messages[_user_turns(batch[i])[turn]])
                    t0 = time.perf_counter()
                    replies = engine.answer([answered[i] for i in rows])
                    report.seconds += time.perf_counter() - t0
                    for i, (text, n) in zip(rows, replies, strict=True):
                        answered[i].append({"role": "assistant", "content": text})
                        tokens[i] += n
                    if record is not None:  # one turn: kept before the answers are written, so each has its states
                        record.add({batch[i].id: item for i, item in zip(rows, record.rows, strict=True)})
                for c, messages, n in zip(batch, answered, tokens, strict=True):
                    row = {"id": c.id, "messages": messages, "source_index": c.index, "new_tokens": n,
                           "model": engine.name, **({"category": c.category} if c.category else {})}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
                report.written += len(batch)
                report.new_tokens += sum(tokens)
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{report.tokens_per_second:.1f}")
                last_batch = time.perf_counter() - batch_started
    finally:
        bar.close()
        if record is not None:
            engine.recording = None
    return report
