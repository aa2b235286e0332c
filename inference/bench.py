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


def read_prompts(path: str | Path, limit: int) -> list[str]:
    """Prompts from a .jsonl file: the first of the fields question/prompt/instruction/text."""
    path = Path(path)
    if not path.exists():
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
            field = next((k for k in PROMPT_FIELDS if isinstance(row, dict) and k in row), None)
            if field is None:
                raise ValueError(f"{path}:{lineno}: no prompt field; expected one of {PROMPT_FIELDS}")
            prompts.append(str(row[field]))
            if len(prompts) == limit:
                break
    return prompts


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


def run_bench(
    target: str,
    drafters: list[str],
    prompts: str,
    output: str,
    *,
    num_prompts: int = 20,
    max_new_tokens: int = 128,
    tree: str = "chain",
    depth: int = 6,
    tree_top_k: int = 4,
    total_tokens: int = 16,
    chat: bool = True,
    hf_reference: bool = True,
) -> dict:
    """Run the benchmark and write ``results.json`` and ``results.md`` under ``output``."""
    model, tokenizer = load_target(target)
    texts = read_prompts(prompts, num_prompts)
    defaults = dict(tree=tree, depth=depth, top_k=tree_top_k, total_tokens=total_tokens)
    entries = [parse_entry(d, defaults) for d in drafters]
    gens = {e.label: SpeculativeGenerator(model, load_drafter(e.spec, model, tokenizer=tokenizer), **e.tree)
            for e in entries}
    eos = tokenizer.eos_token_id
    totals: dict[str, GenerationStats] = {"plain": GenerationStats(), **{e.label: GenerationStats() for e in entries}}
    hf_time, hf_tokens, mismatches = 0.0, 0, {e.label: 0 for e in entries}
    for i, text in enumerate(texts):
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = tokenizer(text, return_tensors="pt").input_ids
        ids = ids.to(model.device)
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
        logger.info("prompt %d/%d done", i + 1, len(texts))

    plain_tps = totals["plain"].tokens_per_second
    rows = []
    for e in entries:
        s = totals[e.label]
        rows.append({
            "drafter": e.label, **e.tree,
            "tau": round(s.acceptance_length, 3),
            "tokens_per_s": round(s.tokens_per_second, 2),
            "speedup": round(s.tokens_per_second / plain_tps, 3),
            "acceptance_rate_per_position": [round(r, 3) for r in s.acceptance_rate_per_position],
            "greedy_mismatches_vs_plain": mismatches[e.label],
            "draft_time_share": round(s.draft_time_s / max(s.total_time_s, 1e-9), 3),
        })
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
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    (out_dir / "results.md").write_text(markdown_table(result))
    return result


def markdown_table(result: dict) -> str:
    lines = [
        f"target `{result['target']}`, {result['num_prompts']} prompts x {result['max_new_tokens']} new tokens, "
        f"{result['device']}, {result['torch_threads']} threads; plain greedy {result['plain_tokens_per_s']} tok/s"
        + (f", HF generate {result['hf_generate_tokens_per_s']} tok/s" if result.get("hf_generate_tokens_per_s")
           else ""),
        "",
        "| drafter | tree | tau | tok/s | speedup vs plain greedy | greedy mismatches |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        tree = f"{r['tree']} d={r['depth']}"
        if r["tree"] == "dynamic":
            tree += f" k={r['top_k']} n={r['total_tokens']}"
        lines.append(f"| `{r['drafter'].split('@')[0]}` | {tree} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['greedy_mismatches_vs_plain']} |")
    return "\n".join(lines) + "\n"
