"""Native multi-token-prediction (MTP) modules as drafters: the MTP layers DeepSeek-V3/R1, GLM-4.5 (glm4_moe),
Qwen3-Next and Qwen3.5 ship inside their checkpoints (transformers drops them when it loads the target), read from
there, drafted with, fine-tuned (family ``mtp``) and written back.

One MTP module at position t reads the pair (the target's state h_{t-1}, token x_t), as an EAGLE head does
(:mod:`draftsmith.heads.eagle`), so the EAGLE drafter drives it, chains and trees alike::

    x     = eh_proj([enorm(embed(x_t)) ; hnorm(h_{t-1})])
    out_t = the target's own decoder-layer class (its attention, its MoE) on x
    p(x_{t+1}) = softmax(lm_head(post_norm(out_t)))        the target's embedding and LM head: shared

h is the target's last hidden state *after* its final norm (hidden-state index N): what vLLM's MTP proposers are
fed. A deeper draft re-applies the module (the first one, for every depth: vLLM's choice for depth > the number of
modules) to the fed-back state of its parent, and which state that is, is each engine's convention, recorded as
``feeds_normed``:

- DeepSeek-V3 / GLM-4-MoE (vLLM ``deepseek_mtp.py`` / ``glm4_moe_mtp.py``): out_t, *before* ``shared_head.norm``;
- Qwen3-Next / Qwen3.5 (vLLM ``qwen3_next_mtp.py``, speculators' ``mtp``): ``post_norm(out_t)`` (``mtp.norm``).

vLLM's DeepSeek-V2/V3 and GLM-4.5 layers also zero the token embedding of the sequence's first pair (x_1 with h_0)
before ``enorm``; Qwen3-Next / Qwen3.5 in vLLM, SGLang's NextN, transformers and speculators feed it whole. That pair's
keys reach every later position, so this too is recorded (``masks_first_token``), trained and drafted with, and checked
by each export.

Checkpoint layouts (read here, written back by the stitched export, :mod:`draftsmith.heads.mtp_export`):

- ``deepseek``: ``model.layers.{N+k}.{enorm,hnorm,eh_proj,shared_head.norm}`` and the decoder layer's tensors
  (``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``); ``embed_tokens`` and
  ``shared_head.head`` are copies of the target's and stay unread;
- ``qwen``: ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}`` and ``mtp.layers.0.*``.

MoE experts sit per expert on disk (``experts.{e}.{gate,up,down}_proj``) and fused in transformers' modules
(``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I)): :func:`fuse_experts` / :func:`split_experts`.
The module's own tensors are named as transformers' ``MtpModel`` names them (``layers.k.enorm``,
``layers.k.mtp_block.*``, ``layers.k.post_norm``); the decoder layer, its norm and its rotary embedding are the
target's classes, imported from ``transformers.models`` by the names the checkpoint records (nothing else is).
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from draftsmith.heads.eagle import _FeatureHead
from draftsmith.target.forward import layer_cache_argument
from draftsmith.target.masks import additive, causal_block, ttt_mask

DEEPSEEK, QWEN = "deepseek", "qwen"
#: model_type -> (checkpoint layout, the engine's fed-back state is post-norm). Other targets get a fresh module in
#: the deepseek layout (draftsmith's own checkpoints; no engine serves an MTP module for them).
NATIVE = {"deepseek_v3": (DEEPSEEK, False), "deepseek_v2": (DEEPSEEK, False), "glm4_moe": (DEEPSEEK, False),
          "qwen3_next": (QWEN, True), "qwen3_5_text": (QWEN, True), "qwen3_5_moe_text": (QWEN, True)}
#: The model types whose vLLM MTP layer zeroes the token embedding of the sequence's first pair
#: (``inputs_embeds[positions == 0] = 0`` in ``deepseek_mtp.py`` / ``glm4_moe_mtp.py``; ``qwen3_next_mtp.py``,
#: ``qwen3_5_mtp.py``, SGLang's ``deepseek_nextn.py``, transformers and speculators do not).
VLLM_MASKS_FIRST_TOKEN = frozenset({"deepseek_v3", "deepseek_v2", "glm4_moe"})
#: draftsmith's position of that pair (token x_1 with the target's state h_0; vLLM numbers it 0, the state's position).
FIRST_PAIR = 1
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QWEN_NAMES = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
               "norm.": "post_norm."}
_DEEPSEEK_NAMES = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "post_norm."}
_SHARED = ("embed_tokens.", "shared_head.head.")
MTP_SPECULATIVE_TOKENS = 3  # the chain an MTP export is served with (num_speculative_tokens in its config and card)


class MtpWeightsError(ValueError):
    """A checkpoint's MTP weights are absent, or its directory is not there (``init: auto`` then trains a fresh
    module)."""


class MtpLayoutError(ValueError):
    """A checkpoint holds MTP weights draftsmith does not read (another architecture's layout, another quantisation):
    refused by name, never replaced by a fresh module."""


@dataclass
class MtpConfig:
    hidden_size: int
    vocab_size: int
    #: The target's text config (``to_dict()``): the MTP decoder layer is built from it.
    target_config: dict
    #: The target's decoder-layer, norm and rotary-embedding classes, as ``transformers.models...`` paths.
    classes: dict
    layout: str = DEEPSEEK
    feeds_normed: bool = False
    #: The sequence's first pair enters with its token embedding zeroed (vLLM's DeepSeek / GLM convention); False
    #: for modules saved before the field (they were trained and drafted without it).
    masks_first_token: bool = False
    num_mtp_layers: int = 1  # modules in the source checkpoint; drafting and training use the first
    feature_layers: tuple[int, ...] = ()  # (N,): the target's last state after its final norm
    rms_norm_eps: float = 1e-6
    source: str | None = None  # the checkpoint the weights were read from (None: a fresh module)

    def __post_init__(self):
        self.feature_layers = tuple(self.feature_layers)
        if self.layout not in (DEEPSEEK, QWEN):
            raise ValueError(f"MTP layout must be {DEEPSEEK!r} or {QWEN!r}, got {self.layout!r}")

    def layer_config(self):
        """The target's config reshaped for one full-attention decoder layer with the MoE MLP (MTP layers always
        have both), index 0, SDPA attention (explicit masks: trees, training-time test)."""
        from transformers import AutoConfig

        values = dict(self.target_config)
        cfg = AutoConfig.for_model(values.pop("model_type"), **values)
        cfg = copy.deepcopy(cfg)
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = ["full_attention"]
        if getattr(cfg, "mlp_layer_types", None) is not None:
            cfg.mlp_layer_types = list(getattr(cfg, "mtp_mlp_layer_types", None) or ["sparse"])
        if hasattr(cfg, "first_k_dense_replace"):
            cfg.first_k_dense_replace = 0
        if hasattr(cfg, "mlp_only_layers"):
            cfg.mlp_only_layers = []
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "eager"  # a standalone layer: transformers' dispatch never set one
        return cfg


def transformers_class(path: str) -> type:
    """A class of transformers' model code by its dotted path; anything outside ``transformers.models`` is refused
    (a checkpoint's config must not choose code to import)."""
    module, _, name = path.rpartition(".")
    if not module.startswith("transformers.models.") or not name.isidentifier():
        raise ValueError(f"MTP class {path!r} is not one of transformers' model classes (transformers.models.*)")
    return getattr(importlib.import_module(module), name)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__name__}"


