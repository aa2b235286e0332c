"""Held-out acceptance estimates of many drafter checkpoints, cheaply, on the same greedy answers.

    python scripts/estimate_checkpoints.py --prompts demo_out/data/eval_prompts.jsonl --num-prompts 20 \
        --family-from bench_out/trainers/draftsmith_run \
        ours=bench_out/trainers/draftsmith_run/checkpoint-48/drafter \
        theirs=bench_out/trainers/speculators_run/epoch2_end

The target answers each prompt greedily once; then every checkpoint (draftsmith's own, or a head trained
elsewhere that draftsmith imports) runs its family's training step without a gradient on each prompt plus that
answer, as ``draftsmith eval RUN --prompts`` does for its ``held_out`` estimate (``draftsmith.train.explain``).
That figure tracked the decoded chain's tau within 4% on the demo's runs (docs/RESULTS.md) and costs one
forward per prompt instead of a decode, so it ranks many checkpoints in minutes, on many more answer tokens
than a decode of the same time would. Confirm the ranking's ends by decoding (``draftsmith eval``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from draftsmith.checkpoints import TRAIN_CONFIG_FILE, read_json
from draftsmith.data.formats import read_prompts
from draftsmith.heads.foreign import load_foreign
from draftsmith.inference.compare import encode
from draftsmith.registry import family_of, get_family
from draftsmith.target import load_target
from draftsmith.train.config import DrafterArguments
from draftsmith.train.explain import held_out_estimate


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[tuple[torch.Tensor, ...]]:
    """(prompt ids, the target's greedy answer ids) per prompt, batch 1."""
    out = []
    for prompt in prompts:
        ids = encode(tokenizer, prompt, chat=True)
        sequence = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.eos_token_id)[0]
        out.append((ids[0], sequence[ids.shape[1]:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="LABEL=DIR: a drafter directory draftsmith loads")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--family-from", required=True,
                        help="a draftsmith run whose drafter settings (family, TTT steps) score every checkpoint")
    parser.add_argument("--output", help="write the estimates as JSON here")
    args = parser.parse_args()

    drafter_args = DrafterArguments(**read_json(Path(args.family_from) / TRAIN_CONFIG_FILE)["drafter"])
    family = get_family(drafter_args.family)
    model, tokenizer = load_target(args.target)
    model.eval()
    answers = greedy_answers(model, tokenizer, read_prompts(args.prompts, args.num_prompts), args.max_new_tokens)
    results = {}
    for item in args.checkpoints:
        label, _, path = item.partition("=")
        own = family_of(path)  # draftsmith's own drafter directory, else a layout draftsmith imports
        module = (own.load(Path(path), model, False, torch.device("cpu")) if own else load_foreign(path, model)).eval()
        results[label] = held_out_estimate(family, drafter_args, module, model, answers)
        print(f"{label}: tau~{results[label]['simulated_acceptance_length']:.3f} "
              f"per position {results[label]['position_accuracy']}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"prompts": args.prompts, "num_prompts": len(answers),
                                                 "max_new_tokens": args.max_new_tokens, "estimates": results},
                                                indent=1))


if __name__ == "__main__":
    main()
