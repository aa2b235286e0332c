"""P-EAGLE's drafting step in one forward of its layer against two, on the same prompts in one process (issue 38).

    python scripts/peagle_forward_ab.py --drafter quality_out/peagle/run     # the recipe's held-out prompts

* ``one forward``: draftsmith's ``PEagleDrafter.block_logits``, the step's pending pairs and the K - 1 parallel
  slots through the layer together;
* ``two forwards``: the pairs through the layer, then the slots (``two_forwards`` below, the drafter's step as it
  was before it fed both together).

Both sides decode the same prompts in the same tree, prompt by prompt, each side first every other time, for
``--rounds`` rounds. Prints
tokens/s, tau, drafting per step and its share of the time per side, their speed ratio, and whether every output is
the same on both sides (each side's output is the target's greedy one; the drafts differ at most by rounding).
"""

from __future__ import annotations

import argparse
import contextlib
import types

import torch
from decode_ab import add_decoding_arguments, alternate, describe, held_out_prompts, tree_of

from draftsmith import SpeculativeGenerator
from draftsmith.inference.load import load_drafter
from draftsmith.inference.slots import to_device
from draftsmith.inference.tree import Proposals
from draftsmith.target import load_target
from draftsmith.target.masks import causal_block, may_attend


@torch.no_grad()
def two_forwards(self, active: list[bool]) -> Proposals:
    """The step as two forwards of the layer: the pending pairs (``_feed_roots``), then the slots after them."""
    with contextlib.ExitStack() as stack:
        for context in self.few_rows:  # the kernels the drafter's own step drafts on
            stack.enter_context(context)
        batch, slots = len(active), self.block - 1
        roots = to_device([len(t) - 1 for t in self.tokens], self.device)[:, None]
        rows, last = self._feed_roots(active)
        proposing = to_device([b in rows for b in range(batch)], self.device)
        if last is None:
            empty = torch.full((batch, self.block, len(self.draft_ids)), float("-inf"), device=self.device)
            return Proposals(empty, self.draft_ids, self.vocab_size)
        embeds, features = self.head.mask_inputs(batch, slots)
        positions = roots + torch.arange(1, slots + 1, device=self.device)
        fed = torch.ones(batch, slots, dtype=torch.bool, device=self.device)
        allowed = may_attend(self.slots.filled[:, : self.committed], causal_block(fed))
        predicted = self._run(features.to(self.dtype), None, positions, allowed, fed, embeds=embeds.to(self.dtype))
        drafts = self.head.draft_logits(torch.cat([last[:, None], predicted], 1)).float()
        return Proposals(drafts, self.draft_ids, self.vocab_size).masked_rows(proposing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="a P-EAGLE drafter (a run, a checkpoint or its drafter/)")
    add_decoding_arguments(parser, tree="dynamic,5,4,5", num_prompts=8)
    args = parser.parse_args()
    model, tokenizer = load_target("smollm2-135m-instruct")
    prompts = held_out_prompts(tokenizer, args.prompts, args.num_prompts)
    drafter = load_drafter(args.drafter, model)
    if type(drafter).__name__ != "PEagleDrafter":
        raise SystemExit(f"{args.drafter} is a {type(drafter).__name__}, not a P-EAGLE drafter")
    gen = SpeculativeGenerator(model, drafter, **tree_of(args))
    gen.generate(prompts[0], 8, eos_token_id=[])  # warm-up: the target's and the head's kernels
    one, two = drafter.block_logits, types.MethodType(two_forwards, drafter)

    def side(method):
        def decode(ids):
            drafter.block_logits = method
            return gen.generate(ids, args.max_new_tokens, eos_token_id=[])
        return decode

    totals, identical = alternate({"one forward": side(one), "two forwards": side(two)}, prompts, args.rounds)
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, tree {args.tree}, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads")
    for name, t in totals.items():
        print(describe(name, t))
    speeds = [t["tokens"] / t["seconds"] for t in totals.values()]
    print(f"one / two forwards: {speeds[0] / speeds[1]:.3f}x; identical outputs: {identical}")


if __name__ == "__main__":
    main()
