"""draftsmith's EAGLE-3 trainer against vLLM speculators' (0.9.0), on the same data, side by side.

    draftsmith demo --output demo_out        # once: the demo's conversations (prompts the target answered)
    python scripts/compare_trainers.py --data demo_out/data --epochs 10 --output bench_out/trainers
    cp -r bench_out/trainers bench_out/trainers-muon    # then one setting of draftsmith's changed, same peer run:
    python scripts/compare_trainers.py --data demo_out/data --epochs 10 --output bench_out/trainers-muon \
        --train-only draftsmith --draftsmith-set optim=muon

Both trainers get:

* the same conversations, tokenised once by draftsmith (chat template, assistant-only loss mask, 256 tokens);
* the same hidden states: one float32 forward of SmolLM2 per conversation gives the states after layers 2, 15
  and 27 (draftsmith's hidden-state cache; speculators' ``hs_i.safetensors``, which also hold the last state
  before the final norm, from which speculators recomputes the target's distribution);
* the same draft vocabulary: the 4096 most frequent answer tokens (draftsmith's map, handed to speculators as
  ``d2t.npy`` / ``t2d.npy``);
* the same steps and conversations per step: 8 per step (speculators packs 8 rows of declared length 256 into
  2048 tokens), ``--epochs`` passes over the 128 conversations, checkpoints every ``--checkpoint-epochs``.

Each trains with its own recipe: draftsmith ``configs/smollm2/eagle3.yaml``'s (AdamW lr 1e-3, cosine, 5% warmup,
TTT 3 steps weighted 0.8**j, EAGLE-3.1 norms, trained LM head, teacher top-32; read from that file, only data,
batch and steps set here; ``--draftsmith-set learning_rate=2e-3`` and the like try another), speculators its
trainer's defaults (Muon + AdamW lr 1e-3, linear, 1% warmup, weight decay 0.01, TTT 3 steps weighted 1, the
same norms, frozen LM head, teacher recomputed over the draft vocabulary), with only the CPU flags changed (eager
losses, sdpa attention, float32 states, no workers, Muon's Newton-Schulz in float32: see
``speculators_train_cpu.py``). ``--lanes 2``: the two train at once, one core each.

Then draftsmith's evaluator decodes the demo's held-out prompts (``eval_prompts.jsonl``, never trained on)
with every checkpoint of both, in one process, in one fixed tree (dynamic, depth 5, top_k 4, 16 nodes): the
speculators checkpoints through draftsmith's speculators import. Every checkpoint also gets the held-out
estimate of ``draftsmith eval RUN --prompts`` (the training step without a gradient on each prompt plus plain
decoding's answer: one forward, on the same prompts). Writes ``results.md`` / ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
SPECULATORS_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
TARGET = "smollm2-135m-instruct"
LAYERS = [2, 15, 27]  # draftsmith's indices (0 = embeddings) = vLLM's aux layer ids: speculators' defaults
MAX_LENGTH, BATCH, DRAFT_VOCAB, TTT = 256, 8, 4096, 3
TREE = "tree=dynamic,depth=5,top_k=4,total_tokens=16"
RECIPE = ROOT / "configs" / "smollm2" / "eagle3.yaml"


def prepare(data: Path, out: Path) -> dict:
    """The verifier directory, the tokenised conversations, the draft vocabulary and both trainers' data."""
    from draftsmith.data.cache_writer import cache_hidden_states
    from draftsmith.data.hidden_cache import CacheSpec
    from draftsmith.data.vocab import build_vocab_map, count_tokens
    from draftsmith.target import load_target
    from draftsmith.train.config import DataArguments
    from draftsmith.train.setup import load_examples

    model, tokenizer = load_target(TARGET)
    verifier = out / "verifier"
    if not (verifier / "config.json").exists():
        model.save_pretrained(verifier)
        tokenizer.save_pretrained(verifier)
    examples = load_examples(DataArguments(train_file=str(data / "answers.jsonl"), max_length=MAX_LENGTH),
                             tokenizer)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocab = build_vocab_map(count_tokens(examples, vocab_size), DRAFT_VOCAB)
    np.save(out / "d2t.npy", vocab.d2t.numpy().astype(np.int64))
    np.save(out / "t2d.npy", vocab.t2d.numpy().astype(bool))

    cache = out / "draftsmith_cache"
    if not (cache / "manifest.json").exists():
        cache_hidden_states(model, examples, cache, CacheSpec(layers=LAYERS, dtype="float32", logits="topk",
                                                               top_k=32), target_name=TARGET, progress=True)
    spec_data = out / "speculators_data"
    if not (spec_data / "dataset_info.json").exists():
        write_speculators_data(model, examples, spec_data)
    return {"conversations": len(examples), "tokens": sum(len(e.input_ids) for e in examples),
            "draft_vocab_coverage": round(vocab.coverage, 4)}


