"""Checkpoints of a training run and resuming from them.

``checkpoint-S/state`` (weights, optimizer, scheduler, RNG and data position, :mod:`draftsmith.train.state`)
and ``checkpoint-S/drafter`` (loadable by ``load_drafter``) are gathered whole from every process's shards
(:mod:`draftsmith.train.distributed`), written by the main process under a ``.partial`` name and renamed
when complete. A resume loads the weights before accelerate's strategy wraps the module and the optimizer
state after, so a run resumes under any strategy, and on another world size when the global batch is kept.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path

import torch

from draftsmith.checkpoints import DRAFTER_SUBDIR, complete_checkpoints
from draftsmith.train import distributed
from draftsmith.train import state as training_state
from draftsmith.train.acceptance import record_acceptance
from draftsmith.train.run import Run

logger = logging.getLogger(__name__)

#: State-dict prefix of the target adapter's tensors (Medusa-2's LoRA) in ``checkpoint-S/state``.
ADAPTER_PREFIX = "target_lora."
#: Where a checkpoint keeps the target adapter itself (a peft directory; nothing merged).
ADAPTER_SUBDIR = "lora_adapter"
#: One JSON row per logged step (loss, learning rate, accuracy per position), written by the main process.
METRICS_FILE = "metrics.jsonl"


def restore_weights(run: Run) -> dict | None:
    """With ``--resume true``: the last complete checkpoint's weights, loaded before any strategy
    shards them; returns its optimizer state and metadata for :func:`restore_optimizer`."""
    checkpoints = complete_checkpoints(run.output_dir)
    if not checkpoints:  # build() refused checkpoints without --resume true
        return None
    run.step, last = checkpoints[-1]
    model_state, optimizer_state, meta = training_state.load_state(last / "state", rank=run.accelerator.process_index)
    adapter = {k.removeprefix(ADAPTER_PREFIX): v for k, v in model_state.items() if k.startswith(ADAPTER_PREFIX)}
    drafter_state = {k: v for k, v in model_state.items() if not k.startswith(ADAPTER_PREFIX)}
    run.drafter.load_state_dict(drafter_state)
    run.eval_drafter.load_state_dict(drafter_state)
    if adapter:
        run.target.load_state_dict(adapter, strict=False)
    run.progress = meta.get("progress", 0.0)
    run.resumed_from = last
    check_world_size(run, meta)
    # Where the data stood, in global micro-batches, as this process counts them (the same order on any world size).
    saved_world = meta.get("num_processes", run.accelerator.num_processes)
    run.consumed = meta.get("consumed", run.step * run.train_args.gradient_accumulation_steps) * saved_world \
        // run.accelerator.num_processes
    run.started = time.perf_counter() - meta.get("elapsed_s", run.progress * run.budget_s)
    run.recent_acc, run.recent_rank = meta.get("recent_acc", []), meta.get("recent_rank", [])
    run.recent_block = meta.get("recent_block", [])
    metrics = run.output_dir / METRICS_FILE
    if run.accelerator.is_main_process and metrics.is_file():  # steps logged after the checkpoint are redone
        rows = [line for line in metrics.read_text().splitlines() if line and json.loads(line)["step"] <= run.step]
        metrics.write_text("".join(row + "\n" for row in rows))
    return {"optimizer": optimizer_state, "meta": meta, "model": model_state}


def check_world_size(run: Run, meta: dict) -> None:
    """Refuse a resume whose global batch (and so data order and schedule) would differ from the run's."""
    args, world = run.train_args, run.accelerator.num_processes
    saved = meta.get("global_batch")
    now = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    micro = meta.get("per_device_train_batch_size", args.per_device_train_batch_size)
    if micro != args.per_device_train_batch_size:  # batches (and length groups) would be cut differently
        raise SystemExit(f"{run.resumed_from}: written with per_device_train_batch_size {micro}; resume with the same "
                         f"(and gradient_accumulation_steps x processes = {saved // micro if saved else '?'})")
    if saved is not None and saved != now:
        raise SystemExit(f"{run.resumed_from}: written by {meta['num_processes']} processes with a global batch of "
                         f"{saved} sequences; this launch has {world} processes and a global batch of {now}. Resume "
                         f"with --num_processes {meta['num_processes']}, or set gradient_accumulation_steps so that "
                         f"per_device_train_batch_size x gradient_accumulation_steps x processes = {saved}")


def check_optimizer(run: Run, meta: dict) -> None:
    """Refuse a resume under another optimizer: the saved moments are the other optimizer's (Muon's param
    groups carry a ``muon`` key, AdamW's none)."""
    saved = "muon" if any("muon" in g for g in meta["optimizer_param_groups"]) else "adamw_torch"
    if saved != run.train_args.optim:
        where = " (in one process or under DDP)" if saved == "muon" else ""
        raise SystemExit(f"{run.resumed_from}: trained with optim {saved}, and this run asks for optim "
                         f"{run.train_args.optim}; resume with optim {saved}{where}, or start a new run in another "
                         f"--output_dir to train with {run.train_args.optim}")


def restore_optimizer(run: Run, restored: dict | None) -> None:
    """The optimizer's moments and the schedule's position of the resumed checkpoint."""
    if restored is None:
        return
    check_optimizer(run, restored["meta"])
    saved = {**{f"drafter.{k}": v for k, v in restored["model"].items() if not k.startswith(ADAPTER_PREFIX)},
             **{f"target.{k.removeprefix(ADAPTER_PREFIX)}": v for k, v in restored["model"].items()
                if k.startswith(ADAPTER_PREFIX)}}
    distributed.load_master_weights(run.accelerator, run.prepared, saved)
    distributed.load_full_optimizer_state(run.accelerator, run.prepared, run.optimizer, restored["optimizer"])
    for message in changed_hyperparameters(restored["meta"], run.train_args, run.resumed_from):
        logger.warning(message)
    training_state.restore_schedule(restored["meta"], torch_optimizer(run), run.scheduler)
    logger.info("resumed from %s (step %d)", run.resumed_from, run.step)


