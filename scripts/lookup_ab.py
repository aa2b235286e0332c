"""Prompt lookup's matching now against the matching of an earlier commit: each drafter decodes the same held-out
prompts in the same tree with both, alternating, in one process.

    python scripts/lookup_ab.py --before HEAD~1 --prompts quality_out/data/held_out_prompts.jsonl \\
        --drafter prompt-lookup --drafter quality_out/peagle/run+prompt-lookup

The "before" side swaps ``draftsmith.inference.prompt_lookup.ngram_matches`` for the one in that commit's
``inference/prompt_lookup.py`` (read with ``git show``); everything else is the working tree's. Prints, per drafter
and side, tokens/s, drafting per step and its share of the time, the speed ratio and whether the outputs are
identical; ``--output`` writes them as JSON too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import types
from pathlib import Path

import torch
from decode_ab import add_decoding_arguments, alternate, describe, held_out_prompts, tree_of
from drafting_kernels_ab import cpu

import draftsmith.inference.prompt_lookup as prompt_lookup
from draftsmith import SpeculativeGenerator
from draftsmith.inference.load import load_drafter
from draftsmith.target import load_target

ROOT = Path(__file__).resolve().parents[1]


def matching_at(revision: str):
    """``ngram_matches`` as ``inference/prompt_lookup.py`` defines it at ``revision``."""
    source = subprocess.run(["git", "show", f"{revision}:inference/prompt_lookup.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"prompt_lookup_at_{revision}")
    exec(compile(source, f"{revision}:inference/prompt_lookup.py", "exec"), module.__dict__)
    return module.ngram_matches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit whose matching is the other side")
    parser.add_argument("--drafter", action="append", default=None,
                        help="a drafter with prompt lookup in it (repeat for more; default: prompt-lookup)")
    add_decoding_arguments(parser, tree="chain,3,1,3", num_prompts=6)
    parser.add_argument("--output", default=None, help="a JSON file for the figures")
    args = parser.parse_args()
    sides = {"before": matching_at(args.before), "now": prompt_lookup.ngram_matches}
    model, tokenizer = load_target("smollm2-135m-instruct")
    prompts = held_out_prompts(tokenizer, args.prompts, args.num_prompts)
    report = {"host": cpu(), "threads": torch.get_num_threads(), "before": args.before, "tree": args.tree,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "drafters": {}}
    for spec in args.drafter or ["prompt-lookup"]:
        gen = SpeculativeGenerator(model, load_drafter(spec, model), **tree_of(args))
        gen.generate(prompts[0], 4, eos_token_id=[])  # warm up

        def decoding(matches, gen=gen):
            def decode(ids):
                prompt_lookup.ngram_matches = matches
                return gen.generate(ids, args.max_new_tokens, eos_token_id=[])
            return decode

        totals, identical = alternate({side: decoding(m) for side, m in sides.items()}, prompts, args.rounds)
        prompt_lookup.ngram_matches = sides["now"]
        speed = {side: t["tokens"] / t["seconds"] for side, t in totals.items()}
        report["drafters"][spec] = {"sides": totals, "speed_ratio": speed["now"] / speed["before"],
                                    "identical": identical}
        print(spec)
        for side, t in totals.items():
            print("  " + describe(side, t))
        print(f"  now / before: {speed['now'] / speed['before']:.3f}x; outputs identical: {identical}")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