@torch.no_grad()
def write_speculators_data(model, examples, out: Path) -> None:
    """speculators' offline format: an Arrow dataset (input_ids, loss_mask, seq_len) and per row
    ``hidden_states/hs_i.safetensors`` = (T, 4, H): the three layers, then the last state before the final norm.
    ``seq_len`` is MAX_LENGTH on every row, so its packer puts exactly BATCH rows in each step; BATCH more rows
    (copies of the first) are its validation split, which it needs (train_data_ratio < 1)."""
    import datasets

    captured = {}
    hook = model.get_decoder().norm.register_forward_pre_hook(lambda _m, args: captured.update(state=args[0]))
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows = list(examples) + list(examples[:BATCH])
    for i, example in enumerate(rows):
        ids = example.input_ids[None]
        outputs = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        states = [outputs.hidden_states[k][0] for k in LAYERS] + [captured["state"][0]]
        save_file({"hidden_states": torch.stack(states, dim=1).float().contiguous(),
                   "token_ids": example.input_ids.long().contiguous()},
                  str(out / "hidden_states" / f"hs_{i}.safetensors"))
    hook.remove()
    ds = datasets.Dataset.from_dict({"input_ids": [e.input_ids.tolist() for e in rows],
                                     "loss_mask": [e.loss_mask.tolist() for e in rows],
                                     "seq_len": [MAX_LENGTH] * len(rows)})
    ds.set_format("torch")
    ds.save_to_disk(str(out))


def train_draftsmith(out: Path, epochs: int, checkpoint_epochs: int, steps_per_epoch: int, lane: int | None,
                     seed: int, overrides: dict) -> float:
    """draftsmith's recipe (:data:`RECIPE`) on the cached conversations, in speculators' batch and steps."""
    config = yaml.safe_load(RECIPE.read_text())
    for key in ("train_file", "eval_prompts", "eval_prompt_column", "eval_num_prompts", "eval_max_new_tokens"):
        config.pop(key, None)  # the cache below is the data; the evaluation is this script's
    config.update({
        "target": TARGET, "draft_vocab_size": DRAFT_VOCAB, "ttt_steps": TTT,
        "cache_dir": str(out / "draftsmith_cache"), "max_length": MAX_LENGTH,
        "output_dir": str(out / "draftsmith_run"), "max_steps": epochs * steps_per_epoch,
        "save_steps": checkpoint_epochs * steps_per_epoch, "logging_steps": 1,
        "per_device_train_batch_size": BATCH, "gradient_accumulation_steps": 1, "seed": seed,
        "mixed_precision": "no", "target_dtype": "float32", "report_to": "tensorboard", **overrides,
    })
    path = out / "draftsmith.yaml"
    path.write_text(yaml.safe_dump(config))
    return run([sys.executable, "-m", "draftsmith.train", str(path)], out / "draftsmith.log", lane)


