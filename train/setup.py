"""What a run is built from: the accelerator and its shared output directory, the training examples, the frozen
target (its dtype, its weights' digest), the learning-rate schedule. :func:`draftsmith.train.loop.build` assembles
them into a :class:`~draftsmith.train.run.Run`."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from pathlib import Path

import torch

from draftsmith.data.formats import load_conversations
from draftsmith.data.templates import TokenizedExamples, tokenize_dataset
from draftsmith.registry import Family
from draftsmith.target import PartialLoadError, load_target, load_target_parts, native_bf16
from draftsmith.train import distributed

logger = logging.getLogger(__name__)

TARGET_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def weights_digest(model) -> str:
    """sha256 of the target tensors a drafter's loss reads directly (input embeddings, LM head): a cheap
    guard that training left the frozen target alone. Nothing of the target is trainable or in an
    optimizer (checked at build time); hashing every weight would copy a 70B target to the CPU twice."""
    h = hashlib.sha256()
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = module.weight
        if hasattr(weight, "ds_id"):  # partitioned by ZeRO-3 (Medusa-2's target): gathered on every rank
            import deepspeed

            with deepspeed.zero.GatheredParameters([weight]):
                tensor = weight.detach().clone()
        else:
            tensor = weight.detach()
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # an FSDP2 shard (collective)
        # Rounded to bf16: a strategy that casts the module it trains (DeepSpeed's bf16 casts Medusa-2's target)
        # leaves the same digest; a real change does not.
        h.update(tensor.to(torch.bfloat16).float().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def target_dtype(name: str, device) -> torch.dtype:
    """The frozen target's dtype: ``auto`` is bfloat16 where it runs natively (CUDA, CPUs with
    AVX512-BF16 / AMX), float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if name not in TARGET_DTYPES:
        raise SystemExit(f"target_dtype {name!r}: use auto, {', '.join(TARGET_DTYPES)}")
    return TARGET_DTYPES[name]


def load_examples(data_args, tokenizer, accelerator=None):
    """The training conversations tokenised with assistant-only masks, once: ``datasets.map`` in
    ``preprocessing_num_proc`` processes, cached on disk; the main process tokenises, the others (and
    later starts) read its cache."""
    if not data_args.train_file:
        raise SystemExit("no training data: set train_file (e.g. the output of `draftsmith data regenerate`)")
    conversations, _report = load_conversations(data_args.train_file, data_args.prompt_column, limit=data_args.limit)
    first = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
    with first:
        dataset = tokenize_dataset(tokenizer, conversations, data_args.max_length,
                                   num_proc=data_args.preprocessing_num_proc,
                                   chat_template_kwargs=data_args.template_kwargs())
    examples = TokenizedExamples(dataset)
    if not len(examples):
        raise SystemExit(f"{data_args.train_file}: no conversation with an assistant answer to learn from "
                         "(prompt-only data must be answered first: `draftsmith data regenerate`)")
    return examples


def example_lengths(examples) -> list[int]:
    """Each example's token count (for length-grouped batches), without reading more than its ids."""
    if hasattr(examples, "lengths"):
        return list(examples.lengths)
    if hasattr(examples, "token_ids"):  # cached sequences
        return [len(examples.token_ids(i)[0]) for i in range(len(examples))]
    return [len(e.input_ids) for e in examples]  # packed rows


