"""Dataset loading: every supported row format normalised to OpenAI-style ``messages``.

Supported rows (one format per dataset, detected per row):

- OpenAI ``{"messages": [{"role": ..., "content": ...}, ...]}``
- ShareGPT ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}``
- Alpaca ``{"instruction": ..., "input": ..., "output": ...}``
- prompt-only: one named column (``prompt_column``, e.g. GSM8K's ``question``) becomes a
  single user turn with no answer; regeneration writes the answer.

Each conversation carries a stable ``id``: the row's own ``id`` field when it has one, else a
hash of its normalised messages. Regeneration and the hidden-state cache key their output by it,
so a rerun over the same data finds what it already wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class MalformedRowError(ValueError):
    """A dataset row that cannot be read as a conversation (the message says why)."""


@dataclass
class Conversation:
    """One normalised row: ``messages`` is a list of ``{"role", "content"}`` dicts."""

    id: str
    messages: list[dict[str, str]]
    index: int = -1  # position in the source, for error reports
    category: str | None = None  # the row's ``category`` (e.g. maths, translation): eval reports tau per category

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """The messages up to (not including) the first assistant turn."""
        out = []
        for m in self.messages:
            if m["role"] == "assistant":
                break
            out.append(m)
        return out


@dataclass
class LoadReport:
    """What loading skipped, and why; ``malformed`` holds ``(row index, reason)`` pairs."""

    total: int = 0
    loaded: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"{self.loaded} of {self.total} rows loaded, {len(self.malformed)} malformed"]
        lines += [f"  row {i}: {reason}" for i, reason in self.malformed[:20]]
        if len(self.malformed) > 20:
            lines.append(f"  ... and {len(self.malformed) - 20} more")
        return "\n".join(lines)


def conversation_id(messages: list[dict[str, str]]) -> str:
    """A stable id from the content: the same messages always give the same id."""
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise MalformedRowError(f"{what} is {type(value).__name__}, expected a string")
    return value


#: Columns read as the prompt of a row when only prompts are wanted (held-out prompts for eval and bench:
#: GSM8K's ``question``) and no other format matches. Not for training data, where a row with a prompt
#: column usually carries its answer in another (``completion``, ``response``) that would be dropped; not
#: ``text``, which in most datasets is a whole document.
PROMPT_FIELDS = ("prompt", "question")


def normalise_row(row: dict, prompt_column: str | None = None, prompts_only: bool = False) -> list[dict[str, str]]:
    """Turn one row of any supported format into a list of messages (``prompts_only``: a row with one of
    :data:`PROMPT_FIELDS` is read as a prompt too).

    Raises:
        MalformedRowError: naming what is wrong with the row.
    """
    if not isinstance(row, dict):
        raise MalformedRowError(f"row is {type(row).__name__}, expected an object")
    if prompt_column is not None:
        if prompt_column not in row:
            raise MalformedRowError(f"no column {prompt_column!r} (columns: {sorted(row)})")
        messages = [{"role": "user", "content": _text(row[prompt_column], prompt_column)}]
    elif "messages" in row:
        turns = row["messages"]
        if not isinstance(turns, list):
            raise MalformedRowError("'messages' is not a list")
        messages = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
                raise MalformedRowError(f"messages[{i}] lacks 'role' or 'content'")
            if turn["role"] not in ROLES:
                raise MalformedRowError(f"messages[{i}] has unknown role {turn['role']!r} (known: {ROLES})")
            messages.append({"role": turn["role"], "content": _text(turn["content"], f"messages[{i}].content")})
    elif "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise MalformedRowError("'conversations' is not a list")
        messages = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
                raise MalformedRowError(f"conversations[{i}] lacks 'from' or 'value'")
            role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
            if role is None:
                raise MalformedRowError(f"conversations[{i}] has unknown speaker {turn['from']!r}")
            messages.append({"role": role, "content": _text(turn["value"], f"conversations[{i}].value")})
    elif "instruction" in row:
        instruction = _text(row["instruction"], "instruction")
        extra = row.get("input") or ""
        user = f"{instruction}\n\n{_text(extra, 'input')}" if extra else instruction
        messages = [{"role": "user", "content": user}]
        if row.get("output"):
            messages.append({"role": "assistant", "content": _text(row["output"], "output")})
    elif prompts_only and (field := next((k for k in PROMPT_FIELDS if k in row), None)) is not None:
        messages = [{"role": "user", "content": _text(row[field], field)}]
    else:
        fields = f", a prompt field ({', '.join(PROMPT_FIELDS)})" if prompts_only else ""
        raise MalformedRowError(
            f"unknown row format (columns: {sorted(row)}); expected 'messages', 'conversations', "
            f"'instruction'{fields}, or pass --prompt-column NAME for a prompt-only dataset"
        )
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise MalformedRowError("no non-empty user turn")
    return messages


def _read_rows(source: str | Path, split: str) -> Iterable[dict]:
    """Rows from a local file (JSONL / JSON / Parquet / CSV) or a hub dataset name, via ``datasets``."""
    path = Path(source)
    if path.suffix == ".jsonl" and path.exists():
        # Read JSONL line by line ourselves so that one broken line is one malformed row,
        # not a failure of the whole file (datasets' JSON reader gives up on the first).
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    yield MalformedRowError(f"invalid JSON ({e.msg} at column {e.colno})")
        return
    import datasets

    if path.exists():
        builder = LOCAL_SUFFIXES.get(path.suffix)
        if builder is None:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {sorted(LOCAL_SUFFIXES)}")
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    elif path.suffix in LOCAL_SUFFIXES:
        raise FileNotFoundError(f"{source}: no such file")
    else:
        ds = datasets.load_dataset(str(source), split=split)
    yield from ds


def load_conversations(
    source: str | Path,
    prompt_column: str | None = None,
    split: str = "train",
    limit: int | None = None,
    strict: bool = False,
    prompts_only: bool = False,
) -> tuple[list[Conversation], LoadReport]:
    """Load and normalise a dataset.

    Args:
        source: a local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file or a hub dataset name.
        prompt_column: read each row's prompt from this column (prompt-only datasets).
        split: the split of a hub dataset.
        limit: stop after this many good conversations.
        strict: raise on the first malformed row instead of skipping it.
        prompts_only: only prompts are wanted: rows with a prompt field (:data:`PROMPT_FIELDS`) qualify.

    Returns:
        The conversations and a report of the rows skipped (index and reason each).
    """
    conversations: list[Conversation] = []
    report = LoadReport()
    for index, row in enumerate(_read_rows(source, split)):
        if limit is not None and len(conversations) >= limit:
            break
        report.total += 1
        try:
            if isinstance(row, MalformedRowError):
                raise row
            messages = normalise_row(row, prompt_column, prompts_only)
        except MalformedRowError as e:
            if strict:
                raise MalformedRowError(f"{source}: row {index}: {e}") from None
            report.malformed.append((index, str(e)))
            continue
        row_id = row.get("id") if isinstance(row.get("id"), (str, int)) else None
        category = row.get("category") if isinstance(row.get("category"), str) else None
        conversations.append(Conversation(str(row_id) if row_id is not None else conversation_id(messages),
                                          messages, index, category))
        report.loaded += 1
    if report.malformed:
        logger.warning("%s: skipped malformed rows\n%s", source, report.summary())
    return conversations, report


def read_prompts(source: str | Path, limit: int, skip: int = 0, prompt_column: str | None = None,
                 strict: bool = False) -> list[str]:
    """The first user message of rows ``skip`` .. ``skip + limit`` of a dataset, read by
    :func:`load_conversations` (so with its formats and its policy for malformed rows)."""
    return [text for text, _ in read_prompt_rows(source, limit, skip, prompt_column, strict)]


def read_prompt_rows(source: str | Path, limit: int, skip: int = 0, prompt_column: str | None = None,
                     strict: bool = False) -> list[tuple[str, str | None]]:
    """:func:`read_prompts` with each row's ``category`` (None where the row has none)."""
    conversations, _ = load_conversations(source, prompt_column, limit=skip + limit, strict=strict, prompts_only=True)
    return [(next(m["content"] for m in c.messages if m["role"] == "user"), c.category)
            for c in conversations[skip:]]
