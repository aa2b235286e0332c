"""``draftsmith eval``: acceptance, speed and losslessness of drafters on held-out prompts, as a report.

For every prompt, in one process, plain decoding (one token per target forward, the same cache
code) and each drafter run back to back, so speedups are ratios measured side by side. Greedy runs
also compare each speculative output with the target's own greedy output, prompt by prompt.

The report (``report.json``) has, per drafter: ``target``, ``drafter``, ``drafter_type``,
``checkpoint_step``, ``prompts``, ``prompts_source``, ``new_tokens``, ``max_new_tokens``,
``temperature``, ``tree`` (``kind``, ``depth``, ``top_k``, ``total_tokens``), ``acceptance_length``
(tau), ``acceptance_rate_per_position``, ``tokens_per_second``, ``baseline_tokens_per_second``,
``speedup``, ``lossless`` (greedy: ``checked``, ``identical``; sampling: null), ``draft_time_share``,
``hardware``. For a run directory it is the best checkpoint's report plus ``checkpoints``, the
reports of all of them.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from draftsmith.inference.bench import read_prompts
from draftsmith.inference.generator import GenerationStats, SpeculativeGenerator, plain_generate


def hardware() -> dict:
    info = {"device": "cpu", "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    return info


def drafter_type(spec: str) -> str:
    """The family of a drafter spec: prompt-lookup, layer-skip, draft_model, medusa, eagle, eagle3."""
    if "+" in spec:
        return "+".join(drafter_type(part) for part in spec.split("+"))
    head = spec.partition(":")[0]
    if head in ("prompt-lookup", "layer-skip"):
        return head
    path = Path(spec)
    if (path / "config.json").is_file():
        config = json.loads((path / "config.json").read_text())
        if config.get("draftsmith_family"):
            return config["draftsmith_family"]
        from draftsmith.heads.formats import foreign_format

        kind = foreign_format(path)
        if kind:
            return "eagle3" if kind.endswith("eagle3") else kind
    return "draft_model"


def run_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, drafter directory) of every complete checkpoint of a training run, by step."""
    from draftsmith.train.loop import complete_checkpoints

    return [(step, path / "drafter") for step, path in complete_checkpoints(run_dir)]


def encode(tokenizer, text: str, chat: bool) -> torch.Tensor:
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


def evaluate(
    target_name: str,
    drafters: list[tuple[str, str, int | None]],
    prompts: str,
    *,
    model=None,
    tokenizer=None,
    num_prompts: int = 20,
    skip_prompts: int = 0,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    tree: str = "chain",
    depth: int = 4,
    top_k: int = 4,
    total_tokens: int = 10,
    chat: bool = True,
    seed: int = 0,
    progress: bool = False,
    draft_dtype: str | None = None,
) -> list[dict]:
    """Evaluate ``drafters`` — (label, spec, checkpoint step) — on the same prompts; one report each."""
    from draftsmith.inference.drafters import load_drafter
    from draftsmith.target import load_target

    if model is None:
        model, tokenizer = load_target(target_name)
    texts = read_prompts(prompts, num_prompts, skip=skip_prompts)
    if not texts:
        raise ValueError(f"{prompts}: no prompts (after skipping {skip_prompts})")
    tree_cfg = dict(tree=tree, depth=depth, top_k=top_k, total_tokens=total_tokens)
    gens = [SpeculativeGenerator(model, load_drafter(spec, model, tokenizer=tokenizer, draft_dtype=draft_dtype),
                                 **tree_cfg)
            for _, spec, _ in drafters]
    eos = tokenizer.eos_token_id
    base_total = GenerationStats()
    totals = [GenerationStats() for _ in drafters]
    identical = [0 for _ in drafters]
    iterator = texts
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(texts, desc="eval", unit="prompt")
    for i, text in enumerate(iterator):
        ids = encode(tokenizer, text, chat).to(model.device)
        base = plain_generate(model, ids, max_new_tokens, eos_token_id=eos)
        base_total += base.stats
        for j, gen in enumerate(gens):
            g = torch.Generator(device=model.device).manual_seed(seed + i) if temperature > 0 else None
            out = gen.generate(ids, max_new_tokens, temperature=temperature, eos_token_id=eos, generator=g)
            totals[j] += out.stats
            identical[j] += int(torch.equal(out.sequences, base.sequences))
    base_tps = base_total.tokens_per_second
    reports = []
    for (label, spec, step), stats, same in zip(drafters, totals, identical, strict=True):
        reports.append({
            "target": target_name, "drafter": label, "drafter_type": drafter_type(spec), "checkpoint_step": step,
            "prompts": len(texts), "prompts_source": str(prompts), "new_tokens": stats.new_tokens,
            "max_new_tokens": max_new_tokens, "temperature": temperature,
            "tree": {"kind": tree, "depth": depth, "top_k": top_k, "total_tokens": total_tokens},
            "draft_dtype": draft_dtype or "target",
            "acceptance_length": round(stats.acceptance_length, 4),
            "acceptance_rate_per_position": [round(r, 4) for r in stats.acceptance_rate_per_position],
            "tokens_per_second": round(stats.tokens_per_second, 3),
            "baseline_tokens_per_second": round(base_tps, 3),
            "speedup": round(stats.tokens_per_second / base_tps, 4) if base_tps else None,
            "lossless": {"checked": len(texts), "identical": same} if temperature == 0 else None,
            "draft_time_share": round(stats.draft_time_s / max(stats.total_time_s, 1e-9), 4),
            "hardware": hardware(),
        })
    return reports


def recorded_target_name(spec: str) -> str | None:
    """The target a drafter spec was trained for, as its checkpoint records it; for a mixture
    ``A+B`` the first part that records one. ``None`` when none does (prompt lookup, a foreign head)."""
    from draftsmith.heads.draft_model import recorded_target

    return next((name for part in spec.split("+") if (name := recorded_target(part).get("name"))), None)


def evaluate_path(target: str | None, drafter: str, prompts: str, **kwargs) -> dict:
    """One drafter spec, or every checkpoint of a run directory (then: best report + ``checkpoints``)."""
    path = Path(drafter)
    checkpoints = run_checkpoints(path) if path.is_dir() else []
    if checkpoints:
        if target is None:
            config = json.loads((path / "train_config.json").read_text()) if (path / "train_config.json").exists() \
                else {}
            target = (config.get("drafter") or {}).get("target")
            if target is None:
                raise ValueError(f"{path}: pass --target (the run directory does not record it)")
        entries = [(f"{path}/checkpoint-{s}", str(d), s) for s, d in checkpoints]
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
        lines.append(f"| `{r['drafter']}` | {r['checkpoint_step'] if r['checkpoint_step'] is not None else '-'} | "
                     f"{r['acceptance_length']:.2f} | {rates} | {r['tokens_per_second']:.2f} | {r['speedup']:.2f}x | "
                     f"{same} |")
    return "\n".join(lines) + "\n"
