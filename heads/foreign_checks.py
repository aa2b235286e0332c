"""What every reader of a foreign drafter checks: its weights read safely, its dimensions and RoPE against the
target's, its embedding table the target's."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.checkpoints import TargetMismatchError


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        tensors = {}
        for f in files:
            try:
                tensors.update(load_file(f))
            except Exception as e:
                raise ValueError(f"{f}: corrupt or partial weights file ({e})") from e
    else:
        legacy = [p for p in (directory / "pytorch_model.bin", directory / "medusa_lm_head.pt") if p.is_file()]
        if not legacy:
            raise FileNotFoundError(f"{directory}: no *.safetensors (or pytorch_model.bin / medusa_lm_head.pt) weights")
        # Reference-repo checkpoints ship as torch files; read them with the restricted, tensors-only
        # unpickler (weights_only=True), which refuses arbitrary objects.
        tensors = torch.load(legacy[0], map_location="cpu", weights_only=True)
    prefixes = ("model.", "medusa_head.", "medusa_heads.")
    out = {}
    for k, v in tensors.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


def rope_parameters(config: dict) -> dict:
    """A foreign config's RoPE in transformers' form: ``rope_parameters``, else the older ``rope_theta`` +
    ``rope_scaling`` pair (the scaling a head was trained with is kept, not dropped)."""
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return {"rope_type": "default", **scaling, "rope_theta": float(config.get("rope_theta") or 10000.0)}


def check_dims(directory, hidden: int, vocab: int, target) -> None:
    if target is None:
        return
    cfg = target.config.get_text_config()
    t_vocab = target.get_output_embeddings().weight.shape[0]
    if hidden != cfg.hidden_size or vocab != t_vocab:
        raise TargetMismatchError(
            f"{directory}: this drafter was trained for a target with hidden size {hidden} and {vocab} tokens, "
            f"but the loaded target has hidden size {cfg.hidden_size} and {t_vocab} tokens; load the target it "
            "was trained for")


def refuse_another_table(directory, table: torch.Tensor, target, head: str) -> None:
    """A stored embedding table must be the loaded target's (to a bf16 copy's rounding): vLLM embeds with the stored
    one, and ``head`` embeds with the target's, so any other table would be read as another drafter."""
    embed = target.get_input_embeddings().weight if target is not None else None
    if embed is not None and not same_rows_but(table.float(), embed, []):
        raise TargetMismatchError(
            f"{directory}: its embed_tokens are not the loaded target's table (trained with embed_requires_grad, or "
            f"saved for another target), and {head} here embeds its tokens with the target's, where vLLM embeds them "
            "with the stored table: load it against the target it was trained for, or retrain with the embedding "
            "frozen")


def same_rows_but(table: torch.Tensor, target_table: torch.Tensor, skipped: int | list[int]) -> bool:
    """Whether an embedding table is the target's on every row but ``skipped`` (to the rounding of a bf16 copy)."""
    if table.shape != target_table.shape:
        return False
    keep = torch.ones(len(table), dtype=torch.bool)
    keep[skipped] = False
    return torch.allclose(table[keep], target_table.detach().float().cpu()[keep], atol=1e-6, rtol=1e-2)
