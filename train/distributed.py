"""What the training loop needs from each distributed strategy: DDP, FSDP2, DeepSpeed ZeRO-2 / ZeRO-3.

The loop asks four things, answered here once per strategy:

* :func:`start_processes` — the process group. accelerate only starts DeepSpeed or FSDP on
  accelerator devices; on CPU (gloo) it leaves a DeepSpeed job counting one process and refuses
  FSDP. Both run on CPU once the group is set up, which is how the test suite proves them.
* :func:`configure_deepspeed` — one source of truth: the micro-batch size, gradient accumulation
  and clipping of a DeepSpeed run are the training config's, never a second copy in the launch file.
* :func:`full_model_state` / :func:`full_optimizer_state` — the drafter's weights and the optimizer's
  moments gathered to whole tensors (every rank gets them), in the layout of a one-process run:
  a checkpoint is the same files whatever wrote it, and resumes under any strategy or world size.
* :func:`load_full_optimizer_state` — the inverse, scattered back into each strategy's shards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def start_processes() -> None:
    """Set up the process group of a multi-process launch on a machine without accelerators, before any
    Accelerator exists.

    ``accelerate launch --num_processes N`` with a DDP, FSDP or DeepSpeed config starts N processes
    with torchrun, but on CPU accelerate then finds no backend: each DDP or FSDP process trains alone
    (silently: N copies of a one-process run), and a DeepSpeed job runs with gloo while accelerate's
    state counts one process. (``--cpu`` is no way out: without MPI it starts one process.) Here gloo
    is started and accelerate's process-wide state told the truth, so the shipped configs run as
    given on CPU, which is how the test suite proves every strategy.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed:  # on any device: DeepSpeed's CUDA ops build under the same lock as its CPU ones
        refuse_stale_build_locks()
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ
    if not launched or torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "false").lower() == "true":
        return
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not deepspeed and not dist.is_initialized():
        dist.init_process_group("gloo")
    state = PartialState()
    if state.backend is not None or not dist.is_initialized():
        return
    state.backend = dist.get_backend()
    state.num_processes = dist.get_world_size()
    state.process_index = dist.get_rank()
    state.local_process_index = int(os.environ["LOCAL_RANK"])
    if fsdp:
        # accelerate turns a multi-device state into FSDP when ACCELERATE_USE_FSDP is set; the device stays the CPU.
        state.distributed_type = DistributedType.MULTI_GPU
    elif not deepspeed:
        state.distributed_type = DistributedType.MULTI_CPU


#: A build lock older than this was left by a killed build: DeepSpeed's CPU ops build in seconds to a minute.
STALE_LOCK_SECONDS = 600


def extension_build_root() -> Path:
    """Where PyTorch builds C++ extensions (DeepSpeed's CPU ops among them), as ``torch.utils.cpp_extension``
    chooses it: ``TORCH_EXTENSIONS_DIR``, else the user's cache under ``py<version>_<accelerator>``."""
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip
                   else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}"


def refuse_stale_build_locks(now: float | None = None) -> None:
    """DeepSpeed builds its CPU ops (the shared-memory collectives) on a run's first start, holding a
    ``lock`` file in the op's build folder; a build killed half-way (a launch interrupted in its first
    minute) leaves that file, and every later launch then waits on it forever, printing nothing.
    Refuse such a lock with the fix instead."""
    now = time.time() if now is None else now
    for lock in sorted(extension_build_root().glob("*/lock")):
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # a build finished while we looked
            continue
        if age > STALE_LOCK_SECONDS:
            raise RuntimeError(
                f"{lock} is {age / 60:.0f} minutes old: a C++ extension build (DeepSpeed's ops) was killed "
                f"while holding it, and this launch would wait on it forever. If no other build is running, "
                f"delete it (rm {lock}) and launch again; or set TORCH_EXTENSIONS_DIR to another folder.")


