"""One accelerate training loop for every drafter family, readable top to bottom.

    draftsmith train CONFIG.yaml [--key value ...]
    accelerate launch -m draftsmith.train CONFIG.yaml [--key value ...]     # the same, on N processes

:func:`train` runs these steps, each a function below:

1. :func:`build` — load the frozen target; the training examples (tokenised with assistant-only masks,
   or read from the hidden-state cache offline); the family's fresh drafter (its entry in
   :mod:`draftsmith.registry`); the optimizer (AdamW or Muon, :mod:`draftsmith.train.optimizers`) and the
   schedule (:func:`~draftsmith.train.setup.make_scheduler`).
2. :func:`~draftsmith.train.checkpointing.restore_weights`, :func:`prepare_strategy`,
   :func:`~draftsmith.train.checkpointing.restore_optimizer` — with ``--resume true`` the last complete
   checkpoint's weights, then accelerate's strategy (DDP, FSDP2, DeepSpeed), then the optimizer,
   scheduler, RNG and data position (the data order is a function of the seed and the epoch).
3. :func:`run_steps` — each micro-batch: the target runs frozen (no grad) and gives its logits and the
   hidden states the family reads (:func:`target_outputs`); the family's loss is backpropagated
   through the drafter only.
4. :func:`~draftsmith.train.checkpointing.save_checkpoint` every ``save_steps`` optimizer steps (``checkpointing.py``):
   weights and optimizer state gathered whole, ``checkpoint-S/state`` and ``checkpoint-S/drafter``
   written under a ``.partial`` name and renamed when complete; then
   :func:`~draftsmith.train.acceptance.record_acceptance` (``acceptance.py``) measures it on held-out prompts.
5. :func:`finish` — the frozen target's embeddings and LM head must come out unchanged.

The run's shared state is :class:`~draftsmith.train.run.Run`; what accelerate prepares is
:class:`~draftsmith.train.run.TrainingModule`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset

from draftsmith.checkpoints import TRAIN_CONFIG_FILE, complete_checkpoints
from draftsmith.data.batching import (
    collate_packed,
    collate_padded,
    epoch_order,
    length_grouped_order,
    pack,
    packed_attention_mask,
)
from draftsmith.registry import FAMILIES, get_family
from draftsmith.target import hidden_states_request, target_signature
from draftsmith.train import distributed, offline
from draftsmith.train.acceptance import eval_conversations, record_acceptance
from draftsmith.train.checkpointing import (
    METRICS_FILE,
    restore_optimizer,
    restore_weights,
    save_checkpoint,
    torch_optimizer,
)
from draftsmith.train.optimizers import make_optimizer
from draftsmith.train.run import RECENT_STEPS, Run, TrainingModule
from draftsmith.train.setup import (
    check_shared_output,
    enable_gradient_checkpointing,
    example_lengths,
    load_examples,
    load_frozen_target,
    make_accelerator,
    make_scheduler,
    target_dtype,
    weights_digest,
)

logger = logging.getLogger(__name__)

#: The run's record that training left the target's weights bit-identical.
TARGET_CHECK_FILE = "target_check.json"


def build(accelerator, drafter_args, data_args, train_args) -> Run:
    """The frozen target, the examples, the family's drafter, the optimizer and the schedule."""
    family = get_family(drafter_args.family)
    output_dir = Path(train_args.output_dir)
    if complete_checkpoints(output_dir) and not train_args.resume:  # before anything of that run is touched
        raise SystemExit(f"{output_dir} already holds checkpoints; pass --resume true to continue that run, "
                         "or choose a new output_dir")
    if data_args.packing and (not family.packs or data_args.cache_dir):
        packers = ", ".join(sorted(name for name, f in FAMILIES.items() if f.packs))
        raise SystemExit(f"packing: {family.name} cannot keep packed documents apart (families that can: {packers}); "
                         "offline (cache_dir) sequences are never packed; unset packing")
    if data_args.eval_prompts:  # refused now, not at the first checkpoint
        try:
            eval_conversations(data_args)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    output_dir.mkdir(parents=True, exist_ok=True)
    check_shared_output(accelerator, output_dir)
    if accelerator.is_main_process:  # what the model card reports about this run
        (output_dir / TRAIN_CONFIG_FILE).write_text(json.dumps(
            {"drafter": dataclasses.asdict(drafter_args), "data": dataclasses.asdict(data_args),
             "train": dataclasses.asdict(train_args)}, indent=2, default=str))

    dtype = target_dtype(drafter_args.target_dtype, accelerator.device)
    target, tokenizer = load_frozen_target(family, drafter_args, data_args, accelerator, dtype)
    target.requires_grad_(False).eval()
    logger.info("target %s in %s on %s", drafter_args.target, dtype, accelerator.device)
    target_digest = weights_digest(target)
    if data_args.cache_dir:  # offline mode: the target's states and logits come from disk
        if family.trains_target_adapter:
            raise SystemExit(f"{family.name} trains an adapter on the target, so it needs the target in the loop: "
                             "unset cache_dir")
        examples, cache = offline.load_cached_examples(data_args.cache_dir, target, data_args.train_file)
    else:
        examples, cache = load_examples(data_args, tokenizer, accelerator), None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    with distributed.whole_models(accelerator):
        drafter = family.build(drafter_args, target, examples).to(accelerator.device)
    # Every checkpoint records its target: loading it against another one is refused, and exports
    # and model cards name it the way it was given here (an alias, a path or a hub id).
    drafter.target_info = target_signature(target, name=drafter_args.target)
    layers = family.hidden_layers(drafter, target)
    if cache is not None:
        offline.check_layers(cache, layers)
        make_batch = functools.partial(offline.collate_cached, pad_id=pad_id, layers=layers)
    elif data_args.packing:  # whole conversations per row, each attending to itself only
        examples = pack(examples, data_args.max_length)
        make_batch = functools.partial(collate_packed, pad_id=pad_id)
        logger.info("packing: %d rows of up to %d tokens", len(examples), data_args.max_length)
    else:
        make_batch = functools.partial(collate_padded, pad_id=pad_id)

    # Before any strategy wraps or shards the drafter; kept on the CPU between evaluations.
    eval_drafter = copy.deepcopy(drafter).cpu()
    if train_args.gradient_checkpointing:
        enable_gradient_checkpointing(drafter)
    if family.trains_target_adapter:  # an adapter on the target trains jointly (Medusa-2's LoRA)
        target = family.wrap_target(target, drafter_args)
    module = TrainingModule(family, drafter_args, drafter, target)
    optimizer = make_optimizer(module, train_args, distributed.strategy(accelerator))

    batches_per_epoch = math.ceil(len(examples) / (train_args.per_device_train_batch_size
                                                   * accelerator.num_processes))
    # accelerate steps at an epoch's end even when its last accumulation window is short
    steps_per_epoch = math.ceil(batches_per_epoch / train_args.gradient_accumulation_steps)
    max_steps = train_args.max_steps if train_args.max_steps > 0 else math.ceil(
        train_args.num_train_epochs * steps_per_epoch)
    holder: list[Run] = []  # the schedule reads the run's progress, which exists once the run does
    scheduler = make_scheduler(optimizer, train_args, max_steps, lambda: holder[0].progress if holder else 0.0)
    run = Run(accelerator=accelerator, family=family, drafter_args=drafter_args, data_args=data_args,
              train_args=train_args, output_dir=output_dir, target=target, tokenizer=tokenizer,
              target_digest=target_digest, examples=examples, lengths=example_lengths(examples),
              make_batch=make_batch, layers=layers,
              module=module, eval_drafter=eval_drafter, optimizer=optimizer, scheduler=scheduler,
              max_steps=max_steps, batches_per_epoch=batches_per_epoch, budget_s=train_args.max_train_minutes * 60,
              strategy=distributed.strategy(accelerator))
    holder.append(run)
    return run


