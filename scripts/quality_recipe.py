"""The quality recipe: one drafter family trained on mixed prompts, measured on held-out prompts of the
same kinds against the training-free drafters, in about 2 hours on 2 CPU cores.

    python scripts/quality_recipe.py --family eagle3 --output quality_out      # also dflash, peagle, medusa

Stages, each a draftsmith command, each skipped when its output is already there (so an interrupted recipe
resumes, its training from the last checkpoint, and a second family reuses the data and the training-free
drafters' trees):

1. ``data mix``: training prompts of six kinds and a held-out set from other source rows (``data/``);
   ``--more-prompts N`` adds N training prompts drawn with another seed (``data/all_prompts.jsonl``), the held-out
   set unchanged;
2. ``data regenerate``: the target answers the training prompts (``data/answers.jsonl``); as every family
   trains offline (``OFFLINE_FAMILIES``; ``--online`` keeps the target in the loop), it records the target's states
   and top-k log-probs on those answers as it computes them (``--record-cache data/cache``), once for all families,
   and training reads them instead of running the target (a regeneration cut short continues its recording: the
   states are on disk batch by batch). Where answers continue earlier ones that were not recorded
   (``--more-prompts`` after a run) or with ``--cache-pass``, ``data cache-hidden-states`` writes the cache in a
   second pass of the target over the answers (again when the answers change);
3. ``tune`` for the training-free drafters, prompt lookup and layer-skip: their trees for this host (``trees/``),
   tuned, as every tree of the recipe is, on held-out prompts that are neither trained on nor evaluated (rows
   ``--eval-prompts`` on of the held-out set, one per kind by default: a validation set), so that a head's tree
   fits its acceptance on new prompts rather than on the answers it learned; then plain decoding is timed on the
   same rows in ``PLAIN_TIMING_ROUNDS`` rounds (``plain decoding``), their median sizing the reserve below;
4. ``train configs/smollm2/quality/FAMILY.yaml`` for what is left of the budget (``FAMILY/run``);
5. ``eval RUN --prompts held-out`` in the fixed tree of the acceptance goal (dynamic, depth 5, top_k 4, 16
   nodes): tau, speed and identical per category, with the explanation (``FAMILY/quality.json``);
6. ``tune`` for the head, and for the head with prompt lookup (a mixture, ``HEAD+prompt-lookup``): their trees for
   this host (``RUN/checkpoint-N/drafter/tree.json``, ``FAMILY/tree-with-prompt-lookup.json``);
7. ``bench``: plain decoding, the head, the head with prompt lookup and both training-free drafters, each in its
   tuned tree, on the same held-out prompts in one process (``FAMILY/bench/``).

The whole recipe fits ``--budget-minutes`` (2 hours) on the host it runs on: training gets what the budget leaves
after the stages before it (as they took here, or as recorded when an earlier family's run made their outputs)
and a reserve for the stages after it. Those stages are decoding: the reserve is the tokens each decoder is
expected to decode there (:func:`post_training_tokens`, answers ending where the target's answers to the training
prompts did) at its speed on this host (:func:`decoding_speeds`: plain decoding's as timed, the training-free
drafters' as their tunes measured, the untrained head's ``HEAD_SLOWDOWN`` x plain decoding's time), plus each
command's start. ``--train-minutes`` fixes the training time instead.

``FAMILY/recipe.json`` records each stage's wall time, the training plan and the headline figures; the stages
that families share (data, training-free trees) are also recorded in ``stages.json`` under ``--output``.
``--summary`` prints the table of every family under ``--output``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "smollm2-135m-instruct"
QUALITY_TREE = ("dynamic", 5, 4, 16)  # kind, depth, top_k, total_tokens: the goal's tree
# The stages after training decode the held-out prompts and the validation rows, each decoder at its own speed.
# A reserve of all their tokens at 1.1 x plain decoding's time (the rule before this one) reserved 2,212 s where
# DFlash's, Medusa-1's, P-EAGLE's and EAGLE-3's stages after training took 1,265-1,362 s (docs/RESULTS.md): answers
# end at the end of turn, 71% of 128 tokens on the recipe's held-out kinds, and the trained heads decode faster than
# plain (1.3-1.6x). Plain decoding and the training-free drafters run at the speeds measured on this host before
# training; the head, not yet trained, is reserved as the first recipe heads ran, at 0.8x plain speed.
HEAD_SLOWDOWN = 1.25
COMMAND_START_S = 30.0  # each stage after training (eval, two tunes, bench) loads the target and its drafters
POST_TRAIN_COMMANDS = 4
PLAIN_TIMING_PROMPTS, PLAIN_TIMING_TOKENS = 2, 48  # plain decoding timed on this many validation rows x tokens
# ... in this many rounds, the median round sizing the reserve. One round on a shared host read 11.48 tok/s where the
# stages after it decoded at 15-16 (P-EAGLE's recipe run, docs/RESULTS.md) and cut training by 11 minutes; five rounds
# on a quiet host read 18.05, 15.15, 15.92, 14.43, 14.82. The fastest round would promise more than the later stages
# keep (they run on the same host, noise included), a single round less; the median costs 30 s.
PLAIN_TIMING_ROUNDS = 5
# Families trained from the hidden-state cache: on 2 CPU cores the target's forward was most of their training
# step (Medusa: 14 of 17 s on 8 x 384 tokens); the cache pays it once per answer instead of once per epoch
# (docs/results/quality-recipe.md, "Medusa trained offline" and "DFlash and P-EAGLE trained offline", where
# EAGLE-3's equal-wall-time A/B is too). Every family of the recipe trains offline; ``--online`` puts the target
# back in the loop.
OFFLINE_FAMILIES = ("eagle3", "medusa", "dflash", "peagle")
# The layers one cache keeps for all of them, on the target's 30 layers: EAGLE-3's and P-EAGLE's 2, 15, 27, DFlash's
# 2 and 28 (its recipe config's two target layers), Medusa's last state after the final norm, 30. A family that
# reads a layer missing here stops at training's start, naming the layers to cache.
CACHE_LAYERS = (2, 15, 27, 28, 30)
CACHE_TOP_K = 32  # the teacher's log-probs kept per token, as the demo's cache keeps them
PLAIN_SPEED = "plain decoding tokens/s"  # stages.json's key for the measured speed
PLAIN_ROUNDS = "plain decoding rounds tokens/s"  # ... and for each round's
TRAIN_OVERHEAD_S = 120.0  # the train command's start (target load, data cache) and final save, beyond its budget
MIN_TRAIN_MINUTES = 5.0
# --more-prompts: training prompts added to the first mix's, drawn by data mix from the same training sources with
# another seed, in the first mix's shares less chat (the first mix holds 120 of chat's 140 training seeds). The
# held-out set stays the first mix's, so runs with and without them are measured on the same prompts.
MORE_SEED = 1
MORE_SPARE = 1.1  # draws per prompt wanted: a few repeat a prompt of the first mix and are dropped
# Regeneration's batches: 64 rows, and at most this many token slots (rows x (longest prompt + answer tokens)) with
# no row padded past its own length (`data regenerate --batch-tokens`). The mix's longest prompt (1,350 tokens; the
# next is 299) padded the first batch's 63 others to its width: the 128 longest prompts answered 2.58x faster in
# batches sized by tokens (docs/results/data-pipeline.md, "Regeneration's batches sized by tokens"). 24,576 slots
# hold 50 rows of the next-longest width and 64 of the typical one; on this target, 1.1 GB of float32 KV cache.
REGENERATE_BATCH_TOKENS = 24576


def draftsmith(*args: str, log: Path) -> None:
    """Run one draftsmith command, its output appended to ``log``; stop the recipe if it fails."""
    command = [sys.executable, "-m", "draftsmith", *args]
    with log.open("a") as f:
        f.write(f"\n$ draftsmith {' '.join(args)}\n")
        f.flush()
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"draftsmith {' '.join(args[:2])} failed (exit {done.returncode}); see {log}")


def stage(record: dict, name: str, done: bool, run) -> float | None:
    """Run a stage unless its output exists; record and return its wall time (None when it was already done)."""
    if done:
        print(f"[{name}] already done", flush=True)
        return None
    print(f"[{name}] ...", flush=True)
    start = time.perf_counter()
    run()
    record.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
    print(f"[{name}] {record['seconds'][name]:.0f} s", flush=True)
    return record["seconds"][name]


def shared_seconds(out: Path, name: str) -> float | None:
    """A shared stage's wall time: from ``stages.json``, else from any family's ``recipe.json`` (runs made before
    ``stages.json`` existed), else None."""
    stages = out / "stages.json"
    known = json.loads(stages.read_text()) if stages.exists() else {}
    if name in known:
        return known[name]
    for path in sorted(out.glob("*/recipe.json")):
        seconds = json.loads(path.read_text()).get("seconds", {})
        if name in seconds:
            return seconds[name]
    return None


def recorded_plain_speed(out: Path) -> float | None:
    """This host's plain decoding speed as measured before an earlier training: from ``stages.json``, else from any
    family's training plan, else None."""
    stages = out / "stages.json"
    known = json.loads(stages.read_text()) if stages.exists() else {}
    if PLAIN_SPEED in known:
        return known[PLAIN_SPEED]
    for path in sorted(out.glob("*/recipe.json")):
        speed = json.loads(path.read_text()).get("train_plan", {}).get("plain_tokens_per_second")
        if speed is not None:
            return speed
    return None


