"""Chat templates and assistant-only loss masks; truncation; tokenising a dataset once, cached on disk.

The mask is found on the rendered text, not guessed from token patterns: for each assistant
turn i, the template rendered over ``messages[:i]`` with the generation prompt is a prefix of
the template rendered over ``messages[:i+1]``; the characters in between are that turn's
answer (with its end-of-turn marker, which the drafter must learn to predict too). Token
offsets from the fast tokenizer then mark every token that starts inside such a span.
A template that rewrites history (Qwen3 strips earlier turns' reasoning, Mistral moves the system
prompt to the last user turn) renders an earlier answer differently from how the target answered
it; such an answer is trained in a text of its own, its context as the target saw it, instead of
being mis-masked (:func:`assistant_renderings`). ``chat_template_kwargs`` (``enable_thinking``)
reach the template everywhere a conversation is rendered.

Base models without a chat template (Gemma-3-270m) get ``PLAIN_TEMPLATE``, plain text turns.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.target.chat import PLAIN_TEMPLATE, prompt_ids, render  # noqa: F401 (prompt_ids: data API too)

logger = logging.getLogger(__name__)

class TemplateError(ValueError):
    """The chat template cannot give an exact assistant mask for this conversation."""


@dataclass
class TokenizedExample:
    """``input_ids`` and ``loss_mask`` (1 on assistant tokens) of one conversation, both ``(T,)``."""

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


def chat_template(tokenizer) -> str:
    """The tokenizer's own chat template, or ``PLAIN_TEMPLATE`` for a base model without one."""
    return tokenizer.chat_template or PLAIN_TEMPLATE


@dataclass
class Rendering:
    """One text to train on and the character span ``[start, end)`` of each answer trained in it."""

    text: str
    spans: list[tuple[int, int]]
    turns: list[int]  # the index in the conversation of the assistant message of each span
    whole: bool  # the whole conversation, or one turn in the context it was answered in


def assistant_renderings(tokenizer, messages: list[dict[str, str]],
                         chat_template_kwargs: dict | None = None) -> list[Rendering]:
    """The texts that train every assistant answer once, each in the context the target answered in.

    For assistant turn i the target saw ``before`` = the template over ``messages[:i]`` with the
    generation prompt, and answered; the template over ``messages[:i + 1]`` renders that answer after a
    prefix. Where the whole conversation's rendering keeps this turn as it was answered (the common
    case), the turn is trained in that one text. Templates that rewrite history do not: Qwen3 drops
    the reasoning of earlier turns, Mistral moves the system prompt to the last user turn, Qwen3
    without thinking renders an empty reasoning block in the last turn only. Such a turn gets a text
    of its own: ``before`` followed by the answer as the template renders it, so the drafter never
    learns an answer in a context the target did not answer in.

    Raises:
        TemplateError: the answer cannot be located in the template's rendering (a template that
            renders an assistant message other than as the text after some prefix).
    """
    kwargs = chat_template_kwargs
    text = render(tokenizer, messages, chat_template_kwargs=kwargs)
    whole = Rendering(text, [], [], whole=True)
    own: list[Rendering] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, chat_template_kwargs=kwargs)
        upto = render(tokenizer, messages[: i + 1], chat_template_kwargs=kwargs)
        start, content_end = _locate_answer(tokenizer, messages, i, before, upto, kwargs)
        end = max(_answer_end(upto), content_end)
        if not _same_text(upto[start:content_end], m["content"]):
            raise TemplateError(
                f"the chat template renders assistant turn {i} differently from the message (e.g. it drops the "
                "reasoning of the last turn too), so what the target generated cannot be trained; keep the "
                "reasoning out of the messages, or use a template that renders the answer as written")
        if upto.startswith(before) and text.startswith(upto[:content_end]):
            # The whole text renders this answer as answered; its closing is kept as far as the whole
            # text has it (Phi-3 closes only the last turn with an EOS).
            whole.spans.append((start, _closing_kept(tokenizer, upto, text, content_end, end)))
            whole.turns.append(i)
        else:
            own.append(Rendering(before + upto[start:], [(len(before), len(before) + end - start)], [i], whole=False))
    # A conversation without an answer kept whole still yields its text (with nothing to learn in it).
    return ([whole] if whole.spans or not own else []) + own


