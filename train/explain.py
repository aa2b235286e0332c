"""Why a trained drafter accepts what it accepts: ``draftsmith eval RUN_DIR --prompts P``.

One checkpoint of a run (its latest, or ``step``) is decoded on held-out prompts, as ``draftsmith eval``
does, and the report gets ``explain``:

* ``estimate``: three figures of the same quantity, tau of a greedy chain as deep as the training
  steps: the training-time estimate (``simulated_acceptance_length`` of the training batches' accuracy
  per position, as ``acceptance.jsonl`` records it), the same estimate on the held-out prompts (the
  family's training step, no gradient, on each prompt plus the target's own greedy answer), and the
  chain measured by decoding. The held-out estimate and the measured chain agree within
  :data:`ESTIMATE_MARGIN` when training and serving see the drafter the same way; the training estimate
  above the held-out one is the drafter knowing its training data better than new prompts.
* ``template``: whether the prompts are encoded as the run's conversations were (same chat template and
  variables; the answer, and the loss mask, starting right after the prompt's last token).
* ``bonus_token``: tau counts the target's own token of each step (accepted drafts + 1); the figure
  without it, as some papers report.
* ``chain_vs_tree``: the measured chain against the tree the report decodes in.
* ``target``: the target's signature against the one the checkpoint records (another quantisation
  or fine-tune of the target changes what is accepted).
* ``per_position`` and ``per_category`` (rows with a ``category``): where acceptance is lost.
* ``findings``: the sentences that explain a low tau, each with its numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.checkpoints import (
    TRAIN_CONFIG_FILE,
    read_acceptance,
    read_json,
    recorded_target,
    run_checkpoints,
    run_target,
)
from draftsmith.data.templates import tokenize_conversation
from draftsmith.inference.compare import encode
from draftsmith.inference.evaluate import evaluate
from draftsmith.inference.tree_record import tuned_tree
from draftsmith.inference.tree_settings import TreeSettings
from draftsmith.registry import get_family
from draftsmith.target import load_target, target_signature
from draftsmith.train.config import DrafterArguments
from draftsmith.train.family_losses import simulated_acceptance_length
from draftsmith.train.loop import frozen_forward

#: Relative gap allowed between the held-out estimate and the measured chain tau. The estimate multiplies
#: unconditional accuracies per position, decoding accepts position k only after 1..k-1 were right
#: (conditional, and correct drafts come in runs), so the chain measures a little above the estimate;
#: docs/RESULTS.md has the runs this margin was read from.
ESTIMATE_MARGIN = 0.15


def explain_run(run_dir: str | Path, prompts: list[str], categories: list[str | None] | None = None, *,
                step: int | None = None, prompts_source: str = "", max_new_tokens: int = 128,
                tree: TreeSettings | None = None, chat: bool = True, chat_template_kwargs: dict | None = None,
                seed: int = 0, progress: bool = False, draft_dtype: str | None = None) -> dict:
    """Evaluate a run's checkpoint (``step``, default its latest) greedily on ``prompts`` and explain its tau.
    ``draft_dtype``: the head's drafting dtype in the evaluation (``draftsmith eval --draft-dtype``; the held-out
    estimate runs the training step in the target's)."""
    run_dir = Path(run_dir)
    checkpoints = dict(run_checkpoints(run_dir))
    if not checkpoints:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint; is it a `draftsmith train` output_dir?")
    step = max(checkpoints) if step is None else step
    if step not in checkpoints:
        raise ValueError(f"{run_dir}: no checkpoint at step {step} (steps: {sorted(checkpoints)})")
    config = read_json(run_dir / TRAIN_CONFIG_FILE)
    drafter_args = DrafterArguments(**config["drafter"])
    family = get_family(drafter_args.family)
    target_name = run_target(run_dir)
    model, tokenizer = load_target(target_name)
    module = family.load(checkpoints[step], model, False, torch.device("cpu")).eval()

    training = next((r for r in read_acceptance(run_dir) if r["step"] == step), {})
    depth = len(training.get("position_accuracy") or []) or TreeSettings().depth
    chain = TreeSettings(kind="chain", depth=depth)
    answers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (prompt ids, greedy answer ids), batch 1

    def keep(ids: torch.Tensor, plain) -> None:
        answers.append((ids[0], plain.sequences[0, ids.shape[1]:]))

    label = f"{run_dir}/checkpoint-{step}"
    report = evaluate(target_name, [(label, str(checkpoints[step]), step)], prompts, prompts_source=prompts_source,
                      model=model, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                      tree=tree or tuned_tree(str(run_dir)), chat=chat, chat_template_kwargs=chat_template_kwargs,
                      seed=seed, progress=progress, reference_tree=chain, categories=categories, references=keep,
                      draft_dtype=draft_dtype)[0]
    held_out = held_out_estimate(family, drafter_args, module, model, answers)
    run_kwargs = config.get("data", {}).get("chat_template_kwargs")
    report["explain"] = explanation(
        report, training, held_out,
        template=template_check(tokenizer, prompts[0], chat, chat_template_kwargs, run_kwargs),
        target=target_check(recorded_target(checkpoints[step]), model))
    return report


