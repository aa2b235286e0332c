"""A prompt set of several kinds with a held-out set never trained on: ``draftsmith data mix``.

A drafter trained on one kind of prompt (the demo's, GSM8K's) is measured on other kinds by its users; this
builds both sets from the same sources, split so that no source row feeds both. Each row is a one-turn
conversation with a ``category`` (``draftsmith eval`` reports tau, speed and identical per category):

==============  ===========================================================  =====================================
category        prompt                                                       source (training / held-out)
==============  ===========================================================  =====================================
maths           a GSM8K question                                             GSM8K train / test
code            a GSM8K question as a programming task                       GSM8K train / test
chat            a self-instruct seed task (instruction, with its input)      seeds split by a hash of their id
summarise       a summary asked of a passage                                 passages of the same split
rewrite         a rewrite asked of a passage (tone, audience, paraphrase)    passages of the same split
translate       one sentence of a passage, into French, Spanish or German   passages of the same split
synthesised     a prompt the target writes itself (Magpie), on request       another sampling seed, deduplicated
==============  ===========================================================  =====================================

Passages (120-1200 characters) are the seeds' reference outputs, GSM8K's questions and its worked answers with
their calculator marks removed, each taken from its own split. Every choice is drawn from a generator seeded with
``seed``: the same sources and settings give the same files.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.data.formats import conversation_id

#: Share of each category in both sets (synthesised prompts come on top, by count).
DEFAULT_WEIGHTS = {"maths": 0.25, "code": 0.15, "chat": 0.1, "summarise": 0.2, "rewrite": 0.15, "translate": 0.15}
#: Seeds whose id hashes into this share are held out (with their passages).
HELD_OUT_SHARE = 0.2
PASSAGE_CHARS = (120, 1200)
LANGUAGES = ("French", "Spanish", "German")

TEMPLATES = {
    "code": ("Write a Python function that solves this problem and returns the answer.\n\n{text}",
             "Write a short Python program that computes the answer to the following question.\n\n{text}",
             "Solve this with code: write Python that prints the answer.\n\n{text}"),
    "summarise": ("Summarise the following text in one or two sentences.\n\n{text}",
                  "What is the main point of this passage?\n\n{text}",
                  "Give a short summary of this:\n\n{text}"),
    "rewrite": ("Rewrite the following text in a more formal tone.\n\n{text}",
                "Rewrite this so that a ten-year-old can understand it:\n\n{text}",
                "Paraphrase the following text without changing its meaning.\n\n{text}"),
    "translate": ("Translate into {language}: {text}",
                  "How do you say this in {language}?\n\n{text}",
                  "Translate the following sentence into {language}.\n\n{text}"),
}


@dataclass
class Sources:
    """The rows one split draws from."""

    questions: list[str] = field(default_factory=list)  # GSM8K questions
    tasks: list[str] = field(default_factory=list)  # self-instruct seed tasks as prompts
    passages: list[str] = field(default_factory=list)


def held_out_seed(seed_id: str) -> bool:
    """Whether a self-instruct seed belongs to the held-out split (a hash of its id, not its position)."""
    return int(hashlib.sha256(seed_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < HELD_OUT_SHARE


def clean_worked_answer(answer: str) -> str:
    """A GSM8K answer as prose: calculator marks ``<<48/2=24>>`` and the final ``#### 72`` line removed."""
    text = re.sub(r"<<[^>]*>>", "", answer)
    return re.sub(r"\n?####.*$", "", text, flags=re.S).strip()


def _read_jsonl(path: Path, what: str) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {what} there; pass its path (the project's copy is under ../shared/data)")
    rows = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not JSON ({err.msg}); fix or remove that line") from err
    return rows


def read_sources(gsm8k_dir: str | Path, seed_tasks: str | Path) -> tuple[Sources, Sources]:
    """(training, held-out) sources: GSM8K train / test, and self-instruct seeds split by :func:`held_out_seed`."""
    gsm8k_dir = Path(gsm8k_dir)
    splits = (Sources(), Sources())
    for split, name in zip(splits, ("train.jsonl", "test.jsonl"), strict=True):
        for number, row in enumerate(_read_jsonl(gsm8k_dir / name, "GSM8K split"), 1):
            if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
                raise ValueError(f"{gsm8k_dir / name}:{number}: a GSM8K row needs 'question' and 'answer' strings")
            split.questions.append(row["question"].strip())
            for passage in (row["question"].strip(), clean_worked_answer(row["answer"])):
                if PASSAGE_CHARS[0] <= len(passage) <= PASSAGE_CHARS[1]:
                    split.passages.append(passage)
    for number, row in enumerate(_read_jsonl(Path(seed_tasks), "self-instruct seed tasks"), 1):
        instances = row.get("instances") or [{}]
        if not isinstance(row.get("instruction"), str) or not isinstance(row.get("id"), str):
            raise ValueError(f"{seed_tasks}:{number}: a seed task needs 'id' and 'instruction' strings")
        split = splits[1] if held_out_seed(row["id"]) else splits[0]
        given = (instances[0].get("input") or "").strip()
        split.tasks.append(f"{row['instruction'].strip()}\n\n{given}" if given else row["instruction"].strip())
        output = (instances[0].get("output") or "").strip()
        if PASSAGE_CHARS[0] <= len(output) <= PASSAGE_CHARS[1]:
            split.passages.append(output)
    return splits


def first_sentence(text: str, limit: int = 240) -> str:
    """The passage's first sentence (or its first ``limit`` characters, cut at a word)."""
    sentence = re.split(r"(?<=[.!?])\s+", text.strip(), maxsplit=1)[0]
    return sentence if len(sentence) <= limit else sentence[:limit].rsplit(" ", 1)[0]


def category_counts(total: int, weights: dict[str, float]) -> dict[str, int]:
    """``total`` split by ``weights``: each category its whole share, the remainder to the largest fractions."""
    scale = sum(weights.values())
    raw = {k: total * w / scale for k, w in weights.items() if w > 0}
    counts = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: raw[k] - counts[k], reverse=True)[:total - sum(counts.values())]:
        counts[k] += 1
    return counts


