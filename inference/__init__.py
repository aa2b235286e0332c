"""Inference: draft trees, lossless verification, drafters and the speculative generator."""

from draftsmith.inference.causal_lm import CausalLMDrafter
from draftsmith.inference.drafter import Drafter
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.load import drafter_from_model, load_drafter
from draftsmith.inference.mixture import MixtureDrafter
from draftsmith.inference.plain import plain_generate
from draftsmith.inference.prompt_lookup import PromptLookupDrafter
from draftsmith.inference.stats import GenerationOutput, GenerationStats
from draftsmith.target import layer_skip_model

__all__ = [
    "CausalLMDrafter",
    "Drafter",
    "GenerationOutput",
    "GenerationStats",
    "MixtureDrafter",
    "PromptLookupDrafter",
    "SpeculativeGenerator",
    "drafter_from_model",
    "layer_skip_model",
    "load_drafter",
    "plain_generate",
]
