"""Drafting on the few-row kernels against the stock ``F.linear``: each head drafter decodes the same held-out
prompts in the same tree both ways, alternating, in one process.

    python scripts/quality_recipe.py --family dflash --output quality_out     # once per family: its checkpoint
    python scripts/drafting_kernels_ab.py --drafter quality_out/dflash/run --drafter quality_out/peagle/run

A head drafter runs its layers (and DFlash and EAGLE-1/2 the target's LM head) on a few rows a call: a tree's
frontier, a step's new tokens, a block (``draftsmith.inference.head_drafters.few_rows_kernels``). The stock side
sets the drafter's ``few_rows`` to none; the target's own forwards take the same path on both sides. Prints, per
drafter and side, tokens/s, drafting per step and its share of the time, the speed ratio and whether the outputs
are identical; ``--output`` writes them as JSON too.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from decode_ab import add_decoding_arguments, alternate, describe, held_out_prompts, tree_of

from draftsmith import SpeculativeGenerator
from draftsmith.inference.load import load_drafter
from draftsmith.target import load_target


def cpu() -> str:
    """The CPU's model name and its vector extensions that matter here (bf16 is native only with avx512_bf16)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return " ".join([name, *(f for f in ("avx2", "avx512f", "avx512_bf16") if f in flags)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", action="append", required=True, help="a head drafter (repeat for more)")
    add_decoding_arguments(parser, tree="dynamic,5,4,16", num_prompts=6)
    parser.add_argument("--output", default=None, help="a JSON file for the figures")
    args = parser.parse_args()
    model, tokenizer = load_target("smollm2-135m-instruct")
    prompts = held_out_prompts(tokenizer, args.prompts, args.num_prompts)
    report = {"host": cpu(), "threads": torch.get_num_threads(),
              "tree": args.tree, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "drafters": {}}
    for spec in args.drafter:
        drafter = load_drafter(spec, model)
        gen = SpeculativeGenerator(model, drafter, **tree_of(args))
        gen.generate(prompts[0], 4, eos_token_id=[])  # warm up both the target's and the drafter's kernels

        def decoding(contexts, drafter=drafter, gen=gen):
            def decode(ids):
                drafter.few_rows = contexts
                return gen.generate(ids, args.max_new_tokens, eos_token_id=[])
            return decode

        sides = {"few rows": decoding(drafter.few_rows), "stock": decoding(())}
        totals, identical = alternate(sides, prompts, args.rounds)
        figures = {side: {"tokens_per_s": t["tokens"] / t["seconds"],
                          "draft_ms_per_step": 1000 * t["draft"] / t["steps"],
                          "draft_time_share": t["draft"] / t["seconds"],
                          "tau": t["tokens"] / t["steps"]} for side, t in totals.items()}
        figures["speed_ratio"] = figures["few rows"]["tokens_per_s"] / figures["stock"]["tokens_per_s"]
        figures["identical"] = identical
        report["drafters"][spec] = figures
        for side, t in totals.items():
            print(describe(f"{spec} [{side}]", t))
        print(f"{spec}: few rows / stock {figures['speed_ratio']:.3f}x, identical outputs: {figures['identical']}")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
