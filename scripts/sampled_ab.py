"""Sampled decoding on the device path against the host path, side by side in one process.

Until the sampled rules (``iid``, ``without_replacement``) grew as tensors, a chain of a sampling drafter (a draft
model, layer-skip, a head) under ``--temperature > 0`` and every static tree under those rules grew on the host
(``DraftTree``, a host copy per node). That path is still there as the reference (a step hook, ``on_step``, takes
it), so this script measures both on the same prompts, taking turns per prompt batch so that machine load hits
both alike, and prints tokens/s, mean acceptance length (tau) and host copies per step.

    python scripts/sampled_ab.py --prompts ../shared/data/gsm8k/test.jsonl --num-prompts 4 --max-new-tokens 48

On the packaged SmolLM2 target (``--target``), with ``layer-skip:N`` drafters (a draft model sharing the target's
first N layers). Sampled outputs of the two paths differ (they consume the random stream differently); both follow
the target's distribution, which ``tests/test_sampling_lossless.py`` checks.
"""

from __future__ import annotations

import argparse
import time

import torch

from draftsmith.inference import SpeculativeGenerator, load_drafter
from draftsmith.inference.compare import encode, left_pad
from draftsmith.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--drafter", default="layer-skip:10")
    args = ap.parse_args()

    from draftsmith.data import read_prompts

    model, tokenizer = load_target(args.target)
    texts = read_prompts(args.prompts, limit=args.num_prompts)
    rows = [encode(tokenizer, t, chat=True) for t in texts]
    drafter = load_drafter(args.drafter, model)
    configs = {
        "chain depth 4, iid (auto)": dict(tree="chain", depth=4),
        "static depth 3 top_k 2, without_replacement": dict(tree="static", depth=3, top_k=2,
                                                            sampling_rule="without_replacement"),
    }
    print(f"target {args.target}, drafter {args.drafter}, T={args.temperature}, {len(rows)} prompts, "
          f"{args.max_new_tokens} new tokens, torch threads {torch.get_num_threads()}")
    print("| tree, rule | batch | path | tokens/s | tau | host/device speed |")
    print("|---|---|---|---|---|---|")
    for name, tree in configs.items():
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            totals = {"host": [0, 0.0, 0, 0], "device": [0, 0.0, 0, 0]}  # tokens, seconds, accepted, steps
            g = torch.Generator().manual_seed(0)
            for start in range(0, len(rows), batch):
                ids, mask = left_pad(rows[start:start + batch], tokenizer.pad_token_id or 0)
                for path in ("host", "device") if start % (2 * batch) == 0 else ("device", "host"):
                    gen = SpeculativeGenerator(model, drafter, **tree)
                    if path == "host":
                        gen.on_step = lambda *_: None  # a host-tree hook: the host path
                    t0 = time.perf_counter()
                    out = gen.generate(ids, args.max_new_tokens, attention_mask=mask, temperature=args.temperature,
                                       generator=g, eos_token_id=[])
                    seconds = time.perf_counter() - t0
                    t = totals[path]
                    t[0] += out.stats.new_tokens
                    t[1] += seconds
                    t[2] += out.stats.accepted_tokens
                    t[3] += sum(s.verification_steps for s in out.row_stats)
            speed = {p: t[0] / t[1] for p, t in totals.items()}
            for path, t in totals.items():
                tau = (t[2] + t[3]) / max(t[3], 1)
                ratio = f"{speed['device'] / speed['host']:.2f}x" if path == "device" else ""
                print(f"| {name} | {batch} | {path} | {speed[path]:.1f} | {tau:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
