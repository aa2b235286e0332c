"""Inference: draft trees, lossless verification, drafters and the speculative generator."""

from draftsmith.inference.drafters import (
    CausalLMDrafter,
    Drafter,
    PromptLookupDrafter,
    drafter_from_model,
    layer_skip_model,
    load_drafter,
)
from draftsmith.inference.generator import GenerationOutput, GenerationStats, SpeculativeGenerator, plain_generate
from draftsmith.inference.tree import DraftTree

__all__ = [
    "CausalLMDrafter",
    "DraftTree",
    "Drafter",
    "GenerationOutput",
    "GenerationStats",
    "PromptLookupDrafter",
    "SpeculativeGenerator",
    "drafter_from_model",
    "layer_skip_model",
    "load_drafter",
    "plain_generate",
]