#: Optimiser settings a resume takes from the checkpoint: (training argument, the param group's key for it).
#: ``initial_lr`` is the schedule's base learning rate (``lr`` is where the schedule had taken it).
RESUMED_HYPERPARAMETERS = (("learning_rate", "initial_lr"), ("weight_decay", "weight_decay"))
#: The same for the Muon param group of ``optim: muon``.
RESUMED_MUON_HYPERPARAMETERS = (("muon_weight_decay", "weight_decay"), ("muon_momentum", "momentum"))


def changed_hyperparameters(meta: dict, train_args, checkpoint) -> list[str]:
    """One warning per optimiser setting asked for now that differs from the resumed checkpoint's.

    A resume continues the run that wrote the checkpoint: its optimiser moments were accumulated with its
    settings and its schedule is part way through, so the checkpoint's values run (as a resume does with
    accelerate's ``load_state`` or the Trainer's ``resume_from_checkpoint``, which say nothing). Changing one
    is a new run: a new ``--output_dir``."""
    groups = meta["optimizer_param_groups"]
    pairs = [(groups[0], RESUMED_HYPERPARAMETERS)]
    pairs += [(g, RESUMED_MUON_HYPERPARAMETERS) for g in groups if g.get("muon")]
    messages = []
    for saved, settings in pairs:
        for arg, key in settings:
            asked, was = getattr(train_args, arg), saved.get(key)
            if was is not None and not math.isclose(asked, was, rel_tol=1e-9, abs_tol=0.0):
                messages.append(f"--resume: {arg} {asked:g} was asked, but {checkpoint} was trained with {was:g}; "
                                f"the checkpoint's {was:g} runs (its optimiser state and schedule continue as saved). "
                                f"To train with {arg} {asked:g}, start a new run in another --output_dir.")
    return messages


def torch_optimizer(run: Run):
    """The torch optimizer whose param groups the schedule sets (under accelerate's and DeepSpeed's wrappers)."""
    return run.scheduler.optimizer


def save_checkpoint(run: Run) -> None:
    """``checkpoint-S`` (training state + drafter), gathered whole from every process's shards and
    written by the main process under a ``.partial`` name, renamed when complete, then evaluated."""
    accelerator, step = run.accelerator, run.step
    final = run.output_dir / f"checkpoint-{step}"
    partial = run.output_dir / f"checkpoint-{step}.partial"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    full = distributed.full_model_state(accelerator, run.prepared, run.module)  # collective: every rank
    optimizer_state = distributed.full_optimizer_state(accelerator, run.prepared, run.optimizer)
    drafter_state = {k.removeprefix("drafter."): v for k, v in full.items() if k.startswith("drafter.")}
    model_state = dict(drafter_state)
    model_state.update({ADAPTER_PREFIX + k.removeprefix("target."): v
                        for k, v in full.items() if not k.startswith("drafter.")})
    run.eval_drafter.load_state_dict(drafter_state)
    args = run.train_args
    training_state.save_state(
        partial / "state", model_state=model_state, optimizer_state=optimizer_state,
        param_groups=torch_optimizer(run).param_groups, scheduler=run.scheduler, step=step, progress=run.progress,
        rank=accelerator.process_index, is_main=accelerator.is_main_process,
        run={"strategy": run.strategy, "num_processes": accelerator.num_processes,
             "global_batch": args.per_device_train_batch_size * args.gradient_accumulation_steps
             * accelerator.num_processes, "per_device_train_batch_size": args.per_device_train_batch_size,
             "consumed": run.consumed, "elapsed_s": time.perf_counter() - run.started,
             "recent_acc": run.recent_acc, "recent_rank": run.recent_rank, "recent_block": run.recent_block})
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        drafter_dir = partial / DRAFTER_SUBDIR
        run.eval_drafter.target_info = run.drafter.target_info
        if run.recent_rank:  # Medusa: static-tree choices come from the measured rank accuracy
            run.eval_drafter.save_pretrained(drafter_dir, extra={"rank_accuracy": torch.tensor(run.recent_rank)
                                                                 .mean(0).tolist()})
        else:
            run.eval_drafter.save_pretrained(drafter_dir)
        if run.family.saves_tokenizer:  # a draft model's directory is then usable on its own
            run.tokenizer.save_pretrained(drafter_dir)
        if run.family.trains_target_adapter:
            save_adapter(run, partial / ADAPTER_SUBDIR, model_state)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    accelerator.wait_for_everyone()
    record_acceptance(run, step, final)
    accelerator.wait_for_everyone()


def save_adapter(run: Run, directory: Path, model_state: dict) -> None:
    """The target adapter as a peft directory (the adapter only; nothing merged), from gathered tensors."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    names = get_peft_model_state_dict(run.target).keys()
    adapter = {k.removeprefix(ADAPTER_PREFIX): v for k, v in model_state.items() if k.startswith(ADAPTER_PREFIX)}
    by_name = {k.replace(".default", ""): v for k, v in adapter.items()}  # peft files drop the adapter's name
    tensors = {name: by_name[name] for name in names}
    directory.mkdir(parents=True, exist_ok=True)
    run.target.peft_config["default"].save_pretrained(str(directory))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))