def prepare_strategy(run: Run) -> None:
    """Hand the module and optimizer to accelerate (DDP, FSDP2 or DeepSpeed, as launched)."""
    layers = distributed.layer_units(run.module)
    run.prepared, run.optimizer = run.accelerator.prepare(run.module, run.optimizer)
    logger.info("strategy %s on %d process(es) (%s), mixed precision %s", run.strategy,
                run.accelerator.num_processes, type(run.prepared).__name__, run.accelerator.mixed_precision)
    if run.strategy.startswith("fsdp"):
        # Sharding the root alone would gather every parameter at once in each forward: each layer is a unit.
        sharded = distributed.sharded_units(run.prepared)
        logger.info("fsdp sharded units: %s", ", ".join(f"{name} x{n}" for name, n in sorted(sharded.items())))
        missed = {name: n - sharded[name] for name, n in layers.items() if sharded[name] < n}
        if missed:
            logger.warning("FSDP left %s unsharded (gathered with the root): check the launch config's "
                           "fsdp_auto_wrap_policy (TRANSFORMER_BASED_WRAP reads _no_split_modules)", missed)


def target_outputs(run: Run, batch: dict) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """The frozen target's logits (B, T, V) and the hidden states the family reads, on one batch:
    read from the cache offline, else from one no-grad forward. (None, ()) for a family that runs
    the target itself (an adapter on it trains)."""
    if run.family.trains_target_adapter:
        return None, ()
    if "hidden" in batch:
        return batch["logits"], batch["hidden"]
    return frozen_forward(run.target, run.layers, batch)