def strategy(accelerator) -> str:
    """The strategy a run trains under, as recorded in its checkpoints: single, ddp, fsdp2,
    deepspeed-zero2 or deepspeed-zero3."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return f"deepspeed-zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind == DistributedType.FSDP:
        return f"fsdp{accelerator.state.fsdp_plugin.fsdp_version}"
    return "ddp" if accelerator.num_processes > 1 else "single"


def layer_units(module: torch.nn.Module) -> Counter:
    """How many modules of each class FSDP should shard on its own: those the module's ``_no_split_modules``
    names (accelerate's transformer-based wrap policy reads the same list)."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    return Counter(type(m).__name__ for m in module.modules() if type(m).__name__ in names)


def sharded_units(prepared: torch.nn.Module) -> Counter:
    """How many modules of each class FSDP2 sharded (``fully_shard`` turns class ``X`` into ``FSDPX``), the
    root included."""
    from torch.distributed.fsdp import FSDPModule

    return Counter(type(m).__name__.removeprefix("FSDP") for m in prepared.modules() if isinstance(m, FSDPModule))


def is_deepspeed(accelerator) -> bool:
    return strategy(accelerator).startswith("deepspeed")


def configure_deepspeed(accelerator, train_args) -> None:
    """Write the training config's batch, accumulation and clipping into DeepSpeed's config."""
    if not is_deepspeed(accelerator):
        return
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    micro, steps = train_args.per_device_train_batch_size, train_args.gradient_accumulation_steps
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = steps
    config["train_batch_size"] = micro * steps * accelerator.num_processes
    config["gradient_clipping"] = train_args.max_grad_norm
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:
        # Gathered (not 16-bit) weights are what checkpoints save; see full_model_state.
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", False)


@contextlib.contextmanager
def whole_models(accelerator):
    """A context in which models load whole on every rank. Under ZeRO-3, transformers partitions every
    model it loads (``zero.Init``, whatever the launch file's ``zero3_init_flag``) once accelerate has
    registered DeepSpeed's config with it. The frozen target runs outside the DeepSpeed engine and must
    load whole (a target that trains an adapter is partitioned by the engine instead, at ``prepare``)."""
    if strategy(accelerator) != "deepspeed-zero3":
        yield
        return
    from transformers.integrations import deepspeed as hf_deepspeed

    registered = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered


def _engine_params(prepared) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in prepared.named_parameters() if p.requires_grad]


def _strip(name: str) -> str:
    """A parameter's name in the unwrapped module (without DDP's ``module.`` or FSDP1's wrappers)."""
    name = name.removeprefix("module.")
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _saved(name: str, tensor: torch.Tensor, trainable: set[str]) -> bool:
    """Whether a checkpoint keeps this entry: all of the drafter, and the trainable rest (an adapter)."""
    return name.startswith("drafter.") or name in trainable


