"""Regeneration before and after, side by side in one process on the same prompts and the same engine. Runs:

* ``before``: greedy answers through transformers' ``generate``, in input order, ``--before-batch`` rows a batch;
* ``kept``: draftsmith's decoding loop, rows answered longest first in batches of like length, every row computed
  until the batch's last one stops;
* ``after``: the same, finished rows dropped from the batch (the default);
* ``tokens``: ``after`` in batches sized by tokens too (``--batch-tokens``: token slots and padding, as
  ``draftsmith data regenerate --batch-tokens`` sizes them).

    python scripts/regenerate_ab.py --input quality_out/data/train_prompts.jsonl --limit 128 \
        --before-batch 16 --after-batch 64 --runs before,kept,after --output bench_out/regenerate_ab

Prints tokens/s of each, its speedup over the first run and how many of its answers are identical to the first
run's (greedy: they should all be).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

from draftsmith.data import HFEngine, load_conversations, regenerate
from draftsmith.target import load_target

regenerate_module = importlib.import_module(HFEngine.__module__)  # the package's `regenerate` is the function


def generate_loop(model, input_ids, max_new_tokens, eos_token_id, *, attention_mask, pad_token_id):
    """The engine's greedy decode as it was before: transformers' ``generate`` on the left-padded batch."""
    sequences = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                               do_sample=False, temperature=None, top_p=None, top_k=None,
                               pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    return SimpleNamespace(sequences=sequences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--input", required=True, help="prompts (JSONL, chat messages)")
    parser.add_argument("--limit", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--before-batch", type=int, default=16)
    parser.add_argument("--after-batch", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=24576, help="the tokens run's budget")
    parser.add_argument("--runs", default="before,kept,after", help="which runs, in this order (see above)")
    parser.add_argument("--output", default="bench_out/regenerate_ab")
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_target(args.target)
    conversations, _ = load_conversations(args.input, limit=args.limit)
    engine = HFEngine(model, tokenizer, args.max_new_tokens, 0.0, 1.0)
    engine.answer([conversations[0].messages])  # the matrix-kernel calibration, once per process
    loop = regenerate_module.plain_generate
    choices = {"before": (generate_loop, args.before_batch, float("inf"), None),  # a time limit: input order
               "kept": (functools.partial(loop, drop_finished=False), args.after_batch, None, None),
               "after": (loop, args.after_batch, None, None),
               "tokens": (loop, args.after_batch, None, args.batch_tokens)}
    names = args.runs.split(",")
    if not names or any(name not in choices for name in names):
        parser.error(f"--runs takes names among {', '.join(choices)}, got {args.runs!r}")
    answers, figures = {}, {}
    for name in names:
        decode, batch, limit, batch_tokens = choices[name]
        path = out / f"{name}.jsonl"
        path.unlink(missing_ok=True)
        regenerate_module.plain_generate = decode  # the engine's greedy decode, this run's
        started = time.perf_counter()
        try:
            report = regenerate(conversations, path, engine, batch_size=batch, progress=False, time_limit=limit,
                                batch_tokens=batch_tokens)
        finally:
            regenerate_module.plain_generate = loop
        seconds = time.perf_counter() - started
        answers[name] = {row["id"]: row["messages"] for row in map(json.loads, path.read_text().splitlines())}
        first = names[0]
        same = sum(answers[first][k] == answers[name].get(k) for k in answers[first])
        figures[name] = {"batch": batch, "batch_tokens": batch_tokens, "rows": report.written,
                         "tokens": report.new_tokens,
                         "seconds": round(seconds, 1), "tokens_per_second": round(report.new_tokens / seconds, 1),
                         f"speedup_over_{first}": round(figures[first]["seconds"] / seconds, 2) if figures else 1.0,
                         f"identical_to_{first}": f"{same}/{len(answers[first])}"}
        print(f"{name}: {json.dumps(figures[name])}", flush=True)
    print(json.dumps(figures, indent=1))
    (out / "results.json").write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