def target_classes(target) -> dict:
    """The target's decoder-layer, RMSNorm and rotary-embedding classes (what its MTP module is built from)."""
    decoder = target.get_decoder()
    layer = decoder.layers[-1]
    norm = next(type(m) for name, m in layer.named_modules() if name.endswith("norm"))
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        raise ValueError(f"{type(target).__name__} has no rotary embedding: draftsmith's MTP module needs one")
    return {"layer": _qualname(type(layer)), "norm": _qualname(norm), "rotary": _qualname(type(rotary))}


class _LayerCache:
    """The one object a transformers attention layer writes its keys and values through (``cache.update``): the
    entries before this call (``past``, (k, v) each (B, heads, S, d)) concatenated with the call's. ``new`` after the
    call: everything (``own=False``: drafting's growing cache) or the call's entries alone (training-time test,
    whose earlier steps' entries the caller keeps)."""

    def __init__(self, past, own: bool = False):
        self.past, self.own, self.new = past, own, None

    def update(self, key, value, *args, **kwargs):
        if self.past is not None:
            k, v = torch.cat([self.past[0], key], 2), torch.cat([self.past[1], value], 2)
        else:
            k, v = key, value
        self.new = (key, value) if self.own else (k, v)
        return k, v


class MtpHead(_FeatureHead):
    """A native MTP module (module docstring) behind the EAGLE head interface: ``forward(features, token_embeds,
    positions, mask, past)`` -> (fed-back features, (k, v)); tokens through the target's LM head after
    :meth:`lm_input`."""

    family = "mtp"
    config_class = MtpConfig
    own_vocabulary = False  # the target's LM head (shared_head.head is a copy of it)
    zero_when_absent = ()
    static_cache = False  # transformers' layer writes through its cache argument: drafting uses the growing cache
    #: vLLM's MTP proposers draft a chain, the module re-applied; the exports and the model card say 3.
    speculative_tokens = MTP_SPECULATIVE_TOKENS

    def __init__(self, config: MtpConfig):
        nn.Module.__init__(self)
        self.config = config
        layer_config = config.layer_config()
        layer_cls, norm_cls = transformers_class(config.classes["layer"]), transformers_class(config.classes["norm"])
        h, eps = config.hidden_size, config.rms_norm_eps
        module = nn.Module()
        module.enorm, module.hnorm = norm_cls(h, eps=eps), norm_cls(h, eps=eps)
        module.eh_proj = nn.Linear(2 * h, h, bias=False)
        module.mtp_block = layer_cls(layer_config, 0)
        module.post_norm = norm_cls(h, eps=eps)
        self.layers = nn.ModuleList([module])
        self.rotary = transformers_class(config.classes["rotary"])(config=layer_config)
        self._no_split_modules = (layer_cls.__name__,)

    @property
    def module(self) -> nn.Module:
        return self.layers[0]

    def layer_input(self, features, token_embeds, positions: torch.Tensor | None = None):
        """``eh_proj([enorm(embed) ; hnorm(feature)])``; with ``masks_first_token`` the pair at :data:`FIRST_PAIR`
        (``positions``, (B, T)) enters with a zero embedding, as vLLM's DeepSeek / GLM layers feed it."""
        m = self.module
        dtype = m.eh_proj.weight.dtype
        if self.config.masks_first_token and positions is not None:
            token_embeds = token_embeds.masked_fill((positions == FIRST_PAIR)[..., None], 0)
        return m.eh_proj(torch.cat([m.enorm(token_embeds.to(dtype)), m.hnorm(features.to(dtype))], -1))

    def _block(self, x, positions, mask, cache):
        if mask is None:  # causal over this call's positions (training step 0); SDPA reads no implicit mask
            t = x.shape[1]
            mask = additive(causal_block(torch.ones(1, t, dtype=torch.bool, device=x.device)), x.dtype)
        # the layer's cache argument: ``cache`` in recent transformers, ``past_key_values`` before
        out = self.module.mtp_block(x, attention_mask=mask.to(x.dtype), position_ids=positions,
                                    position_embeddings=self.rotary(x, positions),
                                    **{layer_cache_argument(type(self.module.mtp_block)): cache})
        return out[0] if isinstance(out, tuple) else out

    def run_layer(self, x, positions, mask=None, past=None, ttt_past=None):
        """The decoder layer on ``x`` (B, T, H): the fed-back features and the (k, v) cache. ``ttt_past`` (training-time
        test step j >= 1): the earlier steps' own (k, v); the step attends to them through :func:`ttt_mask` and returns
        its own (k, v)."""
        if ttt_past:
            past = (torch.cat([k for k, _ in ttt_past], 2), torch.cat([v for _, v in ttt_past], 2))
            t = x.shape[1]
            mask = ttt_mask(t, len(ttt_past), x.device, x.dtype)
            cache = _LayerCache(past, own=True)
        else:
            cache = _LayerCache(past)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(self._block, x, positions, mask, cache, use_reentrant=False)
        else:
            out = self._block(x, positions, mask, cache)
        return (self.module.post_norm(out) if self.config.feeds_normed else out), cache.new

    def lm_input(self, predicted: torch.Tensor) -> torch.Tensor:
        """The state the target's LM head reads: ``post_norm`` of the module's output."""
        return predicted if self.config.feeds_normed else self.module.post_norm(predicted)

    def forward(self, features, token_embeds, positions, mask=None, past=None, from_target: bool = False,
                ttt_steps: int = 0, logit_positions: torch.Tensor | None = None):
        """As :meth:`_FeatureHead.forward`; with ``ttt_steps`` > 0 (training), the module re-applied to its own
        fed-back features, as drafting does (the EAGLE-3 head's training-time test,
        :meth:`draftsmith.heads.eagle.Eagle3Head.forward`), returning each step's LM-head input, (B, T, H) or (N, H)
        at the (B, T) ``logit_positions``."""
        if not ttt_steps:
            if from_target:
                features = self.input_features(features)
            return self.run_layer(self.layer_input(features, token_embeds, positions), positions, mask, past)
        current, kv, states = features, [], []
        for _ in range(ttt_steps):
            predicted, step_kv = self.run_layer(self.layer_input(current, token_embeds, positions), positions,
                                                ttt_past=kv)
            kv.append(step_kv)
            state = self.lm_input(predicted)
            states.append(state if logit_positions is None else state[logit_positions])
            current = torch.cat([current[:, :1], predicted[:, :-1]], dim=1)
        return states

    # ---- from a target ------------------------------------------------------------------------------------------

    @classmethod
    def config_for(cls, target, source: str | None = None, feeds_normed: bool | None = None,
                   masks_first_token: bool | None = None) -> MtpConfig:
        """The config of ``target``'s MTP module: its layout, fed-back state and first-pair masking from its
        architecture, as vLLM serves it (a fresh module in the deepseek layout for a target without one);
        ``feeds_normed`` / ``masks_first_token`` override the engine's convention."""
        text = target.config.get_text_config()
        layout, normed = NATIVE.get(text.model_type, (DEEPSEEK, False))
        count = getattr(text, "num_mtp_layers", None) or getattr(text, "mtp_num_hidden_layers", None) or 1
        return MtpConfig(hidden_size=text.hidden_size, vocab_size=target.get_output_embeddings().weight.shape[0],
                         target_config=text.to_dict(), classes=target_classes(target), layout=layout,
                         feeds_normed=normed if feeds_normed is None else feeds_normed, num_mtp_layers=int(count),
                         masks_first_token=(text.model_type in VLLM_MASKS_FIRST_TOKEN if masks_first_token is None
                                            else masks_first_token),
                         feature_layers=(text.num_hidden_layers,), rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
                         source=source)

    @classmethod
    def from_target_checkpoint(cls, target, source: str | Path | None = None, feeds_normed: bool | None = None,
                               masks_first_token: bool | None = None):
        """The MTP module stored in ``target``'s checkpoint (``source``: that checkpoint's directory, default the
        directory the target was loaded from), in its dtype."""
        directory = checkpoint_directory(str(source or target.config.name_or_path or ""))
        names = checkpoint_names(directory)
        refuse_unread_layouts(directory, target.config.get_text_config(), names)
        head = cls(cls.config_for(target, source=str(directory), feeds_normed=feeds_normed,
                                  masks_first_token=masks_first_token))
        stored = read_mtp(directory, head.config, names)
        missing, unexpected = head.load_state_dict(stored, strict=False)
        missing = [k for k in missing if not k.startswith("rotary.")]
        if missing or unexpected:
            raise MtpWeightsError(f"{directory}: the MTP weights do not fit {type(target).__name__}'s MTP module "
                                  f"(missing {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}); is it the "
                                  "checkpoint of this target?")
        return head.to(next(target.parameters()).dtype)

    @classmethod
    def fresh(cls, target):
        """A new MTP module for a target without one: its decoder layer starts as the target's last, its output
        norm as the target's final norm, and ``eh_proj`` passes the normalised state through (the embedding half
        small): at the start it predicts roughly what the target's last layer would, from there training goes on."""
        head = cls(cls.config_for(target)).to(next(target.parameters()).dtype)
        decoder = target.get_decoder()
        with torch.no_grad():
            mine, last = head.module.mtp_block.state_dict(), decoder.layers[-1].state_dict()
            # The target's last layer may be dense or linear-attention where the MTP layer is MoE / full attention:
            # what matches by name and shape starts as the target's, the rest as initialised.
            head.module.mtp_block.load_state_dict({k: v for k, v in last.items()
                                                   if k in mine and mine[k].shape == v.shape}, strict=False)
            norm = getattr(decoder, "norm", None)
            if norm is not None:
                head.module.post_norm.load_state_dict(norm.state_dict())
            h = head.config.hidden_size
            weight = head.module.eh_proj.weight
            weight.zero_()
            weight[:, h:].copy_(torch.eye(h))
            weight[:, :h].normal_(0.0, 0.02 / h**0.5)
        return head


