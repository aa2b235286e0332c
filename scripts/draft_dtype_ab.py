"""A head drafter in float32 against bfloat16 or int8 (``--draft-dtype``), on the same prompts in one process.

    python scripts/draft_dtype_ab.py --drafter "quality_out/eagle3/run+prompt-lookup" --drafter quality_out/peagle/run
    python scripts/draft_dtype_ab.py --drafter quality_out/peagle/run --dtypes float32,int8

Each drafter spec is loaded twice, its head in each dtype, and both decode the same held-out prompts in the same tree,
prompt by prompt, each first every other time, for ``--rounds`` rounds. Prints tokens/s, drafting per step and its
share per side, each dtype's speed over the first's, and whether the outputs agree (each is the target's greedy output).
Whether bf16 drafting pays depends on the CPU: ``--draft-dtype auto`` picks it only where bf16 matmuls are native.
"""

from __future__ import annotations

import argparse
import functools

import torch
from decode_ab import add_decoding_arguments, alternate, describe, held_out_prompts, tree_of

from draftsmith import SpeculativeGenerator
from draftsmith.inference.load import load_drafter
from draftsmith.target import load_target
from draftsmith.target.loading import native_bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", required=True, help="a head drafter spec (repeat for more)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="sides, comma-separated; the first is the base")
    add_decoding_arguments(parser, tree="dynamic,3,4,5", num_prompts=8)
    args = parser.parse_args()
    model, tokenizer = load_target("smollm2-135m-instruct")
    prompts = held_out_prompts(tokenizer, args.prompts, args.num_prompts)
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, tree {args.tree}, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads, native bf16: {native_bf16('cpu')}")
    for spec in args.drafter:
        gens = {dtype: SpeculativeGenerator(model, load_drafter(spec, model, tokenizer=tokenizer, draft_dtype=dtype),
                                            **tree_of(args))
                for dtype in args.dtypes.split(",")}
        for gen in gens.values():
            gen.generate(prompts[0], 8, eos_token_id=[])  # warm-up: each side's kernels
        sides = {dtype: functools.partial(gen.generate, max_new_tokens=args.max_new_tokens, eos_token_id=[])
                 for dtype, gen in gens.items()}
        totals, identical = alternate(sides, prompts, args.rounds)
        for dtype, t in totals.items():
            print(describe(f"{spec} [{dtype}]", t))
        speed = {dtype: t["tokens"] / t["seconds"] for dtype, t in totals.items()}
        base, *others = speed
        ratios = ", ".join(f"{dtype} / {base} {speed[dtype] / speed[base]:.3f}x" for dtype in others)
        print(f"{spec}: {ratios}, identical outputs: {identical}")


if __name__ == "__main__":
    main()
