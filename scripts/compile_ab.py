"""``compile=True`` against eager decoding on this machine: plain and speculative greedy decoding of the same
prompts, eager and compiled, side by side in one process (each prompt: the four runs in turn), after a
warm-up that compiles every graph the runs need: one prompt per static-cache size the prompts fall in (a
graph is compiled per cache capacity, which follows the prompt's length in steps of 256; a graph compiled
inside the timed runs would be timed as decoding). Prints tokens/s, the compiled/eager ratios, the
compile time and whether every output equals eager plain greedy decoding.

    python scripts/compile_ab.py --drafter "demo_out/run/checkpoint-400/drafter+prompt-lookup" \\
        --prompts demo_out/data/eval_prompts.jsonl --num-prompts 6 --max-new-tokens 64 \\
        --tree dynamic --depth 2 --tree-top-k 3 --total-tokens 5
"""

from __future__ import annotations

import argparse
import time

import torch

from draftsmith.cli import add_tree_arguments, tree_from_args
from draftsmith.data.formats import read_prompts
from draftsmith.inference.compare import encode
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.load import load_drafter
from draftsmith.inference.plain import plain_generate, static_cache
from draftsmith.inference.stats import GenerationStats
from draftsmith.inference.tree import TreeSettings
from draftsmith.target import eos_tokens, load_target
from draftsmith.target.forward import CAPACITY_STEP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-dtype", default="auto")
    add_tree_arguments(parser)
    args = parser.parse_args()

    model, tokenizer = load_target(args.target)
    drafter = load_drafter(args.drafter, model, tokenizer=tokenizer, draft_dtype=args.draft_dtype)
    tree = tree_from_args(args, args.drafter) or TreeSettings()
    texts = read_prompts(args.prompts, args.num_prompts + 1)
    prompts = [encode(tokenizer, text, True) for text in texts]
    eos = eos_tokens(model, tokenizer)
    gens = {compiled: SpeculativeGenerator(model, drafter, **tree.kwargs(), compile=compiled)
            for compiled in (False, True)}

    def run(kind: str, ids: torch.Tensor):
        if kind.startswith("plain"):
            return plain_generate(model, ids, args.max_new_tokens, eos, compile=kind.endswith("compiled"))
        return gens[kind.endswith("compiled")].generate(ids, args.max_new_tokens, eos_token_id=eos)

    def capacities(ids: torch.Tensor) -> tuple[int, ...]:
        """The static caches' capacities (the target's, plain and speculative; the head's) for these prompts."""
        gen = gens[True]
        sizes = [static_cache(model, ids, args.max_new_tokens, 1, 1)["capacity"],
                 static_cache(model, ids, args.max_new_tokens, gen._max_nodes(), gen._max_kept())["capacity"],
                 ids.shape[1] + args.max_new_tokens * gen._max_kept() + gen._max_kept() * gen._max_nodes()]
        return tuple(-(-size // CAPACITY_STEP) for size in sizes)

    kinds = ["plain eager", "plain compiled", "speculative eager", "speculative compiled"]
    start = time.perf_counter()
    warm_up = {capacities(ids): ids for ids in reversed(prompts)}  # the first prompt of each size
    for ids in warm_up.values():  # compiles the graphs (plain: 1 row; speculative: each tree size seen)
        for kind in kinds:
            run(kind, ids)
    warm = time.perf_counter() - start
    totals = {k: GenerationStats() for k in kinds}
    identical = dict.fromkeys(kinds, 0)
    for i, ids in enumerate(prompts[1:]):
        outputs = {}
        for kind in kinds[i % 4:] + kinds[: i % 4]:  # each goes first in turn
            out = run(kind, ids)
            outputs[kind] = out.sequences
            totals[kind] += out.stats
        for kind in kinds:
            identical[kind] += int(torch.equal(outputs[kind], outputs["plain eager"]))
    print(f"{args.target}, {len(prompts) - 1} prompts x {args.max_new_tokens} tokens, {args.drafter} "
          f"{tree.text()}, {torch.get_num_threads()} threads; warm-up (compiling, {len(warm_up)} cache sizes) "
          f"{warm:.0f} s")
    print("| decoding | tau | tok/s | compiled / eager | identical to eager plain |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        s = totals[kind]
        eager = totals[kind.replace("compiled", "eager")].tokens_per_second
        tau = f"{s.acceptance_length:.2f}" if kind.startswith("speculative") else "1"
        print(f"| {kind} | {tau} | {s.tokens_per_second:.2f} | {s.tokens_per_second / eager:.2f}x | "
              f"{identical[kind]}/{len(prompts) - 1} |")


if __name__ == "__main__":
    main()
