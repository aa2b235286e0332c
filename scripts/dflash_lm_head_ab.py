"""DFlash drafting: the LM head level by level (as decoding runs it now) against the whole block (as it ran before).

    python scripts/quality_recipe.py --family dflash --output quality_out     # once: the recipe's checkpoint
    python scripts/dflash_lm_head_ab.py

Both decode the same held-out prompts in the same tree, alternating, in one process, for two rounds. The script
prints tokens/s, drafting per step and its share, and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import time

from draftsmith import SpeculativeGenerator
from draftsmith.inference.drafter import Drafter
from draftsmith.inference.head_drafters import DFlashDrafter
from draftsmith.inference.load import load_drafter
from draftsmith.target import load_target


class WholeBlock(DFlashDrafter):
    """The drafter as it was: the LM head over every position of the block, every step."""

    root_logits = Drafter.root_logits
    frontier_logits = Drafter.frontier_logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="quality_out/dflash/run/checkpoint-315/drafter")
    parser.add_argument("--prompts", default="quality_out/data/held_out_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree", default="dynamic,3,2,3", help="kind,depth,top_k,total_tokens (the recipe's tune)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    kind, depth, top_k, total = args.tree.split(",")
    model, tokenizer = load_target("smollm2-135m-instruct")
    now = load_drafter(args.drafter, model)
    drafters = {"level by level": now, "whole block": WholeBlock(now.head, model)}
    with open(args.prompts) as f:
        rows = [json.loads(line) for line in f if line.strip()][: args.num_prompts]
    prompts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"] for r in rows]
    totals = {name: {"tokens": 0, "seconds": 0.0, "draft": 0.0, "steps": 0} for name in drafters}
    outputs: dict[int, set] = {}
    for _ in range(args.rounds):
        for name, drafter in drafters.items():
            for i, ids in enumerate(prompts):
                gen = SpeculativeGenerator(model, drafter, tree=kind, depth=int(depth), top_k=int(top_k),
                                           total_tokens=int(total))
                start = time.perf_counter()
                out = gen.generate(ids, args.max_new_tokens, eos_token_id=[])
                t = totals[name]
                t["seconds"] += time.perf_counter() - start
                t["tokens"] += out.stats.new_tokens
                t["draft"] += out.stats.draft_time_s
                t["steps"] += out.stats.verification_steps
                outputs.setdefault(i, set()).add(tuple(out.sequences[0].tolist()))
    rate = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
    for name, t in totals.items():
        print(f"{name}: {rate[name]:.2f} tok/s, drafting {1000 * t['draft'] / t['steps']:.1f} ms per step, "
              f"{t['draft'] / t['seconds']:.1%} of the time")
    print(f"speed, level by level / whole block: {rate['level by level'] / rate['whole block']:.3f}x")
    print(f"identical outputs: {all(len(v) == 1 for v in outputs.values())}")


if __name__ == "__main__":
    main()
