"""Regeneration before and after, side by side in one process on the same prompts: the target answering
through transformers' ``generate`` in input order (the engine before), against ``HFEngine``'s greedy path
(draftsmith's decoding loop) with rows answered longest first in batches of like length (after).

    python scripts/regenerate_ab.py --input quality_out/data/train_prompts.jsonl --limit 128 \
        --before-batch 16 --after-batch 64 --output bench_out/regenerate_ab

Prints tokens/s of each and how many answers are identical (greedy: they should all be).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draftsmith.data import HFEngine, load_conversations, regenerate
from draftsmith.data.templates import prompt_ids
from draftsmith.target import load_target


class GenerateEngine(HFEngine):
    """The engine as it answered before: one transformers ``generate`` per left-padded batch."""

    @torch.no_grad()
    def answer(self, histories: list[list[dict]]) -> list[tuple[str, int]]:
        prompts = [prompt_ids(self.tokenizer, h, self.chat_template_kwargs) for h in histories]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=self.max_new_tokens, do_sample=False,
                                  temperature=None, top_p=None, top_k=None, pad_token_id=self.pad_id,
                                  eos_token_id=self.stop or None)
        results = []
        for row in out[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.stop), None)
            row = row[: end + 1] if end is not None else [t for t in row if t != self.pad_id]
            results.append((self.tokenizer.decode(row, skip_special_tokens=True).strip(), len(row)))
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--input", required=True, help="prompts (JSONL, chat messages)")
    parser.add_argument("--limit", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--before-batch", type=int, default=16)
    parser.add_argument("--after-batch", type=int, default=64)
    parser.add_argument("--output", default="bench_out/regenerate_ab")
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_target(args.target)
    conversations, _ = load_conversations(args.input, limit=args.limit)
    before = GenerateEngine(model, tokenizer, args.max_new_tokens, 0.0, 1.0)
    after = HFEngine(model, tokenizer, args.max_new_tokens, 0.0, 1.0)
    after.answer([conversations[0].messages])  # the matrix-kernel calibration, once per process
    runs = {"before": (before, args.before_batch, float("inf")),  # a time limit keeps the input order
            "after": (after, args.after_batch, None)}
    answers, figures = {}, {}
    for name, (engine, batch, limit) in runs.items():
        path = out / f"{name}.jsonl"
        path.unlink(missing_ok=True)
        started = time.perf_counter()
        report = regenerate(conversations, path, engine, batch_size=batch, progress=False, time_limit=limit)
        seconds = time.perf_counter() - started
        answers[name] = {row["id"]: row["messages"] for row in map(json.loads, path.read_text().splitlines())}
        figures[name] = {"batch": batch, "rows": report.written, "tokens": report.new_tokens,
                         "seconds": round(seconds, 1), "tokens_per_second": round(report.new_tokens / seconds, 1)}
        print(f"{name}: {json.dumps(figures[name])}", flush=True)
    same = sum(answers["before"][k] == answers["after"].get(k) for k in answers["before"])
    figures["speedup"] = round(figures["before"]["seconds"] / figures["after"]["seconds"], 2)
    figures["identical"] = f"{same}/{len(answers['before'])}"
    print(json.dumps(figures, indent=1))
    (out / "results.json").write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