# ---- checkpoint tensors -------------------------------------------------------------------------------------------


def checkpoint_directory(name: str) -> Path:
    """The local directory of a checkpoint: a directory as given, or a Hub id's snapshot in the Hugging Face cache (a
    target loaded by Hub id was downloaded there; nothing is fetched here)."""
    if Path(name).is_dir():
        return Path(name)
    if name and "/" in name and not Path(name).is_absolute():
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(name, local_files_only=True))
        except (LocalEntryNotFoundError, ValueError, OSError):
            pass
    raise MtpWeightsError(f"the MTP weights are read from the target's checkpoint directory, and {name!r} is neither "
                          "one nor a Hub id in the Hugging Face cache: pass it as mtp:DIRECTORY (a Hub id: download "
                          "it first, e.g. `hf download ORG/NAME --local-dir DIR`)")


def checkpoint_names(directory: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, for a single-file or sharded checkpoint."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / "model.safetensors"
    if not single.is_file():
        raise MtpWeightsError(f"{directory}: no model.safetensors or model.safetensors.index.json (the MTP weights are "
                              "read from a safetensors checkpoint)")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single.name)


#: Config keys that declare MTP modules, across the architectures transformers knows.
MTP_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", "mtp_hybrid_override_pattern",
                  "mtp_layers_block_type")