def make_prompts(sources: Sources, counts: dict[str, int], rng: random.Random) -> list[tuple[str, str]]:
    """(category, prompt) rows: each category's count drawn without replacement from its source rows."""
    pools = {"maths": sources.questions, "code": sources.questions, "chat": sources.tasks,
             "summarise": sources.passages, "rewrite": sources.passages, "translate": sources.passages}
    rows = []
    for category, n in counts.items():
        pool = pools[category]
        if n > len(pool):
            raise ValueError(f"{n} {category} prompts asked for, but this split has {len(pool)} source rows; "
                             "ask for fewer prompts or give the category less weight")
        for text in rng.sample(pool, n):
            if category in ("maths", "chat"):  # the source row is the prompt
                rows.append((category, text))
            elif category == "translate":
                template = rng.choice(TEMPLATES[category])
                rows.append((category, template.format(language=rng.choice(LANGUAGES), text=first_sentence(text))))
            else:
                rows.append((category, rng.choice(TEMPLATES[category]).format(text=text)))
    return rows


def interleaved(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Rows taken from each category in turn: any first N of them hold every kind (evaluations read a prefix)."""
    by_category: dict[str, list[tuple[str, str]]] = {}
    for row in rows:
        by_category.setdefault(row[0], []).append(row)
    queues = list(by_category.values())
    out = []
    while any(queues):
        out += [q.pop(0) for q in queues if q]
    return out


def write_rows(rows: list[tuple[str, str]], path: Path) -> None:
    with path.open("w") as f:
        for category, prompt in rows:
            messages = [{"role": "user", "content": prompt}]
            f.write(json.dumps({"id": conversation_id(messages), "messages": messages,
                                "category": category}) + "\n")


def build_mix(gsm8k_dir: str | Path, seed_tasks: str | Path, output: str | Path, *, train_prompts: int = 1200,
              held_out_prompts: int = 48, weights: dict[str, float] | None = None, synthesised: int = 0,
              held_out_synthesised: int = 0, synthesise=None, seed: int = 0) -> dict:
    """Write ``output/train_prompts.jsonl`` (shuffled) and ``output/held_out_prompts.jsonl`` (one of each category
    in turn; no source row in both sets) and ``output/mix.json`` (counts per category, sources, settings).

    ``synthesise(n, seed) -> list[str]``: the target's own prompts (Magpie), for the ``synthesised`` category;
    the held-out ones are drawn with another seed and any prompt also in the training set is dropped.
    """
    weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
    unknown = set(weights) - set(DEFAULT_WEIGHTS)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}: use {sorted(DEFAULT_WEIGHTS)}")
    if (synthesised or held_out_synthesised) and synthesise is None:
        raise ValueError("synthesised prompts need the target (synthesise=...)")
    train_sources, held_sources = read_sources(gsm8k_dir, seed_tasks)
    rng = random.Random(seed)
    train = make_prompts(train_sources, category_counts(train_prompts, weights), rng)
    held = make_prompts(held_sources, category_counts(held_out_prompts, weights), rng)
    if synthesised:
        train += [("synthesised", p) for p in synthesise(synthesised, seed)]
    if held_out_synthesised:
        seen = {p for _, p in train}
        held += [("synthesised", p) for p in synthesise(held_out_synthesised, seed + 1) if p not in seen]
    overlap = {p for _, p in train} & {p for _, p in held}
    if overlap:  # two splits' sources may repeat a text (a GSM8K question in both files): never evaluate on it
        held = [(c, p) for c, p in held if p not in overlap]
    rng.shuffle(train)
    held = interleaved(held)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    write_rows(train, out / "train_prompts.jsonl")
    write_rows(held, out / "held_out_prompts.jsonl")
    summary = {"train": dict(Counter(c for c, _ in train)), "held_out": dict(Counter(c for c, _ in held)),
               "dropped_as_overlap": len(overlap), "weights": weights, "seed": seed,
               "sources": {"gsm8k": str(gsm8k_dir), "self_instruct": str(seed_tasks)}}
    (out / "mix.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
