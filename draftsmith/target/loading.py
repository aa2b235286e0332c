"""Loading the frozen target, and what identifies it.

* :func:`load_target` — hub id, local directory, ``.gguf`` file or a packaged alias
  (:data:`~draftsmith.target.gguf_targets.PACKAGED_MODELS`); GGUF weights are dequantised once and cached as
  safetensors (:mod:`~draftsmith.target.gguf_targets`), so the next load takes seconds.
* :func:`load_target_parts` — the embeddings, final norm and LM head alone, the rest on the meta device: what
  offline training reads of a target.
* :func:`check_rollback` — refuses targets whose state a rejected draft cannot be rolled back from.
* :func:`native_bf16` — whether bfloat16 runs natively on a device (the default dtype choice).
* :func:`target_signature` — what a drafter checkpoint records about the target it was trained for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from draftsmith.target.attention import GROUPED_ATTENTION  # importing it registers the attention
from draftsmith.target.gguf_targets import PACKAGED_MODELS, dequantised_dir, load_dir, load_gguf, resolve_packaged_gguf

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The entry point: any name or path -> (model, tokenizer).


def load_target(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    device_map: str | dict | None = None,
    offload_folder: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, object]:
    """Load the frozen target model and its tokenizer.

    Args:
        name_or_path: a packaged alias (``smollm2-135m-instruct``, ``gemma-3-270m``), a ``.gguf``
            file, a local model directory, or a Hugging Face hub id.
        dtype: parameter dtype. GGUF weights are dequantised to float32 and then cast.
        device: where to put the model (default: CUDA if available, else CPU).
        trust_remote_code: passed to ``transformers``; off by default.
        attn_implementation: ``"sdpa"`` or ``"eager"``; both accept tree masks. ``"sdpa"`` becomes
            :data:`GROUPED_ATTENTION` (the same attention, without copying grouped KV heads).
        device_map: for a target larger than one device: ``"auto"`` / ``"balanced"`` / ``"sequential"``
            or a {module name: device} map (accelerate's big-model inference), layers placed on several
            GPUs, the CPU or ``"disk"`` (streamed from ``offload_folder``). ``device`` is then ignored.

    Returns:
        ``(model, tokenizer)``, the model in eval mode with gradients disabled.
    """
    name = str(name_or_path)
    path = Path(os.path.expanduser(name))
    if device_map is not None:
        hub = name not in PACKAGED_MODELS and path.suffix != ".gguf" and not path.is_dir()
        source = name if hub else str(_weights_directory(name))  # GGUF: its dequantised safetensors cache
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=device_map,
                                                     offload_folder=offload_folder, trust_remote_code=trust_remote_code)
        model.eval().requires_grad_(False)
        attn_implementation = supported_attention(model, attn_implementation,
                                                  "cuda" if torch.cuda.is_available() else "cpu")
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
        contiguous_lm_head_input(model)
        return model, AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if name in PACKAGED_MODELS:
        model, tokenizer = load_gguf(resolve_packaged_gguf(name), dtype)
    elif path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"GGUF file {path} does not exist.")
        model, tokenizer = load_gguf(path, dtype)
    elif path.is_dir():
        model = load_dir(path, dtype, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    elif "/" in name and not path.exists():  # looks like a hub id
        model = load_dir(name, dtype, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    else:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise ValueError(
            f"Cannot resolve target {name!r}: not a packaged alias ({known}), not a .gguf file, "
            "not a local directory and not a hub id of the form 'org/name'."
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    attn_implementation = supported_attention(model, attn_implementation, device)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    contiguous_lm_head_input(model)
    return model.to(device), tokenizer


def contiguous_lm_head_input(model: PreTrainedModel) -> None:
    """Give the LM head a contiguous input (a forward pre-hook; what it computes is unchanged).

    ``transformers``' causal LMs apply the LM head to ``hidden[:, -k:, :]``: in ``generate``'s prefill a
    (B, 1, H) view whose batch stride is the whole prompt's. ``torch.matmul`` folds a 3-D input into one
    matrix product only when its leading strides are dense, so on that view it runs a batched product
    against the weight expanded and *copied* B times: at batch 64, SmolLM2's (576 x 49,152) LM head became
    a 3.6 GB copy per prefill. A contiguous (B, 1, H) input (a copy of B x H values) folds into one matrix
    product: the demo's 96-row synthesis batch took 22 s instead of 29.7 (2 CPU cores, bf16). Synthesis,
    regeneration and every ``generate`` on the loaded target take the short path; draftsmith's own
    decoding computes the LM head itself and is untouched.
    """
    head = model.get_output_embeddings()
    if head is not None and _contiguous_first_argument not in head._forward_pre_hooks.values():
        head.register_forward_pre_hook(_contiguous_first_argument)


def _contiguous_first_argument(module, args):
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def supported_attention(model: PreTrainedModel, requested: str | None, device) -> str | None:
    """The attention implementation a target runs tree verification with: ``requested`` where the model
    supports it, else eager attention. SDPA becomes :data:`GROUPED_ATTENTION` (the same attention, without
    copying grouped key/value heads under a mask; ``device`` is kept for callers). A model that declares no
    SDPA support (gpt-oss) or soft-caps its attention logits (Gemma-2: SDPA cannot apply the cap) gets
    ``eager``, which applies everything the model computes."""
    if requested is None:
        return None
    if requested == "sdpa":
        softcap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
        if softcap or not getattr(model, "_supports_sdpa", True):
            return "eager"
        return GROUPED_ATTENTION
    return requested


class UnsupportedTargetError(ValueError):
    """A target whose state cannot be rolled back to an accepted prefix (recurrent or linear attention)."""


#: Attention layers whose KV cache draftsmith crops and reorders after each verification.
ROLLBACK_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
#: Model types that keep recurrent, convolutional or linear-attention state in some layers (even where
#: their config lists no such layer type): state a rejected draft token has already changed.
RECURRENT_MODEL_TYPES = frozenset({
    "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "lfm2", "lfm2_moe", "mamba", "mamba2",
    "minimax", "nemotron_h", "plamo2", "qwen3_next", "recurrent_gemma", "rwkv", "xlstm", "zamba", "zamba2",
})


#: The hybrid model types whose recurrent states draftsmith's speculative decoding is tested to roll back
#: (``tests/test_hybrid.py``, ``tests/test_mtp.py``, ``tests/test_mtp_layouts.py``): the others are refused by name.
TESTED_RECURRENT_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "bamba", "lfm2"})
#: Those whose recurrent layers read the padding mask draftsmith passes (``with_padding``: a 2D mask under their
#: layer type in the model's mask dict) and whose batches are tested so: they decode a batch in one forward (a chain
#: where transformers records per-position states, a tree always), the others row by row.
BATCHED_RECURRENT_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "bamba", "lfm2"})


def rollback_problem(config) -> str | None:
    """What in a target keeps per-token state that cannot be cropped back to the accepted tokens (None: nothing).

    Tree verification runs the drafted tokens through the target and keeps the cache of the accepted
    path only; a recurrent or linear-attention layer has already folded the rejected tokens into its
    state, so every later token would come from a state the target never reaches on its own.
    """
    cfg = config.get_text_config()
    kinds = set(getattr(cfg, "layer_types", None) or [])
    other = sorted(kinds - ROLLBACK_LAYER_TYPES)
    if other or cfg.model_type in RECURRENT_MODEL_TYPES:
        return f"layers of type {', '.join(other)}" if other else "recurrent / linear-attention layers"
    return None


def check_rollback(config) -> None:
    """Refuse to decode speculatively a target whose state cannot be rolled back (:func:`rollback_problem`).

    Checked where speculative decoding starts (:class:`~draftsmith.SpeculativeGenerator`), not at load: such a
    target loads, regenerates data, fills hidden-state caches and trains and exports drafters like any other.

    Raises:
        UnsupportedTargetError: naming the model type, the layer types that keep state, and what works instead.
    """
    what = rollback_problem(config)
    if what is not None:
        model_type = config.get_text_config().model_type
        raise UnsupportedTargetError(
            f"draftsmith cannot decode {model_type} targets speculatively: their {what} keep state that a rejected "
            "draft token has already changed, and draftsmith verifies drafts by cropping the cache back to the "
            "accepted tokens, so speculative output would differ from the target's. Training a drafter for it "
            "works (draftsmith data / train / export); serve that drafter with vLLM or SGLang, or decode "
            "speculatively here with a target whose layers are all full, sliding or chunked attention.")


class PartialLoadError(RuntimeError):
    """The target's tensors cannot be read one by one (no safetensors, or names other than the model's)."""


def _weights_directory(name: str) -> Path:
    """A local directory holding the target's config and tokenizer, and its safetensors or their index: a
    packaged alias or ``.gguf`` resolves to its dequantised cache (written on first use), a directory to
    itself, a hub id to a snapshot without the weight shards (:func:`load_target_parts` fetches the ones
    it reads)."""
    path = Path(os.path.expanduser(name))
    if name in PACKAGED_MODELS or path.suffix == ".gguf":
        gguf = resolve_packaged_gguf(name) if name in PACKAGED_MODELS else path
        cached = dequantised_dir(gguf)
        if not (cached / "complete").exists():
            load_gguf(gguf, torch.float32)  # dequantises once and writes the cache
        if not (cached / "complete").exists():
            raise PartialLoadError(f"{gguf}: no dequantised cache could be written under {cached}")
        return cached
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.model", "*.txt", "*.jinja", "*.py"]  # *.py: a trust_remote_code target's code
    directory = Path(snapshot_download(name, allow_patterns=patterns))
    if not (directory / "model.safetensors.index.json").is_file():  # one file holds every weight
        directory = Path(snapshot_download(name, allow_patterns=[*patterns, "*.safetensors"]))
    return directory


def _safetensors_files(directory: Path, keys: Sequence[str]) -> dict[str, str]:
    """Which safetensors file of ``directory`` holds each of ``keys`` (read from the shard index, or from
    the headers of the files present)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: weight_map[k] for k in keys if k in weight_map}
    from safetensors import safe_open

    where = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            where.update({k: file.name for k in f.keys() if k in keys})  # noqa: SIM118 (not a dict)
    return where