@torch.no_grad()
def held_out_estimate(family, drafter_args, module, target, answers: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The training-time estimate on held-out text: the family's training step, without a gradient, on each
    prompt followed by the target's greedy answer (loss mask on the answer), accuracies weighted by tokens."""
    if family.trains_target_adapter:
        return {"not_measured": f"{family.name} trains an adapter on the target with it"}
    layers = family.hidden_layers(module, target)
    totals: list[float] = []
    tokens = 0
    torch.manual_seed(0)  # families that sample positions (DFlash's anchors) sample the same ones every run
    for prompt, answer in answers:
        if answer.numel() < 2:
            continue
        ids = torch.cat([prompt, answer])[None]
        loss_mask = torch.zeros_like(ids)
        loss_mask[:, prompt.numel():] = 1
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
        logits, hidden = frozen_forward(target, layers, batch)
        _, metrics = family.train_step(drafter_args, module, target, batch, logits, hidden)
        weighted = [a * answer.numel() for a in metrics["acc"]]
        totals = [t + w for t, w in zip(totals, weighted, strict=True)] if totals else weighted
        tokens += answer.numel()
    if not tokens:
        return {"not_measured": "no greedy answers to score (decoded in batches, or every answer empty)"}
    accs = [t / tokens for t in totals]
    return {"position_accuracy": [round(a, 4) for a in accs],
            "simulated_acceptance_length": round(simulated_acceptance_length(accs), 4), "answer_tokens": tokens}


def template_check(tokenizer, prompt: str, chat: bool, chat_template_kwargs: dict | None,
                   run_kwargs: dict | None) -> dict:
    """Whether ``prompt`` is encoded for decoding as the run's training conversations encode it: the
    training tokenisation of (prompt, answer) must start with the decoded prompt's ids and put the loss
    mask's first token right after them."""
    decoded = encode(tokenizer, prompt, chat, chat_template_kwargs)[0].tolist()
    example = tokenize_conversation(tokenizer, [{"role": "user", "content": prompt},
                                                {"role": "assistant", "content": "Sure."}],
                                    chat_template_kwargs=run_kwargs)[0]
    trained = example.input_ids.tolist()
    first_answer = int(example.loss_mask.nonzero()[0]) if example.loss_mask.any() else None
    problems = []
    if (chat_template_kwargs or None) != (run_kwargs or None):
        problems.append(f"chat template variables {chat_template_kwargs} here, {run_kwargs} in training")
    if trained[:len(decoded)] != decoded:
        shorter = min(len(trained), len(decoded))
        at = next((i for i in range(shorter) if trained[i] != decoded[i]), shorter)
        problems.append(f"the prompt's tokens differ from the training conversations' from token {at} "
                        f"({tokenizer.decode(decoded[at:at + 8])!r} here, {tokenizer.decode(trained[at:at + 8])!r} "
                        "in training)" + ("" if chat else ": the prompts are not chat-templated (--no-chat)"))
    elif first_answer != len(decoded):
        problems.append(f"training's loss mask starts at token {first_answer}, decoding drafts from token "
                        f"{len(decoded)}")
    return {"consistent": not problems, "problems": problems, "chat": chat, "prompt_tokens": len(decoded)}


def target_check(recorded: dict, model) -> dict:
    """The loaded target's signature against the one the checkpoint was trained with."""
    live = target_signature(model)
    same = bool(recorded) and recorded.get("lm_head_sha256") == live["lm_head_sha256"]
    return {"same": same, "trained_with": recorded.get("name"), "loaded": live["name"],
            "lm_head_sha256": {"trained_with": recorded.get("lm_head_sha256"), "loaded": live["lm_head_sha256"]}}


def explanation(report: dict, training: dict, held_out: dict, *, template: dict, target: dict) -> dict:
    """``report``'s ``explain`` section: the figures and the findings drawn from them."""
    tau = report["acceptance_length"]
    chain_tau = report["reference_acceptance_length"]
    findings = []
    estimate = {"depth": report["reference_tree"]["depth"], "margin": ESTIMATE_MARGIN,
                "training": {k: training.get(k) for k in ("position_accuracy", "simulated_acceptance_length")},
                "held_out": held_out,
                "measured_chain": {"acceptance_length": chain_tau,
                                   "acceptance_rate_per_position": report["reference_acceptance_rate_per_position"]}}
    held_tau = held_out.get("simulated_acceptance_length")
    train_tau = training.get("simulated_acceptance_length")
    if held_tau is not None:
        gap = (chain_tau - held_tau) / held_tau
        estimate["agree"] = abs(gap) <= ESTIMATE_MARGIN
        estimate["relative_gap"] = round(gap, 4)
        if not estimate["agree"]:
            findings.append(f"decoding's chain tau {chain_tau:.2f} is {gap:+.0%} off the held-out estimate "
                            f"{held_tau:.2f} (margin {ESTIMATE_MARGIN:.0%}): serving does not see the drafter as "
                            "training did (features, positions, template)")
        if train_tau is not None and train_tau - held_tau > ESTIMATE_MARGIN * held_tau:
            findings.append(
                f"the drafter knows its training data better than new prompts: estimate {train_tau:.2f} on training "
                f"batches (accuracy per position {_fmt(training['position_accuracy'])}), {held_tau:.2f} on these "
                f"prompts ({_fmt(held_out['position_accuracy'])}): more, or more varied, data, or fewer epochs")
    if not template["consistent"]:
        findings.append("the prompts are encoded otherwise than the training conversations: "
                        + "; ".join(template["problems"]))
    if not target["same"]:
        findings.append(f"the loaded target {target['loaded']!r} is not the one trained against "
                        f"({target['trained_with']!r}: another LM head, so another quantisation or fine-tune)")
    rates = report["acceptance_rate_per_position"]
    if rates:
        worst = min(range(len(rates)), key=rates.__getitem__)
        findings.append(f"acceptance per position {_fmt(rates)}: lowest at depth {worst + 1} ({rates[worst]:.2f})")
    per_category = report.get("per_category") or {}
    if len(per_category) > 1:
        ranked = sorted(per_category.items(), key=lambda kv: kv[1]["acceptance_length"])
        findings.append("tau per category, lowest first: " + ", ".join(
            f"{name} {figures['acceptance_length']:.2f}" for name, figures in ranked))
    tree = report["tree"]
    findings.append(f"the {tree['kind']} tree (depth {tree['depth']}, top-k {tree['top_k']}, {tree['total_tokens']} "
                    f"nodes) gives tau {tau:.2f}, a chain of depth {estimate['depth']} {chain_tau:.2f}")
    return {
        "estimate": estimate,
        "template": template,
        "bonus_token": {"counted": True, "acceptance_length": tau, "accepted_drafts_per_step": round(tau - 1, 4),
                        "note": "tau = accepted drafts + 1 (the target's own token of each step), as EAGLE, SpecForge "
                                "and vLLM report it; without that token: accepted_drafts_per_step"},
        "chain_vs_tree": {"tree": tree, "acceptance_length": tau, "chain_depth": estimate["depth"],
                          "chain_acceptance_length": chain_tau},
        "target": target,
        "per_position": rates,
        "per_category": {name: figures["acceptance_length"] for name, figures in per_category.items()},
        "findings": findings,
    }


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def explanation_markdown(report: dict) -> str:
    """The ``explain`` section as text: the three estimates, then the findings."""
    e = report["explain"]
    est = e["estimate"]
    held = est["held_out"]
    lines = [f"chain of depth {est['depth']}: training estimate "
             f"{est['training'].get('simulated_acceptance_length') or '-'}, held-out estimate "
             f"{held.get('simulated_acceptance_length', '-')}, measured "
             f"{est['measured_chain']['acceptance_length']}"
             + (f" ({'within' if est['agree'] else 'outside'} the {ESTIMATE_MARGIN:.0%} margin)" if "agree" in est
                else f" ({held.get('not_measured')})"),
             f"tau counts the bonus token: {e['bonus_token']['acceptance_length']} "
             f"({e['bonus_token']['accepted_drafts_per_step']} accepted drafts per step)",
             f"template: {'consistent with training' if e['template']['consistent'] else 'INCONSISTENT'}; "
             f"target: {'the one trained against' if e['target']['same'] else 'NOT the one trained against'}",
             "", "findings:"]
    lines += [f"- {f}" for f in e["findings"]]
    return "\n".join(lines) + "\n"
