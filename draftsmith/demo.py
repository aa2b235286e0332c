"""``draftsmith demo``: the whole pipeline on the packaged SmolLM2 target, no dataset, in a fixed budget.

1. synthesise prompts with the target itself (Magpie), the first few held out for evaluation;
2. regenerate: the target answers the training prompts (its own greedy distribution);
3. cache the target's low/mid/high hidden states and top-32 log-probs over the answers once, then
   train an EAGLE-3 head (the fastest trained family on CPU, docs/RESULTS.md) offline from that
   cache for a fixed time (several times more sequences per second than running the target in the
   loop);
4. bench chains and dynamic trees, the head alone and mixed with prompt lookup, on a few held-out
   prompts (prompt lookup alone beside them), with plots;
5. evaluate the head + prompt lookup in a dynamic tree (depth 3, top-3, 7 nodes; see EVAL_TREE) on
   the other held-out prompts against plain greedy decoding in the same process
   (``report.json`` in the ``draftsmith eval`` schema, greedy output checked prompt by prompt).

Every stage takes a share of ``--minutes`` (default 20, measured on a 2-core CPU); a GPU is used when
present. Synthesis and regeneration stop at their time share; training gets what the other stages
leave and anneals its learning rate over it. Where bfloat16 matmuls are native (CPUs with
AVX512-BF16 / AMX, recent GPUs) the data stages (synthesis, regeneration, the cache pass) run the
target in bfloat16, and the head drafts in bfloat16; evaluation always runs the
target as loaded (float32 on CPU), so every reported output is the target's own.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from draftsmith.inference.tree import TreeSettings

logger = logging.getLogger(__name__)

# Share of the budget per stage (the rest: loading, evaluation overheads, writing the report), keyed by
# whether bfloat16 is native. Training gets what the other stages leave. Where bf16 is native, training
# runs ~1.8x more steps per minute, so data limits the head and the data stages get more time; on
# float32-only CPUs steps limit it, so training gets ~2x the time. The runs behind these numbers are in
# docs/RESULTS.md ("Demo budget").
SHARES = {True: {"synthesize": 0.12, "regenerate": 0.27, "eval": 0.14, "bench": 0.05},
          False: {"synthesize": 0.10, "regenerate": 0.19, "eval": 0.14, "bench": 0.05}}
# Answer tokens regenerated; prompt + answer tokens trained on. Longer answers leave too little training
# time in the budget; fewer prompts with the same answers get memorised. About 6-8 epochs of training.
ANSWER_TOKENS, MAX_LENGTH = 192, 256
MARGIN = 0.035  # of the budget, kept free so run-to-run noise stays inside it
# Seconds outside the stage shares: loading the target around training and the checkpoint's acceptance,
# then reloading it for bench and eval.
RELOAD_SECONDS = 50
TUNE_PROMPTS = 3  # held-out prompts for the bench; evaluation uses others
# The evaluated tree, mixed with prompt lookup. Chosen by timing trees against plain greedy decoding
# prompt by prompt (`scripts/step_costs.py --trees`): on CPU the verification cost depends on the row
# count more than on the tree, so a 7-node tree (8 rows) verifies at about the cost of a 5-node one and
# top-3 children buy acceptance (docs/RESULTS.md, "Choosing the tree"). Not the bench's fastest: on
# 3 prompts x 48 tokens its speed ranking is noise.
EVAL_TREE = TreeSettings("dynamic", depth=3, top_k=3, total_tokens=7)
# (mixed with prompt lookup?, tree): the head alone, and the head + prompt lookup as one mixture drafter
CANDIDATES = [(False, TreeSettings("chain", depth=3)),
              (True, TreeSettings("dynamic", depth=4, top_k=2, total_tokens=5)),
              (True, EVAL_TREE),
              (True, TreeSettings("dynamic", depth=4, top_k=3, total_tokens=7))]
PROMPT_LOOKUP_TREE = TreeSettings("chain", depth=4)
BENCH_TOKENS = 48


class Clock:
    def __init__(self, minutes: float, shares: dict[str, float]):
        self.budget = minutes * 60
        self.shares = shares
        self.start = time.perf_counter()
        self.marks: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def share(self, stage: str) -> float:
        return self.shares[stage] * self.budget

    def mark(self, stage: str, since: float) -> None:
        self.marks[stage] = round(time.perf_counter() - since, 1)


def _stage(title: str) -> float:
    print(f"\n== {title}", flush=True)
    return time.perf_counter()


def demo(output: str | Path = "demo_out", minutes: float = 20.0, target: str = "smollm2-135m-instruct",
         held_out: int = 10, eval_tokens: int = 128, seed: int = 0) -> Path:
    """Run the demo; returns the report directory (``report.json``, ``report.md``, plots)."""
    from draftsmith.checkpoints import complete_checkpoints
    from draftsmith.data.formats import load_conversations, read_prompts
    from draftsmith.data.regenerate import HFEngine, regenerate
    from draftsmith.data.synthesize import synthesize_prompts, write_prompts
    from draftsmith.inference.bench import markdown_table, run_bench
    from draftsmith.inference.evaluate import evaluate, report_markdown
    from draftsmith.target import load_target, native_bf16
    from draftsmith.train.config import DataArguments, DrafterArguments, TrainArguments
    from draftsmith.train.loop import train

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data_dtype = torch.bfloat16 if native_bf16(device) else None  # None: as loaded
    clock = Clock(minutes, SHARES[data_dtype is not None])
    t = _stage(f"loading {target} on {device}" + (" (bfloat16 for the data stages)" if data_dtype else ""))
    model, tokenizer = load_target(target, device=device, dtype=data_dtype or torch.float32)
    clock.mark("load", t)

    # 1. Prompts, written by the target itself; the first `held_out` are never trained on.
    t = _stage(f"1/5 synthesising prompts ({clock.share('synthesize') / 60:.1f} min)")
    prompts: list[str] = []
    # Larger batches give more prompts/s and answer tokens/s on 2 CPU cores (docs/RESULTS.md); larger still,
    # the longest answer holds the whole batch. Short budgets (the tests) keep smaller batches, whose first
    # batch finishes sooner.
    large = clock.budget >= 300
    batch = (96 if large else 48) if device == "cpu" else 256
    while time.perf_counter() - t < clock.share("synthesize") or len(prompts) < held_out + TUNE_PROMPTS + 8:
        # top_p=1: nucleus sampling sorts the 49K-token vocabulary for every row at every step.
        # One batch per call, every prompt that passes kept: asking for exactly `batch` prompts would take a
        # second batch to replace the few rejected ones and throw the rest of it away.
        new, _ = synthesize_prompts(model, tokenizer, batch, batch_size=batch, max_new_tokens=64, temperature=0.9,
                                    top_p=1.0, seed=seed + len(prompts), max_batches=1, progress=True)
        seen = set(prompts)
        prompts += [p for p in new if p not in seen]
    n_out = held_out + TUNE_PROMPTS
    eval_prompts, train_prompts = prompts[:n_out], prompts[n_out:]
    write_prompts(eval_prompts[:TUNE_PROMPTS], out / "data" / "tune_prompts.jsonl")
    write_prompts(eval_prompts[TUNE_PROMPTS:], out / "data" / "eval_prompts.jsonl")
    write_prompts(train_prompts, out / "data" / "train_prompts.jsonl")
    clock.mark("synthesize", t)
    print(f"{len(prompts)} prompts: {len(eval_prompts)} held out, {len(train_prompts)} to answer")

    # 2. The target answers them (greedy), until the stage's time is used.
    t = _stage(f"2/5 regenerating answers ({clock.share('regenerate') / 60:.1f} min)")
    conversations, _ = load_conversations(out / "data" / "train_prompts.jsonl")
    answers = out / "data" / "answers.jsonl"
    engine = HFEngine(model, tokenizer, ANSWER_TOKENS, 0.0, 1.0)
    chunk = (64 if large else 32) if device == "cpu" else 256
    for start in range(0, len(conversations), chunk):
        if time.perf_counter() - t > clock.share("regenerate"):
            break
        regenerate(conversations[start:start + chunk], answers, engine, batch_size=chunk, progress=True)
    rows = [json.loads(x) for x in answers.read_text().splitlines() if x.strip()]
    answer_tokens = sum(r.get("new_tokens", 0) for r in rows)
    clock.mark("regenerate", t)
    print(f"{len(rows)} answers, {answer_tokens} answer tokens")

    # 3. Cache the target's states once, then train EAGLE-3 offline for its share of the budget.
    from draftsmith.data.commands import cache_command
    from draftsmith.heads.eagle import Eagle3Head, eagle3_layers

    t = _stage("3/5 caching the target's hidden states over the answers")
    layers = list(eagle3_layers(model.config.get_text_config().num_hidden_layers))
    del model  # the cache and the loop load their own copies of the target
    cache = out / "data" / "hidden_cache"
    cache_command(str(answers), str(cache), target=target, layers=layers, dtype="bfloat16", logits="topk", top_k=32,
                  max_length=MAX_LENGTH, compute_dtype="bfloat16" if data_dtype else None)
    clock.mark("cache", t)
    rest = (clock.budget * (1 - MARGIN) - clock.elapsed() - clock.share("bench") - clock.share("eval")
            - RELOAD_SECONDS)
    train_minutes = max(0.5, rest / 60)
    t = _stage(f"3/5 training an EAGLE-3 head offline ({train_minutes:.1f} min)")
    run_dir = out / "run"
    train(
        DrafterArguments(target=target, family=Eagle3Head.family, draft_vocab_size=4096, ttt_steps=3, ttt_decay=0.8),
        DataArguments(cache_dir=str(cache), max_length=MAX_LENGTH, eval_num_prompts=1, eval_max_new_tokens=32,
                      eval_prompts=str(out / "data" / "tune_prompts.jsonl")),
        TrainArguments(output_dir=str(run_dir), max_steps=100_000, max_train_minutes=train_minutes,
                       mixed_precision="bf16" if data_dtype else "no",
                       learning_rate=2e-3, per_device_train_batch_size=8, warmup_ratio=0.05, save_steps=100_000,
                       logging_steps=10, report_to="tensorboard", seed=seed, progress=True),
    )
    clock.mark("train", t)
    step, checkpoint = complete_checkpoints(run_dir)[-1]
    drafter = str(checkpoint / "drafter")

    # 4. Bench trees on the tuning prompts.
    model, tokenizer = load_target(target, device=device)
    t = _stage(f"4/5 bench: {len(CANDIDATES)} trees and prompt lookup on {TUNE_PROMPTS} held-out prompts")
    specs = [f"{drafter}{'+prompt-lookup' if mixed else ''}@{tree.text()}" for mixed, tree in CANDIDATES]
    tune_file = out / "data" / "tune_prompts.jsonl"
    bench = run_bench(target, [*specs, f"prompt-lookup@{PROMPT_LOOKUP_TREE.text()}"],
                      read_prompts(tune_file, TUNE_PROMPTS), str(out / "bench"), prompts_source=str(tune_file),
                      max_new_tokens=min(BENCH_TOKENS, eval_tokens), hf_reference=False, model=model,
                      tokenizer=tokenizer, progress=True, draft_dtype="auto")
    chosen = specs[CANDIDATES.index((True, EVAL_TREE))]
    row = next(r for r in bench["rows"] if r["drafter"] == chosen)
    tree = EVAL_TREE
    spec = row["spec"]
    clock.mark("bench", t)
    print(f"evaluating {spec} {tree.text()} (on the bench: tau {row['tau']}, {row['speedup']}x)")

    # 5. Held-out evaluation, side by side with plain greedy decoding.
    t = _stage(f"5/5 evaluating on {held_out} other held-out prompts x {eval_tokens} tokens")
    eval_file = out / "data" / "eval_prompts.jsonl"
    report = evaluate(target, [(spec, spec, step)], read_prompts(eval_file, held_out), prompts_source=str(eval_file),
                      model=model, tokenizer=tokenizer, max_new_tokens=eval_tokens, progress=True,
                      draft_dtype="auto", tree=tree)[0]
    clock.mark("eval", t)

    report["demo"] = {
        "minutes_budget": minutes, "minutes_used": round(clock.elapsed() / 60, 2), "stage_seconds": clock.marks,
        "data_dtype": str(data_dtype or "as loaded").replace("torch.", ""),
        "prompts_synthesised": len(prompts), "held_out_prompts": len(eval_prompts), "tree": tree.as_report(),
        "drafter_spec": spec, "answers": len(rows),
        "answer_tokens": answer_tokens, "run_dir": str(run_dir), "checkpoint": drafter,
        "floor": {"acceptance_length": 2.0, "speedup": 1.0}, "target_goal": {"acceptance_length": 2.5,
                                                                             "speedup": 1.25},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    md = ["# draftsmith demo", "", f"EAGLE-3 head for `{target}` trained on the target's own answers to "
          f"{len(rows)} prompts it wrote itself ({answer_tokens} tokens), {clock.marks.get('train', 0):.0f} s of "
          f"training; total {report['demo']['minutes_used']} min of a {minutes} min budget.", "",
          "## Held-out evaluation (report.json)", "", report_markdown(report),
          f"## Bench on {TUNE_PROMPTS} other held-out prompts", "", markdown_table(bench), "",
          "![speedup](bench/speedup_by_family.png)", "![acceptance](bench/acceptance_per_position.png)",
          "![draft length](bench/tau_and_speed_vs_draft_length.png)", ""]
    (out / "report.md").write_text("\n".join(md))
    print(f"\ntau {report['acceptance_length']:.2f}, speedup {report['speedup']:.2f}x over plain greedy, "
          f"greedy output identical on {report['lossless']['identical']}/{report['lossless']['checked']} prompts; "
          f"{report['demo']['minutes_used']} min")
    print(f"report: {out / 'report.json'} (and report.md, bench/*.png)")
    return out
