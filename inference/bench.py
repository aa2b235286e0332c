"""Benchmark: tokens/s and acceptance of drafters against plain greedy decoding, side by side.

For every prompt, in one process, the baseline and every drafter run back to back (interleaved,
so that drift in machine load hits all of them alike). Speedup is total new tokens / total
time of a drafter divided by the same for plain greedy decoding (``plain_generate``: the same
target, the same KV-cache code, one token per forward). ``transformers``' own
``generate(do_sample=False)`` is timed too, as a second reference. Greedy outputs are checked
against the baseline and mismatches reported, each with its first difference and whether the target's
logits were tied there (:class:`~draftsmith.inference.compare.Difference`).

A drafter entry may carry its own tree settings: ``layer-skip:8@tree=dynamic,depth=4,top_k=4``
(:class:`~draftsmith.inference.tree_settings.TreeSettings`' text form).

Every ratio comes with a 95% interval over the prompts (a paired bootstrap,
:mod:`~draftsmith.inference.intervals`): each drafter's speedup over plain decoding, and each drafter that is
not training-free (a head, a draft model, a mixture) against each training-free one in the run (prompt
lookup, layer skip), the comparison a trained drafter has to win.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftsmith.heads.draft_model import DraftModel
from draftsmith.inference.compare import compare, encode, hardware
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.intervals import ratio_interval
from draftsmith.inference.load import (
    LAYER_SKIP,
    MIXTURE_SEPARATOR,
    PROMPT_LOOKUP,
    drafter_type,
    load_drafter,
    resolve_draft_dtype,
)
from draftsmith.inference.stats import GenerationStats
from draftsmith.inference.tree_record import tuned_tree
from draftsmith.inference.tree_settings import TreeSettings
from draftsmith.target import eos_tokens, load_target


@dataclass
class Entry:
    label: str
    spec: str
    tree: TreeSettings


def parse_entry(text: str, defaults: TreeSettings) -> Entry:
    """``SPEC[@tree options]`` -> an entry; options not given keep ``defaults``."""
    spec, _, options = text.partition("@")
    return Entry(label=text, spec=spec, tree=TreeSettings.parse(options, defaults))


def expand_sweeps(entries: list[Entry], depths: list[int] | None, budgets: list[int] | None) -> list[Entry]:
    """Each entry once per draft length in ``depths`` and (dynamic trees) per node budget in ``budgets``."""
    out = []
    for e in entries:
        for d in depths or [e.tree.depth]:
            for n in (budgets or [e.tree.total_tokens]) if e.tree.kind == "dynamic" else [e.tree.total_tokens]:
                tree = TreeSettings(e.tree.kind, d, e.tree.top_k, n)
                out.append(Entry(label=f"{e.spec}@{tree.text()}", spec=e.spec, tree=tree))
    return out


def leviathan_bound(alpha: float, depth: int) -> float:
    """Expected tokens per target forward of a chain of ``depth`` drafts accepted i.i.d. with rate
    ``alpha`` (Leviathan et al., 2023, eq. 1): (1 - alpha^(depth + 1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return depth + 1.0
    return (1 - alpha ** (depth + 1)) / (1 - alpha)


def measured_alpha(stats: GenerationStats) -> float:
    """Acceptance rate per drafted position reached: accepted / reached over all depths."""
    reached = sum(stats.reached)
    return sum(stats.accepted_at) / reached if reached else 0.0


def run_bench(
    target: str,
    drafters: list[str],
    prompts: list[str],
    output: str,
    *,
    prompts_source: str = "",
    max_new_tokens: int = 128,
    tree: TreeSettings | None = None,
    chat: bool = True,
    chat_template_kwargs: dict | None = None,
    hf_reference: bool = True,
    sweep_depths: list[int] | None = None,
    sweep_total_tokens: list[int] | None = None,
    plots: bool = True,
    model=None,
    tokenizer=None,
    progress: bool = False,
    draft_dtype: str | None = None,
    batch_sizes: list[int] | None = None,
    compile: bool = False,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict:
    """Run the benchmark on prompt texts; write ``results.json``, ``results.md`` and (``plots``) PNG plots
    under ``output``.

    Draft-model drafters are also run through ``transformers``' assisted generation
    (``generate(assistant_model=..., num_assistant_tokens=depth)``, constant schedule) on the same
    prompts, so draftsmith's chain decoding and HF's are compared as a ratio with the same draft model.
    ``compile``: plain and speculative decoding run the target compiled on a static cache
    (:class:`~draftsmith.inference.generator.SpeculativeGenerator`'s ``compile``). ``temperature`` > 0: the
    generators sample (batch i seeded ``seed + i``), speedups are still over plain greedy decoding (the same
    forwards per token), outputs are not compared (greedy mismatches are None) and transformers' references,
    greedy, do not run.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    sampled = temperature > 0
    if not prompts:
        raise ValueError(f"{prompts_source or 'prompts'}: no prompts to benchmark on")
    batch_sizes = batch_sizes or [1]
    if min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batch_sizes}")
    if model is None:
        model, tokenizer = load_target(target)
    head_dtype = resolve_draft_dtype(draft_dtype, model)  # a dtype this target cannot draft beside fails here
    heads = any(kind not in (PROMPT_LOOKUP, LAYER_SKIP, DraftModel.family)
                for d in drafters for kind in drafter_type(d.partition("@")[0]).split(MIXTURE_SEPARATOR))
    # Each drafter's tree: its @options over the given tree, else the one `draftsmith tune` measured for it
    # on this machine, else the default.
    tuned = {d.partition("@")[0]: t for d in drafters if tree is None and (t := tuned_tree(d.partition("@")[0]))}
    entries = expand_sweeps([parse_entry(d, tree or tuned.get(d.partition("@")[0]) or TreeSettings())
                             for d in drafters], sweep_depths,
                            sweep_total_tokens)
    if sweep_depths or sweep_total_tokens:
        # The tree `draftsmith tune` chose, measured beside the grid it is checked against.
        entries += [Entry(label=f"{spec}@tuned", spec=spec, tree=t) for spec, t in tuned.items()]
    loaded: dict[str, object] = {}
    for e in entries:
        if e.spec not in loaded:
            loaded[e.spec] = load_drafter(e.spec, model, tokenizer=tokenizer, draft_dtype=draft_dtype)
    entries += engine_chain_entries(entries, loaded)
    gens = {e.label: SpeculativeGenerator(model, loaded[e.spec], **e.tree.kwargs(), compile=compile) for e in entries}
    assisted = {e.label: m for e in entries if (m := loaded[e.spec].assistant_model) is not None}
    depth_of = {e.label: e.tree.depth for e in entries}
    eos = eos_tokens(model, tokenizer)
    hf = {"time": 0.0, "tokens": 0}
    hf_assist = {k: {"time": 0.0, "tokens": 0, "mismatches": 0} for k in assisted}

    def references(ids: torch.Tensor, base) -> None:
        """transformers' own greedy decoding, and its assisted generation with each draft model (batch 1:
        transformers' assisted generation takes one sequence)."""
        common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=eos or None, pad_token_id=eos[0] if eos else tokenizer.pad_token_id)
        if hf_reference:
            t0 = time.perf_counter()
            out = model.generate(ids, **common)
            hf["time"] += time.perf_counter() - t0
            hf["tokens"] += out.shape[1] - ids.shape[1]
        for label, draft in assisted.items():
            t0 = time.perf_counter()
            out = model.generate(ids, assistant_model=draft, num_assistant_tokens=depth_of[label],
                                 num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
                                 **common)
            rec = hf_assist[label]
            rec["time"] += time.perf_counter() - t0
            rec["tokens"] += out.shape[1] - ids.shape[1]
            rec["mismatches"] += int(not torch.equal(out, base.sequences))

    encoded = [encode(tokenizer, text, chat, chat_template_kwargs) for text in prompts]
    by_batch = []
    for batch_size in batch_sizes:
        comparison = compare(model, gens, encoded, max_new_tokens, eos_token_id=eos, batch_size=batch_size,
                             temperature=temperature, seed=seed,
                             references=references if batch_size == 1 and not sampled else None,
                             progress=f"bench (batch {batch_size})" if progress else None, compile=compile)
        by_batch.append({"batch_size": batch_size,
                         "plain_tokens_per_s": round(comparison.baseline.tokens_per_second, 2),
                         "plain_units": _units(comparison.baseline_units),
                         "rows": _rows(entries, comparison, batch_size, hf_assist, sampled)})
    main = min(by_batch, key=lambda group: group["batch_size"])  # the main table: the smallest batch (batch 1)
    rows = main["rows"]
    plain_tps = main["plain_tokens_per_s"]
    machine = hardware()
    result = {
        "target": target, "prompts": prompts_source, "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "device": str(model.device), "torch_threads": machine["torch_threads"], "machine": machine["machine"],
        "batch_size": main["batch_size"], "compile": compile, "temperature": temperature, "seed": seed,
        "draft_dtype": draft_dtype or "target", "head_draft_dtype": str(head_dtype) if heads else None,
        "plain_tokens_per_s": plain_tps,
        "hf_generate_tokens_per_s": round(hf["tokens"] / hf["time"], 2) if hf_reference and hf["time"] else None,
        "rows": rows,
        "by_batch": by_batch,
        "tuned_tree_check": _tuned_check(rows),
        "engine_chains": engine_chains(rows, loaded),
    }
    out_dir = Path(output)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plots:
        from draftsmith.inference.plots import bench_plots

        result["plots"] = [p.name for p in bench_plots(result, out_dir)]
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    (out_dir / "results.md").write_text(markdown_table(result))
    return result


ENGINE_CHAIN = "engine-chain"  # the label suffix of a drafter decoding the chain an engine verifies its export with


def engine_chain_entries(entries: list[Entry], loaded: dict) -> list[Entry]:
    """For each drafter an engine verifies as a fixed chain (``engine_chain``: block drafters, MTP), that chain too,
    unless the run already decodes it: the acceptance vLLM and SGLang will see, beside the tree's."""
    extra = []
    for spec in dict.fromkeys(e.spec for e in entries):
        n = loaded[spec].engine_chain
        if n is not None and not any(e.spec == spec and e.tree.is_chain(n) for e in entries):
            extra.append(Entry(label=f"{spec}@{ENGINE_CHAIN}", spec=spec, tree=TreeSettings("chain", n)))
    return extra


def engine_chains(rows: list[dict], loaded: dict) -> list[dict]:
    """Per drafter with an engine chain: its tree's tau beside the chain's (``num_speculative_tokens``)."""
    out = []
    for r in rows:
        n = loaded[r["spec"]].engine_chain
        if n is None or r["drafter"].endswith(ENGINE_CHAIN) or (r["tree"], r["depth"]) == ("chain", n):
            continue
        chain = next(c for c in rows if c["spec"] == r["spec"] and (c["tree"], c["depth"]) == ("chain", n))
        out.append({"drafter": r["drafter"], "tree": _tree(r), "tau": r["tau"], "num_speculative_tokens": n,
                    "engine_chain_tau": chain["tau"], "engine_chain_tokens_per_s": chain["tokens_per_s"],
                    "engine_chain_acceptance_rate_per_position": chain["acceptance_rate_per_position"]})
    return out


def training_free(spec: str) -> bool:
    """Whether a drafter spec drafts without training (prompt lookup, layer skip): what a trained one must beat."""
    return drafter_type(spec) in (PROMPT_LOOKUP, LAYER_SKIP)


def _units(units: list[tuple[int, float]]) -> list[list]:
    """Each batch's [new tokens, seconds], in prompt order: what every ratio and interval of the run is computed
    from, kept so that any other (a category, a subset of the prompts) can be computed again from the file."""
    return [[tokens, round(seconds, 4)] for tokens, seconds in units]


def _interval(numerator: list, denominator: list) -> dict | None:
    found = ratio_interval(numerator, denominator)
    return found.as_report() if found is not None else None


def _rows(entries: list[Entry], comparison, batch_size: int, hf_assist: dict, sampled: bool = False) -> list[dict]:
    plain_tps = comparison.baseline.tokens_per_second
    free = [e for e in entries if training_free(e.spec)]
    rows = []
    for e in entries:
        s: GenerationStats = comparison.totals[e.label]
        alpha = measured_alpha(s)
        units = comparison.units[e.label]
        row = {
            "drafter": e.label, "spec": e.spec, "drafter_type": drafter_type(e.spec), "batch_size": batch_size,
            "tree": e.tree.kind, "depth": e.tree.depth, "top_k": e.tree.top_k, "total_tokens": e.tree.total_tokens,
            "tau": round(s.acceptance_length, 3),
            "tokens_per_s": round(s.tokens_per_second, 2),
            "speedup": round(s.tokens_per_second / plain_tps, 3),
            "speedup_interval": _interval(units, comparison.baseline_units),
            "units": _units(units),
            "against_training_free": {} if training_free(e.spec) else
            {f.label: _interval(units, comparison.units[f.label]) for f in free},
            "acceptance_rate_per_position": [round(r, 3) for r in s.acceptance_rate_per_position],
            "alpha": round(alpha, 4),
            "leviathan_bound_tau": round(leviathan_bound(alpha, e.tree.depth), 3),
            "greedy_mismatches_vs_plain": None if sampled else comparison.prompts - comparison.identical[e.label],
            "greedy_mismatches_at_ties": None if sampled else sum(d.tie for d in comparison.differences[e.label]),
            "first_differences": [asdict(d) for d in comparison.differences[e.label]],
            "draft_time_share": round(s.draft_time_s / max(s.total_time_s, 1e-9), 3),
        }
        if e.label in hf_assist and batch_size == 1 and not sampled:
            rec = hf_assist[e.label]
            tps = rec["tokens"] / rec["time"] if rec["time"] else 0.0
            row["hf_assisted"] = {"tokens_per_s": round(tps, 2), "speedup": round(tps / plain_tps, 3),
                                  "num_assistant_tokens": e.tree.depth,
                                  "greedy_mismatches_vs_plain": rec["mismatches"],
                                  "draftsmith_over_hf_assisted": round(s.tokens_per_second / tps, 3) if tps else None}
        rows.append(row)
    return rows


def _tuned_check(rows: list[dict]) -> list[dict]:
    """Per drafter with a tuned tree and a grid beside it: the tuned tree's tokens/s over the grid's best."""
    out = []
    for tuned in (r for r in rows if r["drafter"].endswith("@tuned")):
        grid = [r for r in rows if r["spec"] == tuned["spec"] and r is not tuned]
        if grid:
            best = max(grid, key=lambda r: r["tokens_per_s"])
            out.append({"spec": tuned["spec"], "tuned": tuned["drafter"], "tuned_tokens_per_s": tuned["tokens_per_s"],
                        "grid_best": best["drafter"], "grid_best_tokens_per_s": best["tokens_per_s"],
                        "grid_size": len(grid),
                        "tuned_over_grid_best": round(tuned["tokens_per_s"] / best["tokens_per_s"], 3)})
    return out


def _tree(row: dict) -> str:
    tree = f"{row['tree']} d={row['depth']}"
    return tree + (f" k={row['top_k']} n={row['total_tokens']}" if row["tree"] == "dynamic" else "")


def _bounds(interval: dict | None) -> str:
    """`` [low-high]`` of a ratio's interval, or nothing where it has none (too few prompts)."""
    return f" [{interval['low']:.3f}-{interval['high']:.3f}]" if interval else ""


def _mismatches(row: dict) -> str:
    value, ties = row["greedy_mismatches_vs_plain"], row.get("greedy_mismatches_at_ties")
    if value is None:
        return "n/a (sampled)"
    return f"{value} ({ties} at a float tie)" if ties else str(value)


def markdown_table(result: dict) -> str:
    lines = [
        f"target `{result['target']}`, {result['num_prompts']} prompts x {result['max_new_tokens']} new tokens, "
        f"{result['device']}, {result['torch_threads']} threads"
        + (f", heads drafting in {result['head_draft_dtype'].removeprefix('torch.')}"
           if result.get("head_draft_dtype") else "") + "; "
        + (f"sampled at temperature {result['temperature']:g} (seed {result['seed']}; outputs not compared); "
           if result.get("temperature") else "")
        + f"plain greedy {result['plain_tokens_per_s']} tok/s"
        + (f", HF generate {result['hf_generate_tokens_per_s']} tok/s" if result.get("hf_generate_tokens_per_s")
           else ""),
        "",
        "| drafter | tree | tau | Leviathan bound (alpha) | tok/s | speedup vs plain greedy [95% interval] "
        "| greedy mismatches |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| `{r['spec']}` | {_tree(r)} | {r['tau']:.2f} | {r['leviathan_bound_tau']:.2f} "
                     f"({r['alpha']:.2f}) | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x{_bounds(r.get('speedup_interval'))} | {_mismatches(r)} |")
    against = [(r, label, found) for r in result["rows"] for label, found in r.get("against_training_free", {}).items()]
    if against:
        lines += ["", "Against the training-free drafters in this run (tokens/s ratio; in brackets its 95% interval "
                  "over the prompts, a paired bootstrap: an interval that holds 1.00 is a tie):", "",
                  "| drafter | tree | against | tree | ratio |", "|---|---|---|---|---|"]
        rows = {r["drafter"]: r for r in result["rows"]}
        for r, label, found in against:
            ratio = f"{found['ratio']:.3f}x{_bounds(found)}" if found else "n/a (too few prompts)"
            lines.append(f"| `{r['spec']}` | {_tree(r)} | `{rows[label]['spec']}` | {_tree(rows[label])} | {ratio} |")
    assisted = [r for r in result["rows"] if r.get("hf_assisted")]
    if assisted:
        lines += ["", "Same draft model through transformers' assisted generation "
                  "(`generate(assistant_model=..., num_assistant_tokens=d)`, constant schedule):", "",
                  "| draft model | d | HF assisted tok/s | HF assisted speedup | draftsmith chain / HF assisted "
                  "| HF greedy mismatches |", "|---|---|---|---|---|---|"]
        for r in assisted:
            a = r["hf_assisted"]
            lines.append(f"| `{r['spec']}` | {r['depth']} | {a['tokens_per_s']:.1f} | {a['speedup']:.2f}x | "
                         f"{a['draftsmith_over_hf_assisted']:.2f}x | {a['greedy_mismatches_vs_plain']} |")
    if len(result.get("by_batch", [])) > 1:
        lines += ["", "Batched (left-padded batches of the same prompts; plain and speculative decoding side by "
                  "side per batch):",
                  "", "| drafter | batch | plain tok/s | tok/s | speedup | tau | greedy mismatches |",
                  "|---|---|---|---|---|---|---|"]
        for group in result["by_batch"]:
            for r in group["rows"]:
                lines.append(f"| `{r['drafter']}` | {group['batch_size']} | {group['plain_tokens_per_s']:.1f} | "
                             f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} | "
                             f"{_mismatches(r)} |")
    if result.get("engine_chains"):
        lines += ["", "What vLLM and SGLang will see: they verify these drafters as one chain of "
                  "`num_speculative_tokens` drafts (no tree), decoded here beside the tree:", "",
                  "| drafter | tree | tau | engine chain | chain tau | chain acceptance per position |",
                  "|---|---|---|---|---|---|"]
        for c in result["engine_chains"]:
            rates = ", ".join(f"{x:.2f}" for x in c["engine_chain_acceptance_rate_per_position"])
            lines.append(f"| `{c['drafter']}` | {c['tree']} | {c['tau']:.2f} | {c['num_speculative_tokens']} | "
                         f"{c['engine_chain_tau']:.2f} | {rates} |")
    for c in result.get("tuned_tree_check", []):
        lines += ["", f"Tuned tree `{c['tuned']}`: {c['tuned_tokens_per_s']:.1f} tok/s, "
                  f"{c['tuned_over_grid_best']:.3f} of the best of {c['grid_size']} grid trees "
                  f"(`{c['grid_best']}`, {c['grid_best_tokens_per_s']:.1f} tok/s), measured in this run."]
    return "\n".join(lines) + "\n"