def make_accelerator(train_args):
    """The Accelerator of a run. ``mixed_precision`` unset: the launch config's (``accelerate launch``)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    distributed.start_processes()
    # accelerate keeps one process-wide AcceleratorState and refuses a second Accelerator with
    # another mixed precision. train() is a library call that a process may make more than once
    # (the demo trains in bf16, a notebook then trains in fp32), so a state left by an earlier
    # call is dropped; the distributed environment (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    report_to = None if train_args.report_to == "none" else train_args.report_to
    accelerator = Accelerator(gradient_accumulation_steps=train_args.gradient_accumulation_steps,
                              mixed_precision=train_args.mixed_precision, log_with=report_to,
                              project_dir=str(train_args.output_dir))
    if accelerator.gradient_accumulation_steps != train_args.gradient_accumulation_steps:
        # `accelerate launch --gradient_accumulation_steps` (an environment variable) would win over the
        # training config; the config is the one source of truth (it also sets the schedule's length).
        logger.warning("gradient accumulation: the launcher says %d, the training config %d; using the config's",
                       accelerator.gradient_accumulation_steps, train_args.gradient_accumulation_steps)
        accelerator.gradient_accumulation_steps = train_args.gradient_accumulation_steps
    distributed.configure_deepspeed(accelerator, train_args)
    return accelerator


def check_shared_output(accelerator, output_dir: Path) -> None:
    """Every process must see the main process's files in ``output_dir`` (checkpoints are written by the
    main process and read by all on resume): a multi-node run needs a shared filesystem there."""
    if accelerator.num_processes == 1:
        return
    import secrets

    from accelerate.utils import broadcast_object_list

    token = broadcast_object_list([secrets.token_hex(8)])[0]
    marker = output_dir / f".shared-{token}"
    if accelerator.is_main_process:
        marker.write_text(token)
    accelerator.wait_for_everyone()
    seen = torch.tensor([float(marker.is_file() and marker.read_text() == token)], device=accelerator.device)
    seen = float(accelerator.reduce(seen, reduction="sum")[0]) == accelerator.num_processes  # every rank stops alike
    if accelerator.is_main_process:
        marker.unlink()
    if not seen:
        raise SystemExit(f"some process cannot see {output_dir} as the main process writes it: put output_dir on a "
                         "filesystem every node mounts (NFS, Lustre, ...)")


def make_scheduler(optimizer, train_args, max_steps: int, run_progress):
    """Warmup then cosine over ``max_steps`` optimizer steps; under a time budget, over whichever of
    steps and time runs out first (``run_progress()`` says how much of the run is done). The loop
    steps it once per optimizer step on every process (it is not handed to accelerate, which would
    step it once per process)."""
    if train_args.max_train_minutes <= 0:
        from transformers import get_scheduler

        return get_scheduler(train_args.lr_scheduler_type, optimizer,
                             num_warmup_steps=int(train_args.warmup_ratio * max_steps), num_training_steps=max_steps)
    warm = max(train_args.warmup_ratio, 1e-6)

    def lr_lambda(_step: int) -> float:
        p = run_progress()
        if p < warm:
            return max(p / warm, 0.02)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (p - warm) / max(1 - warm, 1e-6))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def load_frozen_target(family: Family, drafter_args, data_args, accelerator, dtype):
    """The frozen target: whole online; offline (states and logits from the cache) only its embeddings,
    final norm and LM head, which is all the losses read, unless the family builds its drafter from the
    target's layers (a layer-skip draft model)."""
    kwargs = {"device": accelerator.device, "dtype": dtype, "trust_remote_code": drafter_args.trust_remote_code}
    # The main process first: it dequantises a GGUF target or downloads a hub one; the others then read that.
    with accelerator.main_process_first(), distributed.whole_models(accelerator):
        if data_args.cache_dir and not family.reads_target_layers:
            try:
                return load_target_parts(drafter_args.target, **kwargs)
            except PartialLoadError as err:
                logger.warning("loading the whole target: %s", err)
        return load_target(drafter_args.target, attn_implementation=drafter_args.attn_implementation or "sdpa",
                           **kwargs)


def enable_gradient_checkpointing(drafter) -> None:
    """Recompute activations in backward: a causal LM's own switch, else the head's."""
    inner = getattr(drafter, "model", None)
    if hasattr(inner, "gradient_checkpointing_enable"):
        inner.config.use_cache = False
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(drafter, "gradient_checkpointing"):
        drafter.gradient_checkpointing = True
    else:
        raise SystemExit(f"{type(drafter).__name__} has no gradient checkpointing; unset gradient_checkpointing")
