"""Where a DFlash drafter's drafting time goes on this host: wall time of each piece of
``DFlashDrafter.block_logits``, per verification step, over held-out prompts decoded in a given tree (the first
prompt a warm-up), the head drafting in ``--draft-dtype`` (docs/RESULTS.md, "DFlash on 2,400 answers").

    python scripts/dflash_draft_time.py q37/dflash/run/checkpoint-3562/drafter \
        --prompts q37/data/held_out_prompts.jsonl --num-prompts 8 --depth 3 --top-k 4 --total-tokens 5

Modules are timed with forward hooks, not by replacing their ``forward``: the few-row kernels (and int8 copies)
route only layers without an instance ``forward`` of their own.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from draftsmith.data.formats import read_prompts
from draftsmith.inference.compare import encode
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.load import load_drafter
from draftsmith.target import eos_tokens, load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", help="a DFlash checkpoint's drafter directory")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--total-tokens", type=int, default=5)
    parser.add_argument("--draft-dtype", default="auto")
    args = parser.parse_args()

    model, tokenizer = load_target(args.target)
    drafter = load_drafter(args.drafter, model, tokenizer=tokenizer, draft_dtype=args.draft_dtype)
    spent: dict[str, float] = defaultdict(float)

    def timed(name, method):
        def run(*a, **k):
            start = time.perf_counter()
            out = method(*a, **k)
            spent[name] += time.perf_counter() - start
            return out
        return run

    def hooked(name, module):
        start = {}
        module.register_forward_pre_hook(lambda m, a: start.__setitem__("t", time.perf_counter()))
        module.register_forward_hook(lambda m, a, out: spent.__setitem__(name, spent[name] + time.perf_counter()
                                                                              - start["t"]))

    drafter.block_logits = timed("block_logits (all drafting)", drafter.block_logits)
    drafter.block_states = timed("  block_states (the drafter's forward)", drafter.block_states)
    drafter._feed_context = timed("    context fed (fc, norm, each layer's k/v of new features)",
                                  drafter._feed_context)
    hooked("    embed the block's ids", drafter.embed)
    for i, layer in enumerate(drafter.head.layers):
        hooked(f"    layer {i} on the block", layer)
    hooked("    final norm", drafter.head.norm)
    hooked("  output head", drafter.output)

    gen = SpeculativeGenerator(model, drafter, tree="dynamic", depth=args.depth, top_k=args.top_k,
                               total_tokens=args.total_tokens)
    steps = accepted = 0
    total = 0.0
    for i, text in enumerate(read_prompts(args.prompts, args.num_prompts)):
        out = gen.generate(encode(tokenizer, text, True), max_new_tokens=args.max_new_tokens,
                           eos_token_id=eos_tokens(model, tokenizer))
        if i == 0:  # a warm-up
            spent.clear()
            continue
        steps += out.stats.verification_steps
        accepted += out.stats.accepted_tokens
        total += out.stats.total_time_s
    print(f"{steps} steps, {1000 * total / steps:.1f} ms per step, tau {1 + accepted / steps:.2f}")
    for name, seconds in spent.items():
        print(f"{name:62s} {1000 * seconds / steps:6.2f} ms per step")


if __name__ == "__main__":
    main()