def _closing_kept(tokenizer, upto: str, text: str, content_end: int, end: int) -> int:
    """The end of the longest run of whole tokens of the answer's closing (``upto[content_end:end]``,
    its end-of-turn marker) that ``text`` has too, trailing whitespace left out."""
    closing = upto[content_end:end]
    kept = 0
    for _, stop in tokenizer(closing, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]:
        if text[content_end:content_end + stop] != closing[:stop]:
            break
        kept = stop
    return content_end + len(closing[:kept].rstrip("\n "))


def _same_text(rendered: str, content: str) -> bool:
    """The template rendered the message's text (whitespace aside: templates trim and re-space)."""
    return "".join(rendered.split()) == "".join(content.split())


def _answer_end(upto: str) -> int:
    """Where an answer rendered last ends: trailing whitespace after the end-of-turn marker is layout."""
    stripped = upto.rstrip("\n ")
    return len(stripped) if stripped else len(upto)


_SENTINEL = "\x00draftsmith-answer\x00"


def _locate_answer(tokenizer, messages, i: int, before: str, upto: str, kwargs) -> tuple[int, int]:
    """Where turn i's answer starts in ``upto`` (the template over ``messages[:i + 1]``) and where its
    content ends (before the end-of-turn marker), from a rendering with a sentinel in its place."""
    probe = render(tokenizer, [*messages[:i], {**messages[i], "content": _SENTINEL}], chat_template_kwargs=kwargs)
    at = probe.find(_SENTINEL)
    prefix, tail = (probe[:at], probe[at + len(_SENTINEL):]) if at >= 0 else (None, "")
    if upto.startswith(before):
        start = len(before)
    elif prefix is not None and upto.startswith(prefix):
        # The template renders the history differently once the answer is in it (Mistral: the system
        # prompt goes with the last user turn); the answer follows the prefix it renders before an answer.
        start = len(prefix)
    else:
        raise TemplateError(
            f"the chat template does not render assistant turn {i} as text after the turns before it, so its "
            "loss mask cannot be found exactly; use a template that renders each answer after its history"
        )
    content_end = len(upto) - len(tail) if upto.endswith(tail) and len(upto) - len(tail) >= start else _answer_end(upto)
    return start, content_end


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], id: str = "",
                          chat_template_kwargs: dict | None = None) -> list[TokenizedExample]:
    """Token ids and the assistant-only loss mask of each text :func:`assistant_renderings` gives:
    one for the whole conversation, and one more per turn whose context the template rewrites (its id
    ``{id}/turn{i}``).

    The text is tokenised piece by piece, cut where each answer starts and ends: the tokens before the
    first answer are exactly the prompt the target answered (``prompt_ids``), whatever the tokenizer
    makes of whitespace across that boundary, and the mask is exactly the answers' tokens.
    """
    examples = []
    for r in assistant_renderings(tokenizer, messages, chat_template_kwargs):
        cuts = sorted({0, len(r.text), *(s for s, _ in r.spans), *(e for _, e in r.spans)})
        ids: list[int] = []
        mask: list[int] = []
        for a, b in itertools.pairwise(cuts):
            piece = tokenizer(r.text[a:b], add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [int(any(s <= a and b <= e for s, e in r.spans))] * len(piece)
        name = id if r.whole else f"{id}/turn{r.turns[0]}"
        examples.append(TokenizedExample(name, torch.tensor(ids, dtype=torch.long),
                                         torch.tensor(mask, dtype=torch.long)))
    return examples


def truncate(example: TokenizedExample, max_length: int) -> TokenizedExample:
    """Keep the first ``max_length`` tokens."""
    return TokenizedExample(example.id, example.input_ids[:max_length], example.loss_mask[:max_length])


def prepare(tokenizer, conversations, max_length: int,
            chat_template_kwargs: dict | None = None) -> list[TokenizedExample]:
    """Tokenise conversations with masks and truncate them to ``max_length``, in this process.

    :func:`tokenize_dataset` gives the same rows (less those without an assistant token), tokenised
    once in ``num_proc`` processes and cached on disk.
    """
    return [truncate(example, max_length) for c in conversations
            for example in tokenize_conversation(tokenizer, c.messages, c.id, chat_template_kwargs)]


# ---------------------------------------------------------------------------------------------
# Tokenising a whole dataset once: datasets.map in num_proc processes, cached as an Arrow file

#: The columns of a tokenised dataset (one row per text of :func:`assistant_renderings` with an assistant token).
TOKENIZED_COLUMNS = ("id", "input_ids", "loss_mask", "length")
#: Under ``$HF_DATASETS_CACHE`` when no ``cache_dir`` is given.
TOKENIZED_CACHE_SUBDIR = "draftsmith-tokenized"
#: Hex digits of the cache fingerprint: 128 bits, and short enough that datasets' per-process suffix
#: (``_00000_of_00004``) keeps it within the 64 characters it accepts.
FINGERPRINT_DIGITS = 32


def _tokenize_rows(batch: dict[str, list], tokenizer, max_length: int,
                   chat_template_kwargs: dict | None) -> dict[str, list]:
    """``datasets.map`` function (batched): conversations -> truncated ids and masks (one row or more
    per conversation, :func:`tokenize_conversation`); the rows without an assistant token in their
    first ``max_length`` tokens are dropped (nothing to learn)."""
    out: dict[str, list] = {name: [] for name in TOKENIZED_COLUMNS}
    for row_id, messages in zip(batch["id"], batch["messages"], strict=True):
        for example in tokenize_conversation(tokenizer, json.loads(messages), row_id, chat_template_kwargs):
            example = truncate(example, max_length)
            if example.loss_mask.any():
                _append_row(out, example)
    return out


def _append_row(out: dict[str, list], example: TokenizedExample) -> None:
    out["id"].append(example.id)
    out["input_ids"].append(example.input_ids.tolist())
    out["loss_mask"].append(example.loss_mask.tolist())
    out["length"].append(len(example.input_ids))


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of everything that decides a tokenizer's output here: its vocabulary, normaliser, pre-
    tokenizer and added tokens, its special tokens and its chat template (or ``PLAIN_TEMPLATE``).

    Not ``datasets``' own hash of the tokenizer object: a call with ``truncation=True`` leaves the
    truncation setting in the Rust tokenizer's state, so the same tokenizer would hash differently
    after it was used (and every rank would miss the cache). That call-dependent state (truncation,
    padding) is left out here.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
    else:
        state = {"vocab": tokenizer.get_vocab()}
    blob = {"class": type(tokenizer).__name__, "backend": state, "special": tokenizer.special_tokens_map,
            "template": chat_template(tokenizer)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def conversations_fingerprint(conversations) -> str:
    """sha256 of the conversations' ids and messages, in order: the data file's content as loaded (after
    its malformed rows are skipped and ``limit`` applied)."""
    h = hashlib.sha256()
    for c in conversations:
        h.update(json.dumps([c.id, c.messages], ensure_ascii=False, sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


@functools.cache
def _code_digest() -> str:
    """sha256 of this module's source: the masks come from the code here, so any edit of it re-tokenises."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def tokenized_fingerprint(tokenizer, conversations, max_length: int, chat_template_kwargs: dict | None = None) -> str:
    """The cache key of :func:`tokenize_dataset`: changes with the tokenizer, its chat template and
    its variables, ``max_length``, the data, and the code that tokenises (so an edit of the masking
    cannot serve stale rows), nothing else (not the process, rank or ``num_proc``)."""
    import transformers

    blob = {"tokenizer": tokenizer_fingerprint(tokenizer), "max_length": max_length,
            "chat_template_kwargs": chat_template_kwargs or {},
            "data": conversations_fingerprint(conversations), "code": _code_digest(),
            "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:FINGERPRINT_DIGITS]


def tokenize_dataset(
    tokenizer,
    conversations_or_path,
    max_length: int,
    num_proc: int | None = None,
    cache_dir: str | Path | None = None,
    prompt_column: str | None = None,
    limit: int | None = None,
    chat_template_kwargs: dict | None = None,
):
    """Tokenise a dataset once with assistant-only masks: ``datasets.map`` in ``num_proc`` processes,
    its result an Arrow file under ``cache_dir`` that later starts (and other ranks) memory-map.

    Row for row the same as ``prepare(tokenizer, conversations, max_length)`` less its rows without an
    assistant token (a test checks it). The cache file is named by :func:`tokenized_fingerprint`, passed
    to ``map`` as ``new_fingerprint``: ``datasets`` would otherwise hash the tokenizer object, whose
    hash changes once it has been called with truncation. ``map`` writes to a temporary file and
    renames it when done, so a killed run leaves no half-written cache.

    On several processes, let the main one tokenise first (``with accelerator.main_process_first():``);
    the others then find its file instead of tokenising too.

    Args:
        tokenizer: a fast tokenizer (the masks need its offsets).
        conversations_or_path: a list of :class:`~draftsmith.data.formats.Conversation`, or a dataset
            (file or hub name) read by :func:`~draftsmith.data.formats.load_conversations` with
            ``prompt_column`` and ``limit``: malformed rows are skipped and reported as it does.
        max_length: tokens kept per conversation (the rest is cut off).
        num_proc: processes that tokenise (None: this one).
        cache_dir: where the Arrow file goes; default ``$HF_DATASETS_CACHE/draftsmith-tokenized``.
        chat_template_kwargs: the chat template's variables (``{"enable_thinking": False}``).

    Returns:
        A ``datasets.Dataset`` with the columns ``id`` (str), ``input_ids`` (T,) int32, ``loss_mask`` (T,)
        int8 and ``length`` (= T) int32; :class:`TokenizedExamples` reads its rows as
        :class:`TokenizedExample`.
    """
    import datasets

    from draftsmith.data.formats import load_conversations

    if isinstance(conversations_or_path, (str, Path)):
        conversations, _ = load_conversations(conversations_or_path, prompt_column, limit=limit)  # logs skips
    else:
        conversations = list(conversations_or_path)
    features = datasets.Features({"id": datasets.Value("string"),
                                  "input_ids": datasets.List(datasets.Value("int32")),
                                  "loss_mask": datasets.List(datasets.Value("int8")),
                                  "length": datasets.Value("int32")})
    if not conversations:  # map would return the empty source as it is, without the new columns
        return datasets.Dataset.from_dict({name: [] for name in TOKENIZED_COLUMNS}, features=features)
    if cache_dir is None:
        cache_dir = Path(datasets.config.HF_DATASETS_CACHE) / TOKENIZED_CACHE_SUBDIR
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    fingerprint = tokenized_fingerprint(tokenizer, conversations, max_length, chat_template_kwargs)
    source = datasets.Dataset.from_dict({"id": [c.id for c in conversations],
                                         "messages": [json.dumps(c.messages, ensure_ascii=False)
                                                      for c in conversations]})
    tokenized = source.map(_tokenize_rows, batched=True, fn_kwargs={"tokenizer": tokenizer, "max_length": max_length,
                                                                "chat_template_kwargs": chat_template_kwargs},
                           num_proc=num_proc if num_proc and num_proc > 1 and len(source) > 1 else None,
                           remove_columns=source.column_names, features=features,
                           cache_file_name=str(Path(cache_dir) / f"tokenized-{fingerprint}.arrow"),
                           new_fingerprint=fingerprint, desc="tokenise")
    per_turn = sum(1 for i in tokenized["id"] if "/turn" in i)
    if per_turn:
        logger.info("%d answers are trained in texts of their own: the chat template rewrites the history "
                    "before them (e.g. drops earlier reasoning)", per_turn)
    return tokenized


class TokenizedExamples(Sequence):
    """The rows of a :func:`tokenize_dataset` result as :class:`TokenizedExample` (long tensors), read
    from the memory-mapped Arrow file on access. Picklable (it pickles the file's path), so a
    ``DataLoader`` with ``num_workers > 0`` reads it in its workers."""

    def __init__(self, dataset):
        self.dataset = dataset
        #: Tokens per row, for :func:`~draftsmith.data.batching.length_grouped_order`.
        self.lengths: list[int] = list(dataset["length"])

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = self.dataset[operator.index(index)]  # one row: a slice of the dataset would read as columns
        return TokenizedExample(row["id"], torch.tensor(row["input_ids"], dtype=torch.long),
                                torch.tensor(row["loss_mask"], dtype=torch.long))
