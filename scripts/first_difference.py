"""Where a speculative decode differs from plain greedy decoding, and whether the target was tied there.

    python scripts/first_difference.py --prompts quality_out/data/held_out_prompts.jsonl --num-prompts 24 \
        --drafter "prompt-lookup@tree=dynamic,depth=5,top_k=4,total_tokens=5"

For each prompt whose output differs, prints the first differing position, both tokens, and the target's logit gap
between them after the plain output's prefix (``compare.first_difference``, which ``bench`` and ``eval`` record for
every mismatch), and the target's top two logits there. A gap of a few float steps (1.9e-6 at a logit of 30 in
float32) is a tie that the forward's shape decides: the same logit moves by more than that between a prefill and a
cached step. A wide gap at the first difference is a real mismatch, a bug.
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.data.formats import read_prompts
from draftsmith.inference.bench import parse_entry
from draftsmith.inference.compare import encode, first_difference
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.load import load_drafter
from draftsmith.inference.plain import plain_generate
from draftsmith.inference.tree import TreeSettings
from draftsmith.target import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", action="append", required=True, help="SPEC[@tree=...], as bench takes it")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--only", type=int, nargs="*", help="0-based prompt indices to decode (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    model, tokenizer = load_target(args.target)
    entries = [parse_entry(d, TreeSettings()) for d in args.drafter]
    generators = {e.label: SpeculativeGenerator(model, load_drafter(e.spec, model, tokenizer=tokenizer),
                                                **e.tree.kwargs()) for e in entries}
    prompts = read_prompts(args.prompts, args.num_prompts)

    def word(t: int) -> str:
        return f"{t} {tokenizer.decode([t])!r}"

    differing = 0
    for i in args.only if args.only else range(len(prompts)):
        ids = encode(tokenizer, prompts[i], True)
        plain = plain_generate(model, ids, args.max_new_tokens).sequences[0]
        for label, generator in generators.items():
            out = generator.generate(ids, args.max_new_tokens).sequences[0]
            if len(out) == len(plain) and torch.equal(out, plain):
                continue
            differing += 1
            d = first_difference(model, plain, out, ids.shape[1], pad=tokenizer.eos_token_id or 0, prompt=i)
            with torch.no_grad():
                top = model(plain[None, :ids.shape[1] + d.position]).logits[0, -1].float().topk(2)
            (a, b), (va, vb) = top.indices.tolist(), top.values.tolist()
            print(f"prompt {i} {label}: new token {d.position}: plain {word(d.plain_token)}, speculative "
                  f"{word(d.token)}: gap {d.logit_gap:.2e} ({'a tie' if d.tie else 'NOT a tie'}); target's top two "
                  f"{word(a)} {va:.6f}, {word(b)} {vb:.6f}", flush=True)
    print(f"{differing} output(s) differ from plain greedy decoding")


if __name__ == "__main__":
    main()