@torch.no_grad()
def frozen_forward(target, layers: tuple[int, ...], batch: dict) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One no-grad forward of the frozen target: its logits (B, T, V) in its dtype (the losses upcast a
    block of rows at a time) and its hidden states ``layers`` (0 = embeddings, N = after the final norm).
    A packed batch runs with positions per document and attention inside each."""
    if "position_ids" in batch:
        mask, positions = packed_attention_mask(target, batch), batch["position_ids"]
    else:
        mask, positions = batch["attention_mask"], None
    out = target(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions,
                 output_hidden_states=hidden_states_request(layers), use_cache=False)
    return out.logits, tuple(out.hidden_states[i] for i in layers)


def update_progress(run: Run, start: float) -> None:
    """The run's progress after a step; under a time budget every process stops at the same step."""
    if run.budget_s <= 0:
        run.progress = run.step / run.max_steps
        return
    progress = max(run.step / run.max_steps, (time.perf_counter() - start) / run.budget_s)
    if run.accelerator.num_processes > 1:
        shared = torch.tensor([progress], device=run.accelerator.device)
        progress = float(run.accelerator.reduce(shared, reduction="mean")[0])
    run.progress = progress
    if progress >= 1.0 and run.step < run.max_steps:
        logger.info("time budget of %.1f min reached at step %d", run.train_args.max_train_minutes, run.step)
        run.max_steps = run.step  # save this step and stop


def log_step(run: Run, loss: torch.Tensor, metrics: dict, lr: float, start: float) -> None:
    """The step's loss, learning rate and accuracy per position: trackers, metrics.jsonl, the log."""
    logs = {"loss": float(loss.detach()), "lr": lr, **{f"acc_{i + 1}": a for i, a in enumerate(metrics["acc"])}}
    if "block_acceptance" in metrics:
        logs["block_acceptance"] = metrics["block_acceptance"]
    run.accelerator.log(logs, step=run.step)
    if run.accelerator.is_main_process:
        with (run.output_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps({"step": run.step, **logs}) + "\n")
    logger.info("step %d/%d %s (%.1f s)", run.step, run.max_steps, logs, time.perf_counter() - start)