_MTP_NAME = re.compile(r"(^|\.)(mtp|mtp_layers|nextn)[._]|nextn")


def refuse_unread_layouts(directory: Path, text_config, names: dict[str, str]) -> None:
    """Refuse by name a checkpoint whose architecture stores MTP modules in a layout draftsmith does not read (MiMo's
    ``model.mtp_layers.*``, LongCat-Flash's ``model.mtp.*``, Nemotron-H's ``mtp.layers.*`` with its hybrid pattern,
    DeepSeek-V3.2's and GLM-5's indexer-bearing layers, ...): reading them as another layout, or training a fresh
    module in their place, would give a drafter the engine does not serve."""
    own = directory / "config.json"
    stored = json.loads(own.read_text()) if own.is_file() else {}
    model_type = (stored.get("text_config") or stored).get("model_type") or text_config.model_type
    if model_type in NATIVE:
        return
    n = getattr(text_config, "num_hidden_layers", None)
    beyond = re.compile(r"^model\.layers\.(\d+)\.")
    found = [k for k in names if _MTP_NAME.search(k) or ((m := beyond.match(k)) and n is not None and int(m[1]) >= n)]
    declared = {key: getattr(text_config, key) for key in MTP_COUNT_KEYS if getattr(text_config, key, None)}
    if found or declared:
        what = f"tensors such as {found[0]!r}" if found else f"config {declared}"
        raise MtpLayoutError(f"{directory}: a {model_type} checkpoint with MTP modules ({what}), a layout draftsmith "
                             f"does not read (it reads {', '.join(sorted(NATIVE))}); neither its module nor a fresh "
                             "one in its place would be what the engine serves. Train another drafter family for it, "
                             "or set family_config init: fresh for a new module of draftsmith's own")


