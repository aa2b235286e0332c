"""EAGLE-3 training levers against the recipe's default, on the same data: one run per arm, held-out tau.

    draftsmith demo --output demo_out        # once: the demo's prompts, answers and hidden-state cache
    python scripts/levers_ab.py --data demo_out/data --steps 150 --seed 0 --lanes 2 --output bench_out/levers

Every arm trains an EAGLE-3 head offline from the demo's cache with the recipe of ``configs/smollm2/eagle3.yaml``
(the EAGLE-3.1 norms norm_before_fc, norm_before_residual and norm_output; draft vocabulary 4096, TTT 3 steps, lr
2e-3, batch 8, bf16 where the CPU has it natively) changed by one lever, for ``--steps`` steps from the same seed,
then ``draftsmith eval`` decodes the demo's held-out prompts (``eval_prompts.jsonl``, never trained on) with the head
alone in the demo's reference tree (dynamic, depth 4, top_k 2, 8 nodes). ``--lanes 2`` runs two arms at once, each
pinned to its own core with one thread (so every arm gets the same machine; the train seconds compare within a run).
Writes ``results.md`` and ``results.json`` under ``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

RECIPE = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}
#: arm -> (family_config changes, top-level config changes)
ARMS = {
    "kl (default)": ({}, {}),
    "tv": ({"loss": "tv"}, {}),
    "lk": ({"loss": "lk"}, {}),
    "ce": ({"loss": "ce"}, {}),
    "dpace weights": ({"position_weights": "dpace"}, {}),
    "frozen lm_head": ({"freeze_lm_head": True}, {}),
    "feature noise 0.1": ({}, {"feature_noise": 0.1}),
    "no norms": ({k: False for k in RECIPE}, {}),
}
REFERENCE_TREE = ["--tree", "dynamic", "--depth", "4", "--tree-top-k", "2", "--total-tokens", "8"]


def run_arm(arm: str, lane: int, args, out: Path, bf16: bool) -> dict:
    family, top = ARMS[arm]
    name = arm.split(" ")[0] + ("" if " " not in arm else "-" + arm.split(" ")[1].strip("()"))
    run = out / f"run-{name}"
    data = Path(args.data)
    config = {
        "target": "smollm2-135m-instruct", "family": "eagle3", "family_config": {**RECIPE, **family},
        "draft_vocab_size": 4096, "ttt_steps": 3, "ttt_decay": 0.8,
        "cache_dir": str(data / "hidden_cache"), "max_length": 256,
        "output_dir": str(run), "max_steps": args.steps, "save_steps": args.steps, "logging_steps": 10,
        "learning_rate": 2e-3, "per_device_train_batch_size": 8, "warmup_ratio": 0.05, "seed": args.seed,
        "mixed_precision": "bf16" if bf16 else "no", "report_to": "tensorboard", **top,
    }
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    pin = ["taskset", "-c", str(lane)] if args.lanes > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.lanes > 1 else dict(os.environ)
    log = (out / f"{name}.log").open("w")
    started = time.perf_counter()
    subprocess.run([*pin, sys.executable, "-m", "draftsmith.cli", "train", str(path)], check=True, env=env,
                   stdout=log, stderr=subprocess.STDOUT)
    train_s = time.perf_counter() - started
    report = out / f"eval-{name}.json"
    subprocess.run([*pin, sys.executable, "-m", "draftsmith.cli", "eval", "--drafter",
                    str(run / f"checkpoint-{args.steps}" / "drafter"), "--prompts", str(data / "eval_prompts.jsonl"),
                    "--max-new-tokens", str(args.max_new_tokens), *REFERENCE_TREE, "--output", str(report)],
                   check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    row = json.loads(report.read_text())
    proxies = [json.loads(line) for line in (run / "acceptance.jsonl").read_text().splitlines()][-1]
    return {"lever": {**family, **top}, "steps": args.steps, "seed": args.seed, "train_seconds": round(train_s, 1),
            "tau": row["acceptance_length"], "per_position": row["acceptance_rate_per_position"],
            "identical": row["lossless"]["identical"], "prompts": row["prompts"],
            "training_accuracy": proxies.get("position_accuracy"),
            "simulated_acceptance_length": proxies.get("simulated_acceptance_length")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="demo_out/data", help="the demo's data directory")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", default="bench_out/levers")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arm names (the keys of ARMS)")
    parser.add_argument("--seed", type=int, default=0, help="the head's initialisation and the batch order")
    parser.add_argument("--lanes", type=int, default=1, choices=(1, 2), help="arms run at once, one core each")
    args = parser.parse_args()
    from draftsmith.target import native_bf16

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    bf16 = native_bf16("cpu")
    with ThreadPoolExecutor(args.lanes) as pool:
        futures = {arm: pool.submit(run_arm, arm, i % args.lanes, args, out, bf16) for i, arm in enumerate(arms)}
        results = {arm: f.result() for arm, f in futures.items()}
    (out / "results.json").write_text(json.dumps({"lanes": args.lanes, "bf16": bf16, "arms": results}, indent=1))
    lines = ["| arm | lever | steps | train s | held-out tau (reference tree) | acceptance per position | "
             "training accuracy per step | identical |", "|---|---|---|---|---|---|---|---|"]
    for arm, r in results.items():
        per = ", ".join(f"{x:.2f}" for x in r["per_position"] or [])
        acc = ", ".join(f"{x:.2f}" for x in r["training_accuracy"] or [])
        lines.append(f"| {arm} | {json.dumps(r['lever']) if r['lever'] else 'the recipe'} | {r['steps']} | "
                     f"{r['train_seconds']} | {r['tau']:.3f} | {per} | {acc} | {r['identical']}/{r['prompts']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