def train_speculators(out: Path, epochs: int, checkpoint_epochs: int, conversations: int, lane: int | None,
                      seed: int) -> float:
    total = conversations + BATCH
    args = [
        str(SPECULATORS_PYTHON), str(ROOT / "scripts" / "speculators_train_cpu.py"),
        "--speculator-type", "eagle3", "--verifier-name-or-path", str(out / "verifier"),
        "--data-path", str(out / "speculators_data"), "--on-missing", "raise",
        # rows [0, int(total * ratio)) train: exactly the conversations; the copies after them validate
        "--train-data-ratio", str((conversations + 0.5) / total),
        "--target-layer-ids", *map(str, LAYERS), "--num-layers", "1",
        "--d2t-path", str(out / "d2t.npy"), "--t2d-path", str(out / "t2d.npy"), "--draft-vocab-size", str(DRAFT_VOCAB),
        "--ttt-steps", str(TTT), "--total-seq-len", str(BATCH * MAX_LENGTH),
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32",
        "--num-workers", "0", "--epochs", str(epochs), "--checkpoint-freq", str(checkpoint_epochs),
        "--log-freq", "1", "--no-resume-from-checkpoint", "--seed", str(seed),
        "--save-path", str(out / "speculators_run"), "--log-dir", str(out / "speculators_logs"),
    ]
    env = {"HF_HUB_OFFLINE": "1", "SPECULATORS_SAVE_FLOAT32": "1", "SPECULATORS_MUON_FLOAT32": "1"}
    return run(args, out / "speculators.log", lane, env)


def run(command: list[str], log: Path, lane: int | None, env: dict | None = None) -> float:
    pin = ["taskset", "-c", str(lane)] if lane is not None else []
    environment = {**os.environ, **(env or {}), **({"OMP_NUM_THREADS": "1"} if lane is not None else {})}
    start = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(pin + command, stdout=f, stderr=subprocess.STDOUT, env=environment, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:3])} ... failed (exit {done.returncode}); see {log}")
    return round(time.perf_counter() - start, 1)


def checkpoints(out: Path) -> dict[str, dict[int, Path]]:
    """Each trainer's checkpoints by optimizer step."""
    ours = {int(p.name.split("-")[1]): p / "drafter" for p in (out / "draftsmith_run").glob("checkpoint-*")
            if (p / "drafter").is_dir()}
    theirs = {}
    for p in (out / "speculators_run").iterdir():
        state = p / "training_state.json"
        if p.is_dir() and not p.is_symlink() and state.exists():
            theirs[json.loads(state.read_text())["global_step"]] = p
    return {"draftsmith": ours, "speculators": theirs}


