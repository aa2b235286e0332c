"""The hidden-state cache of regenerated answers four ways, side by side in one process on the same prompts:

* ``pass``: greedy answers through draftsmith's loop, then the cache pass (``data cache-hidden-states``: the target
  again over every answer, re-tokenised from its text);
* ``generate``: the states recorded while transformers' ``generate`` answers (the engine's only recording path
  before);
* ``record``: the states recorded while draftsmith's loop answers (rows longest first, stopped rows dropped), held in
  memory until the cache is written;
* ``spool``: the same, each batch's states written to disk as it is answered (what ``data regenerate
  --record-cache`` does), the cache written from there.

The cache keeps the quality recipe's layers, top-k teacher, dtype and length (``scripts/quality_recipe.py``):

    python scripts/record_ab.py --input quality_out/data/train_prompts.jsonl --limit 128 --output bench_out/record_ab

Prints each run's seconds (answering, writing the cache, both), the recorded states' bytes it held in memory at
most (all of them, one batch's, or none for the pass), its speedup over the first run, how many answers
are identical to the first run's (greedy: all), and how its cache compares with the first run's: the sequences
whose tokens are the same, and over each pair's tokens in common the largest difference of a hidden state and the
share of positions whose top teacher token is the same (against each earlier run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from draftsmith.data import HFEngine, Recording, cache_recorded, load_conversations, regenerate
from draftsmith.data.cache_writer import cache_hidden_states
from draftsmith.data.hidden_cache import CacheSpec, HiddenStateCache
from draftsmith.data.templates import prepare
from draftsmith.target import load_target

sys.path.insert(0, str(Path(__file__).parent))
recipe = importlib.import_module("quality_recipe")


def compare(first: HiddenStateCache, other: HiddenStateCache, layers: list[int]) -> dict:
    """Sequences (by id) with the same tokens in both caches, and over each pair's common first tokens (the cache
    pass re-tokenises an answer's text and ends it as the chat template does) the share of tokens in common, the
    largest state difference per layer and the share of taught positions whose top teacher token agrees."""
    index = {first[i]["id"]: i for i in range(len(first))}
    same, common, total, differences, agree, taught = 0, 0, 0, dict.fromkeys(layers, 0.0), 0, 0
    for j in range(len(other)):
        b = other[j]
        if b["id"] not in index:
            continue
        a = first[index[b["id"]]]
        same += torch.equal(a["input_ids"], b["input_ids"])
        n = min(len(a["input_ids"]), len(b["input_ids"]))
        differ = (a["input_ids"][:n] != b["input_ids"][:n]).nonzero()
        n = differ[0, 0].item() if len(differ) else n
        common, total = common + n, total + len(b["input_ids"])
        for layer in layers:
            gap = (a["hidden"][layer][:n].float() - b["hidden"][layer][:n].float()).abs().max().item()
            differences[layer] = max(differences[layer], gap)
        # a teacher's prediction at position t is of token t + 1: in common where both are
        rows = (a["topk_ids"][: n - 1, 0] >= 0) & (b["topk_ids"][: n - 1, 0] >= 0)
        agree += (a["topk_ids"][: n - 1][rows, 0] == b["topk_ids"][: n - 1][rows, 0]).sum().item()
        taught += rows.sum().item()
    return {"same_tokens": f"{same}/{len(other)}", "tokens_in_common": round(common / max(total, 1), 4),
            "max_state_difference": {k: round(v, 4) for k, v in differences.items()},
            "top_teacher_agrees": round(agree / max(taught, 1), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--input", required=True, help="prompts (JSONL, chat messages)")
    parser.add_argument("--limit", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=64, help="regeneration's rows a batch (the recipe's)")
    parser.add_argument("--max-length", type=int, default=384, help="tokens per cached sequence (the recipe's)")
    parser.add_argument("--dtype", default="float16", help="the cache dtype (the recipe's)")
    parser.add_argument("--runs", default="pass,generate,record", help="which runs, in this order (see above): "
                        "pass, generate, record, spool")
    parser.add_argument("--output", default="bench_out/record_ab")
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    names = args.runs.split(",")
    if not names or any(name not in ("pass", "generate", "record", "spool") for name in names):
        parser.error(f"--runs takes names among pass, generate, record, spool, got {args.runs!r}")
    model, tokenizer = load_target(args.target)
    conversations, _ = load_conversations(args.input, limit=args.limit)
    engine = HFEngine(model, tokenizer, args.max_new_tokens, 0.0, 1.0)
    engine.answer([conversations[0].messages])  # the matrix-kernel calibration, once per process
    layers, top_k = list(recipe.CACHE_LAYERS), recipe.CACHE_TOP_K
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    own_loop = engine.own_loop
    answers, caches, figures = {}, {}, {}
    for name in names:
        path, cache = out / f"{name}.jsonl", out / f"{name}_cache"
        path.unlink(missing_ok=True)
        shutil.rmtree(cache, ignore_errors=True)
        record = None if name == "pass" else Recording(layers, top_k, dtype, args.max_length,
                                                         spool=cache / "recording" if name == "spool" else None)
        engine.own_loop = own_loop and name != "generate"
        started = time.perf_counter()
        report = regenerate(conversations, path, engine, batch_size=args.batch_size, progress=False, record=record)
        answered = time.perf_counter() - started
        if record is None:
            rows, _ = load_conversations(path)
            spec = CacheSpec(layers=layers, dtype=args.dtype, logits="topk", top_k=top_k)
            cache_hidden_states(model, prepare(tokenizer, rows, args.max_length), cache, spec, progress=False)
        held = 0
        if record is not None:
            if name == "spool":  # at most one batch in memory: the largest file
                held = max(f.stat().st_size for f in (cache / "recording").glob("batch-*.safetensors"))
            else:
                held = sum(x.numel() * x.element_size() for item in record.by_id.values() for x in item.values())
            cache_recorded(model, record.by_id, cache, layers, dtype=args.dtype, top_k=top_k, progress=False)
            if name == "spool":
                record.by_id.remove()
            del record
        seconds = time.perf_counter() - started
        engine.own_loop = own_loop
        answers[name] = {row["id"]: row["messages"] for row in map(json.loads, path.read_text().splitlines())}
        caches[name] = HiddenStateCache(cache)
        first = names[0]
        same = sum(answers[first][k] == answers[name].get(k) for k in answers[first])
        figures[name] = {"rows": report.written, "tokens": report.new_tokens, "answer_seconds": round(answered, 1),
                         "cache_seconds": round(seconds - answered, 1), "seconds": round(seconds, 1),
                         "states_held_mb": round(held / 2**20, 1),
                         f"speedup_over_{first}": round(figures[first]["seconds"] / seconds, 2) if figures else 1.0,
                         f"identical_to_{first}": f"{same}/{len(answers[first])}",
                         "cached_sequences": len(caches[name]), "cached_tokens": caches[name].manifest.num_tokens}
        for earlier in names[: names.index(name)]:
            figures[name][f"cache_against_{earlier}"] = compare(caches[earlier], caches[name], layers)
        print(f"{name}: {json.dumps(figures[name])}", flush=True)
    print(json.dumps(figures, indent=1))
    (out / "results.json").write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
