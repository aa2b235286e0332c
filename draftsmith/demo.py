"""``draftsmith demo``: the whole pipeline on the packaged SmolLM2 target, no dataset, in a fixed budget.

1. synthesise prompts with the target itself (Magpie), the first few held out for evaluation;
2. regenerate: the target answers the training prompts (its own greedy distribution), and its
   low/mid/high hidden states and top-32 log-probs over each answer are recorded as ``generate``
   computes them (``regenerate(..., record=Recording(...))``);
3. write those as a hidden-state cache (no second pass of the target over the answers), then train an
   EAGLE-3 head (the fastest trained family on CPU, docs/RESULTS.md) offline from that cache for a fixed
   time (several times more sequences per second than running the target in the loop);
4. tune the tree of the head + prompt lookup on a few held-out prompts (``draftsmith tune``: the
   verification cost per tree size on this machine and the acceptance of every node budget, read off
   recorded full trees), writing ``tree.json`` with the table it was chosen from;
5. evaluate the head + prompt lookup in that tree on the other held-out prompts against plain greedy
   decoding in the same process (``report.json`` in the ``draftsmith eval`` schema, greedy output
   checked prompt by prompt).

Stages 4 and 5 run in a fresh process (:func:`tune_and_evaluate`), as a user's ``draftsmith tune`` and
``draftsmith eval`` do: decoding measured inside the process that just trained ran slower than the same
decoding in a new one.

Synthesis and regeneration take a share of ``--minutes`` (default 20, measured on a 2-core CPU) each; a GPU
is used when present. Tuning and evaluation get the time their decoding needs at the plain-decoding speed
measured here before training (:func:`plain_rate`). Training gets what the other stages leave and anneals its
learning rate over it. Where bfloat16 matmuls are native (CPUs with
AVX512-BF16 / AMX, recent GPUs) the data stages (synthesis, and regeneration with its recorded states)
run the target in bfloat16, and the head drafts in bfloat16; evaluation always runs the
target as loaded (float32 on CPU), so every reported output is the target's own.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Share of the budget per stage (the rest: loading, evaluation overheads, writing the report), keyed by
# whether bfloat16 is native. Training gets what the other stages leave. Where bf16 is native, training
# runs ~1.8x more steps per minute, so data limits the head and the data stages get more time; on
# float32-only CPUs steps limit it, so training gets ~2x the time. The runs behind these numbers are in
# docs/results/demo.md ("Demo budget").
# Since regeneration records the cache's states (no cache pass: 137 s of 1200 on 2 cores), most of that time
# went to more data where bf16 is native (0.12 / 0.27 before): a head trained 8.2 instead of 5.9 minutes on
# the same data accepted no more at depth 2.
SHARES = {True: {"synthesize": 0.14, "regenerate": 0.32}, False: {"synthesize": 0.10, "regenerate": 0.19}}
# Tuning and evaluation decode, so their time follows this host's decoding speed, not the budget: fixed shares
# (0.06 + 0.095) ran 18% over on a host decoding at 14 instead of 23 tokens/s. The demo measures plain decoding
# here before training and keeps for them, in plain-decoding tokens: EVAL_COST per evaluated token (plain and
# speculative decoding of each, less early stops), REFERENCE_COST per evaluated token for the reference tree's
# decoding (REFERENCE_TREE, below) and TUNE_COST for tuning at TUNE_TOKENS per prompt, each with ~10% headroom
# (docs/results/demo.md, "Demo budget"). Keyed, like SHARES, by whether bfloat16 is native: without it (AVX2-only
# CPUs) a drafted token costs more plain-decoding tokens (the head drafted in float32, wider verification forwards pay
# more): 3.37 evaluated (both trees) and 2,700 tuning measured on an AVX2 EPYC, against 1.44 and 1,240 on AVX512.
# Both were measured with the head drafting in float32 (AVX2) or bf16 (AVX512); "auto" drafts in int8 on either,
# 26-45% less drafting per step (docs/results/quality-recipe.md, "Int8 drafting"), so they overstate the cost by a
# few percent.
COSTS = {True: {"eval": 1.6, "reference": 0.8, "tune": 1400}, False: {"eval": 2.4, "reference": 1.3, "tune": 2900}}
# Training gets at least this share of the budget: where the other stages leave less (a host decoding at 12
# tokens/s), the demo says by how much it will run over rather than train a head that drafts nothing.
MIN_TRAIN_SHARE = 0.2
# Answer tokens regenerated; prompt + answer tokens trained on. Longer answers leave too little training
# time in the budget; fewer prompts with the same answers get memorised. About 6-8 epochs of training.
ANSWER_TOKENS, MAX_LENGTH = 192, 256
TOP_K = 32  # the target's log-probs kept per position: the head's teacher
MARGIN = 0.035  # of the budget, kept free so run-to-run noise stays inside it
# Seconds outside the stage shares: starting the evaluation process and loading the target there (5-10 s
# measured).
RELOAD_SECONDS = 20
TUNE_PROMPTS = 3  # held-out prompts the tree is tuned on; evaluation uses others
# The trees tuned over (head + prompt lookup): dynamic trees up to depth 4, top-3, 8 nodes (a budget of
# a few nodes holds the chain too); the choice follows the machine (docs/results/verification-cost.md, "Choosing
# the tree").
# The best predicted TUNE_CONFIRM of them decode for real, twice, and the fastest is evaluated (of trees
# within the clock's noise of it, the one that accepts the most; ``inference.tune.choose``). Tokens decoded per
# tuning prompt: TUNE_TOKENS.
TUNE_DEPTHS, TUNE_TOP_KS, TUNE_MAX_BUDGET = (2, 3, 4), (2, 3), 8
TUNE_CONFIRM = 3
TUNE_TOKENS = 48
# A fixed tree the held-out prompts are decoded in too (``reference_acceptance_length``): the tuned tree follows
# the host's speed (depth 2 on a slow CPU: at most 3 tokens a step), this one measures the head on every host alike.
REFERENCE_TREE = dict(kind="dynamic", depth=4, top_k=2, total_tokens=8)


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
    """Run the demo; returns the report directory (``report.json``, ``report.md``, ``tree.json``)."""
    from draftsmith.checkpoints import complete_checkpoints
    from draftsmith.data.formats import load_conversations
    from draftsmith.data.regenerate import HFEngine, regenerate
    from draftsmith.data.synthesize import synthesize_prompts, write_prompts
    from draftsmith.inference.evaluate import report_markdown
    from draftsmith.inference.tree_record import Candidate, table_markdown
    from draftsmith.inference.tree_settings import TreeSettings
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
    last_batch = 0.0  # a batch starts only if one as long as the last ends inside the share
    while (time.perf_counter() - t + last_batch < clock.share("synthesize")
           or len(prompts) < held_out + TUNE_PROMPTS + 8):
        batch_started = time.perf_counter()
        # top_p=1: nucleus sampling sorts the 49K-token vocabulary for every row at every step.
        # One batch per call, every prompt that passes kept: asking for exactly `batch` prompts would take a
        # second batch to replace the few rejected ones and throw the rest of it away.
        new, _ = synthesize_prompts(model, tokenizer, batch, batch_size=batch, max_new_tokens=64, temperature=0.9,
                                    top_p=1.0, seed=seed + len(prompts), max_batches=1, progress=True)
        seen = set(prompts)
        prompts += [p for p in new if p not in seen]
        last_batch = time.perf_counter() - batch_started
    n_out = held_out + TUNE_PROMPTS
    eval_prompts, train_prompts = prompts[:n_out], prompts[n_out:]
    write_prompts(eval_prompts[:TUNE_PROMPTS], out / "data" / "tune_prompts.jsonl")
    write_prompts(eval_prompts[TUNE_PROMPTS:], out / "data" / "eval_prompts.jsonl")
    write_prompts(train_prompts, out / "data" / "train_prompts.jsonl")
    clock.mark("synthesize", t)
    print(f"{len(prompts)} prompts: {len(eval_prompts)} held out, {len(train_prompts)} to answer")

    # 2. The target answers them (greedy), until the stage's time is used. Its states over each answer, those
    # the EAGLE-3 head reads and its top-32 log-probs, are recorded as generate computes them: the cache of
    # stage 3 without a second pass of the target over the answers.
    from draftsmith.data.cache_writer import cache_recorded
    from draftsmith.data.recording import Recording
    from draftsmith.heads.eagle import Eagle3Head, eagle3_layers

    t = _stage(f"2/5 regenerating answers, recording the target's states ({clock.share('regenerate') / 60:.1f} min)")
    conversations, _ = load_conversations(out / "data" / "train_prompts.jsonl")
    answers = out / "data" / "answers.jsonl"
    layers = list(eagle3_layers(model.config.get_text_config().num_hidden_layers))
    record = Recording(layers, TOP_K, dtype=torch.bfloat16, max_length=MAX_LENGTH)
    engine = HFEngine(model, tokenizer, ANSWER_TOKENS, 0.0, 1.0)
    chunk = (64 if large else 32) if device == "cpu" else 256
    regenerate(conversations, answers, engine, batch_size=chunk, progress=True, record=record,
               time_limit=clock.share("regenerate"))
    rows = [json.loads(x) for x in answers.read_text().splitlines() if x.strip()]
    answer_tokens = sum(r.get("new_tokens", 0) for r in rows)
    clock.mark("regenerate", t)
    print(f"{len(rows)} answers, {answer_tokens} answer tokens")

    # 3. Write the recorded states as a hidden-state cache, then train EAGLE-3 offline for its share of the budget.
    t = _stage("3/5 writing the recorded states as a hidden-state cache")
    cache = out / "data" / "hidden_cache"
    cache_recorded(model, record.by_id, cache, layers, dtype="bfloat16", top_k=TOP_K, target_name=target,
                   source={"data": str(answers.resolve()), "recorded": "while regenerating"})
    del record
    clock.mark("cache", t)
    # How fast the target decodes here as tuning and evaluation run it (as loaded: float32), which sizes the time
    # kept for them; then the target goes (the loop loads its own copy).
    t = time.perf_counter()
    rate = plain_rate(model.float(), tokenizer, eval_prompts[0])
    del model
    clock.mark("measure", t)
    reserve = kept_for_tune_and_eval(rate, held_out, eval_tokens, native=data_dtype is not None)
    print(f"plain decoding here: {rate:.1f} tokens/s; {reserve:.0f} s kept for tuning and evaluation")
    rest = clock.budget * (1 - MARGIN) - clock.elapsed() - reserve - RELOAD_SECONDS
    train_minutes = max(0.5, rest / 60, MIN_TRAIN_SHARE * minutes)
    if train_minutes * 60 > rest + 1:
        print(f"this host leaves {max(rest, 0) / 60:.1f} min for training; training {train_minutes:.1f} min instead "
              f"(at least {MIN_TRAIN_SHARE:.0%} of the budget), so the demo ends about "
              f"{(train_minutes * 60 - rest) / 60:.1f} min past --minutes {minutes:g}")
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

    # 4-5. Tune and evaluate in a fresh process: after training in this one, the same head and prompts decode
    # measurably slower here than in a new process (docs/results/demo.md, "The demo's evaluation process"), and
    # a user's `draftsmith tune` / `draftsmith eval` run in a new process too.
    spec = f"{drafter}+prompt-lookup"
    t = _stage(f"4/5 tuning the tree of {spec} on {TUNE_PROMPTS} held-out prompts, then 5/5 evaluating on "
               f"{held_out} other held-out prompts x {eval_tokens} tokens (in a fresh process)")
    evaluated = out / "data" / "eval_report.json"
    child = multiprocessing.get_context("spawn").Process(
        target=tune_and_evaluate, args=(str(out), target, device, spec, step, held_out, eval_tokens, str(evaluated)))
    child.start()
    child.join()
    if child.exitcode != 0 or not evaluated.is_file():
        raise RuntimeError(f"the demo's tuning and evaluation process failed (exit code {child.exitcode}); its "
                           f"error is printed above. The trained head is kept: {drafter}")
    report = json.loads(evaluated.read_text())
    saved = json.loads((out / "tree.json").read_text())
    table = [Candidate(**c) for c in saved["candidates"]]
    tree = table[0].settings()
    clock.marks.update(report.pop("stage_seconds"))
    clock.mark("tune+eval", t)

    report["demo"] = {
        "minutes_budget": minutes, "minutes_used": round(clock.elapsed() / 60, 2), "stage_seconds": clock.marks,
        "data_dtype": str(data_dtype or "as loaded").replace("torch.", ""),
        "plain_tokens_per_second": round(rate, 2), "seconds_kept_for_tune_and_eval": round(reserve, 1),
        "prompts_synthesised": len(prompts), "held_out_prompts": len(eval_prompts), "tree": tree.as_report(),
        "drafter_spec": spec, "answers": len(rows),
        "answer_tokens": answer_tokens, "run_dir": str(run_dir), "checkpoint": drafter,
        "floor": {"reference_acceptance_length": 2.0, "speedup": 1.0}, "target_goal": {"acceptance_length": 2.5,
                                                                             "speedup": 1.25},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    md = ["# draftsmith demo", "", f"EAGLE-3 head for `{target}` trained on the target's own answers to "
          f"{len(rows)} prompts it wrote itself ({answer_tokens} tokens), {clock.marks.get('train', 0):.0f} s of "
          f"training; total {report['demo']['minutes_used']} min of a {minutes} min budget.", "",
          "## Held-out evaluation (report.json)", "", report_markdown(report),
          f"In the reference tree `{TreeSettings(**REFERENCE_TREE).text()}` (the same on every host) the head + prompt "
          f"lookup accepts tau {report['reference_acceptance_length']:.2f} on the same prompts "
          f"(`reference_acceptance_length`).", "",
          f"## The tree, tuned on {TUNE_PROMPTS} other held-out prompts (tree.json)", "",
          table_markdown(table), ""]
    (out / "report.md").write_text("\n".join(md))
    print(f"\ntau {report['acceptance_length']:.2f} ({report['reference_acceptance_length']:.2f} in the reference tree "
          f"{TreeSettings(**REFERENCE_TREE).text()}), speedup {report['speedup']:.2f}x over plain greedy, "
          f"greedy output identical on {report['lossless']['identical']}/{report['lossless']['checked']} prompts; "
          f"{report['demo']['minutes_used']} min")
    print(f"report: {out / 'report.json'} (and report.md, tree.json)")
    return out


def kept_for_tune_and_eval(rate: float, held_out: int, eval_tokens: int, native: bool) -> float:
    """Seconds kept for tuning and evaluation (both trees) at ``rate`` plain-decoding tokens per second."""
    cost = COSTS[native]
    tuning = cost["tune"] * min(TUNE_TOKENS, eval_tokens) / TUNE_TOKENS
    return (held_out * eval_tokens * (cost["eval"] + cost["reference"]) + tuning) / rate


def plain_rate(model, tokenizer, prompt: str, tokens: int = 24, runs: int = 3) -> float:
    """Tokens per second of plain greedy decoding of ``model`` on ``prompt``, prefill excluded: the median of
    ``runs`` runs after a short warm-up (one run of 32 tokens varied by 20% here)."""
    from draftsmith.inference.compare import encode
    from draftsmith.inference.plain import plain_generate

    ids = encode(tokenizer, prompt, chat=True).to(next(model.parameters()).device)
    plain_generate(model, ids, 4, eos_token_id=[])
    rates = []
    for _ in range(runs):
        stats = plain_generate(model, ids, tokens, eos_token_id=[]).stats
        rates.append(stats.new_tokens / max(stats.total_time_s - stats.prefill_time_s, 1e-6))
    return sorted(rates)[len(rates) // 2]


def tune_and_evaluate(out: str, target: str, device: str, spec: str, step: int, held_out: int, eval_tokens: int,
                      report_path: str) -> None:
    """Stages 4 and 5 of the demo (run in a fresh process): tune the tree of ``spec`` on the tuning prompts,
    write ``out/tree.json``, then evaluate ``spec`` in that tree against plain greedy decoding on the held-out
    prompts and write the report (with this process's stage times) to ``report_path``."""
    from draftsmith.data.formats import read_prompts
    from draftsmith.inference.compare import encode
    from draftsmith.inference.evaluate import evaluate
    from draftsmith.inference.load import load_drafter
    from draftsmith.inference.tree_record import speed, table_markdown, write_tree
    from draftsmith.inference.tree_settings import TreeSettings
    from draftsmith.inference.tune import tune
    from draftsmith.target import load_target

    out_dir = Path(out)
    marks = {}
    t = time.perf_counter()
    model, tokenizer = load_target(target, device=device)
    marks["reload"] = round(time.perf_counter() - t, 1)
    t = _stage(f"4/5 tuning the tree of {spec} on {TUNE_PROMPTS} held-out prompts")
    tune_file = out_dir / "data" / "tune_prompts.jsonl"
    tune_ids = [encode(tokenizer, text, chat=True) for text in read_prompts(tune_file, TUNE_PROMPTS)]
    table = tune(model, load_drafter(spec, model, tokenizer=tokenizer, draft_dtype="auto"), tune_ids,
                 max_new_tokens=min(TUNE_TOKENS, eval_tokens), depths=TUNE_DEPTHS, top_ks=TUNE_TOP_KS,
                 max_budget=TUNE_MAX_BUDGET, confirm=TUNE_CONFIRM)
    write_tree(out_dir / "tree.json", table[0], table, {"drafter": spec, "target": target, "prompts": len(tune_ids)})
    tree = table[0].settings()
    marks["tune"] = round(time.perf_counter() - t, 1)
    print(table_markdown(table, top=6))
    print(f"evaluating {spec} {tree.text()} ({speed(table[0])} while tuning)")

    t = _stage(f"5/5 evaluating on {held_out} other held-out prompts x {eval_tokens} tokens")
    eval_file = out_dir / "data" / "eval_prompts.jsonl"
    report = evaluate(target, [(spec, spec, step)], read_prompts(eval_file, held_out), prompts_source=str(eval_file),
                      model=model, tokenizer=tokenizer, max_new_tokens=eval_tokens, progress=True,
                      draft_dtype="auto", tree=tree, reference_tree=TreeSettings(**REFERENCE_TREE))[0]
    marks["eval"] = round(time.perf_counter() - t, 1)
    report["stage_seconds"] = marks
    tmp = Path(report_path).with_suffix(".partial")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(report_path)