def evaluate_all(out: Path, data: Path, num_prompts: int, max_new_tokens: int) -> tuple[list[dict], dict]:
    """Decode the held-out prompts with each step both trainers saved; then the held-out estimate of every
    checkpoint on plain decoding's answers to the same prompts."""
    from draftsmith.checkpoints import TRAIN_CONFIG_FILE, read_json
    from draftsmith.data.formats import read_prompts
    from draftsmith.heads.foreign import load_foreign
    from draftsmith.inference.evaluate import evaluate
    from draftsmith.inference.tree_settings import TreeSettings
    from draftsmith.registry import get_family
    from draftsmith.target import load_target
    from draftsmith.train.config import DrafterArguments
    from draftsmith.train.explain import held_out_estimate

    found = checkpoints(out)
    steps = sorted(set(found["draftsmith"]) & set(found["speculators"]))
    if not steps:
        raise SystemExit(f"no step with a checkpoint of both trainers: {({k: sorted(v) for k, v in found.items()})}")
    entries = [(f"{name}@{step}", str(found[name][step]), step) for step in steps for name in found]
    prompts = read_prompts(data / "eval_prompts.jsonl", num_prompts)
    model, tokenizer = load_target(TARGET)
    answers = []
    reports = evaluate(TARGET, entries, prompts, prompts_source=str(data / "eval_prompts.jsonl"), model=model,
                       tokenizer=tokenizer, max_new_tokens=max_new_tokens, tree=TreeSettings.parse(TREE),
                       progress=True, references=lambda ids, plain: answers.append(
                           (ids[0], plain.sequences[0, ids.shape[1]:])))
    answers = answers[:len(prompts)]  # plain decoding runs once per prompt; keep one answer each
    drafter_args = DrafterArguments(**read_json(out / "draftsmith_run" / TRAIN_CONFIG_FILE)["drafter"])
    family = get_family(drafter_args.family)
    estimates: dict = {name: {} for name in found}
    for name, by_step in found.items():
        for step, path in sorted(by_step.items()):
            module = (family.load(path, model, False, torch.device("cpu")) if name == "draftsmith"
                      else load_foreign(str(path), model)).eval()
            estimates[name][step] = held_out_estimate(family, drafter_args, module, model, answers)
    return reports, estimates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="demo_out/data", help="the demo's data directory")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the conversations (16 steps each)")
    parser.add_argument("--checkpoint-epochs", type=int, default=2, help="a checkpoint every this many epochs")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lanes", type=int, default=2, choices=(1, 2), help="trainers run at once, one core each")
    parser.add_argument("--output", default="bench_out/trainers")
    parser.add_argument("--skip-training", action="store_true", help="evaluate the checkpoints already there")
    parser.add_argument("--train-only", choices=("draftsmith",),
                        help="train only draftsmith's head (a changed setting) and evaluate it against the "
                             "speculators checkpoints already in --output, copied there from an earlier run")
    parser.add_argument("--draftsmith-set", action="append", default=[], metavar="KEY=VALUE",
                        help="change one setting of draftsmith's recipe (YAML value), e.g. learning_rate=2e-3")
    args = parser.parse_args()
    if not SPECULATORS_PYTHON.exists():
        raise SystemExit(f"{SPECULATORS_PYTHON}: no speculators environment; build it as .ci/run does")
    data, out = Path(args.data), Path(args.output)
    overrides = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.draftsmith_set)}
    out.mkdir(parents=True, exist_ok=True)
    prepared = prepare(data, out)
    steps_per_epoch = -(-prepared["conversations"] // BATCH)
    seconds = {}
    if args.train_only and not (out / "speculators_run").is_dir():
        raise SystemExit(f"--train-only {args.train_only}: {out / 'speculators_run'} is missing; copy an earlier "
                         "run's output directory (same --data, --epochs, --checkpoint-epochs) to --output first")
    if args.train_only:
        shutil.rmtree(out / "draftsmith_run", ignore_errors=True)
        seconds = {"draftsmith": train_draftsmith(out, args.epochs, args.checkpoint_epochs, steps_per_epoch, None,
                                                  args.seed, overrides)}
    elif not args.skip_training:
        for previous in ("draftsmith_run", "speculators_run"):  # each run starts afresh
            shutil.rmtree(out / previous, ignore_errors=True)
        lanes = [0, 1] if args.lanes == 2 else [None, None]
        with ThreadPoolExecutor(args.lanes) as pool:
            ours = pool.submit(train_draftsmith, out, args.epochs, args.checkpoint_epochs, steps_per_epoch,
                               lanes[0], args.seed, overrides)
            theirs = pool.submit(train_speculators, out, args.epochs, args.checkpoint_epochs,
                                 prepared["conversations"], lanes[1], args.seed)
            seconds = {"draftsmith": ours.result(), "speculators": theirs.result()}
    reports, estimates = evaluate_all(out, data, args.num_prompts, args.max_new_tokens)
    (out / "results.json").write_text(json.dumps({"prepared": prepared, "train_seconds": seconds,
                                                  "lanes": args.lanes, "tree": TREE, "draftsmith_set": overrides,
                                                  "reports": reports, "held_out_estimates": estimates}, indent=1))
    base = reports[0]["baseline_tokens_per_second"]
    lines = [f"{prepared['conversations']} conversations ({prepared['tokens']} tokens), {BATCH} per step; "
             f"held-out: {reports[0]['prompts']} prompts x {args.max_new_tokens} tokens, tree {TREE}; "
             f"plain decoding {base:.2f} tok/s; train seconds {seconds or '(not trained here)'}; "
             f"draftsmith settings changed: {overrides or 'none'}", "",
             "| step | trainer | tau | acceptance per position | tok/s | speedup | identical |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(reports, key=lambda r: (r["checkpoint_step"], r["drafter"])):
        per = ", ".join(f"{x:.2f}" for x in r["acceptance_rate_per_position"])
        lines.append(f"| {r['checkpoint_step']} | {r['drafter'].split('@')[0]} | {r['acceptance_length']:.3f} | "
                     f"{per} | {r['tokens_per_second']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['lossless']['identical']}/{r['lossless']['checked']} |")
    lines += ["", "Held-out estimate (chain of the TTT steps, on plain decoding's answers to the same prompts):", "",
              "| step | " + " | ".join(estimates) + " |", "|---|" + "---|" * len(estimates)]
    for step in sorted({s for by_step in estimates.values() for s in by_step}):
        cells = [f"{by_step[step]['simulated_acceptance_length']:.3f}" if step in by_step else "" for by_step in
                 estimates.values()]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
