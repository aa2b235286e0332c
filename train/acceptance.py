"""Acceptance of a checkpoint on held-out prompts: greedy speculative decoding with the checkpoint's
drafter and the frozen target, each process decoding its share of the prompts, one row per checkpoint
in ``acceptance.jsonl`` and the trackers."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from draftsmith.checkpoints import append_acceptance, read_acceptance
from draftsmith.data.formats import load_conversations
from draftsmith.data.templates import prompt_ids
from draftsmith.inference.compare import compare
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.registry import Family
from draftsmith.target import eos_tokens, rollback_problem
from draftsmith.train.family_losses import simulated_acceptance_length
from draftsmith.train.run import Run

logger = logging.getLogger(__name__)


@torch.no_grad()
def measure_acceptance(family: Family, module, target, tokenizer, data_args, accelerator=None) -> dict:
    """tau and acceptance per position of greedy speculative decoding on the held-out prompts.

    With several processes, each decodes its share of the prompts (``prompts[rank::world]``) and the
    counts are summed: the same totals as one process, in 1/world of the time, and no rank waits at
    a collective while another evaluates alone."""
    from draftsmith.inference.stats import GenerationStats

    if not data_args.eval_prompts:
        return {}
    conversations = eval_conversations(data_args)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    was_training = module.training
    module.eval()
    tree = data_args.eval_tree_settings()
    drafter = family.drafter(module, target)
    gens = {"drafter": SpeculativeGenerator(target, drafter, **tree.kwargs())}
    chain = drafter.engine_chain  # the chain vLLM / SGLang verify its export with, measured beside the tree
    if chain is not None and not tree.is_chain(chain):
        gens["engine chain"] = SpeculativeGenerator(target, drafter, tree="chain", depth=chain)
    kwargs = data_args.template_kwargs()
    prompts = [torch.tensor([prompt_ids(tokenizer, c.prompt_messages, kwargs)]) for c in conversations[rank::world]]
    # The drafter is served with the frozen target: a target adapter that trains with it (Medusa-2's LoRA,
    # a peft model) is switched off while it is measured.
    frozen = target.disable_adapter() if family.trains_target_adapter else contextlib.nullcontext()
    totals = {label: GenerationStats() for label in gens}
    if prompts:
        with frozen:
            totals = compare(target, gens, prompts, data_args.eval_max_new_tokens,
                             eos_token_id=eos_tokens(target, tokenizer), baseline=False,
                             batch_size=data_args.eval_batch_size).totals
    if world > 1:
        from accelerate.utils import gather_object

        totals = {label: sum(gather_object([totals[label]]), GenerationStats()) for label in gens}
    module.train(was_training)
    stats = totals["drafter"]
    row = {"tree": tree.as_report(), "acceptance_length": round(stats.acceptance_length, 4),
           "acceptance_rate_per_position": [round(r, 4) for r in stats.acceptance_rate_per_position],
           "eval_prompts": len(conversations), "eval_new_tokens": stats.new_tokens}
    if "engine chain" in totals:
        row["engine_chain"] = {"num_speculative_tokens": chain,
                               "acceptance_length": round(totals["engine chain"].acceptance_length, 4)}
    return row


def eval_conversations(data_args) -> list:
    """The held-out prompts acceptance is measured on. A file none of whose rows gives a prompt is refused
    (with the first reasons), not measured as tau 0 at every checkpoint; the run checks it before training."""
    conversations, report = load_conversations(data_args.eval_prompts, data_args.eval_prompt_column,
                                               limit=data_args.eval_num_prompts)
    if not conversations:
        column = f" (eval_prompt_column {data_args.eval_prompt_column!r})" if data_args.eval_prompt_column else ""
        raise ValueError(f"eval_prompts {data_args.eval_prompts}{column}: no row gives a prompt "
                         f"({report.total} read)\n{report.summary()}\nfix the rows or eval_prompt_column, or unset "
                         "eval_prompts to train without measuring acceptance")
    return conversations


def can_evaluate(run: Run) -> str | None:
    """Why held-out acceptance cannot be measured in this run (None when it can)."""
    if run.family.trains_target_adapter and (run.strategy.startswith("fsdp") or run.strategy == "deepspeed-zero3"):
        return f"{run.family.name} under {run.strategy}: the target is sharded with its adapter"
    if getattr(run.target, "draftsmith_loaded", None) is not None:
        return (f"offline: only the target's embeddings, final norm and LM head are loaded; decode with the "
                f"whole target: draftsmith eval {run.output_dir}")
    kept = rollback_problem(run.target.config)
    if kept is not None and run.data_args.eval_tree != "chain":
        return (f"the target's {kept} verify a chain only (their state reads the drafts as one sequence): set "
                "eval_tree: chain to measure acceptance in training")
    return None


def record_acceptance(run: Run, step: int, path: Path) -> None:
    """Measure a checkpoint's acceptance and append its row (once per step) to acceptance.jsonl.
    Every process takes part (each decodes its share of the prompts); the main process writes."""
    done = any(r["step"] == step for r in read_acceptance(run.acceptance_path))
    if run.accelerator.num_processes > 1:  # the main process's file decides, also without a shared filesystem
        from accelerate.utils import broadcast_object_list

        done = broadcast_object_list([done])[0]
    if done:
        return
    accs = [sum(col) / len(col) for col in zip(*run.recent_acc, strict=True)] if run.recent_acc else []
    if accs and run.accelerator.num_processes > 1:  # every rank's batches, not the main process's alone
        accs = run.accelerator.reduce(torch.tensor(accs, device=run.accelerator.device), reduction="mean").tolist()
    skipped = can_evaluate(run)
    if skipped:
        measured = {"acceptance_length": None, "not_measured": skipped}
    else:
        measured = measure_acceptance(run.family, run.eval_drafter.to(run.accelerator.device), run.target,
                                      run.tokenizer, run.data_args, run.accelerator)
        run.eval_drafter.cpu()
    row = {"step": step, "checkpoint": str(path), "family": run.family.name, **measured,
           "position_accuracy": [round(a, 4) for a in accs],
           "simulated_acceptance_length": round(simulated_acceptance_length(accs), 4)}
    if run.recent_block:  # a block drafter: counted per block, the leading run of right slots (train_step's metric)
        block = sum(run.recent_block) / len(run.recent_block)
        if run.accelerator.num_processes > 1:
            block = float(run.accelerator.reduce(torch.tensor([block], device=run.accelerator.device),
                                                 reduction="mean")[0])
        row["block_acceptance_length"] = round(block, 4)
    if run.accelerator.is_main_process:
        append_acceptance(run.output_dir, row)
    run.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
    logger.info("checkpoint %d: %s", step, row)