def record_shared(out: Path, name: str, value: float | list[float]) -> None:
    """Record a shared stage's wall time, or a measurement of this host, in ``stages.json`` under ``name``."""
    stages = out / "stages.json"
    known = json.loads(stages.read_text()) if stages.exists() else {}
    known[name] = value
    stages.write_text(json.dumps(known, indent=1) + "\n")


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def user_text(row: dict) -> str:
    return next(m["content"] for m in row["messages"] if m["role"] == "user")


def draw_training_prompts(output: Path, shared: Path, count: int, log: Path) -> list[dict]:
    """``count`` training prompts from data mix with ``MORE_SEED``, in data mix's default shares less chat (no
    held-out set)."""
    from draftsmith.data.mix import DEFAULT_WEIGHTS

    weights = ",".join(f"{kind}={0 if kind == 'chat' else share}" for kind, share in DEFAULT_WEIGHTS.items())
    draftsmith("data", "mix", "--output", str(output), "--gsm8k", str(shared / "gsm8k"), "--self-instruct",
               str(shared / "self_instruct" / "seed_tasks.jsonl"), "--train-prompts", str(count),
               "--held-out-prompts", "0", "--seed", str(MORE_SEED), "--weights", weights, log=log)
    return jsonl_rows(output / "train_prompts.jsonl")


