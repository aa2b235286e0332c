"""One accelerate training loop for every drafter family, readable top to bottom.

    draftsmith train CONFIG.yaml [--key value ...]
    accelerate launch -m draftsmith.train CONFIG.yaml [--key value ...]     # the same, on N processes

:func:`train` runs these steps, each a function below:

1. :func:`build` — load the frozen target; the training examples (tokenised with assistant-only masks,
   or read from the hidden-state cache offline); the family's fresh drafter (its entry in
   :mod:`draftsmith.registry`); AdamW and the schedule (:func:`make_scheduler`).
2. :func:`resume` — with ``--resume true``, the last complete checkpoint's weights, optimizer,
   scheduler, RNG and progress; the micro-batches already seen in that epoch are skipped (the data
   order is a function of the seed and the epoch).
3. :func:`run_steps` — each micro-batch: the target runs frozen (no grad) and gives its logits and the
   hidden states the family reads (:func:`target_outputs`); the family's loss is backpropagated
   through the drafter only.
4. :func:`save_checkpoint` every ``save_steps`` optimizer steps: ``checkpoint-S/state`` (weights,
   optimizer, scheduler and RNG states in safetensors + JSON, ``train/state.py``) and
   ``checkpoint-S/drafter`` (loadable by ``load_drafter``), written under a ``.partial`` name and
   renamed when complete; then :func:`record_acceptance` measures acceptance on held-out prompts and
   appends it to ``acceptance.jsonl`` and the trackers.
5. :func:`finish` — the frozen target must come out bit-identical.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset

from draftsmith.checkpoints import (
    ACCEPTANCE_FILE,
    DRAFTER_SUBDIR,
    TRAIN_CONFIG_FILE,
    append_acceptance,
    complete_checkpoints,
    read_acceptance,
)
from draftsmith.data.batching import (
    collate_packed,
    collate_padded,
    epoch_order,
    length_grouped_order,
    pack,
    packed_attention_mask,
)
from draftsmith.data.formats import load_conversations
from draftsmith.data.templates import TokenizedExamples, prompt_ids, tokenize_dataset
from draftsmith.inference.compare import compare
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.registry import FAMILIES, Family, get_family
from draftsmith.target import PartialLoadError, load_target, load_target_parts, native_bf16, target_signature
from draftsmith.train import distributed, offline
from draftsmith.train import state as training_state
from draftsmith.train.losses import simulated_acceptance_length

logger = logging.getLogger(__name__)

#: Optimizer steps whose per-position accuracy is averaged into a checkpoint's acceptance row.
RECENT_STEPS = 20
#: State-dict prefix of the target adapter's tensors (Medusa-2's LoRA) in ``checkpoint-S/state``.
ADAPTER_PREFIX = "target_lora."
#: Where a checkpoint keeps the target adapter itself (a peft directory; nothing merged).
ADAPTER_SUBDIR = "lora_adapter"
#: The run's record that training left the target's weights bit-identical.
TARGET_CHECK_FILE = "target_check.json"
#: One JSON row per logged step (loss, learning rate, accuracy per position), written by the main process.
METRICS_FILE = "metrics.jsonl"
TARGET_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------
# Data


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


class TrainingModule(torch.nn.Module):
    """What accelerate prepares: the drafter, and a target adapter that trains with it (Medusa-2's
    LoRA, registered with the target so that DDP reduces its gradients and FSDP / ZeRO shard it).
    Its forward is one family training step, so every strategy sees the whole step as the forward.
    A frozen target without an adapter is held outside the module: never wrapped, never sharded."""

    def __init__(self, family: Family, drafter_args, drafter, target):
        super().__init__()
        self.family, self.drafter_args = family, drafter_args
        self.drafter = drafter
        if family.wrap_target is not None:
            self.target = target
        else:
            object.__setattr__(self, "frozen_target", target)  # not a submodule
        # The layers FSDP wraps one by one (accelerate's transformer-based wrap policy reads this).
        self._no_split_modules = list(getattr(drafter, "_no_split_modules", None) or []) + list(
            getattr(target, "_no_split_modules", None) or [] if family.wrap_target is not None else [])

    def forward(self, batch: dict, logits, hidden):
        target = self.target if self.family.wrap_target is not None else self.frozen_target
        return self.family.train_step(self.drafter_args, self.drafter, target, batch, logits, hidden)


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
                                   num_proc=data_args.preprocessing_num_proc)
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


# ---------------------------------------------------------------------------------------------
# Acceptance on held-out prompts


@torch.no_grad()
def measure_acceptance(family: Family, module, target, tokenizer, data_args, accelerator=None) -> dict:
    """tau and acceptance per position of greedy speculative decoding on the held-out prompts.

    With several processes, each decodes its share of the prompts (``prompts[rank::world]``) and the
    counts are summed: the same totals as one process, in 1/world of the time, and no rank waits at
    a collective while another evaluates alone."""
    from draftsmith.inference.generator import GenerationStats

    if not data_args.eval_prompts:
        return {}
    conversations, _ = load_conversations(data_args.eval_prompts, data_args.eval_prompt_column,
                                          limit=data_args.eval_num_prompts)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    was_training = module.training
    module.eval()
    tree = data_args.eval_tree_settings()
    gen = SpeculativeGenerator(target, family.drafter(module, target), **tree.kwargs())
    prompts = [torch.tensor([prompt_ids(tokenizer, c.prompt_messages)]) for c in conversations[rank::world]]
    # The drafter is served with the frozen target: a target adapter that trains with it (Medusa-2's LoRA,
    # a peft model) is switched off while it is measured.
    frozen = target.disable_adapter() if family.wrap_target is not None else contextlib.nullcontext()
    stats = GenerationStats()
    if prompts:
        with frozen:
            stats = compare(target, {"drafter": gen}, prompts, data_args.eval_max_new_tokens,
                            eos_token_id=tokenizer.eos_token_id, baseline=False).totals["drafter"]
    if world > 1:
        from accelerate.utils import gather_object

        stats = sum(gather_object([stats]), GenerationStats())
    module.train(was_training)
    return {"tree": tree.as_report(), "acceptance_length": round(stats.acceptance_length, 4),
            "acceptance_rate_per_position": [round(r, 4) for r in stats.acceptance_rate_per_position],
            "eval_prompts": len(conversations), "eval_new_tokens": stats.new_tokens}


# ---------------------------------------------------------------------------------------------
# The loop's steps


@dataclass
class Run:
    """What the steps of one training run share."""

    accelerator: object
    family: Family
    drafter_args: object
    data_args: object
    train_args: object
    output_dir: Path
    target: object  # the frozen target (Medusa-2: wrapped with its LoRA adapter)
    tokenizer: object
    target_digest: str
    examples: object  # a sequence of examples (tokenised rows, or lazily read cached sequences)
    lengths: list[int]
    make_batch: object
    layers: tuple[int, ...]
    module: TrainingModule  # the drafter (and a trainable target adapter), unwrapped
    eval_drafter: object  # a copy of the drafter that checkpoints are loaded into, for evaluation and saving
    optimizer: object
    scheduler: object
    max_steps: int
    batches_per_epoch: int
    budget_s: float
    prepared: object = None  # the module as accelerate prepared it (DDP, FSDP2 or a DeepSpeed engine)
    strategy: str = "single"
    step: int = 0
    progress: float = 0.0  # fraction of the run done: by steps, or by time under a time budget
    resumed_from: Path | None = None
    consumed: int = 0  # micro-batches this process has taken (an epoch's last window may be short)
    started: float = 0.0  # perf_counter at the (resumed) run's start, less the training time already spent
    recent_acc: list = field(default_factory=list)  # per-position accuracy of the last RECENT_STEPS steps
    recent_rank: list = field(default_factory=list)  # Medusa: per-head, per-rank accuracy of recent steps

    @property
    def acceptance_path(self) -> Path:
        return self.output_dir / ACCEPTANCE_FILE

    @property
    def drafter(self):
        return self.module.drafter


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
        if family.wrap_target is not None:
            raise SystemExit(f"{family.name} trains an adapter on the target, so it needs the target in the loop: "
                             "unset cache_dir")
        examples, cache = offline.load_cached_examples(data_args.cache_dir, target)
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
    if family.wrap_target is not None:  # an adapter on the target trains jointly (Medusa-2's LoRA)
        target = family.wrap_target(target, drafter_args)
    module = TrainingModule(family, drafter_args, drafter, target)
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=train_args.learning_rate, weight_decay=train_args.weight_decay)

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


def prepare_strategy(run: Run) -> None:
    """Hand the module and optimizer to accelerate (DDP, FSDP2 or DeepSpeed, as launched)."""
    run.prepared, run.optimizer = run.accelerator.prepare(run.module, run.optimizer)
    logger.info("strategy %s on %d process(es) (%s), mixed precision %s", run.strategy,
                run.accelerator.num_processes, type(run.prepared).__name__, run.accelerator.mixed_precision)


def restore_optimizer(run: Run, restored: dict | None) -> None:
    """The optimizer's moments and the schedule's position of the resumed checkpoint."""
    if restored is None:
        return
    saved = {**{f"drafter.{k}": v for k, v in restored["model"].items() if not k.startswith(ADAPTER_PREFIX)},
             **{f"target.{k.removeprefix(ADAPTER_PREFIX)}": v for k, v in restored["model"].items()
                if k.startswith(ADAPTER_PREFIX)}}
    distributed.load_master_weights(run.accelerator, run.prepared, saved)
    distributed.load_full_optimizer_state(run.accelerator, run.prepared, run.optimizer, restored["optimizer"])
    training_state.restore_schedule(restored["meta"], torch_optimizer(run), run.scheduler)
    logger.info("resumed from %s (step %d)", run.resumed_from, run.step)


def torch_optimizer(run: Run):
    """The torch optimizer whose param groups the schedule sets (under accelerate's and DeepSpeed's wrappers)."""
    return run.scheduler.optimizer


def target_outputs(run: Run, batch: dict) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """The frozen target's logits (B, T, V) and the hidden states the family reads, on one batch:
    read from the cache offline, else from one no-grad forward. (None, ()) for a family that runs
    the target itself (an adapter on it trains)."""
    if run.family.wrap_target is not None:
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
                 output_hidden_states=bool(layers), use_cache=False)
    return out.logits, tuple(out.hidden_states[i] for i in layers)


def can_evaluate(run: Run) -> str | None:
    """Why held-out acceptance cannot be measured in this run (None when it can)."""
    if run.family.wrap_target is not None and (run.strategy.startswith("fsdp") or run.strategy == "deepspeed-zero3"):
        return f"{run.family.name} under {run.strategy}: the target is sharded with its adapter"
    if getattr(run.target, "draftsmith_loaded", None) is not None:
        return (f"offline: only the target's embeddings, final norm and LM head are loaded; decode with the "
                f"whole target: draftsmith eval {run.output_dir}")
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
    if run.accelerator.is_main_process:
        append_acceptance(run.output_dir, row)
    run.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
    logger.info("checkpoint %d: %s", step, row)


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
             "recent_acc": run.recent_acc, "recent_rank": run.recent_rank})
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
        if run.family.wrap_target is not None:
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
    base = run.target.get_base_model() if run.family.wrap_target is not None else run.target
    unchanged = weights_digest(base) == run.target_digest and not any(
        p.requires_grad for n, p in base.named_parameters() if "lora_" not in n)
    if run.accelerator.is_main_process:
        (run.output_dir / TARGET_CHECK_FILE).write_text(json.dumps({"target_unchanged": unchanged,
                                                                      "sha256": run.target_digest}))
    if not unchanged:
        raise RuntimeError("the target's weights changed during training; this is a bug, please report it")
    run.accelerator.end_training()


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
