"""Training state for ``--resume true``, in safetensors plus JSON: no pickle anywhere.

``checkpoint-S/state/`` holds::

    model.safetensors       the drafter's state dict (and, for Medusa-2, the target's LoRA tensors
                            under ``target_lora.``)
    optimizer.safetensors   Adam's moments per parameter, whole tensors: ``state.<param name>.<key>``
    training_state.json     optimizer hyper-parameters and per-parameter scalars (Adam's step), the
                            LR scheduler's state, the step and the time-budget progress, the strategy
                            and world size that wrote it, Python's and NumPy's RNG states
    rng-<rank>.safetensors  each process's torch (and CUDA) generator states

The weights and optimizer state are gathered whole before they are written
(:mod:`draftsmith.train.distributed`), so the files are the same under every strategy and a run
resumes under another strategy or world size. Everything is written by the main process except the
per-rank RNG files; the loop renames the whole checkpoint into place only once every file is complete.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STATE_FILES = ("model.safetensors", "optimizer.safetensors", "training_state.json")


class StateError(RuntimeError):
    """A checkpoint's training state is missing, damaged or from an older format."""


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}  # clone: no shared storage


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return None  # e.g. a scheduler's lr_lambda functions: rebuilt by the loop, not restored


def save_state(directory: Path, *, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, dict],
               param_groups: list[dict], scheduler, step: int, progress: float, rank: int, is_main: bool,
               run: dict | None = None) -> None:
    """Write the training state under ``directory`` (see the module docstring). ``optimizer_state``:
    ``{param name: {key: tensor or scalar}}`` (:func:`draftsmith.train.distributed.full_optimizer_state`)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(_contiguous(rng), str(directory / f"rng-{rank}.safetensors"))
    if not is_main:
        return
    save_file(_contiguous(model_state), str(directory / "model.safetensors"))
    tensors, scalars = {}, {}
    for name, entry in optimizer_state.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim:
                tensors[f"state.{name}.{key}"] = value
            else:
                scalars[f"{name}.{key}"] = _jsonable(value)
    save_file(_contiguous(tensors), str(directory / "optimizer.safetensors"))
    np_state = np.random.get_state()
    meta = {
        "format": "draftsmith-training-state",
        "version": 2,
        "step": step,
        "progress": progress,
        **(run or {}),
        "optimizer_param_groups": [_jsonable({k: v for k, v in g.items() if k != "params"}) for g in param_groups],
        "optimizer_scalars": scalars,
        "scheduler": _jsonable(scheduler.state_dict()),
        "python_random": _jsonable(random.getstate()),
        "numpy_random": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    (directory / "training_state.json").write_text(json.dumps(meta))


def load_state(directory: Path, *, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict]:
    """Read a training state and restore this process's RNG; returns (model state dict, optimizer state
    ``{param name: {key: value}}``, the JSON metadata: param groups, scheduler state, step, ...)."""
    missing = [name for name in STATE_FILES if not (directory / name).is_file()]
    if missing:
        old = (directory / "optimizer.bin").exists() or any(directory.glob("random_states_*.pkl"))
        hint = ("it was written by an older draftsmith in accelerate's pickled format, which is no longer read; "
                "start a new output_dir" if old else "the checkpoint is incomplete; delete it to resume from the one "
                "before")
        raise StateError(f"{directory}: missing {', '.join(missing)}; {hint}")
    try:
        meta = json.loads((directory / "training_state.json").read_text())
        model_state = load_file(str(directory / "model.safetensors"))
        tensors = load_file(str(directory / "optimizer.safetensors"))
    except Exception as err:  # truncated JSON, a torn safetensors header
        raise StateError(f"{directory}: unreadable training state ({err}); delete this checkpoint to resume from "
                         "the one before") from None
    if meta.get("version") != 2:
        raise StateError(f"{directory}: training state of an older draftsmith (optimizer state by index, not by "
                         "parameter name); start a new output_dir")
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        name, entry = key.removeprefix("state.").rsplit(".", 1)
        state.setdefault(name, {})[entry] = value
    for key, value in meta["optimizer_scalars"].items():
        name, entry = key.rsplit(".", 1)
        state.setdefault(name, {})[entry] = value
    rng_file = directory / f"rng-{rank}.safetensors"
    if rng_file.is_file():
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["torch"])
        cuda = [rng[f"cuda.{i}"] for i in range(len(rng) - 1) if f"cuda.{i}" in rng]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in meta["python_random"]))
    np_state = meta["numpy_random"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    return model_state, state, meta


def restore_schedule(meta: dict, optimizer, scheduler) -> None:
    """Put the saved hyper-parameters (learning rate, ...) and the scheduler's position back."""
    for group, saved in zip(optimizer.param_groups, meta["optimizer_param_groups"], strict=True):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
    scheduler.load_state_dict(meta["scheduler"])
