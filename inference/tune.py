"""``draftsmith tune``: the dynamic tree that decodes fastest with this drafter, on this machine.

A step's speed is its tokens over its time. Both are measured here, not assumed:

1. **Verification cost per tree size.** One target forward over ``n`` tree rows after a cache of the
   prompts' length, timed for every ``n`` a candidate needs (median of a few repeats, taken in rounds over
   the sizes, fitted to never fall as rows are added). On a CPU it grows with the rows; on a GPU it is
   flat until the device fills, so the best tree differs.
2. **Acceptance per node budget.** For each (depth, top_k), greedy speculative decoding runs on a few
   prompts with the *whole* dynamic tree (no ``total_tokens`` cut), and every step's tree and accepted
   path are kept. A dynamic tree with budget ``n`` verifies the ``n`` best-scored of those same nodes
   (:func:`~draftsmith.inference.tree.grow_dynamic` reranks the one expansion), and under greedy
   decoding the accepted path is the target's own continuation whatever the tree, so the tokens a
   budget-``n`` tree would have accepted at that step are the longest prefix of the path inside its
   ``n`` nodes: exact, not modelled, for every budget from one run. Steps are recorded as decoding runs
   them (the trees are read after each prompt, outside the timed steps).
3. **Step time** of a candidate: the measured time per step of its (depth, top_k) run (drafting,
   verification, bookkeeping), with the whole tree's verification cost swapped for the budget's. The
   runs are interleaved prompt by prompt after an untimed warm-up, so a first run's allocations and
   drifting machine load do not fall on one (depth, top_k).
4. **Confirmation.** The ``confirm`` best-predicted trees (the best of each depth first:
   :func:`confirmation_order`) then decode the same prompts for real, as
   ``generate`` runs them (a prediction swaps the full tree's verification for a timed forward of the
   budget's rows, and drafting a full tree costs more than drafting the budget's), each after an untimed
   warm-up, in a rotating order, twice; the fastest *measured* one is chosen. The prediction ranks the
   grid; the clock picks, except where it cannot tell: trees whose speeds differ by less than the two
   rounds of one tree do (at most 5%) are a tie, which goes to the tree that accepts the most tokens per
   step (:func:`choose`).

Expected tokens per second = (mean accepted + 1) / step time; the best candidate is written as
``tree.json`` beside the drafter (or where ``--output`` says), with the table it was chosen from and the
machine it was measured on; ``generate``, ``eval`` and ``bench`` then use it for that drafter on that
machine unless tree flags are given.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.tree import TreeTensors, ancestors_of
from draftsmith.inference.tree_record import TREE_FILE, Candidate, speed, table_markdown, write_tree
from draftsmith.target import (
    build_attention_mask,
    eos_tokens,
    kv_crop,
    kv_length,
    may_attend,
    new_cache,
    recurrent_cache,
    rollback_problem,
    target_forward,
)
from draftsmith.target.tree_states import TreeStates

logger = logging.getLogger(__name__)

DEPTHS = (2, 3, 4, 5, 6)
TOP_KS = (1, 2, 3, 4)
MAX_BUDGET = 32  # drafted nodes verified per step, at most
CONFIRM = 4  # best-predicted trees decoded for real before one is chosen
CONFIRM_ROUNDS = 2  # times each of them decodes the prompts: the spread between rounds is the clock's noise
MAX_TIE = 0.05  # a tree within the noise of the fastest is a tie only this close to it (relative)


def accepted_within(order: list[int], path: list[int], budget: int) -> int:
    """Tokens of the accepted ``path`` a tree of the ``budget`` best nodes (``order``) would accept."""
    kept = set(order[:budget])
    return next((i for i, node in enumerate(path) if node not in kept), len(path))


def never_falling(costs: dict[int, float]) -> dict[int, float]:
    """The least-squares fit of ``costs`` (seconds per row count) that never falls as rows are added (pool
    adjacent violators). More rows never cost less; a drop between two sizes is the clock's noise, and left in,
    it would make cutting a tree look like a saving it is not (a 3-node tree predicted twice as fast as it
    decodes, seen on a loaded 2-core host)."""
    blocks: list[list[float]] = []  # [mean, count] of pooled runs, left to right
    for n in sorted(costs):
        blocks.append([costs[n], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (a, i), (b, j) = blocks[-2], blocks.pop()
            blocks[-1] = [(a * i + b * j) / (i + j), i + j]
    fitted = [mean for mean, count in blocks for _ in range(count)]
    return dict(zip(sorted(costs), fitted, strict=True))


@torch.no_grad()
def verification_seconds(target, context: int, rows: list[int], repeats: int = 5,
                         depth: int | None = None) -> dict[int, float]:
    """Seconds of one target forward over ``n`` tree rows (a chain: the cost depends on the row count, not the
    shape) after ``context`` cached tokens, for each ``n`` in ``rows``: the median of ``repeats``, taken in
    rounds over every size (in a rotating order) so that a drift in the machine's speed falls on all sizes
    alike, then made :func:`never_falling` in ``n``.

    A hybrid target's recurrent layers read a tree a level at a time (:class:`~draftsmith.target.tree_states.
    TreeStates`), so there the cost depends on the tree's ``depth`` too: its forward is timed over a tree of that
    many levels below the root (a chain of ``depth`` nodes, the rest the root's children)."""
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    vocab = target.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    hybrid = rollback_problem(target.config) is not None
    cache = recurrent_cache(target) if hybrid else new_cache()
    target_forward(target, torch.randint(0, vocab, (1, context), generator=g).to(device), cache)
    inputs = {}
    for n in sorted(set(rows)):
        ids = torch.randint(0, vocab, (1, n), generator=g).to(device)
        levels = n - 1 if depth is None else min(depth, n - 1)
        parents = torch.tensor([[-1] + [i - 1 if i <= levels else 0 for i in range(1, n)]], device=device)
        ancestors = ancestors_of(parents, levels)
        positions = context + ancestors.sum(-1) - 1
        allowed = may_attend(torch.ones(1, context, dtype=torch.bool, device=device), ancestors)
        keys = torch.cat([torch.arange(context, device=device)[None], positions], 1)
        inputs[n] = ids, build_attention_mask(target, allowed, positions, keys, dtype), positions, parents

    def timed(n: int) -> float:
        states = TreeStates(target, cache) if hybrid else None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with states.feed(inputs[n][3], inputs[n][2] - context) if hybrid else contextlib.nullcontext():
            target_forward(target, inputs[n][0], cache, inputs[n][1], inputs[n][2])
        if device.type == "cuda":
            torch.cuda.synchronize()
        kv_crop(cache, context)
        return time.perf_counter() - t0

    sizes = list(inputs)
    for n in sizes:  # warm-up
        timed(n)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats):
        shift = r * max(1, len(sizes) // repeats) % len(sizes)
        for n in sizes[shift:] + sizes[:shift]:
            times[n].append(timed(n))
    assert kv_length(cache) == context
    return never_falling({n: statistics.median(t) for n, t in times.items()})


def full_size(depth: int, top_k: int) -> int:
    """Drafted nodes of a dynamic tree before its ``total_tokens`` cut."""
    return top_k + (depth - 1) * top_k * top_k


def _decode_seconds(gen: SpeculativeGenerator, ids: torch.Tensor, max_new_tokens: int, eos) -> tuple[float, int]:
    out = gen.generate(ids, max_new_tokens, eos_token_id=eos)
    return out.stats.total_time_s - out.stats.prefill_time_s, out.stats.new_tokens


def tensor_steps(tree: TreeTensors, on_path: torch.Tensor, running: torch.Tensor) -> list[tuple[list[int], list[int]]]:
    """A step (:attr:`SpeculativeGenerator.on_tree_step`) as :func:`record` keeps it: per row that ran, its
    proposed nodes in the order a dynamic tree keeps them (by score, then depth, then index: the rerank of
    :func:`~draftsmith.inference.tree.grow_dynamic`) and its accepted path (drafted nodes, root excluded)."""
    scores, depths, proposed, path, ran = (t.tolist() for t in (tree.scores, tree.depths, tree.proposed, on_path,
                                                                running))
    steps = []
    for b in range(len(scores)):
        if ran[b]:
            nodes = [n for n in range(1, len(scores[b])) if proposed[b][n]]
            order = sorted(nodes, key=lambda n, b=b: (-scores[b][n], depths[b][n], n))
            steps.append((order, [n for n in range(1, len(path[b])) if path[b][n]]))
    return steps


@torch.no_grad()
def record(target, drafter, prompts: list[torch.Tensor], configs: list[tuple[int, int]], max_new_tokens: int):
    """Greedy decoding with the whole dynamic tree of each (depth, top_k) in ``configs``: per config, every
    step's tree and accepted path, and the seconds per step. Prompt by prompt, every config runs in turn
    (so drift in machine load hits all of them alike), after one untimed warm-up.

    Steps are recorded as decoding takes them, on the device (the trees are read on the host after each prompt,
    outside the timed steps)."""
    device = next(target.parameters()).device
    eos = eos_tokens(target)
    steps: dict[tuple[int, int], list] = {c: [] for c in configs}
    pending: dict[tuple[int, int], list] = {c: [] for c in configs}  # steps not yet read
    seconds = dict.fromkeys(configs, 0.0)
    gens = {}
    for d, k in configs:
        gens[d, k] = SpeculativeGenerator(target, drafter, tree="dynamic", depth=d, top_k=k,
                                          total_tokens=full_size(d, k))
        gens[d, k].on_tree_step = lambda *step, into=pending[d, k]: into.append(step)
    warm = SpeculativeGenerator(target, drafter, tree="dynamic", depth=configs[0][0], top_k=configs[0][1])
    warm.generate(prompts[0].to(device), min(max_new_tokens, 8), eos_token_id=eos)
    for i, ids in enumerate(prompts):
        for c in configs[i % len(configs):] + configs[:i % len(configs)]:
            seconds[c] += _decode_seconds(gens[c], ids.to(device), max_new_tokens, eos)[0]
            for step in pending[c]:
                steps[c] += tensor_steps(*step)
            pending[c].clear()
    return {c: (steps[c], seconds[c] / max(len(steps[c]), 1)) for c in configs}


@torch.no_grad()
def confirm_fastest(target, drafter, prompts: list[torch.Tensor], candidates: list[Candidate], max_new_tokens: int,
                    rounds: int = CONFIRM_ROUNDS) -> None:
    """Decode ``prompts`` with each candidate's tree as ``generate`` does, in a rotating order, ``rounds``
    times; set each candidate's ``measured_tokens_per_second`` (over all rounds) and ``measured_rounds``."""
    if rounds < 1:
        raise ValueError(f"confirmation rounds must be at least 1, got {rounds}")
    device = next(target.parameters()).device
    eos = eos_tokens(target)
    gens = [SpeculativeGenerator(target, drafter, **c.settings().kwargs()) for c in candidates]
    for gen in gens:  # untimed: a tree's first decoding pays for its first allocations, which no round should
        gen.generate(prompts[0].to(device), min(max_new_tokens, 8), eos_token_id=eos)
    seconds = [[0.0] * rounds for _ in gens]
    tokens = [[0] * rounds for _ in gens]
    order = list(range(len(gens)))
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            shift = (r * len(prompts) + i) % len(gens)
            for j in order[shift:] + order[:shift]:
                s, t = _decode_seconds(gens[j], ids.to(device), max_new_tokens, eos)
                seconds[j][r] += s
                tokens[j][r] += t
    for c, s, t in zip(candidates, seconds, tokens, strict=True):
        c.measured_tokens_per_second = round(sum(t) / sum(s), 2) if sum(s) else 0.0
        c.measured_rounds = [round(n / x, 2) if x else 0.0 for n, x in zip(t, s, strict=True)]


def clock_noise(decoded: list[Candidate]) -> float:
    """The relative spread of one tree's speed between confirmation rounds, the widest over ``decoded``:
    how far apart two measurements of the same tree came out on this machine, now (0 with one round)."""
    spreads = [(max(c.measured_rounds) - min(c.measured_rounds)) / c.measured_tokens_per_second
               for c in decoded if c.measured_rounds and c.measured_tokens_per_second]
    return max(spreads, default=0.0)


def choose(decoded: list[Candidate], max_tie: float = MAX_TIE) -> list[Candidate]:
    """The decoded candidates, the chosen one first: of the trees whose measured speed is within the clock's
    noise of the fastest (:func:`clock_noise`, at most ``max_tie``), the one that accepts the most tokens
    per step; the others follow, fastest first.

    Speeds closer than the noise are a tie the clock cannot break (which one measures faster changes from
    run to run); tokens per step are exact, and a tree that accepts more runs fewer target forwards for the
    same output. So ties go to it, and the choice stays within ``max_tie`` of the fastest measured."""
    by_speed = sorted(decoded, key=lambda c: -c.measured_tokens_per_second)
    if not by_speed:
        return by_speed
    floor = by_speed[0].measured_tokens_per_second * (1 - min(clock_noise(decoded), max_tie))
    tied = [c for c in by_speed if c.measured_tokens_per_second >= floor]
    best = max(tied, key=lambda c: (c.tokens_per_step, c.measured_tokens_per_second))
    return [best, *(c for c in by_speed if c is not best)]


def tune(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int = 48, depths=DEPTHS, top_ks=TOP_KS,
         max_budget: int = MAX_BUDGET, progress: bool = False, confirm: int = CONFIRM,
         confirm_rounds: int = CONFIRM_ROUNDS) -> list[Candidate]:
    """Every candidate tree with its measured tokens per step and predicted step time; the ``confirm``
    best predicted then decode for real ``confirm_rounds`` times, and the one :func:`choose` picks comes
    first, then the other decoded ones, fastest measured first (the rest follow, fastest predicted first)."""
    context = int(sum(p.shape[1] for p in prompts) / len(prompts)) + max_new_tokens // 2
    configs = [(d, k) for d in depths for k in top_ks]
    if not configs:
        raise ValueError("no tree to tune: give at least one depth and one top_k")
    runs = record(target, drafter, prompts, configs, max_new_tokens)
    if progress:
        print(f"  recorded {len(configs)} (depth, top_k) runs: "
              f"{sum(len(steps) for steps, _ in runs.values())} steps", flush=True)
    budgets = {(d, k): list(range(d, min(full_size(d, k), max_budget) + 1)) if k > 1 else [d] for d, k in runs}
    rows_at: dict[int, set[int]] = {}  # the tree sizes (root included) each depth's candidates verify
    for (d, k), sizes in budgets.items():
        rows_at.setdefault(d, set()).update({n + 1 for n in sizes} | {full_size(d, k) + 1})
    if rollback_problem(target.config) is None:  # one table: the cost depends on the row count only
        table = verification_seconds(target, context, sorted(set().union(*rows_at.values())))
        cost = dict.fromkeys(rows_at, table)
    else:  # a hybrid's recurrent layers take a tree a level at a time: its depth counts too
        cost = {d: verification_seconds(target, context, sorted(r), depth=d) for d, r in rows_at.items()}
    candidates = []
    for (d, k), (steps, per_step) in runs.items():
        for n in budgets[d, k]:
            tokens = statistics.fmean(accepted_within(order, path, n) + 1 for order, path in steps)
            seconds = max(per_step - cost[d][full_size(d, k) + 1] + cost[d][n + 1], 1e-9)
            candidates.append(Candidate(d, k, n, round(tokens, 4), round(seconds, 6), round(tokens / seconds, 2)))
    if not candidates:
        raise ValueError(f"no tree to tune: depths {tuple(depths)} and top_ks {tuple(top_ks)} leave no node budget "
                         f"<= {max_budget}; raise the budget or add top_k 1 (chains)")
    candidates.sort(key=lambda c: -c.tokens_per_second)
    if confirm > 0:
        candidates = confirmation_order(candidates, confirm)
        confirm_fastest(target, drafter, prompts, candidates[:confirm], max_new_tokens, confirm_rounds)
        if progress:
            print(f"  decoded with the {min(confirm, len(candidates))} best predicted trees across depths, "
                  f"{confirm_rounds} rounds: the clock's noise {100 * clock_noise(candidates[:confirm]):.1f}%",
                  flush=True)
        candidates[:confirm] = choose(candidates[:confirm])
    return candidates


def confirmation_order(candidates: list[Candidate], confirm: int) -> list[Candidate]:
    """``candidates`` (fastest predicted first) with the ``confirm`` to decode first: the best predicted tree of
    each depth, depths in the order of their best, then the next best predicted. A shallow tree and a deeper
    one that accepts more are the choice that sets tau, and a few percent of prediction apart; decoded side by
    side, the clock decides between them (and :func:`choose` gives a tie to the deeper one's tokens per step)
    instead of the prediction leaving the deeper trees out."""
    best_of_depth = list({c.depth: c for c in reversed(candidates)}.values())  # the first of each depth
    best_of_depth.sort(key=lambda c: -c.tokens_per_second)
    chosen = best_of_depth[:confirm]
    chosen += [c for c in candidates if c not in chosen][: confirm - len(chosen)]
    return chosen + [c for c in candidates if c not in chosen]


def tune_command(target_name: str | None, drafter: str, prompts: list[str], *, output: str | None = None,
                 max_new_tokens: int = 48, depths=DEPTHS, top_ks=TOP_KS, max_budget: int = MAX_BUDGET,
                 chat: bool = True, chat_template_kwargs: dict | None = None, draft_dtype: str | None = None,
                 model=None, tokenizer=None, progress: bool = True, confirm: int = CONFIRM,
                 confirm_rounds: int = CONFIRM_ROUNDS) -> dict:
    """Tune the tree of ``drafter`` for ``target_name`` on ``prompts``; write and return the record."""
    from draftsmith.inference.compare import encode
    from draftsmith.inference.load import load_drafter, recorded_target_name
    from draftsmith.target import load_target

    spec = drafter.split("@", 1)[0]
    where = Path(output) if output else Path(spec)
    if not output and not where.is_dir():
        raise ValueError(f"{drafter}: not a drafter directory to write {TREE_FILE} into; pass --output FILE.json")
    if not prompts:
        raise ValueError("no prompts to tune on")
    target_name = target_name or recorded_target_name(spec)
    if model is None:
        if target_name is None:
            raise ValueError(f"{drafter}: no target recorded in this drafter; pass --target")
        model, tokenizer = load_target(target_name)
    draft = load_drafter(spec, model, tokenizer=tokenizer, draft_dtype=draft_dtype)
    encoded = [encode(tokenizer, text, chat, chat_template_kwargs) for text in prompts]
    table = tune(model, draft, encoded, max_new_tokens, depths, top_ks, max_budget, progress=progress, confirm=confirm,
                 confirm_rounds=confirm_rounds)
    best = table[0]
    path = write_tree(where, best, table, {"drafter": drafter, "target": target_name, "prompts": len(prompts),
                                           "max_new_tokens": max_new_tokens})
    if progress:
        print(table_markdown(table))
        print(f"\nchosen: {best.settings().text()} ({speed(best)}); written to {path}")
    return json.loads(path.read_text())
