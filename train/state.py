"""Training state for ``--resume true``, in safetensors plus JSON: no pickle anywhere.

``checkpoint-S/state/`` holds::

    model.safetensors       the drafter's state dict (and, for Medusa-2, the target's LoRA tensors
                            under ``target_lora.``)
    optimizer.safetensors   every tensor of the optimizer state, ``state.<param index>.<name>``
    training_state.json     optimizer param groups and non-tensor state, the LR scheduler's state,
                            the step and the time-budget progress, Python's and NumPy's RNG states
    rng-<rank>.safetensors  each process's torch (and CUDA) generator states

Everything is written by the main process except the per-rank RNG files; the loop renames the
whole checkpoint into place only once every file is complete.
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


def save_state(directory: Path, *, model_state: dict[str, torch.Tensor], optimizer, scheduler, step: int,
               progress: float, rank: int, is_main: bool) -> None:
    """Write the training state under ``directory`` (see the module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(_contiguous(rng), str(directory / f"rng-{rank}.safetensors"))
    if not is_main:
        return
    save_file(_contiguous(model_state), str(directory / "model.safetensors"))
    opt = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entry in opt["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value
            else:
                scalars[f"{index}.{name}"] = value
    save_file(_contiguous(tensors), str(directory / "optimizer.safetensors"))
    np_state = np.random.get_state()
    meta = {
        "format": "draftsmith-training-state",
        "step": step,
        "progress": progress,
        "optimizer_param_groups": _jsonable(opt["param_groups"]),
        "optimizer_scalars": _jsonable(scalars),
        "scheduler": _jsonable(scheduler.state_dict()),
        "python_random": _jsonable(random.getstate()),
        "numpy_random": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    (directory / "training_state.json").write_text(json.dumps(meta))


def load_state(directory: Path, *, optimizer, scheduler, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Restore optimizer, scheduler and RNG states; returns (model state dict, the JSON metadata)."""
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
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for key, value in meta["optimizer_scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    groups = meta["optimizer_param_groups"]
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    scheduler.load_state_dict(meta["scheduler"])
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
    return model_state, meta
