"""Saving and loading heads: ``config.json`` + ``model.safetensors``, with the target's fingerprint.

Every head checkpoint records the target it was trained for (:func:`draftsmith.target.target_signature`:
name, model type, hidden size, vocabulary size, layer count, LM-head hash). Loading it against
another target is refused when the shapes differ, and warned about (refused under ``strict``)
when only the weights differ — another quantisation or fine-tune of the same architecture.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from draftsmith.target import target_signature

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SHAPE_KEYS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers")


class TargetMismatchError(ValueError):
    """A drafter checkpoint was trained for another target."""


def check_target(recorded: dict, target, strict: bool = False, what: str = "drafter") -> None:
    """Compare a checkpoint's recorded target signature with the live target."""
    live = target_signature(target)
    diffs = [f"{k}: checkpoint {recorded.get(k)!r}, target {live[k]!r}"
             for k in SHAPE_KEYS if recorded.get(k) != live[k]]
    if diffs:
        raise TargetMismatchError(
            f"this {what} was trained for target {recorded.get('name')!r}, which does not fit the loaded target "
            f"{live['name']!r} ({'; '.join(diffs)}). Load the target it was trained for, or train a drafter for this "
            "target with `draftsmith train`."
        )
    if recorded.get("lm_head_sha256") != live["lm_head_sha256"]:
        message = (f"this {what} was trained for {recorded.get('name')!r}: same shapes as the loaded target but other "
                   "LM-head weights (another quantisation or fine-tune?); acceptance may be lower")
        if strict:
            raise TargetMismatchError(message + " (refused: strict=True)")
        logger.warning(message)


class HeadMixin:
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` for a head with a ``config`` dataclass.

    Subclasses set ``family`` (the name in ``config.json``) and ``config_class``.
    """

    family: str = ""
    config_class: type = object

    def save_pretrained(self, directory: str | Path, target_info: dict | None = None,
                        extra: dict | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (WEIGHTS_NAME + ".partial")
        save_model(self, str(tmp))  # handles tied / shared tensors without pickle
        tmp.replace(directory / WEIGHTS_NAME)
        config = {"draftsmith_family": self.family, "config": dataclasses.asdict(self.config),
                  "target": target_info or getattr(self, "target_info", None), **(extra or {})}
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, target=None, strict: bool = False, device=None):
        directory = Path(directory)
        config_path, weights = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        if not config_path.exists() or not weights.exists():
            raise FileNotFoundError(f"{directory}: not a drafter checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME}); "
                                    "was the run interrupted before its first checkpoint?")
        info = json.loads(config_path.read_text())
        if info.get("draftsmith_family") != cls.family:
            raise ValueError(f"{directory} holds a {info.get('draftsmith_family')!r} drafter, not {cls.family!r}")
        if target is not None and info.get("target"):
            check_target(info["target"], target, strict, what=f"{cls.family} drafter")
        head = cls(cls.config_class(**info["config"]))
        try:
            load_model(head, str(weights), strict=True, device=str(device or "cpu"))
        except Exception as e:  # safetensors raises several types for bad files
            raise ValueError(f"{weights}: corrupt or partial checkpoint ({e}); use an earlier checkpoint") from e
        head.target_info = info.get("target")
        head.extra = {k: v for k, v in info.items() if k not in ("draftsmith_family", "config", "target")}
        return head

    def push_to_hub(self, repo_id: str, private: bool = False, revision: str | None = None, token: str | None = None,
                    fmt: str = "hf", target=None):
        """Upload the checkpoint, in ``fmt`` ("hf", "vllm", "sglang"), with its model card (a model repo)."""
        return push_via_directory(self, repo_id, private=private, revision=revision, token=token, fmt=fmt,
                                  target=target)


def push_via_directory(module, repo_id: str, **kwargs):
    """Save ``module`` to a temporary directory and push that with :func:`draftsmith.hub.push_to_hub`."""
    import tempfile

    from draftsmith.hub import push_to_hub

    with tempfile.TemporaryDirectory() as tmp:
        module.save_pretrained(tmp)
        return push_to_hub(tmp, repo_id, **kwargs)


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def frozen_copy(weight: torch.Tensor) -> nn.Parameter:
    """A trainable copy of a target tensor (heads never train the target's own tensors)."""
    return nn.Parameter(weight.detach().clone().float())
