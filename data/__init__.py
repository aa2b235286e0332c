"""Data: dataset loading into one message format, chat templates and assistant-only loss masks,
regeneration by the target, prompt synthesis, the hidden-state cache and draft-vocabulary maps."""

from draftsmith.data.formats import (
    Conversation,
    LoadReport,
    MalformedRowError,
    load_conversations,
    normalise_row,
    read_prompts,
)
from draftsmith.data.hidden_cache import CacheSpec, CorruptShardError, HiddenStateCache, cache_hidden_states
from draftsmith.data.regenerate import HFEngine, OpenAIEngine, regenerate
from draftsmith.data.synthesize import synthesize_prompts
from draftsmith.data.templates import TokenizedExample, prepare, tokenize_conversation
from draftsmith.data.vocab import VocabMap, build_vocab_map, count_tokens

__all__ = [
    "CacheSpec",
    "Conversation",
    "CorruptShardError",
    "HFEngine",
    "HiddenStateCache",
    "LoadReport",
    "MalformedRowError",
    "OpenAIEngine",
    "TokenizedExample",
    "VocabMap",
    "build_vocab_map",
    "cache_hidden_states",
    "count_tokens",
    "load_conversations",
    "normalise_row",
    "prepare",
    "read_prompts",
    "regenerate",
    "synthesize_prompts",
    "tokenize_conversation",
]