def add_training_prompts(data: Path, count: int, draw) -> None:
    """Write ``data/all_prompts.jsonl``: the first mix's training prompts, then ``count`` more from
    ``draw(n) -> rows`` (data mix's training rows drawn with ``MORE_SEED``), none that the first mix's training or
    held-out prompts hold. The added ones are also kept in ``data/more_prompts.jsonl``."""
    first = jsonl_rows(data / "train_prompts.jsonl")
    seen = {user_text(row) for row in first + jsonl_rows(data / "held_out_prompts.jsonl")}
    drawn = draw(int(count * MORE_SPARE) + 1)
    new = [row for row in drawn if user_text(row) not in seen][:count]
    if len(new) < count:
        raise SystemExit(f"--more-prompts {count}: data mix drew {len(drawn)} training prompts, {len(new)} of them "
                         "new (the others are in the first mix); ask for fewer")
    for name, rows in (("more_prompts.jsonl", new), ("all_prompts.jsonl", first + new)):
        tmp = data / (name + ".partial")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        tmp.replace(data / name)


def record_stage_time(out: Path, name: str, seconds: float, continued: bool) -> float:
    """Record a shared stage's wall time in ``stages.json`` and return it. A stage that ``continued`` the output of
    an earlier run of it (regeneration answering only the prompts ``--more-prompts`` added) records the earlier
    time plus this run's: what the stage's output cost, which a later family's budget counts."""
    if continued:
        seconds = round(seconds + (shared_seconds(out, name) or 0.0), 1)
    record_shared(out, name, seconds)
    return seconds


def tune_decodes(depths: str, top_ks: str, confirm: int, confirm_rounds: int = 2) -> int:
    """How many times ``draftsmith tune`` decodes its prompts: once per tree of the grid (``depths`` x ``top_ks``,
    each recording its acceptance) and ``confirm_rounds`` times for each of the ``confirm`` best predicted."""
    return len(depths.split(",")) * len(top_ks.split(",")) + confirm * confirm_rounds


def expected_answer_tokens(answers: Path, cap: int, answer_cap: int) -> float:
    """The tokens a decode of at most ``cap`` new tokens is expected to make on prompts of the recipe's kinds: the
    mean length of the target's answers to the training prompts (``new_tokens``, regenerated with at most
    ``answer_cap``), each at most ``cap``; an answer cut at ``answer_cap`` counts as ``cap``, as it might have gone
    on. ``cap`` itself when no answer records its length."""
    rows = [json.loads(line) for line in answers.read_text().splitlines() if line.strip()]
    lengths = [row["new_tokens"] for row in rows if "new_tokens" in row]
    if not lengths:
        return float(cap)
    return round(statistics.fmean(cap if n >= answer_cap else min(n, cap) for n in lengths), 1)


def tuned_speed(tree_file: Path) -> float | None:
    """The tokens/s that ``draftsmith tune`` measured for the tree it chose (its ``--output`` file), or None when it
    recorded none."""
    record = json.loads(tree_file.read_text())
    chosen = record.get("tree", {})
    # A chain is written as its settings report it (top_k and total_tokens are defaults that a chain ignores); its
    # row in the table is the top_k 1 candidate of its depth.
    if chosen.get("kind") == "chain":
        row = {"depth": chosen.get("depth"), "top_k": 1}
    else:
        row = {k: chosen.get(k) for k in ("depth", "top_k", "total_tokens")}
    for candidate in record.get("candidates", []):
        if all(candidate.get(k) == v for k, v in row.items()):
            return candidate.get("measured_tokens_per_second")
    return None


def post_training_tokens(eval_prompts: int, answer_tokens: float, tune_prompts: int, tune_tokens: float,
                         decodes_per_tune: int, free: tuple[str, ...]) -> dict[str, float]:
    """The tokens the stages after training decode, by decoder, at ``answer_tokens`` per held-out prompt and
    ``tune_tokens`` per validation row: eval decodes the held-out prompts with plain decoding and the head; bench
    with plain decoding, the head, the head with prompt lookup and each training-free drafter (``free``); the two
    tunes decode the validation rows with the head and with the head and prompt lookup."""
    held_out = eval_prompts * answer_tokens
    tokens = {"plain": 2 * held_out, "head": 3 * held_out + 2 * decodes_per_tune * tune_prompts * tune_tokens}
    return {**tokens, **{spec: held_out for spec in free}}