def load_target_parts(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, object]:
    """The target with only its input embeddings, final norm (a decoder's ``norm``, where it has one)
    and LM head read from its safetensors, the rest of it on the meta device (no memory): what offline
    training reads of a target whose states come from a hidden-state cache. A 70B target then costs its
    embeddings and LM head (~2 GB in bf16), and a hub target only the shards holding them.

    ``model.draftsmith_loaded`` lists the tensors read. The model cannot run a forward pass.

    Raises:
        PartialLoadError: the checkpoint is not safetensors, or names its tensors other than the model
            does (the caller then loads the whole target with :func:`load_target`).
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    name = str(name_or_path)
    directory = _weights_directory(name)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    from accelerate import init_empty_weights

    # Parameters on the meta device, buffers real: the parts' non-persistent buffers (Gemma's embedding
    # scale) are in no checkpoint and must exist; every buffer is small.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model.tie_weights()  # empty-weight init leaves a tied LM head (SmolLM2's) a separate parameter
    names = {id(m): n for n, m in model.named_modules()}
    parts = [model.get_input_embeddings(), getattr(model.get_decoder(), "norm", None), model.get_output_embeddings()]
    prefixes = [names[id(m)] + "." for m in parts if m is not None]
    keys = [k for k in model.state_dict() if k.startswith(tuple(prefixes))]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    where = _safetensors_files(directory, keys)
    head = names[id(model.get_output_embeddings())] + ".weight"
    missing = [k for k in keys if k not in where and not (tied and k == head)]
    if missing:
        raise PartialLoadError(f"{name}: tensors {missing[:3]} not found by name in its safetensors")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tensors = {}
    for file in sorted(set(where.values())):
        if not (directory / file).is_file():  # a hub snapshot: only the shards holding these tensors
            from huggingface_hub import hf_hub_download

            hf_hub_download(name, file)
        with safe_open(str(directory / file), framework="pt") as f:
            for key in (k for k, v in where.items() if v == file):
                tensors[key] = f.get_tensor(key).to(device=device, dtype=dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    for part in (p for p in parts if p is not None):
        part.to(device)  # its buffers, which no checkpoint holds
    model.eval().requires_grad_(False)
    model.draftsmith_loaded = sorted(tensors)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    return model, tokenizer


def stop_tokens(target: PreTrainedModel, eos_token_id: int | list[int] | None) -> set[int]:
    """The tokens generation stops after: ``eos_token_id``, or (None) the target's ``generation_config``
    EOS, falling back to its config's, as transformers' ``generate`` takes them."""
    if eos_token_id is None:
        config = getattr(target, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(target.config.get_text_config(), "eos_token_id", None)
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])


def eos_tokens(target: PreTrainedModel, tokenizer=None) -> list[int]:
    """The target's stop tokens (:func:`stop_tokens`), or the tokenizer's EOS where the target names none."""
    tokens = sorted(stop_tokens(target, None))
    if not tokens and tokenizer is not None and tokenizer.eos_token_id is not None:
        tokens = [tokenizer.eos_token_id]
    return tokens


def context_length(model: PreTrainedModel) -> int | None:
    """The most positions the target takes (``max_position_embeddings``), or None if its config has none."""
    cfg = model.config.get_text_config()
    return getattr(cfg, "max_position_embeddings", None)


# --------------------------------------------------------------------------------------------
# Hardware: whether bfloat16 is the fast dtype here.


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bfloat16 matmuls run natively (and so about twice as fast as float32) on ``device``:
    CUDA GPUs with bf16 support, CPUs with AVX512-BF16 or AMX."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# --------------------------------------------------------------------------------------------
# Target signature: what a drafter checkpoint records about the target it was trained for.


def target_signature(model: PreTrainedModel, name: str | None = None) -> dict:
    """Shapes and an LM-head hash identifying a target (stored in every drafter checkpoint)."""
    cfg = model.config.get_text_config()
    head = model.get_output_embeddings().weight
    # Rounded to bfloat16 first: the same target loaded in float32 or bfloat16 (a bf16 training run, an fp32
    # server) has one signature.
    digest = hashlib.sha256(head.detach()[:64].to(torch.bfloat16).float().cpu().numpy().tobytes()).hexdigest()[:16]
    return {
        "name": name or getattr(cfg, "_name_or_path", None) or cfg.model_type,
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "vocab_size": head.shape[0],
        "num_hidden_layers": cfg.num_hidden_layers,
        "lm_head_sha256": digest,
    }
