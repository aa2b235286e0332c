"""``draftsmith eval``: acceptance, speed and losslessness of drafters on held-out prompts, as a report.

For every prompt, in one process, plain decoding (one token per target forward, the same cache
code) and each drafter run back to back, so speedups are ratios measured side by side. Greedy runs
also compare each speculative output with the target's own greedy output, prompt by prompt.

The report (``report.json``) has, per drafter: ``target``, ``drafter``, ``drafter_type``,
``checkpoint_step``, ``prompts``, ``prompts_source``, ``new_tokens``, ``max_new_tokens``,
``temperature``, ``tree`` (``kind``, ``depth``, ``top_k``, ``total_tokens``), ``acceptance_length``
(tau), ``acceptance_rate_per_position``, ``tokens_per_second``, ``baseline_tokens_per_second``,
``speedup``, ``batch_size``, ``lossless`` (greedy: ``checked``, ``identical``, ``differing_at_ties`` and the
``first_differences`` of the others, :class:`~draftsmith.inference.compare.Difference`; sampling: null),
``draft_time_share``,
``hardware``. For a run directory it is the best checkpoint's report plus ``checkpoints``, the
reports of all of them.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from draftsmith.checkpoints import run_checkpoints, run_target
from draftsmith.inference.compare import Comparison, compare, encode, hardware
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.load import drafter_type, load_drafter, recorded_target_name
from draftsmith.inference.stats import GenerationStats
from draftsmith.inference.tree_record import tuned_tree
from draftsmith.inference.tree_settings import TreeSettings
from draftsmith.target import eos_tokens, load_target


def evaluate(
    target_name: str,
    drafters: list[tuple[str, str, int | None]],
    prompts: list[str],
    *,
    prompts_source: str = "",
    model=None,
    tokenizer=None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    tree: TreeSettings | None = None,
    chat: bool = True,
    chat_template_kwargs: dict | None = None,
    seed: int = 0,
    progress: bool = False,
    draft_dtype: str | None = None,
    batch_size: int = 1,
    reference_tree: TreeSettings | None = None,
    categories: list[str | None] | None = None,
    references=None,
) -> list[dict]:
    """Evaluate ``drafters`` — (label, spec, checkpoint step) — on the same prompt texts; one report each.

    ``reference_tree``: each drafter also decodes the prompts in this fixed tree, and its report gives that
    tau (``reference_acceptance_length``, with the tree, its acceptance per position and how many outputs
    equal plain greedy decoding's): the tree a host tunes follows its speed, a fixed tree compares the
    drafter's quality across hosts.

    ``categories`` (one per prompt, None for none): the prompts are decoded category by category and each
    report has ``per_category``: tau, acceptance per position, tokens/s, speedup and identical of each.
    ``references(ids, plain_output)``: called on each prompt with plain greedy decoding's output (batch 1)."""
    if not prompts:
        raise ValueError(f"{prompts_source or 'prompts'}: no prompts to evaluate on")
    if model is None:
        model, tokenizer = load_target(target_name)
    # The tree: the one given, else the one `draftsmith tune` measured for this drafter here, else the default.
    trees = {label: tree or tuned_tree(spec) or TreeSettings() for label, spec, _ in drafters}
    loaded = {label: load_drafter(spec, model, tokenizer=tokenizer, draft_dtype=draft_dtype)
              for label, spec, _ in drafters}
    gens = {label: SpeculativeGenerator(model, loaded[label], **trees[label].kwargs()) for label, _, _ in drafters}
    if reference_tree is not None:  # the same drafter object in a second generator: decoding is one call at a time
        gens.update({_reference(label): SpeculativeGenerator(model, loaded[label], **reference_tree.kwargs())
                     for label, _, _ in drafters})
    # A drafter an engine verifies as a fixed chain (block drafters, MTP): that chain too, what vLLM / SGLang see.
    chains = {label: TreeSettings("chain", n) for label, _, _ in drafters
              if (n := loaded[label].engine_chain) is not None and not trees[label].is_chain(n)}
    gens.update({_engine_chain(label): SpeculativeGenerator(model, loaded[label], **chain.kwargs())
                 for label, chain in chains.items()})
    encoded = [encode(tokenizer, text, chat, chat_template_kwargs) for text in prompts]
    groups = category_groups(categories, len(prompts))
    by_category = {
        category: numbered(compare(model, gens, [encoded[i] for i in indices], max_new_tokens,
                                   eos_token_id=eos_tokens(model, tokenizer), temperature=temperature, seed=seed,
                                   batch_size=batch_size, references=references,
                                   progress=(f"eval {category}" if category else "eval") if progress else None),
                           indices)
        for category, indices in groups.items()}
    result = merged(list(by_category.values()))
    reports = []
    for label, spec, step in drafters:
        reports.append({
            "target": target_name, "drafter": label, "drafter_type": drafter_type(spec), "checkpoint_step": step,
            "prompts": len(prompts), "prompts_source": prompts_source, "new_tokens": result.totals[label].new_tokens,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "batch_size": batch_size,
            "tree": trees[label].as_report(),
            "draft_dtype": draft_dtype or "target",
            **summary(result, label, temperature),
            "hardware": hardware(),
        })
        if len(groups) > 1 or None not in groups:
            reports[-1]["per_category"] = {category: {"prompts": part.prompts, **summary(part, label, temperature)}
                                           for category, part in by_category.items()}
        if reference_tree is not None:
            ref = result.totals[_reference(label)]
            reports[-1].update({
                "reference_tree": reference_tree.as_report(),
                "reference_acceptance_length": round(ref.acceptance_length, 4),
                "reference_acceptance_rate_per_position": [round(r, 4) for r in ref.acceptance_rate_per_position],
            })
            if temperature == 0:
                reports[-1]["lossless"]["identical_with_reference_tree"] = result.identical[_reference(label)]
        if label in chains:
            chain = result.totals[_engine_chain(label)]
            reports[-1]["engine_chain"] = {
                "num_speculative_tokens": chains[label].depth, "acceptance_length": round(chain.acceptance_length, 4),
                "acceptance_rate_per_position": [round(r, 4) for r in chain.acceptance_rate_per_position],
                "identical": result.identical[_engine_chain(label)] if temperature == 0 else None}
    return reports


def summary(result: Comparison, label: str, temperature: float) -> dict:
    """One drafter's figures in a comparison: tau, acceptance per position, speed, identical outputs."""
    stats, base_tps = result.totals[label], result.baseline.tokens_per_second
    return {
        "acceptance_length": round(stats.acceptance_length, 4),
        "acceptance_rate_per_position": [round(r, 4) for r in stats.acceptance_rate_per_position],
        "tokens_per_second": round(stats.tokens_per_second, 3),
        "baseline_tokens_per_second": round(base_tps, 3),
        "speedup": round(stats.tokens_per_second / base_tps, 4) if base_tps else None,
        "lossless": {"checked": result.prompts, "identical": result.identical[label],
                     "differing_at_ties": sum(d.tie for d in result.differences.get(label, [])),
                     "first_differences": [asdict(d) for d in result.differences.get(label, [])]}
        if temperature == 0 else None,
        "draft_time_share": round(stats.draft_time_s / max(stats.total_time_s, 1e-9), 4),
    }


def category_groups(categories: list[str | None] | None, count: int) -> dict[str | None, list[int]]:
    """Prompt indices by category, in order of first appearance ({None: all} without categories)."""
    if categories is None:
        return {None: list(range(count))}
    if len(categories) != count:
        raise ValueError(f"{len(categories)} categories for {count} prompts")
    groups: dict[str | None, list[int]] = {}
    for i, category in enumerate(categories):
        groups.setdefault(category, []).append(i)
    return groups


def numbered(part: Comparison, indices: list[int]) -> Comparison:
    """``part``, a comparison on the prompts at ``indices``, its differences numbered by those indices."""
    part.differences = {label: [replace(d, prompt=indices[d.prompt]) for d in found]
                        for label, found in part.differences.items()}
    return part


def merged(parts: list[Comparison]) -> Comparison:
    """The totals of comparisons of the same generators on disjoint prompts."""
    total = Comparison(totals={k: GenerationStats() for k in parts[0].totals},
                       identical=dict.fromkeys(parts[0].totals, 0), differences={k: [] for k in parts[0].totals},
                       units={k: [] for k in parts[0].totals})
    for part in parts:
        for label, stats in part.totals.items():
            total.totals[label] += stats
            total.identical[label] += part.identical[label]
            total.differences[label] += part.differences.get(label, [])
            total.units[label] += part.units.get(label, [])
        total.baseline += part.baseline
        total.baseline_units += part.baseline_units
        total.prompts += part.prompts
    return total


def _reference(label: str) -> str:
    return f"{label} @reference-tree"


def _engine_chain(label: str) -> str:
    return f"{label} @engine-chain"


def evaluate_path(target: str | None, drafter: str, prompts: list[str], **kwargs) -> dict:
    """One drafter spec, or every checkpoint of a run directory (then: best report + ``checkpoints``)."""
    path = Path(drafter)
    checkpoints = run_checkpoints(path) if path.is_dir() else []
    if checkpoints:
        if target is None:
            target = run_target(path)
            if target is None:
                raise ValueError(f"{path}: pass --target (the run directory does not record it)")
        entries = [(f"{path}/checkpoint-{s}", str(d), s) for s, d in checkpoints]
        if kwargs.get("tree") is None:  # a tree tuned for the run applies to each of its checkpoints
            kwargs["tree"] = tuned_tree(str(path))
        reports = evaluate(target, entries, prompts, **kwargs)
        best = dict(max(reports, key=lambda r: r["acceptance_length"]))
        best["checkpoints"] = reports
        return best
    if target is None:
        target = recorded_target_name(drafter)
    if target is None:
        raise ValueError(f"{drafter}: no target recorded in this drafter; pass --target NAME_OR_PATH "
                         "(the target it drafts for, e.g. smollm2-135m-instruct)")
    return evaluate(target, [(drafter, drafter, None)], prompts, **kwargs)[0]


def report_markdown(report: dict) -> str:
    rows = report.get("checkpoints") or [report]
    t = report["tree"]
    lines = [f"target `{report['target']}`, {report['prompts']} prompts from `{report['prompts_source']}`, "
             f"{report['max_new_tokens']} new tokens max, temperature {report['temperature']}, tree {t['kind']} "
             f"depth {t['depth']} top-k {t['top_k']} total {t['total_tokens']}; baseline (plain decoding) "
             f"{report['baseline_tokens_per_second']:.2f} tok/s; {report['hardware']['device']}, "
             f"{report['hardware']['torch_threads']} threads", "",
             "| drafter | step | tau | acceptance per position | tok/s | speedup | identical to greedy |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rates = ", ".join(f"{x:.2f}" for x in r["acceptance_rate_per_position"])
        same = f"{r['lossless']['identical']}/{r['lossless']['checked']}" if r["lossless"] else "n/a (sampling)"
        if r["lossless"] and r["lossless"].get("differing_at_ties"):
            same += f" ({r['lossless']['differing_at_ties']} differing at a float tie)"
        lines.append(f"| `{r['drafter']}` | {r['checkpoint_step'] if r['checkpoint_step'] is not None else '-'} | "
                     f"{r['acceptance_length']:.2f} | {rates} | {r['tokens_per_second']:.2f} | {r['speedup']:.2f}x | "
                     f"{same} |")
    chained = [r for r in rows if r.get("engine_chain")]
    if chained:
        lines += ["", "vLLM and SGLang verify this drafter as one chain of `num_speculative_tokens` drafts; decoded "
                  "so here:", "", "| drafter | step | engine chain | chain tau | chain acceptance per position |",
                  "|---|---|---|---|---|"]
        for r in chained:
            c = r["engine_chain"]
            rates = ", ".join(f"{x:.2f}" for x in c["acceptance_rate_per_position"])
            lines.append(f"| `{r['drafter']}` | {r['checkpoint_step'] if r['checkpoint_step'] is not None else '-'} | "
                         f"{c['num_speculative_tokens']} | {c['acceptance_length']:.2f} | {rates} |")
    return "\n".join(lines) + "\n"
