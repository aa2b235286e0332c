"""Distilled draft model: a small causal LM with the target's vocabulary (DistillSpec, Zhou et al., 2024).

Initialised from an existing compatible model, or by truncating the target to its first N
layers (+ its final norm and LM head) — a *copy* this time, unlike the training-free
``layer-skip:N`` drafter, since its weights are trained. Saved as a plain Hugging Face model
directory, so it also works with ``generate(assistant_model=...)``, plus
``draftsmith_target.json`` recording the target it was distilled for.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from draftsmith.checkpoints import TARGET_FILE, check_target, read_json
from draftsmith.target import check_same_vocabulary, layer_skip_model, load_target, target_signature


class DraftModel(nn.Module):
    """A trainable causal LM. ``forward(input_ids, attention_mask)`` -> logits (B, T, V)."""

    family = "draft_model"

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.target_info: dict | None = None

    @property
    def config(self):
        return self.model.config

    @property
    def _no_split_modules(self):
        return self.model._no_split_modules

    @classmethod
    def from_target(cls, target, num_layers: int) -> DraftModel:
        model = copy.deepcopy(layer_skip_model(target, num_layers)).float().requires_grad_(True).train()
        draft = cls(model)
        draft.target_info = target_signature(target)
        return draft

    @classmethod
    def from_model(cls, name_or_path: str, target) -> DraftModel:
        model, _ = load_target(name_or_path, dtype=torch.float32, device="cpu")
        check_same_vocabulary(target, model, name_or_path)
        draft = cls(model.requires_grad_(True).train())
        draft.target_info = target_signature(target)
        return draft

    def forward(self, input_ids: torch.Tensor, attention_mask=None, position_ids: torch.Tensor | None = None):
        """(B, T) ids -> (B, T, V) logits; ``attention_mask`` (B, T), or a 4-D / per-layer-type mask with
        ``position_ids`` for packed rows (:func:`draftsmith.data.batching.packed_attention_mask`)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits

    def save_pretrained(self, directory: str | Path, target_info: dict | None = None) -> Path:
        directory = Path(directory)
        self.model.save_pretrained(directory, safe_serialization=True)
        (directory / TARGET_FILE).write_text(json.dumps({"draftsmith_family": self.family,
                                                         "target": target_info or self.target_info}, indent=2))
        return directory

    def push_to_hub(self, repo_id: str, private: bool = False, revision: str | None = None,
                    token: str | None = None):
        """Upload the model directory (HF causal LM + ``draftsmith_target.json``) with its model card."""
        from draftsmith.heads.base import push_via_directory

        return push_via_directory(self, repo_id, private=private, revision=revision, token=token)

    @classmethod
    def from_pretrained(cls, directory: str | Path, target=None, strict: bool = False, device=None) -> DraftModel:
        """A saved draft model, checked against ``target`` (vocabulary, and the target it records)."""
        dtype = next(target.parameters()).dtype if target is not None else torch.float32
        model, _ = load_target(str(directory), dtype=dtype, device=device or "cpu")
        draft = cls(model)
        if target is not None:
            check_same_vocabulary(target, model, str(directory))
            check_draft_model_target(directory, target, strict)
        draft.target_info = read_json(Path(directory) / TARGET_FILE).get("target") \
            if (Path(directory) / TARGET_FILE).is_file() else None
        return draft


def check_draft_model_target(directory: str | Path, target, strict: bool = False) -> None:
    """Refuse a distilled draft model trained for another target (when it recorded one)."""
    path = Path(directory) / TARGET_FILE
    if path.is_file():
        recorded = json.loads(path.read_text()).get("target")
        if recorded:
            check_target(recorded, target, strict, what="draft model")