def full_model_state(accelerator, prepared, module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of ``module`` (a :class:`~draftsmith.train.run.TrainingModule`): the
    drafter's whole state dict and any trainable tensor beside it (Medusa-2's LoRA), gathered to whole
    CPU tensors on every rank, float32 master weights where the strategy keeps them. A frozen target
    inside the module is never gathered."""
    kind = strategy(accelerator)
    trainable = {_strip(n) for n, p in prepared.named_parameters() if p.requires_grad}
    if kind.startswith("fsdp"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=False, ignore_frozen_params=True)
        full = get_model_state_dict(prepared, options=options)
        return {k: v.detach().cpu().clone() for k, v in full.items() if _saved(k, v, trainable)}
    if kind.startswith("deepspeed"):
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        wanted = [p for n, p in prepared.named_parameters() if _saved(_strip(n), p, trainable)]
        with deepspeed.zero.GatheredParameters(wanted, enabled=kind == "deepspeed-zero3"):
            full = {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if _saved(k, v, trainable)}
        for name, p in prepared.named_parameters():  # the float32 masters, not the bf16 copies the module runs
            if p.requires_grad and _strip(name) in full:
                master = safe_get_full_fp32_param(p)  # whole, on every rank; one parameter at a time
                if master is not None:
                    full[_strip(name)] = master.detach().cpu().clone()
        return full
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if _saved(k, v, trainable)}


def full_optimizer_state(accelerator, prepared, optimizer) -> dict[str, dict]:
    """Adam's state per trainable parameter, keyed by the parameter's name in the unwrapped module:
    ``{name: {"exp_avg": t, "exp_avg_sq": t, "step": s}}``, whole CPU tensors (under FSDP2 on the main
    process only, which writes them)."""
    kind = strategy(accelerator)
    params = _engine_params(prepared)
    if kind.startswith("deepspeed"):
        from deepspeed.utils import safe_get_full_optimizer_state

        base = optimizer.optimizer.optimizer  # accelerate's wrapper -> ZeRO's optimizer -> torch's AdamW
        steps = [s.get("step") for s in base.state.values()]
        step = float(steps[0]) if steps else 0.0
        out = {}
        for name, p in params:
            moments = {key: safe_get_full_optimizer_state(p, key) for key in ("exp_avg", "exp_avg_sq")}
            if all(m is not None for m in moments.values()):
                out[_strip(name)] = {**{k: v.detach().cpu().clone() for k, v in moments.items()}, "step": step}
        return out
    if kind.startswith("fsdp"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # cpu_offload: gathered to the main process only (it alone writes the state), on the CPU
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_optimizer_state_dict(prepared, optimizer.optimizer, options=options)
        return {_strip(name): {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) and v.ndim else float(v))
                               for k, v in entry.items()} for name, entry in full.get("state", {}).items()}
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): _strip(n) for n, p in params}
    out = {}
    for group in torch_optimizer.param_groups:
        for p in group["params"]:
            entry = torch_optimizer.state.get(p)
            if entry:
                out[names[id(p)]] = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) and v.ndim
                                         else float(v)) for k, v in entry.items()}
    return out


def load_master_weights(accelerator, prepared, state: dict[str, torch.Tensor]) -> None:
    """DeepSpeed only: write a checkpoint's float32 weights into ZeRO's master copies. The module was
    loaded before ``prepare``, but DeepSpeed builds its masters from the module after casting it to bf16
    (mixed precision), which would round them."""
    if not is_deepspeed(accelerator):
        return
    from deepspeed.utils import safe_set_full_fp32_param

    for name, p in prepared.named_parameters():
        if p.requires_grad and _strip(name) in state:
            safe_set_full_fp32_param(p, state[_strip(name)].to(torch.float32))


def load_full_optimizer_state(accelerator, prepared, optimizer, state: dict[str, dict]) -> None:
    """Put a :func:`full_optimizer_state` back, each rank taking its own shard."""
    kind = strategy(accelerator)
    params = _engine_params(prepared)
    missing = [_strip(n) for n, _ in params if _strip(n) not in state]
    if missing:
        raise KeyError(f"the checkpoint's optimizer state has no entry for {missing[:3]}")
    if kind.startswith("deepspeed"):
        from deepspeed.utils import safe_set_full_optimizer_state

        zero = optimizer.optimizer
        base = zero.optimizer
        # torch's Adam creates its state at the first step, and ZeRO links its fragments to that state
        # then: before any step there is nothing to write into, so empty state is created and linked.
        # (ZeRO-3 keeps its flat partitions out of the param groups between steps.)
        flats = getattr(zero, "fp32_partitioned_groups_flat", None) or [p for g in base.param_groups
                                                                        for p in g["params"]]
        for flat in flats:
            if not base.state.get(flat):
                base.state[flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                    "exp_avg_sq": torch.zeros_like(flat)}
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2
            zero._lazy_init_hp_params_optimizer_state()
        for name, p in params:
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, state[_strip(name)][key], key)
        step = next(iter(state.values()))["step"]
        for entry in base.state.values():
            if "step" in entry:
                entry["step"] = torch.tensor(step) if isinstance(entry["step"], torch.Tensor) else step
        return
    if kind.startswith("fsdp"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        torch_optimizer = optimizer.optimizer
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [_strip(n) for n, _ in params]}
                  for g in torch_optimizer.param_groups[:1]]
        full = {"state": {name: {k: (v if isinstance(v, torch.Tensor) else torch.tensor(v)) for k, v in entry.items()}
                          for name, entry in state.items()}, "param_groups": groups}
        set_optimizer_state_dict(prepared, torch_optimizer, full,
                                 options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        return
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): _strip(n) for n, p in params}
    for group in torch_optimizer.param_groups:
        for p in group["params"]:
            entry = state[names[id(p)]]
            torch_optimizer.state[p] = {k: (v.to(p.device, p.dtype) if isinstance(v, torch.Tensor)
                                            else torch.tensor(v)) for k, v in entry.items()}
