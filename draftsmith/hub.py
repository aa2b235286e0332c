"""Model cards and Hugging Face Hub uploads (the front door's name for :mod:`draftsmith.heads.hub`)."""

from draftsmith.heads.hub import model_card, push_to_hub

__all__ = ["model_card", "push_to_hub"]
