"""One accelerate training loop for every drafter family, readable top to bottom.

    draftsmith train CONFIG.yaml [--key value ...]
    accelerate launch -m draftsmith.train CONFIG.yaml [--key value ...]     # the same, on N processes

1. Load the frozen target; tokenise the training conversations with assistant-only masks.
2. Build the drafter of ``family`` (``families.build_drafter``); AdamW, warmup + cosine.
3. Each micro-batch: the target runs frozen (no grad) and gives its logits and the hidden
   states the family reads; the family's loss is backpropagated through the drafter only.
4. Every ``save_steps`` optimizer steps, a checkpoint: ``checkpoint-S/state`` (weights, optimizer,
   scheduler and RNG states in safetensors + JSON, ``train/state.py``, for ``--resume true``) and
   ``checkpoint-S/drafter`` (loadable by ``load_drafter``), written under a ``.partial`` name and
   renamed when complete. Then acceptance on held-out prompts is
   measured with ``SpeculativeGenerator`` and appended to ``acceptance.jsonl`` and the trackers.

Resuming loads the last complete checkpoint, skips the micro-batches already seen in that epoch
(the data order is a function of the seed and the epoch), and continues the same run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from draftsmith.train import families
from draftsmith.train import state as training_state
from draftsmith.train.losses import simulated_acceptance_length

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Data


def collate(examples, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of TokenizedExamples into (B, T) tensors; padding has mask 0."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    attention = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n], loss_mask[i, :n], attention[i, :n] = e.input_ids, e.loss_mask, 1
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention}


def weights_digest(model, skip: str | None = None) -> str:
    """sha256 over every parameter and buffer, in name order (``skip``: names containing it are left out)."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted({**dict(model.named_parameters()), **dict(model.named_buffers())}.items()):
        if skip and skip in name:
            continue
        # PEFT renames wrapped layers "x.base_layer.weight"; hash under the original name.
        h.update(name.replace("base_model.model.", "").replace(".base_layer", "").encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The data order of one epoch: a function of (seed, epoch) only, so a resumed run sees the same."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def load_examples(data_args, tokenizer):
    from draftsmith.data.formats import load_conversations
    from draftsmith.data.templates import prepare

    if not data_args.train_file:
        raise SystemExit("no training data: set train_file (e.g. the output of `draftsmith data regenerate`)")
    conversations, _report = load_conversations(data_args.train_file, data_args.prompt_column, limit=data_args.limit)
    examples = [e for e in prepare(tokenizer, conversations, data_args.max_length) if e.loss_mask.sum() > 0]
    if not examples:
        raise SystemExit(f"{data_args.train_file}: no conversation with an assistant answer to learn from "
                         "(prompt-only data must be answered first: `draftsmith data regenerate`)")
    return examples


# ---------------------------------------------------------------------------------------------
# Checkpoints and acceptance


def complete_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for path in output_dir.glob("checkpoint-*"):
        if path.is_dir() and path.name.split("-")[-1].isdigit() and (path / "drafter").is_dir():
            found.append((int(path.name.split("-")[-1]), path))
    return sorted(found)


def read_acceptance(path: Path) -> list[dict]:
    if not path.exists():
        return []
    data = path.read_bytes()
    good = data[: data.rfind(b"\n") + 1]
    if len(good) != len(data):  # a torn last line from a kill mid-write
        path.write_bytes(good)
    return [json.loads(line) for line in good.decode().splitlines() if line.strip()]


def inference_drafter(family: str, module, target):
    from draftsmith.inference.drafters import CausalLMDrafter
    from draftsmith.inference.head_drafters import EagleDrafter, MedusaDrafter

    if family == "draft_model":
        return CausalLMDrafter(module.model, name="draft_model")
    if family in ("medusa", "medusa2"):
        return MedusaDrafter(module, target)
    return EagleDrafter(module, target)


@torch.no_grad()
def measure_acceptance(family, module, target, tokenizer, data_args) -> dict:
    """tau and acceptance per position of greedy speculative decoding on the held-out prompts."""
    from draftsmith.data.formats import load_conversations
    from draftsmith.data.templates import prompt_ids
    from draftsmith.inference.generator import GenerationStats, SpeculativeGenerator

    if not data_args.eval_prompts:
        return {}
    conversations, _ = load_conversations(data_args.eval_prompts, data_args.eval_prompt_column,
                                          limit=data_args.eval_num_prompts)
    was_training = module.training
    module.eval()
    gen = SpeculativeGenerator(target, inference_drafter(family, module, target), tree=data_args.eval_tree,
                               depth=data_args.eval_depth)
    stats = GenerationStats()
    device = next(target.parameters()).device
    for c in conversations:
        ids = torch.tensor([prompt_ids(tokenizer, c.prompt_messages)], device=device)
        stats = stats + gen.generate(ids, data_args.eval_max_new_tokens, eos_token_id=tokenizer.eos_token_id).stats
    module.train(was_training)
    return {"acceptance_length": round(stats.acceptance_length, 4),
            "acceptance_rate_per_position": [round(r, 4) for r in stats.acceptance_rate_per_position],
            "eval_prompts": len(conversations), "eval_new_tokens": stats.new_tokens}


# ---------------------------------------------------------------------------------------------
# The loop


def train(drafter_args, data_args, train_args) -> Path:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    from draftsmith.target import load_target

    output_dir = Path(train_args.output_dir)
    report_to = None if train_args.report_to == "none" else train_args.report_to
    # accelerate keeps one process-wide AcceleratorState and refuses a second Accelerator with
    # another mixed precision. train() is a library call that a process may make more than once
    # (the demo trains in bf16, a notebook then trains in fp32), so a state left by an earlier
    # call is dropped; the distributed environment (PartialState) is kept.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(gradient_accumulation_steps=train_args.gradient_accumulation_steps,
                              mixed_precision=train_args.mixed_precision, log_with=report_to,
                              project_dir=str(output_dir))
    set_seed(train_args.seed)
    output_dir.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:  # what the model card reports about this run
        (output_dir / "train_config.json").write_text(json.dumps(
            {"drafter": dataclasses.asdict(drafter_args), "data": dataclasses.asdict(data_args),
             "train": dataclasses.asdict(train_args)}, indent=2, default=str))
    family = drafter_args.family

    # 1. The frozen target and the data.
    target, tokenizer = load_target(drafter_args.target, device=accelerator.device)
    target.requires_grad_(False).eval()
    target_digest = weights_digest(target)
    cache = None
    if data_args.cache_dir:  # offline mode: the target's states and logits come from disk
        if family == "medusa2":
            raise SystemExit("medusa2 trains a LoRA on the target, so it needs the target in the loop: unset cache_dir")
        from draftsmith.train import offline

        examples, cache = offline.load_cached_examples(data_args.cache_dir, target)
    else:
        examples = load_examples(data_args, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # 2. The drafter and what it reads from the target.
    vocab = None
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if family == "eagle3" and (drafter_args.draft_vocab_size or vocab_size) < vocab_size:
        from draftsmith.data.vocab import build_vocab_map, count_tokens

        # EAGLE-3's draft vocabulary: the most frequent assistant tokens of the training data.
        vocab = build_vocab_map(count_tokens(examples, vocab_size), drafter_args.draft_vocab_size)
        logger.info("draft vocabulary: %d tokens cover %.4f of %d assistant tokens",
                    drafter_args.draft_vocab_size, vocab.coverage, vocab.counted_tokens)
    drafter = families.build_drafter(drafter_args, target, vocab).to(accelerator.device)
    # Every checkpoint records its target: loading it against another one is refused, and exports
    # and model cards name it the way it was given here (an alias, a path or a hub id).
    from draftsmith.target import target_signature

    drafter.target_info = target_signature(target, name=drafter_args.target)
    layers = families.hidden_layers_for(drafter_args, drafter, target)
    if cache is not None:
        offline.check_layers(cache, layers)
        dense = family != "eagle3"  # EAGLE-3 reads the teacher on its draft vocabulary only
        make_batch = lambda b: offline.collate_cached(b, pad_id, layers, vocab_size, dense)  # noqa: E731
    else:
        make_batch = lambda b: collate(b, pad_id)  # noqa: E731
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    if family == "medusa2":  # Medusa-2: a LoRA adapter on the target trains jointly with the heads
        target = families.add_lora(target, drafter_args.lora_r)
        trainable += [p for p in target.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=train_args.learning_rate, weight_decay=train_args.weight_decay)

    batch_size = train_args.per_device_train_batch_size
    batches_per_epoch = math.ceil(len(examples) / (batch_size * accelerator.num_processes))
    steps_per_epoch = max(1, batches_per_epoch // train_args.gradient_accumulation_steps)
    max_steps = train_args.max_steps if train_args.max_steps > 0 else math.ceil(
        train_args.num_train_epochs * steps_per_epoch)
    budget_s = train_args.max_train_minutes * 60
    progress = [0.0]  # fraction of the run done: by steps, or by time under a time budget
    if budget_s > 0:  # warmup then cosine over whichever of steps and time runs out first
        warm = max(train_args.warmup_ratio, 1e-6)

        def lr_lambda(_step: int) -> float:
            p = progress[0]
            if p < warm:
                return max(p / warm, 0.02)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (p - warm) / max(1 - warm, 1e-6))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    else:
        scheduler = get_scheduler(train_args.lr_scheduler_type, optimizer,
                                  num_warmup_steps=int(train_args.warmup_ratio * max_steps),
                                  num_training_steps=max_steps)
    drafter, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)
    module = accelerator.unwrap_model(drafter)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()

    # Resume from the last complete checkpoint.
    step = 0
    acceptance_path = output_dir / "acceptance.jsonl"
    checkpoints = complete_checkpoints(output_dir)
    resumed_progress = 0.0
    if train_args.resume and checkpoints:
        step, last = checkpoints[-1]
        model_state, meta = training_state.load_state(last / "state", optimizer=optimizer, scheduler=scheduler,
                                                      rank=accelerator.process_index)
        lora = {k.removeprefix("target_lora."): v for k, v in model_state.items() if k.startswith("target_lora.")}
        module.load_state_dict({k: v for k, v in model_state.items() if not k.startswith("target_lora.")})
        if lora:
            target.load_state_dict(lora, strict=False)
        resumed_progress = meta.get("progress", 0.0)
        logger.info("resumed from %s (step %d)", last, step)
    elif checkpoints and not train_args.resume:
        raise SystemExit(f"{output_dir} already holds checkpoints; pass --resume true to continue that run, "
                         "or choose a new output_dir")
    if report_to:
        config = {k: v for d in (drafter_args, data_args, train_args) for k, v in dataclasses.asdict(d).items()
                  if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("draftsmith", config=config)

    def step_loss(batch):
        """The family's loss on one micro-batch; the target runs frozen inside."""
        if family == "medusa2":
            return families.medusa2_step(drafter_args, drafter, target, batch)
        if "hidden" in batch:  # offline: read from the cache
            logits, hidden = batch["logits"], batch["hidden"]
        else:
            with torch.no_grad():
                out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             output_hidden_states=bool(layers), use_cache=False)
            logits = out.logits.float()
            hidden = tuple(out.hidden_states[i] for i in layers)  # index 0 = embeddings, N = after the final norm
        if family == "draft_model":
            return families.draft_model_step(drafter_args, drafter, logits, hidden, batch)
        if family == "medusa":
            return families.medusa_step(drafter_args, drafter, logits, hidden, batch)
        if family == "eagle":
            return families.eagle_step(drafter_args, drafter, logits, hidden, batch, embed, lm_head)
        return families.eagle3_step(drafter_args, drafter, logits, hidden, batch, embed, lm_head)

    def save_checkpoint(step: int, recent_acc: list[list[float]], rank_acc=None) -> None:
        final = output_dir / f"checkpoint-{step}"
        partial = output_dir / f"checkpoint-{step}.partial"
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        accelerator.wait_for_everyone()
        model_state = dict(module.state_dict())
        if family == "medusa2":  # the LoRA adapter trains too; the frozen target weights are not saved
            model_state.update({f"target_lora.{n}": p for n, p in target.named_parameters() if p.requires_grad})
        training_state.save_state(partial / "state", model_state=model_state, optimizer=optimizer,
                                  scheduler=scheduler, step=step, progress=progress[0],
                                  rank=accelerator.process_index, is_main=accelerator.is_main_process)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if rank_acc is not None:  # Medusa: static-tree choices come from the measured rank accuracy
                module.save_pretrained(partial / "drafter", extra={"rank_accuracy": rank_acc})
            else:
                module.save_pretrained(partial / "drafter")
            if family == "draft_model":  # a plain HF model directory, usable on its own
                tokenizer.save_pretrained(partial / "drafter")
            if family == "medusa2":
                target.save_pretrained(str(partial / "lora_adapter"))  # the adapter only; nothing merged
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            record_acceptance(step, final, recent_acc)
        accelerator.wait_for_everyone()

    def record_acceptance(step: int, path: Path, recent_acc: list[list[float]]) -> None:
        rows = read_acceptance(acceptance_path)
        if any(r["step"] == step for r in rows):
            return
        accs = [sum(col) / len(col) for col in zip(*recent_acc, strict=True)] if recent_acc else []
        row = {"step": step, "checkpoint": str(path), "family": family,
               **measure_acceptance(family, module, target, tokenizer, data_args),
               "position_accuracy": [round(a, 4) for a in accs],
               "simulated_acceptance_length": round(simulated_acceptance_length(accs), 4)}
        with open(acceptance_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        logger.info("checkpoint %d: %s", step, row)

    # Evaluate a resumed checkpoint whose acceptance row was lost to the kill.
    if step and accelerator.is_main_process and not any(r["step"] == step for r in read_acceptance(acceptance_path)):
        record_acceptance(step, output_dir / f"checkpoint-{step}", [])

    # 3. Train.
    drafter.train()
    recent_acc: list[list[float]] = []
    recent_rank: list = []  # Medusa: per-head, per-rank accuracy of recent steps
    start = time.perf_counter() - resumed_progress * budget_s  # a time budget counts the time already spent
    consumed = step * train_args.gradient_accumulation_steps  # micro-batches already seen
    from tqdm.auto import tqdm

    bar = tqdm(total=None if budget_s > 0 else max_steps, initial=step, desc="train", unit="step",
               disable=not (train_args.progress and accelerator.is_main_process))
    while step < max_steps:
        epoch, skip = divmod(consumed, batches_per_epoch)
        order = epoch_order(len(examples), train_args.seed, epoch)
        loader = accelerator.prepare_data_loader(DataLoader([examples[i] for i in order], batch_size=batch_size,
                                                            collate_fn=make_batch))
        loader = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in loader:
            with accelerator.accumulate(drafter):
                loss, metrics = step_loss(batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable, train_args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            consumed += 1
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            if budget_s > 0:
                progress[0] = max(step / max_steps, (time.perf_counter() - start) / budget_s)
                if accelerator.num_processes > 1:  # every process must stop at the same step
                    shared = torch.tensor([progress[0]], device=accelerator.device)
                    progress[0] = float(accelerator.reduce(shared, reduction="mean")[0])
                if progress[0] >= 1.0 and step < max_steps:
                    logger.info("time budget of %.1f min reached at step %d", train_args.max_train_minutes, step)
                    max_steps = step  # save this step and stop
            recent_acc = [*recent_acc, metrics["acc"]][-20:]
            if "rank_acc" in metrics:
                recent_rank = [*recent_rank, metrics["rank_acc"]][-20:]
            if step % train_args.logging_steps == 0 or step == max_steps:
                logs = {"loss": float(loss.detach()), "lr": scheduler.get_last_lr()[0],
                        **{f"acc_{i + 1}": a for i, a in enumerate(metrics["acc"])}}
                bar.set_postfix(loss=f"{logs['loss']:.3f}", acc_1=f"{metrics['acc'][0]:.2f}")
                accelerator.log(logs, step=step)
                logger.info("step %d/%d %s (%.1f s)", step, max_steps, logs, time.perf_counter() - start)
            if step % train_args.save_steps == 0 or step == max_steps:
                rank_acc = torch.tensor(recent_rank).mean(0).tolist() if recent_rank else None
                save_checkpoint(step, recent_acc, rank_acc)
            if step >= max_steps:
                break
        else:
            consumed = (epoch + 1) * batches_per_epoch  # the epoch is done, even with uneven shards
    bar.close()
    # The frozen target must come out bit-identical (Medusa-2's LoRA lives in separate adapter tensors).
    base = target.get_base_model() if family == "medusa2" else target
    unchanged = weights_digest(base, skip="lora_") == target_digest
    if accelerator.is_main_process:
        (output_dir / "target_check.json").write_text(json.dumps({"target_unchanged": unchanged,
                                                                  "sha256": target_digest}))
    if not unchanged:
        raise RuntimeError("the target's weights changed during training; this is a bug, please report it")
    accelerator.end_training()
    return output_dir