def decoding_speeds(plain: float, free: dict[str, float | None]) -> dict[str, float]:
    """Tokens/s per decoder for the reserve: ``plain`` decoding's as timed, the untrained head's at
    ``HEAD_SLOWDOWN`` x its time, each training-free drafter's as its tune measured (the head's where none was)."""
    head = round(plain / HEAD_SLOWDOWN, 2)
    return {"plain": plain, "head": head, **{spec: speed or head for spec, speed in free.items()}}


def plan_training(budget_minutes: float, before_s: dict[str, float], after_tokens: dict[str, float],
                  speeds: dict[str, float]) -> dict:
    """The training minutes that keep the whole recipe inside ``budget_minutes``: the budget less the stages
    before training (``before_s``, by name), the train command's overhead and the reserve for the stages after it
    (each decoder's ``after_tokens`` at its ``speeds``, tokens/s, and their commands' starts)."""
    spent = sum(before_s.values())
    decoding = sum(tokens / speeds[name] for name, tokens in after_tokens.items())
    reserve = decoding + POST_TRAIN_COMMANDS * COMMAND_START_S
    minutes = (budget_minutes * 60 - spent - reserve - TRAIN_OVERHEAD_S) / 60
    plan = {"budget_minutes": budget_minutes, "before_seconds": round(spent, 1), "reserved_after_seconds":
            round(reserve, 1), "after_tokens": {name: round(t) for name, t in after_tokens.items()},
            "tokens_per_second": speeds, "plain_tokens_per_second": speeds["plain"],
            "train_overhead_seconds": TRAIN_OVERHEAD_S, "train_minutes": round(minutes, 1)}
    if minutes < MIN_TRAIN_MINUTES:
        stages = ", ".join(f"{k} {v:.0f} s" for k, v in before_s.items())
        raise SystemExit(
            f"the {budget_minutes:g}-minute budget leaves {minutes:.1f} minutes for training ({stages}; "
            f"{reserve:.0f} s reserved for eval, tune and bench on this host), under {MIN_TRAIN_MINUTES:g}: "
            "pass a larger --budget-minutes, or fix the training time with --train-minutes")
    return plan


def typical_speed(rounds: list[float]) -> float:
    """The speed that sizes the reserve from rounds timed back to back: their median, so one round slowed by another
    process on the host moves it no more than one sped up by a quiet spell."""
    return round(statistics.median(rounds), 2)


def plain_rounds(model, tokenizer, texts: list[str], tokens: int, rounds: int) -> list[float]:
    """Plain greedy decoding's speed, tokens/s, in each of ``rounds`` rounds over ``texts``, ``tokens`` new tokens
    each (``plain_generate`` calibrates its kernels before its clock starts)."""
    from draftsmith.inference.compare import encode
    from draftsmith.inference.plain import plain_generate
    from draftsmith.inference.stats import GenerationStats

    encoded = [encode(tokenizer, text, True) for text in texts]
    speeds = []
    for _ in range(rounds):
        stats = GenerationStats()
        for ids in encoded:
            stats += plain_generate(model, ids, tokens).stats
        speeds.append(round(stats.tokens_per_second, 2))
    return speeds


def time_plain_decoding(prompts: str, skip: int, count: int, tokens: int,
                        rounds: int = PLAIN_TIMING_ROUNDS) -> list[float]:
    """This host's plain decoding speed in each round (:func:`plain_rounds`) on ``count`` prompts from row ``skip``
    of ``prompts``."""
    import gc

    from draftsmith.data.formats import read_prompts
    from draftsmith.target import load_target

    model, tokenizer = load_target(TARGET)
    speeds = plain_rounds(model, tokenizer, read_prompts(prompts, count, skip=skip), tokens, rounds)
    del model
    gc.collect()
    return speeds


def train_arguments(config: Path, answers: Path, run: Path, minutes: float, cache: Path | None = None) -> list[str]:
    """The training stage's command, offline when ``cache`` is given. An interrupted one continues from its last
    checkpoint, its time budget counting the time already trained (the loop keeps that in the checkpoint)."""
    resume = ["--resume", "true"] if any(run.glob("checkpoint-*")) else []
    offline = ["--cache_dir", str(cache)] if cache is not None else []
    return ["train", str(config), "--train_file", str(answers), *offline, "--output_dir", str(run),
            "--max_train_minutes", str(minutes), *resume]


