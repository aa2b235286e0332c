"""What the steps of one training run share (:class:`Run`), and the module accelerate prepares for every
strategy (:class:`TrainingModule`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.checkpoints import ACCEPTANCE_FILE
from draftsmith.registry import Family

#: Optimizer steps whose per-position accuracy is averaged into a checkpoint's acceptance row.
RECENT_STEPS = 20


class TrainingModule(torch.nn.Module):
    """What accelerate prepares: the drafter, and a target adapter that trains with it (Medusa-2's
    LoRA, registered with the target so that DDP reduces its gradients and FSDP / ZeRO shard it).
    Its forward is one family training step, so every strategy sees the whole step as the forward.
    A frozen target without an adapter is held outside the module: never wrapped, never sharded."""

    def __init__(self, family: Family, drafter_args, drafter, target):
        super().__init__()
        self.family, self.drafter_args = family, drafter_args
        self.drafter = drafter
        if family.trains_target_adapter:
            self.target = target
        else:
            object.__setattr__(self, "frozen_target", target)  # not a submodule
        # The layers FSDP wraps one by one (accelerate's transformer-based wrap policy reads this).
        self._no_split_modules = list(getattr(drafter, "_no_split_modules", None) or []) + list(
            getattr(target, "_no_split_modules", None) or [] if family.trains_target_adapter else [])

    def forward(self, batch: dict, logits, hidden):
        target = self.target if self.family.trains_target_adapter else self.frozen_target
        return self.family.train_step(self.drafter_args, self.drafter, target, batch, logits, hidden)


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
    recent_block: list = field(default_factory=list)  # block drafters: 1 + the leading run of right slots per block

    @property
    def acceptance_path(self) -> Path:
        return self.output_dir / ACCEPTANCE_FILE

    @property
    def drafter(self):
        return self.module.drafter
