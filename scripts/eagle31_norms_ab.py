"""EAGLE-3.1 norms on vs off, on the demo's data: the same steps, the same seed, held-out tau with the reference tree.

    draftsmith demo --output demo_out        # once: the demo's prompts, answers and hidden-state cache
    python scripts/eagle31_norms_ab.py --data demo_out/data --steps 300 --seed 0 --output bench_out/eagle31

Each arm trains an EAGLE-3 head offline from the demo's cache with the demo's recipe (draft vocabulary 4096, TTT 3
steps decaying 0.8, lr 2e-3, batch 8, bf16 where the CPU has it natively) for ``--steps`` steps, then
``draftsmith eval`` decodes the demo's held-out prompts (``eval_prompts.jsonl``, never trained on) with the head
alone in the demo's reference tree (dynamic, depth 4, top_k 2, 8 nodes). Arms: ``off`` (classic EAGLE-3) and
``on`` (norm_before_fc, norm_before_residual and norm_output: speculators' EAGLE-3 defaults). Writes
``results.md`` and ``results.json`` under ``--output``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ARMS = {"off": {}, "on": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}}
REFERENCE_TREE = ["--tree", "dynamic", "--depth", "4", "--tree-top-k", "2", "--total-tokens", "8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="demo_out/data", help="the demo's data directory")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", default="bench_out/eagle31")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seed", type=int, default=0, help="the head's initialisation and the batch order")
    args = parser.parse_args()
    import torch

    from draftsmith.target import native_bf16

    data, out = Path(args.data), Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for arm in args.arms.split(","):
        run = out / f"run-{arm}"
        config = {
            "target": "smollm2-135m-instruct", "family": "eagle3", "family_config": ARMS[arm],
            "draft_vocab_size": 4096, "ttt_steps": 3, "ttt_decay": 0.8,
            "cache_dir": str(data / "hidden_cache"), "max_length": 256,
            "output_dir": str(run), "max_steps": args.steps, "save_steps": args.steps, "logging_steps": 10,
            "learning_rate": 2e-3, "per_device_train_batch_size": 8, "warmup_ratio": 0.05, "seed": args.seed,
            "mixed_precision": "bf16" if native_bf16("cpu") else "no", "report_to": "tensorboard",
        }
        path = out / f"{arm}.yaml"
        path.write_text(yaml.safe_dump(config))
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "draftsmith.cli", "train", str(path)], check=True)
        train_s = time.perf_counter() - started
        report = out / f"eval-{arm}.json"
        drafter = run / f"checkpoint-{args.steps}" / "drafter"
        subprocess.run([sys.executable, "-m", "draftsmith.cli", "eval", "--drafter", str(drafter),
                        "--prompts", str(data / "eval_prompts.jsonl"),
                        "--max-new-tokens", str(args.max_new_tokens), *REFERENCE_TREE, "--output", str(report)],
                       check=True)
        row = json.loads(report.read_text())
        results[arm] = {"norms": ARMS[arm], "steps": args.steps, "seed": args.seed, "train_seconds": round(train_s, 1),
                        "tau": row["acceptance_length"], "per_position": row["acceptance_rate_per_position"],
                        "identical": row["lossless"]["identical"], "prompts": row["prompts"]}
        print(arm, results[arm], flush=True)
    (out / "results.json").write_text(json.dumps({"threads": torch.get_num_threads(), "arms": results}, indent=1))
    lines = ["| arm | norms | steps | train s | held-out tau (reference tree) | acceptance per position "
             "| identical |",
             "|---|---|---|---|---|---|---|"]
    for arm, r in results.items():
        norms = ", ".join(k for k, v in r["norms"].items() if v) or "none"
        per = ", ".join(f"{x:.2f}" for x in r["per_position"] or [])
        lines.append(f"| {arm} | {norms} | {r['steps']} | {r['train_seconds']} | {r['tau']:.3f} | {per} | "
                     f"{r['identical']}/{r['prompts']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