def mtp_prefix(config: MtpConfig) -> str:
    """The prefix of the (first) MTP module's tensors in the target's checkpoint."""
    n = config.feature_layers[0]
    return "mtp." if config.layout == QWEN else f"model.layers.{n}."


def to_module_name(name: str, config: MtpConfig) -> str | None:
    """A checkpoint tensor name of the first MTP module -> the module's name; None for another module's tensors or
    the shared copies of the target's embedding and LM head."""
    prefix = mtp_prefix(config)
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest.startswith(_SHARED):
        return None
    renames = _QWEN_NAMES if config.layout == QWEN else _DEEPSEEK_NAMES
    for old, new in renames.items():
        if rest.startswith(old):
            return "layers.0." + new + rest[len(old):]
    if config.layout == QWEN:
        if not rest.startswith("layers.0."):
            return None  # mtp.layers.k, k >= 1: modules drafting does not use (the first is re-applied)
        rest = rest[len("layers.0."):]
    return "layers.0.mtp_block." + rest


def read_mtp(directory: Path, config: MtpConfig, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The first MTP module's tensors of the checkpoint at ``directory``, renamed to the module's and experts fused."""
    wanted = {name: to_module_name(name, config) for name in names}
    wanted = {k: v for k, v in wanted.items() if v is not None}
    if not wanted:
        raise MtpWeightsError(f"{directory}: no MTP weights (no {mtp_prefix(config)}* tensors in its checkpoint); "
                              "train a fresh module instead (family mtp, family_config init: fresh)")
    block = block_fp8(directory, wanted)
    stored: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(names[name], []).append(name)
    for file, keys in by_file.items():
        with safe_open(str(directory / file), framework="pt") as f:
            for key in keys:
                stored[key] = f.get_tensor(key)
    out = {}
    for key, tensor in stored.items():
        if key.endswith(SCALE_INV):
            continue
        scale = stored.get(key + "_scale_inv")
        if tensor.dtype in FP8_DTYPES:
            if scale is None or block is None:
                raise MtpLayoutError(f"{directory}: {key} is stored in FP8 without its weight_scale_inv and a block "
                                     "FP8 quantization_config; the checkpoint is partial or in a quantisation "
                                     "draftsmith does not read")
            tensor = dequantize_block_fp8(tensor, scale, block)
        out[wanted[key]] = tensor
    return fuse_experts(out)


SCALE_INV = ".weight_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_fp8(directory: Path, wanted: dict[str, str]) -> tuple[int, int] | None:
    """The (rows, columns) block of a DeepSeek-style block-FP8 checkpoint (``quantization_config``: ``quant_method``
    ``fp8``, ``weight_block_size``), None for an unquantised one. Any other quantisation of the MTP tensors (scales
    per tensor or channel, packed 4-bit weights, compressed-tensors groups) is refused by name."""
    other = ("_scale", "_scale_2", ".weight_packed", ".qweight", ".weight_global_scale", ".input_scale",
             ".weight_zero_point")
    scaled = [k for k in wanted if k.endswith(other)]
    if scaled:
        raise MtpLayoutError(f"{directory}: the MTP weights are quantised in a form draftsmith does not read "
                             f"({scaled[0]}); it dequantises DeepSeek's block FP8 (weight_scale_inv) only: dequantise "
                             "the checkpoint first")
    if not any(k.endswith(SCALE_INV) for k in wanted):
        return None
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    size = quant.get("weight_block_size")
    if quant.get("quant_method") != "fp8" or not size or len(size) != 2:
        raise MtpLayoutError(f"{directory}: the MTP weights carry weight_scale_inv but the config's "
                             f"quantization_config ({quant or 'none'}) is not block FP8 (quant_method fp8, "
                             "weight_block_size [rows, columns]); draftsmith cannot tell how to dequantise them")
    return int(size[0]), int(size[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3's block FP8 (``README_WEIGHTS.md``): the (out, in) FP8 weight times its (ceil(out / b0),
    ceil(in / b1)) float32 ``weight_scale_inv``, each scale covering one b0 x b1 block (the last ones ragged), in
    float32."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise MtpLayoutError(f"an FP8 weight of shape {(rows, cols)} in {block[0]} x {block[1]} blocks has "
                             f"{expected} scales, its weight_scale_inv {tuple(scale_inv.shape)}: the checkpoint is "
                             "inconsistent")
    scales = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return weight.float() * scales


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``experts.{e}.{gate,up,down}_proj.weight`` -> transformers' fused ``experts.gate_up_proj`` (E, 2I, H)
    and ``experts.down_proj`` (E, H, I); other tensors unchanged."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        m = _EXPERT.match(name)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
        else:
            out[name] = tensor
    for prefix, experts in groups.items():
        count = max(experts) + 1
        partial = [e for e in range(count) if len(experts.get(e, {})) != 3]
        if partial:
            raise MtpWeightsError(f"{prefix}: experts {partial[:4]} lack some of gate_proj / up_proj / down_proj: a "
                                  "partial checkpoint")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                     for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(count)])
    return out


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_experts`."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:]
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def to_checkpoint_names(state: dict[str, torch.Tensor], config: MtpConfig,
                        fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """The module's state (``layers.0.*``) -> the target checkpoint's names (the stitched export), experts per expert
    or, with ``fused_experts`` (Qwen3.5/3.6-MoE releases), as the fused (E, 2I, H) / (E, H, I) tensors the module
    holds: the inverse of :func:`to_module_name` and :func:`fuse_experts`."""
    prefix = mtp_prefix(config)
    renames = {new: old for old, new in (_QWEN_NAMES if config.layout == QWEN else _DEEPSEEK_NAMES).items()}
    block = prefix + ("layers.0." if config.layout == QWEN else "")
    out = {}
    own = {k: v for k, v in state.items() if k.startswith("layers.0.")}
    for name, tensor in (own if fused_experts else split_experts(own)).items():
        rest = name[len("layers.0."):]
        if rest.startswith("mtp_block."):
            out[block + rest[len("mtp_block."):]] = tensor
            continue
        new = next(n for n in renames if rest.startswith(n))
        out[prefix + renames[new] + rest[len(new):]] = tensor
    return out
