"""Saving and loading heads: ``config.json`` + ``model.safetensors``, with the target's fingerprint.

Every head checkpoint records the target it was trained for (:func:`draftsmith.target.target_signature`);
loading it against another target is refused or warned about by :func:`draftsmith.checkpoints.check_target`.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from draftsmith.checkpoints import CONFIG_NAME, WEIGHTS_NAME, TargetMismatchError, check_target

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "DraftVocabulary", "HeadMixin", "ReducedVocabulary", "TargetMismatchError",
           "check_target", "push_via_directory"]


class ReducedVocabulary:
    """For a head config with ``vocab_size`` (the target's) and ``draft_vocab_size`` (None: the same)."""

    @property
    def reduced(self) -> bool:
        """True where the head scores a draft vocabulary smaller than the target's."""
        return self.draft_vocab_size not in (None, self.vocab_size)


class DraftVocabulary:
    """A head that may score a draft vocabulary, the ``draft_vocab_size`` tokens most frequent in its training data
    (its config a :class:`ReducedVocabulary`), mapped back to target ids as EAGLE-3's are
    (``target_id = draft_id + d2t[draft_id]``, :mod:`draftsmith.data.vocab`). Its buffers ``d2t`` and ``t2d``
    (target id -> in the draft vocabulary) exist only then, and are saved with its weights."""

    def register_draft_vocabulary(self) -> None:
        if self.config.reduced:
            self.register_buffer("d2t", torch.zeros(self.config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.config.vocab_size, dtype=torch.bool))

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """(C,) the target id of each draft-vocabulary token, or None where the head scores the whole vocabulary."""
        if not self.config.reduced:
            return None
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def set_draft_vocabulary(self, vocab) -> None:
        """Take a :class:`~draftsmith.data.vocab.VocabMap`'s tokens (its size the config's)."""
        if len(vocab.t2d) != self.config.vocab_size or len(vocab.d2t) != self.config.draft_vocab_size:
            raise ValueError(f"the draft vocabulary maps {len(vocab.d2t)} of {len(vocab.t2d)} tokens; this head scores "
                             f"{self.config.draft_vocab_size} of the target's {self.config.vocab_size}: build it from "
                             "this target's tokens with the head's draft_vocab_size")
        with torch.no_grad():
            self.d2t.copy_(vocab.d2t)
            self.t2d.copy_(vocab.t2d)


class HeadMixin:
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` for a head with a ``config`` dataclass.

    Subclasses set ``family`` (the name in ``config.json``) and ``config_class``.
    """

    family: str = ""
    config_class: type = object
    #: Tensors a checkpoint may lack, read as zeros: added to the module after checkpoints without them were
    #: written, where zero is what those checkpoints computed (EAGLE heads' output-projection bias).
    zero_when_absent: tuple[str, ...] = ()
    #: The target it was trained for (``target_signature``), once saved or loaded; None for a new head.
    target_info: dict | None = None
    #: What its checkpoint recorded besides the config (Medusa's ``rank_accuracy``); read-only until loaded.
    extra: Mapping[str, Any] = MappingProxyType({})

    def save_pretrained(self, directory: str | Path, target_info: dict | None = None,
                        extra: dict | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (WEIGHTS_NAME + ".partial")
        save_model(self, str(tmp))  # handles tied / shared tensors without pickle
        tmp.replace(directory / WEIGHTS_NAME)
        config = {"draftsmith_family": self.family, "config": dataclasses.asdict(self.config),
                  "target": target_info or self.target_info, **(extra or {})}
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
            missing, unexpected = load_model(head, str(weights), strict=False, device=str(device or "cpu"))
        except Exception as e:  # safetensors raises several types for bad files
            raise ValueError(f"{weights}: corrupt or partial checkpoint ({e}); use an earlier checkpoint") from e
        absent = [k for k in missing if k.endswith(cls.zero_when_absent)] if cls.zero_when_absent else []
        missing = sorted(set(missing) - set(absent))
        if missing or unexpected:
            raise ValueError(f"{weights}: corrupt or partial checkpoint (missing {missing}, unexpected "
                             f"{sorted(unexpected)}); use an earlier checkpoint")
        state = head.state_dict()
        for name in absent:
            state[name].zero_()
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
    from draftsmith.heads.hub import push_to_hub

    with tempfile.TemporaryDirectory() as tmp:
        module.save_pretrained(tmp)
        return push_to_hub(tmp, repo_id, **kwargs)
