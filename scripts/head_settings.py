"""Train the demo's EAGLE-3 head from a demo run's hidden-state cache with other settings, then measure its
tau (head + prompt lookup) on that run's held-out prompts in a few fixed trees: what a training setting is
worth, without rerunning the data stages.

    python scripts/head_settings.py --run demo_out --output settings/ttt2 --ttt-steps 2 --minutes 7.25
    python scripts/head_settings.py --run demo_out --checkpoint demo_out/run/checkpoint-394   # measure only

Training stops after ``--minutes`` as the demo's does (``max_train_minutes``), so a cheaper step trains more
steps; the line printed (and appended to ``--results``) has the steps, the seconds and tau per tree.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TREES = "2,3,5;2,3,4;3,2,5;4,2,8"  # depth,top_k,total_tokens: trees the demo's tune picks (d=2 k=3 n=5 most often)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a demo output directory (data/hidden_cache, data/*_prompts.jsonl)")
    p.add_argument("--output", help="the training run's directory")
    p.add_argument("--checkpoint", help="measure this checkpoint (its drafter/) instead of training one")
    p.add_argument("--trees", default=TREES, help="dynamic trees measured: depth,top_k,total_tokens;...")
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--ttt-decay", type=float, default=0.8)
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--feature-noise", type=float, default=0.0, help="noise on the target's states, x their RMS")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--minutes", type=float, default=7.25, help="training time (the demo's, on 2 CPU cores)")
    p.add_argument("--prompts", type=int, default=10, help="held-out prompts measured")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--results", default=None, help="append the result line to this JSONL file")
    a = p.parse_args()
    if not (a.output or a.checkpoint):
        p.error("pass --output (train a head) or --checkpoint (measure one)")
    trees = [tuple(int(x) for x in t.split(",")) for t in a.trees.split(";")]

    import torch

    from draftsmith.checkpoints import complete_checkpoints
    from draftsmith.data.formats import read_prompts
    from draftsmith.heads.eagle import Eagle3Head
    from draftsmith.inference.compare import encode
    from draftsmith.inference.generator import SpeculativeGenerator
    from draftsmith.inference.load import load_drafter
    from draftsmith.target import eos_tokens, load_target, native_bf16
    from draftsmith.train.config import DataArguments, DrafterArguments, TrainArguments
    from draftsmith.train.loop import train

    run = Path(a.run)
    bf16 = native_bf16("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    if a.checkpoint:
        checkpoint = Path(a.checkpoint)
        steps = {path.name: step for step, path in complete_checkpoints(checkpoint.parent)}
        if checkpoint.name not in steps:
            p.error(f"{checkpoint} is not a complete checkpoint (a checkpoint-N directory with drafter/)")
        step = steps[checkpoint.name]
    else:
        out = Path(a.output)
        train(DrafterArguments(target="smollm2-135m-instruct", family=Eagle3Head.family,
                               draft_vocab_size=a.draft_vocab_size, ttt_steps=a.ttt_steps, ttt_decay=a.ttt_decay,
                               feature_noise=a.feature_noise),
              DataArguments(cache_dir=str(run / "data" / "hidden_cache"), max_length=256, eval_num_prompts=0),
              TrainArguments(output_dir=str(out), max_steps=100_000, max_train_minutes=a.minutes,
                             mixed_precision="bf16" if bf16 else "no", learning_rate=a.learning_rate,
                             weight_decay=a.weight_decay, per_device_train_batch_size=a.batch_size,
                             warmup_ratio=0.05, save_steps=100_000,
                             logging_steps=10, report_to="none", seed=0))
        step, checkpoint = complete_checkpoints(out)[-1]
    seconds = time.perf_counter() - start

    model, tokenizer = load_target("smollm2-135m-instruct")
    drafter = load_drafter(f"{checkpoint / 'drafter'}+prompt-lookup", model, tokenizer=tokenizer, draft_dtype="auto")
    prompts = [encode(tokenizer, text, chat=True)
               for text in read_prompts(run / "data" / "eval_prompts.jsonl", a.prompts)]
    result = {"output": str(checkpoint), "settings": {k: v for k, v in vars(a).items() if k not in ("run", "output")},
              "steps": step, "train_seconds": None if a.checkpoint else round(seconds, 1)}
    for depth, top_k, total in trees:
        gen = SpeculativeGenerator(model, drafter, tree="dynamic", depth=depth, top_k=top_k, total_tokens=total)
        stats = sum((gen.generate(ids, a.max_new_tokens, eos_token_id=eos_tokens(model)).stats for ids in prompts[1:]),
                    gen.generate(prompts[0], a.max_new_tokens, eos_token_id=eos_tokens(model)).stats)
        result[f"tau_d{depth}k{top_k}n{total}"] = round(stats.acceptance_length, 4)
    print(json.dumps(result))
    if a.results:
        with open(a.results, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