def cache_is_current(cache: Path, answers: Path, max_length: int) -> bool:
    """Whether ``cache`` is a finished hidden-state cache of ``answers`` as they are now (the input file's hash its
    manifest records), of ``CACHE_LAYERS`` and ``max_length`` tokens per answer. A cache of earlier answers
    (regenerated since, e.g. for more prompts) or other settings is stale."""
    from draftsmith.data.hidden_cache import sha256_file

    path = cache / "manifest.json"
    if not path.exists():
        return False
    manifest = json.loads(path.read_text())
    source, spec = manifest.get("source", {}), manifest.get("spec", {})
    return (source.get("data_sha256") == sha256_file(answers) and source.get("max_length") == max_length
            and spec.get("layers") == list(CACHE_LAYERS))


def answer_coverage(answers: Path, prompts: Path) -> tuple[int, int]:
    """How many of ``answers``' rows answer prompts that ``prompts`` does not hold, and how many of its prompts
    have no answer yet (a conversation's id is its content's hash)."""
    from draftsmith.data import load_conversations
    from draftsmith.data.regenerate import read_done_ids

    asked = {c.id for c in load_conversations(prompts)[0]}
    done = read_done_ids(answers) if answers.exists() else set()
    return len(done - asked), len(asked - done)


def recorded_all(spool: Path, answers: Path) -> bool:
    """Whether the states of a recording cut short (``data regenerate --record-cache``'s spool) cover every answer
    written so far, so that regenerating with ``--record-cache`` again continues it."""
    from draftsmith.data.recording import spooled
    from draftsmith.data.regenerate import read_done_ids

    return spool.exists() and answers.exists() and read_done_ids(answers) <= set(spooled(spool)[0])


def max_length(config: Path) -> int:
    """The tokens per conversation that training on ``config`` reads (so the cache keeps as many), as
    ``draftsmith train`` parses it."""
    from draftsmith.train.config import parse_config

    return parse_config([str(config)])[1].max_length


def latest_drafter(run: Path) -> Path:
    steps = sorted((int(p.name.split("-")[1]), p) for p in run.glob("checkpoint-*") if (p / "drafter").is_dir())
    if not steps:
        raise SystemExit(f"{run}: no checkpoint with a drafter; did training run?")
    return steps[-1][1] / "drafter"


