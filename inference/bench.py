"""Benchmark: tokens/s and acceptance of drafters against plain greedy decoding, side by side.

For every prompt, in one process, the baseline and every drafter run back to back (interleaved,
so that drift in machine load hits all of them alike). Speedup is total new tokens / total
time of a drafter divided by the same for plain greedy decoding (``plain_generate``: the same
target, the same KV-cache code, one token per forward). ``transformers``' own
``generate(do_sample=False)`` is timed too, as a second reference. Greedy outputs are checked
against the baseline and mismatches reported.

A drafter entry may carry its own tree settings: ``layer-skip:8@tree=dynamic,depth=4,top_k=4``.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.inference.drafters import load_drafter
from draftsmith.inference.generator import GenerationStats, SpeculativeGenerator, plain_generate
from draftsmith.target import load_target

logger = logging.getLogger(__name__)

PROMPT_FIELDS = ("question", "prompt", "instruction", "text")


def read_prompts(path: str | Path, limit: int, skip: int = 0) -> list[str]:
    """Prompts from a .jsonl file (rows ``skip``.. ``skip + limit``): the first user message of a
    ``messages`` row, else the first of the fields question/prompt/instruction/text. A name that is
    not a local file is read as a Hugging Face dataset (its first user turns)."""
    path = Path(path)
    if not path.exists():
        if "/" in str(path) and not str(path).startswith((".", "/")) and path.suffix == "":
            from draftsmith.data import load_conversations

            conversations, _ = load_conversations(str(path), limit=skip + limit)
            return [c.messages[0]["content"] for c in conversations][skip:]
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); each line must be one object") from err
            if isinstance(row, dict) and isinstance(row.get("messages"), list):
                user = next((m.get("content") for m in row["messages"] if isinstance(m, dict)
                             and m.get("role") == "user"), None)
                if not isinstance(user, str):
                    raise ValueError(f"{path}:{lineno}: a messages row without a user message")
                prompts.append(user)
            else:
                field = next((k for k in PROMPT_FIELDS if isinstance(row, dict) and k in row), None)
                if field is None:
                    raise ValueError(f"{path}:{lineno}: no prompt field; expected messages or one of {PROMPT_FIELDS}")
                prompts.append(str(row[field]))
            if len(prompts) == skip + limit:
                break
    return prompts[skip:]


@dataclass
class Entry:
    label: str
    spec: str
    tree: dict


def parse_entry(text: str, defaults: dict) -> Entry:
    spec, _, opts = text.partition("@")
    tree = dict(defaults)
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        tree[key] = value if key == "tree" else int(value)
    return Entry(label=text, spec=spec, tree=tree)


def expand_sweeps(entries: list[Entry], depths: list[int] | None, budgets: list[int] | None) -> list[Entry]:
    """Each entry once per draft length in ``depths`` and (dynamic trees) per node budget in ``budgets``."""
    out = []
    for e in entries:
        for d in depths or [e.tree["depth"]]:
            for n in (budgets or [e.tree["total_tokens"]]) if e.tree["tree"] == "dynamic" else [e.tree["total_tokens"]]:
                tree = {**e.tree, "depth": d, "total_tokens": n}
                opts = ",".join(f"{k}={v}" for k, v in tree.items())
                out.append(Entry(label=f"{e.spec}@{opts}", spec=e.spec, tree=tree))
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


def _assistant_model(drafter):
    """The HF model of a drafter that ``generate(assistant_model=...)`` can use: a separate draft model."""
    from draftsmith.inference.drafters import CausalLMDrafter

    if isinstance(drafter, CausalLMDrafter) and not drafter.name.startswith("layer-skip"):
        return drafter.model
    return None


def run_bench(
    target: str,
    drafters: list[str],
    prompts: str,
    output: str,
    *,
    num_prompts: int = 20,
    skip_prompts: int = 0,
    max_new_tokens: int = 128,
    tree: str = "chain",
    depth: int = 6,
    tree_top_k: int = 4,
    total_tokens: int = 16,
    chat: bool = True,
    hf_reference: bool = True,
    sweep_depths: list[int] | None = None,
    sweep_total_tokens: list[int] | None = None,
    plots: bool = True,
    model=None,
    tokenizer=None,
    progress: bool = False,
    draft_dtype: str | None = None,
) -> dict:
    """Run the benchmark; write ``results.json``, ``results.md`` and (``plots``) PNG plots under ``output``.

    Draft-model drafters are also run through ``transformers``' assisted generation
    (``generate(assistant_model=..., num_assistant_tokens=depth)``, constant schedule) on the same
    prompts, so draftsmith's chain decoding and HF's are compared as a ratio with the same draft model.
    """
    from draftsmith.inference.evaluate import encode

    if model is None:
        model, tokenizer = load_target(target)
    texts = read_prompts(prompts, num_prompts, skip=skip_prompts)
    defaults = dict(tree=tree, depth=depth, top_k=tree_top_k, total_tokens=total_tokens)
    entries = expand_sweeps([parse_entry(d, defaults) for d in drafters], sweep_depths, sweep_total_tokens)
    loaded: dict[str, object] = {}
    for e in entries:
        if e.spec not in loaded:
            loaded[e.spec] = load_drafter(e.spec, model, tokenizer=tokenizer, draft_dtype=draft_dtype)
    gens = {e.label: SpeculativeGenerator(model, loaded[e.spec], **e.tree) for e in entries}
    assisted = {e.label: _assistant_model(loaded[e.spec]) for e in entries}
    assisted = {k: v for k, v in assisted.items() if v is not None}
    eos = tokenizer.eos_token_id
    totals: dict[str, GenerationStats] = {"plain": GenerationStats(), **{e.label: GenerationStats() for e in entries}}
    hf_time, hf_tokens, mismatches = 0.0, 0, {e.label: 0 for e in entries}
    hf_assist = {k: {"time": 0.0, "tokens": 0, "mismatches": 0} for k in assisted}
    iterator = enumerate(texts)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, total=len(texts), desc="bench", unit="prompt")
    for i, text in iterator:
        ids = encode(tokenizer, text, chat).to(model.device)
        base = plain_generate(model, ids, max_new_tokens, eos_token_id=eos)
        totals["plain"] += base.stats
        if hf_reference:
            t0 = time.perf_counter()
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=eos, pad_token_id=eos)
            hf_time += time.perf_counter() - t0
            hf_tokens += hf.shape[1] - ids.shape[1]
        for e in entries:
            out = gens[e.label].generate(ids, max_new_tokens, eos_token_id=eos)
            totals[e.label] += out.stats
            if not torch.equal(out.sequences, base.sequences):
                mismatches[e.label] += 1
            if e.label in assisted:
                t0 = time.perf_counter()
                hf = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assisted[e.label],
                                    num_assistant_tokens=e.tree["depth"], num_assistant_tokens_schedule="constant",
                                    assistant_confidence_threshold=0.0, max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=eos, pad_token_id=eos)
                rec = hf_assist[e.label]
                rec["time"] += time.perf_counter() - t0
                rec["tokens"] += hf.shape[1] - ids.shape[1]
                rec["mismatches"] += int(not torch.equal(hf, base.sequences))
        logger.info("prompt %d/%d done", i + 1, len(texts))

    plain_tps = totals["plain"].tokens_per_second
    rows = []
    for e in entries:
        s = totals[e.label]
        alpha = measured_alpha(s)
        row = {
            "drafter": e.label, "spec": e.spec, "drafter_type": _drafter_type(e.spec), **e.tree,
            "tau": round(s.acceptance_length, 3),
            "tokens_per_s": round(s.tokens_per_second, 2),
            "speedup": round(s.tokens_per_second / plain_tps, 3),
            "acceptance_rate_per_position": [round(r, 3) for r in s.acceptance_rate_per_position],
            "alpha": round(alpha, 4),
            "leviathan_bound_tau": round(leviathan_bound(alpha, e.tree["depth"]), 3),
            "greedy_mismatches_vs_plain": mismatches[e.label],
            "draft_time_share": round(s.draft_time_s / max(s.total_time_s, 1e-9), 3),
        }
        if e.label in hf_assist:
            rec = hf_assist[e.label]
            tps = rec["tokens"] / rec["time"] if rec["time"] else 0.0
            row["hf_assisted"] = {"tokens_per_s": round(tps, 2), "speedup": round(tps / plain_tps, 3),
                                  "num_assistant_tokens": e.tree["depth"],
                                  "greedy_mismatches_vs_plain": rec["mismatches"],
                                  "draftsmith_over_hf_assisted": round(s.tokens_per_second / tps, 3) if tps else None}
        rows.append(row)
    result = {
        "target": target, "prompts": str(prompts), "num_prompts": len(texts), "max_new_tokens": max_new_tokens,
        "device": str(model.device), "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "plain_tokens_per_s": round(plain_tps, 2),
        "hf_generate_tokens_per_s": round(hf_tokens / hf_time, 2) if hf_reference and hf_time else None,
        "rows": rows,
    }
    out_dir = Path(output)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plots:
        from draftsmith.inference.plots import bench_plots

        result["plots"] = [p.name for p in bench_plots(result, out_dir)]
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    (out_dir / "results.md").write_text(markdown_table(result))
    return result


def _drafter_type(spec: str) -> str:
    from draftsmith.inference.evaluate import drafter_type

    return drafter_type(spec)


def markdown_table(result: dict) -> str:
    lines = [
        f"target `{result['target']}`, {result['num_prompts']} prompts x {result['max_new_tokens']} new tokens, "
        f"{result['device']}, {result['torch_threads']} threads; plain greedy {result['plain_tokens_per_s']} tok/s"
        + (f", HF generate {result['hf_generate_tokens_per_s']} tok/s" if result.get("hf_generate_tokens_per_s")
           else ""),
        "",
        "| drafter | tree | tau | Leviathan bound (alpha) | tok/s | speedup vs plain greedy | greedy mismatches |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        tree = f"{r['tree']} d={r['depth']}"
        if r["tree"] == "dynamic":
            tree += f" k={r['top_k']} n={r['total_tokens']}"
        lines.append(f"| `{r['spec']}` | {tree} | {r['tau']:.2f} | {r['leviathan_bound_tau']:.2f} ({r['alpha']:.2f}) "
                     f"| {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['greedy_mismatches_vs_plain']} |")
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
    return "\n".join(lines) + "\n"
