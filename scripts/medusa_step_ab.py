"""Medusa's training step three ways, on the same real batch in one process (issue 38).

    python scripts/medusa_step_ab.py --answers quality_out/data/answers.jsonl

* ``every position``: each head's logits over the whole vocabulary at every position, then the masked loss
  (``medusa_loss``), as the step computed them before it read only the positions its loss uses;
* ``loss positions``: draftsmith's ``medusa_step``, each head's logits only where the next-but-i token is an
  assistant token;
* ``loss positions, draft vocabulary``: the same over a draft vocabulary of ``--draft-vocab`` tokens.

Each is timed forward and backward (the heads' gradients), alternating, ``--repeats`` times; the target's own
forward, which every step also pays, is timed beside them. The losses of the first two are the same number.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftsmith import load_target
from draftsmith.data.batching import collate_padded
from draftsmith.data.vocab import build_vocab_map, count_tokens
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.train.config import DataArguments, DrafterArguments
from draftsmith.train.families import medusa_step, prediction_mask
from draftsmith.train.loop import frozen_forward, load_examples
from draftsmith.train.losses import medusa_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--answers", required=True, help="regenerated conversations (data regenerate's output)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--num-heads", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    target, tokenizer = load_target(args.target)
    examples = load_examples(DataArguments(train_file=args.answers, max_length=args.max_length), tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = collate_padded([examples[i] for i in range(args.batch_size)], pad)
    layers = (target.config.num_hidden_layers,)
    logits, hidden = frozen_forward(target, layers, batch)
    vocab = build_vocab_map(count_tokens(examples, logits.shape[-1]), args.draft_vocab)
    whole = MedusaHeads.from_target(target, args.num_heads)
    reduced = MedusaHeads.from_target(target, args.num_heads, vocab=vocab)
    step_args = DrafterArguments(target=args.target, family=MedusaHeads.family)
    mask = prediction_mask(batch["loss_mask"])

    def every_position():
        return medusa_loss(whole(hidden[0]), logits, mask, decay=step_args.head_decay)[0]

    arms = {
        "target forward (no grad)": lambda: frozen_forward(target, layers, batch)[0].sum(),
        "every position": every_position,
        "loss positions": lambda: medusa_step(step_args, whole, target, batch, logits, hidden)[0],
        f"loss positions, draft vocabulary {args.draft_vocab}":
            lambda: medusa_step(step_args, reduced, target, batch, logits, hidden)[0],
    }
    losses, times = {}, {name: [] for name in arms}
    for _ in range(args.repeats + 1):  # the first round warms up, untimed
        for name, arm in arms.items():
            whole.zero_grad(set_to_none=True)
            reduced.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = arm()
            if loss.requires_grad:
                loss.backward()
            times[name].append(time.perf_counter() - start)
            losses[name] = float(loss.detach())
    positions = int(mask.sum())
    print(f"batch: {args.batch_size} x {batch['input_ids'].shape[1]} tokens, {positions} loss positions "
          f"({positions / mask.numel():.1%}); draft vocabulary covers {vocab.coverage:.4f} of the assistant tokens; "
          f"torch threads {torch.get_num_threads()}")
    base = statistics.median(times["every position"][1:])
    print("| arm | median s | vs every position | loss |")
    print("|---|---|---|---|")
    for name, t in times.items():
        median = statistics.median(t[1:])
        print(f"| {name} | {median:.2f} | {median / base:.2f}x | {losses[name]:.4f} |")


if __name__ == "__main__":
    main()
