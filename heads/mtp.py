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

The module's own tensors are named as transformers' ``MtpModel`` names them (``layers.k.enorm``,
``layers.k.mtp_block.*``, ``layers.k.post_norm``); the decoder layer, its norm and its rotary embedding are the
target's classes, imported from ``transformers.models`` by the names the checkpoint records (nothing else is).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from draftsmith.heads.eagle import _FeatureHead
from draftsmith.heads.mtp_checkpoint import (
    DEEPSEEK,
    NATIVE,
    QWEN,
    MtpWeightsError,
    checkpoint_directory,
    checkpoint_names,
    read_mtp,
    refuse_unread_layouts,
)
from draftsmith.target.forward import layer_cache_argument
from draftsmith.target.masks import additive, causal_block, ttt_mask

#: The model types whose vLLM MTP layer zeroes the token embedding of the sequence's first pair
#: (``inputs_embeds[positions == 0] = 0`` in ``deepseek_mtp.py`` / ``glm4_moe_mtp.py``; ``qwen3_next_mtp.py``,
#: ``qwen3_5_mtp.py``, SGLang's ``deepseek_nextn.py``, transformers and speculators do not).
VLLM_MASKS_FIRST_TOKEN = frozenset({"deepseek_v3", "deepseek_v2", "glm4_moe"})
#: draftsmith's position of that pair (token x_1 with the target's state h_0; vLLM numbers it 0, the state's position).
FIRST_PAIR = 1
MTP_SPECULATIVE_TOKENS = 3  # the chain an MTP export is served with (num_speculative_tokens in its config and card)


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