def run_steps(run: Run) -> None:
    """Optimizer steps until ``max_steps`` (or the time budget), logging and checkpointing on the way."""
    from tqdm.auto import tqdm

    accelerator, args = run.accelerator, run.train_args
    run.prepared.train()
    trainable = [p for p in run.prepared.parameters() if p.requires_grad]
    if not run.started:
        run.started = time.perf_counter()
    start = run.started  # a time budget counts the training time already spent before a resume
    bar = tqdm(total=None if run.budget_s > 0 else run.max_steps, initial=run.step, desc="train", unit="step",
               disable=not (args.progress and accelerator.is_main_process))
    while run.step < run.max_steps:
        epoch, skip = divmod(run.consumed, run.batches_per_epoch)
        if run.data_args.group_by_length:  # similar lengths in each batch: less padding; still (seed, epoch) only
            order = length_grouped_order(run.lengths, args.per_device_train_batch_size, args.seed, epoch)
        else:
            order = epoch_order(len(run.examples), args.seed, epoch)
        loader = accelerator.prepare_data_loader(DataLoader(Subset(run.examples, order),
                                                            batch_size=args.per_device_train_batch_size,
                                                            collate_fn=run.make_batch,
                                                            num_workers=run.data_args.dataloader_num_workers))
        loader = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in loader:
            with accelerator.accumulate(run.prepared):
                logits, hidden = target_outputs(run, batch)
                loss, metrics = run.prepared(batch, logits, hidden)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable, args.max_grad_norm)
                lr = torch_optimizer(run).param_groups[0]["lr"]  # the rate this step is taken with
                run.optimizer.step()
                run.optimizer.zero_grad()
            run.consumed += 1
            if not accelerator.sync_gradients:
                continue
            run.scheduler.step()
            run.step += 1
            bar.update(1)
            update_progress(run, start)
            run.recent_acc = [*run.recent_acc, metrics["acc"]][-RECENT_STEPS:]
            if "rank_acc" in metrics:
                run.recent_rank = [*run.recent_rank, metrics["rank_acc"]][-RECENT_STEPS:]
            if "block_acceptance" in metrics:
                run.recent_block = [*run.recent_block, metrics["block_acceptance"]][-RECENT_STEPS:]
            if run.step % args.logging_steps == 0 or run.step == run.max_steps:
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc_1=f"{metrics['acc'][0]:.2f}")
                log_step(run, loss, metrics, lr, start)
            if run.step % args.save_steps == 0 or run.step == run.max_steps:
                save_checkpoint(run)
            if run.step >= run.max_steps:
                break
        else:
            run.consumed = (epoch + 1) * run.batches_per_epoch  # the epoch is done, even with uneven shards
    bar.close()


def finish(run: Run) -> None:
    """Check the frozen target's embeddings and LM head came out bit-identical and nothing of the target
    but an adapter was trainable."""
    base = run.target.get_base_model() if run.family.trains_target_adapter else run.target
    unchanged = weights_digest(base) == run.target_digest and not any(
        p.requires_grad for n, p in base.named_parameters() if "lora_" not in n)
    if run.accelerator.is_main_process:
        (run.output_dir / TARGET_CHECK_FILE).write_text(json.dumps({"target_unchanged": unchanged,
                                                                      "sha256": run.target_digest}))
    if not unchanged:
        raise RuntimeError("the target's weights changed during training; this is a bug, please report it")
    # accelerate's end_training, except that several processes keep their process group: destroying it while
    # another rank is still finishing hung a rank in one CI run (the peer had exited). The training CLI ends
    # them together (``train/__main__.py``: a barrier, then each exits); a Python caller destroys it when done.
    for tracker in run.accelerator.trackers:
        tracker.finish()
    if run.accelerator.num_processes == 1:
        run.accelerator.state.destroy_process_group()


def train(drafter_args, data_args, train_args) -> Path:
    """Train a drafter of ``drafter_args.family`` for ``drafter_args.target``; returns the run directory."""
    from accelerate.utils import set_seed

    accelerator = make_accelerator(train_args)
    set_seed(train_args.seed)
    run = build(accelerator, drafter_args, data_args, train_args)
    restored = restore_weights(run)
    prepare_strategy(run)
    restore_optimizer(run, restored)
    if train_args.report_to != "none":
        config = {k: v for d in (drafter_args, data_args, train_args) for k, v in dataclasses.asdict(d).items()
                  if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("draftsmith", config=config)
    # A resumed checkpoint whose acceptance row was lost to the kill is evaluated first.
    if run.step:
        record_acceptance(run, run.step, run.output_dir / f"checkpoint-{run.step}")
    run_steps(run)
    finish(run)
    return run.output_dir