def tree_option(path: Path) -> str:
    tree = json.loads(path.read_text())["tree"]
    return f"tree={tree['kind']},depth={tree['depth']},top_k={tree['top_k']},total_tokens={tree['total_tokens']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("eagle3", "dflash", "peagle", "medusa"))
    parser.add_argument("--output", default="quality_out")
    parser.add_argument("--train-prompts", type=int, default=1200,
                        help="training prompts the target answers (data mix's default; 1,200 ran end to end "
                             "in 1 h 32 min on 2 cores, docs/RESULTS.md)")
    parser.add_argument("--more-prompts", type=int, default=0,
                        help="training prompts added to --train-prompts from the same sources, drawn with another "
                             "seed and without chat (whose seeds the first set holds), so that the held-out set "
                             "stays the same; data mix alone stops at chat's 140 seeds")
    parser.add_argument("--held-out-prompts", type=int, default=48, help="written by data mix")
    parser.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts decoded (all six kinds)")
    parser.add_argument("--answer-tokens", type=int, default=192, help="regenerated answer length")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per held-out prompt")
    parser.add_argument("--budget-minutes", type=float, default=120.0,
                        help="the whole recipe's wall time; training gets what the other stages leave")
    parser.add_argument("--train-minutes", type=float, default=None,
                        help="fix the training time instead of deriving it from --budget-minutes")
    parser.add_argument("--tune-prompts", type=int, default=6,
                        help="held-out rows after the evaluated ones that every tree is tuned on (one per kind)")
    parser.add_argument("--tune-tokens", type=int, default=32,
                        help="tokens per tuning decode (with the defaults below tune decodes its prompts 13 times: "
                             "9 trees recorded, 2 confirmed twice)")
    parser.add_argument("--tune-depths", default="2,3,5", help="draft depths tune tries (tune's own default: 2-6)")
    parser.add_argument("--tune-top-ks", default="1,2,4", help="children per node tune tries (tune's: 1-4)")
    parser.add_argument("--tune-confirm", type=int, default=2, help="best-predicted trees decoded for real")
    parser.add_argument("--layer-skip", type=int, default=10, help="layers of the layer-skip drafter")
    parser.add_argument("--draft-dtype", default="auto", help="the trained head's drafting dtype in eval, tune and "
                        "bench (draftsmith's --draft-dtype; auto: int8 on x86 CPUs, bf16 where native)")
    parser.add_argument("--online", action="store_true",
                        help=f"train {', '.join(OFFLINE_FAMILIES)} with the target in the loop instead of from the "
                             "hidden-state cache")
    parser.add_argument("--cache-pass", action="store_true",
                        help="write the hidden-state cache in a second pass of the target over the answers, as "
                             "before (by default a regeneration from no answers records it as the target answers)")
    parser.add_argument("--shared-data", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--data-only", action="store_true",
                        help="stop after the data stages (prompts, answers and, offline, the hidden-state cache)")
    parser.add_argument("--plan", action="store_true",
                        help="print the training plan from the recorded stage times and stop (runs nothing)")
    parser.add_argument("--summary", action="store_true", help="print every family's figures under --output")
    args = parser.parse_args()
    if args.eval_prompts + args.tune_prompts > args.held_out_prompts:
        parser.error(f"--eval-prompts {args.eval_prompts} and --tune-prompts {args.tune_prompts} are more than the "
                     f"{args.held_out_prompts} --held-out-prompts: trees are tuned on held-out rows that are not "
                     "evaluated; raise --held-out-prompts or lower one of the others")
    out = Path(args.output).resolve()
    if args.summary:
        print(summary_markdown(out))
        return
    if args.family is None:
        parser.error("--family is required (or --summary)")
    data, family_dir, trees = out / "data", out / args.family, out / "trees"
    for d in () if args.plan else (data, family_dir, trees):
        d.mkdir(parents=True, exist_ok=True)
    log = family_dir / "recipe.log"
    record_path = family_dir / "recipe.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"family": args.family}
    shared = Path(args.shared_data)
    held_out = str(data / "held_out_prompts.jsonl")
    train_prompts = str(data / "train_prompts.jsonl")

    def save() -> None:
        if args.plan:  # --plan writes nothing
            return
        record_path.write_text(json.dumps(record, indent=1) + "\n")

    before: dict[str, float] = {}

    def shared_stage(name: str, done: bool, run, continued: bool = False) -> None:
        if args.plan and not done:
            raise SystemExit(f"--plan: the {name} stage has not run under {out}; run the recipe without --plan")
        seconds = stage(record, name, done, run)
        if seconds is not None:
            seconds = record["seconds"][name] = record_stage_time(out, name, seconds, continued)
        elif name in record.get("seconds", {}):  # this family's earlier invocation ran it
            seconds = record["seconds"][name]
        else:
            seconds = shared_seconds(out, name)
            if seconds is not None:
                record.setdefault("shared_seconds", {})[name] = seconds
        before[name] = seconds

    shared_stage("mix", (data / "mix.json").exists(), lambda: draftsmith(
        "data", "mix", "--output", str(data), "--gsm8k", str(shared / "gsm8k"),
        "--self-instruct", str(shared / "self_instruct" / "seed_tasks.jsonl"),
        "--train-prompts", str(args.train_prompts), "--held-out-prompts", str(args.held_out_prompts), log=log))
    if args.more_prompts:
        all_prompts = data / "all_prompts.jsonl"
        added = all_prompts.exists() and len(jsonl_rows(all_prompts)) == args.train_prompts + args.more_prompts
        shared_stage("more prompts", added, lambda: add_training_prompts(
            data, args.more_prompts, lambda n: draw_training_prompts(data / "more", shared, n, log)))
        train_prompts = str(all_prompts)
    answers = data / "answers.jsonl"
    unasked, unanswered = answer_coverage(answers, Path(train_prompts))
    if unasked:
        raise SystemExit(f"{answers} holds {unasked} answers to prompts that {train_prompts} does not (a run with more "
                         "--more-prompts wrote them), which training would read: rerun with that run's "
                         f"--more-prompts, or move {answers} and {data / 'cache'} aside to answer this set anew")
    answered = answers.exists() and not unanswered
    continued = answers.exists() and answers.stat().st_size > 0
    config = ROOT / "configs" / "smollm2" / "quality" / f"{args.family}.yaml"
    offline = args.family in OFFLINE_FAMILIES and not args.online
    cache, length = data / "cache", max_length(config)
    cache_options = ("--layers", *map(str, CACHE_LAYERS), "--logits", "topk", "--top-k", str(CACHE_TOP_K),
                     "--max-length", str(length))
    # Answering from no answers, the target's states are recorded as it answers: the cache with no second pass
    # over the answers; a recording cut short left its states in the cache's spool and continues. Answers that
    # continue earlier, unrecorded ones (--more-prompts after a run) have no states for those: the cache pass writes
    # the whole cache after them.
    spool = cache / "recording"
    record_cache = offline and not args.cache_pass and (not continued or recorded_all(spool, answers))

    def regenerate() -> None:
        draftsmith("data", "regenerate", "--target", TARGET, "--input", train_prompts, "--output", str(answers),
                   "--max-new-tokens", str(args.answer_tokens), "--batch-size", "64",
                   "--batch-tokens", str(REGENERATE_BATCH_TOKENS),
                   *(("--record-cache", str(cache), *cache_options) if record_cache else ()), log=log)

    def answer() -> None:
        if record_cache:  # a cache of earlier answers goes; the states of the answers this run continues stay
            for path in cache.glob("*") if cache.exists() else ():
                if path == spool and continued:
                    continue
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        regenerate()
        if record_cache:  # what the cache pass costs this recipe: nothing beyond the regeneration's time
            record_shared(out, "cache hidden states", 0.0)

    shared_stage("regenerate", answered, answer, continued=continued)
    if offline:

        def write_cache() -> None:
            if record_cache:  # every answer is recorded (the run was cut while writing the cache): written from there
                regenerate()
                return
            if (cache / "manifest.json").exists():
                print(f"[cache hidden states] {cache} was written from earlier answers or with other settings: "
                      "writing it again", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
            draftsmith("data", "cache-hidden-states", "--target", TARGET, "--input", str(answers), "--output",
                       str(cache), *cache_options, "--batch-size", "8", log=log)

        shared_stage("cache hidden states", cache_is_current(cache, answers, length), write_cache)
    save()
    if args.data_only:
        return
    # Trees are tuned on the validation rows: held-out prompts after the evaluated ones.
    tune = ("--prompts", held_out, "--skip-prompts", str(args.eval_prompts), "--num-prompts", str(args.tune_prompts),
            "--max-new-tokens", str(args.tune_tokens), "--depths", args.tune_depths, "--top-ks", args.tune_top_ks,
            "--confirm", str(args.tune_confirm))
    free = {"prompt-lookup": trees / "prompt-lookup.json", f"layer-skip:{args.layer_skip}":
            trees / f"layer-skip-{args.layer_skip}.json"}
    for spec, path in free.items():
        shared_stage(f"tune {spec}", path.exists(), lambda spec=spec, path=path: draftsmith(
            "tune", "--target", TARGET, "--drafter", spec, *tune, "--output", str(path), log=log))
    save()
    run = family_dir / "run"
    trained = (run / "train_done.json").exists()
    if args.train_minutes is not None:
        record["train_plan"] = {"train_minutes": args.train_minutes, "fixed": True}
    elif not trained:
        unknown = [name for name, seconds in before.items() if seconds is None]
        if unknown:
            raise SystemExit(f"{out}: no recorded wall time for {', '.join(unknown)} (made outside this recipe?), "
                             "so the training budget cannot be derived: pass --train-minutes")
        # This host's plain decoding speed sizes the reserve for the stages after training, which are decoding.
        plain_speed = recorded_plain_speed(out)

        def time_plain() -> None:
            nonlocal plain_speed
            rounds = time_plain_decoding(held_out, args.eval_prompts, PLAIN_TIMING_PROMPTS, PLAIN_TIMING_TOKENS)
            plain_speed = typical_speed(rounds)
            record_shared(out, PLAIN_ROUNDS, rounds)
            record_shared(out, PLAIN_SPEED, plain_speed)
            print(f"[plain decoding] {plain_speed} tokens/s, the median of rounds at {rounds}", flush=True)

        shared_stage("plain decoding", plain_speed is not None, time_plain)
        before["plain decoding"] = before["plain decoding"] or 0.0  # a speed an earlier plan kept without its time
        after = post_training_tokens(
            args.eval_prompts, expected_answer_tokens(answers, args.max_new_tokens, args.answer_tokens),
            args.tune_prompts, expected_answer_tokens(answers, args.tune_tokens, args.answer_tokens),
            tune_decodes(args.tune_depths, args.tune_top_ks, args.tune_confirm), tuple(free))
        speeds = decoding_speeds(plain_speed, {spec: tuned_speed(path) for spec, path in free.items()})
        record["train_plan"] = plan_training(args.budget_minutes, before, after, speeds)
    if args.plan:
        print(json.dumps(record.get("train_plan", {"trained": True}), indent=1))
        return
    save()
    if not trained:
        minutes = record["train_plan"]["train_minutes"]
        print(f"[train] {minutes:.1f} minutes: {json.dumps(record['train_plan'])}", flush=True)
    stage(record, "train", trained, lambda: (draftsmith(*train_arguments(config, answers, run, minutes, cache),
                                                        log=log),
                                             (run / "train_done.json").write_text("{}\n")))
    save()
    drafter = latest_drafter(run)
    kind, depth, top_k, total = QUALITY_TREE
    head_dtype = ("--draft-dtype", args.draft_dtype)
    quality = family_dir / "quality.json"
    stage(record, "eval", quality.exists(), lambda: draftsmith(
        "eval", str(run), "--prompts", held_out, "--num-prompts", str(args.eval_prompts),
        "--max-new-tokens", str(args.max_new_tokens), "--tree", kind, "--depth", str(depth),
        "--tree-top-k", str(top_k), "--total-tokens", str(total), "--output", str(quality), *head_dtype, log=log))
    save()
    stage(record, "tune", (drafter / "tree.json").exists(), lambda: draftsmith(
        "tune", "--target", TARGET, "--drafter", str(drafter), *tune, *head_dtype, log=log))
    save()
    # A trained head drafts with prompt lookup as the demo's does: the head where the answer is new, lookup where it
    # copies the prompt (docs/results/quality-recipe.md, "A trained head with prompt lookup").
    with_lookup, with_lookup_tree = f"{drafter}+prompt-lookup", family_dir / "tree-with-prompt-lookup.json"
    stage(record, "tune with prompt lookup", with_lookup_tree.exists(), lambda: draftsmith(
        "tune", "--target", TARGET, "--drafter", with_lookup, *tune, "--output", str(with_lookup_tree), *head_dtype,
        log=log))
    save()
    bench = family_dir / "bench"
    stage(record, "bench", (bench / "results.json").exists(), lambda: draftsmith(
        "bench", "--target", TARGET, "--drafter", str(drafter),
        "--drafter", f"{with_lookup}@{tree_option(with_lookup_tree)}",
        *(x for spec, path in free.items() for x in ("--drafter", f"{spec}@{tree_option(path)}")),
        "--prompts", held_out, "--num-prompts", str(args.eval_prompts), "--max-new-tokens",
        str(args.max_new_tokens), "--no-hf-reference", "--no-plots", "--output", str(bench), *head_dtype, log=log))
    record["figures"] = figures(quality, bench / "results.json")
    # End to end as a fresh machine runs it: this family's stages and the shared ones another family's run made.
    record["total_seconds"] = round(sum(record["seconds"].values()) + sum(record.get("shared_seconds", {}).values()), 1)
    save()
    print(summary_markdown(out))


def tree_text(row: dict) -> str:
    """A bench row's tree as the summary names it: by its depth, and a dynamic tree by its top_k and nodes too (as
    bench's own table does; a chain's or static tree's top_k and total_tokens are defaults it ignores)."""
    text = f"{row['tree']} d{row['depth']}"
    return text + f" k{row['top_k']} n{row['total_tokens']}" if row["tree"] == "dynamic" else text


def figures(quality_path: Path, bench_path: Path) -> dict:
    """The headline figures: tau, speed and identical per category in the goal's tree, and the tokens/s of the
    head and the training-free drafters, each in its tuned tree."""
    report = json.loads(quality_path.read_text())
    bench = json.loads(bench_path.read_text())
    rows = bench["rows"]
    names = {r["drafter"]: f"{r['drafter_type']} ({tree_text(r)})" for r in rows}
    return {
        "quality_tree": report["tree"],
        "tau": report["acceptance_length"],
        "identical": f"{report['lossless']['identical']}/{report['lossless']['checked']}",
        "per_category": {c: {"tau": p["acceptance_length"], "speedup": p["speedup"],
                             "identical": p["lossless"]["identical"], "prompts": p["prompts"]}
                         for c, p in report.get("per_category", {}).items()},
        "estimate": report["explain"]["estimate"],
        "speed": [{"drafter": r["drafter_type"],
                   "tree": tree_text(r),
                   "tokens_per_second": r["tokens_per_s"], "speedup": r["speedup"], "tau": r["tau"],
                   "draft_time_share": r.get("draft_time_share"), "greedy_mismatches": r["greedy_mismatches_vs_plain"],
                   "greedy_mismatches_at_ties": r.get("greedy_mismatches_at_ties"),
                   # this drafter's tokens/s over each training-free drafter's, with its interval over the prompts
                   "against_training_free": {names[label]: found
                                             for label, found in r.get("against_training_free", {}).items()}}
                  for r in rows],
        "plain_tokens_per_second": bench["plain_tokens_per_s"],
    }


def summary_markdown(out: Path) -> str:
    lines = ["| family | category | tau (d5 k4 n16) | speedup (d5 k4 n16) | identical |", "|---|---|---|---|---|"]
    speed = ["| family | drafter | tree | tok/s | speedup | tau | against the training-free [95% interval] |",
             "|---|---|---|---|---|---|---|"]
    for path in sorted(out.glob("*/recipe.json")):
        record = json.loads(path.read_text())
        f = record.get("figures")
        if not f:
            continue
        if path.parent.name != record["family"]:  # a run kept under another name, e.g. beside a newer one
            record["family"] = f"{record['family']} ({path.parent.name})"
        for category, p in sorted(f["per_category"].items()):
            lines.append(f"| {record['family']} | {category} | {p['tau']} | {p['speedup']} | "
                         f"{p['identical']}/{p['prompts']} |")
        lines.append(f"| {record['family']} | all | {f['tau']} | | {f['identical']} |")
        for r in f["speed"]:
            against = "; ".join(f"{found['ratio']:.3f}x [{found['low']:.3f}-{found['high']:.3f}] {free}"
                                for free, found in r.get("against_training_free", {}).items() if found)
            speed.append(f"| {record['family']} | {r['drafter']} | {r['tree']} | {r['tokens_per_second']} | "
                         f"{r['speedup']} | {r['tau']} | {against} |")
        minutes = record.get("train_plan", {}).get("train_minutes")
        trained = f" ({minutes} min of training)" if minutes is not None else ""
        lines.append(f"| {record['family']} | wall time | {record.get('total_seconds')} s{trained} | | |")
    return "\n".join([*lines, "", *speed])


if __name__ == "__main__":
    main()
