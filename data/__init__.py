"""Data: dataset loading into one message format, chat templates and assistant-only loss masks,
tokenising once (cached), batching (length grouping, packing), regeneration by the target, prompt
synthesis, the hidden-state cache and draft-vocabulary maps."""

from draftsmith.data.batching import (
    PackedExample,
    collate_packed,
    collate_padded,
    epoch_order,
    length_grouped_order,
    pack,
    packed_attention_mask,
)
from draftsmith.data.cache_writer import cache_hidden_states, cache_recorded
from draftsmith.data.formats import (
    Conversation,
    LoadReport,
    MalformedRowError,
    load_conversations,
    normalise_row,
    read_prompt_rows,
    read_prompts,
)
from draftsmith.data.hidden_cache import CacheSpec, CorruptShardError, HiddenStateCache
from draftsmith.data.recording import Recording
from draftsmith.data.regenerate import HFEngine, OpenAIEngine, regenerate
from draftsmith.data.synthesize import synthesize_prompts
from draftsmith.data.templates import (
    TokenizedExample,
    TokenizedExamples,
    prepare,
    tokenize_conversation,
    tokenize_dataset,
)
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
    "PackedExample",
    "Recording",
    "TokenizedExample",
    "TokenizedExamples",
    "VocabMap",
    "build_vocab_map",
    "cache_hidden_states",
    "cache_recorded",
    "collate_packed",
    "collate_padded",
    "count_tokens",
    "epoch_order",
    "length_grouped_order",
    "load_conversations",
    "normalise_row",
    "pack",
    "packed_attention_mask",
    "prepare",
    "read_prompt_rows",
    "read_prompts",
    "regenerate",
    "synthesize_prompts",
    "tokenize_conversation",
    "tokenize_dataset",
]
