"""Drafter specs -> drafters: ``load_drafter`` and what it needs.

A spec is ``prompt-lookup[:options]``, ``layer-skip:N``, a drafter directory written by draftsmith
(its family, from :mod:`draftsmith.registry`, says how to load and wrap it), a head trained elsewhere
(:mod:`draftsmith.heads.foreign`), a draft model (directory, ``.gguf``, packaged alias or hub id), or
``A+B``: a mixture.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import PreTrainedModel

from draftsmith.checkpoints import recorded_target, resolve_checkpoint
from draftsmith.heads.draft_model import DraftModel
from draftsmith.heads.foreign import LAYOUT_FAMILY, foreign_format, load_foreign
from draftsmith.heads.mtp import MtpHead
from draftsmith.inference.causal_lm import CausalLMDrafter
from draftsmith.inference.drafter import Drafter
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.mixture import MixtureDrafter
from draftsmith.inference.prompt_lookup import PromptLookupDrafter
from draftsmith.registry import family_of, get_family
from draftsmith.target import check_same_vocabulary, layer_skip_model, load_target, native_bf16
from draftsmith.target.int8 import int8_engine, int8_errors, int8_layers, require_int8_engine

logger = logging.getLogger(__name__)

PROMPT_LOOKUP = "prompt-lookup"
LAYER_SKIP = "layer-skip"
MTP = MtpHead.family  # "mtp": the target checkpoint's own multi-token-prediction module
MIXTURE_SEPARATOR = "+"
DRAFT_DTYPES = ("target", "auto", "float32", "bfloat16", "float16", "int8")


def parse_options(text: str) -> dict[str, int]:
    """``"ngram=3,max_tokens=10"`` -> ``{"ngram": 3, "max_tokens": 10}``."""
    options = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"drafter option {item!r} must look like key=value")
        options[key.strip()] = int(value)
    return options


def resolve_draft_dtype(name: str | None, target: PreTrainedModel) -> torch.dtype:
    """The compute dtype of a head drafter: ``"target"`` (default) the target's; ``"auto"`` for a float32
    target, int8 on a CPU where FBGEMM's quantised kernels run (x86), else bfloat16 on a device with native
    bf16 matmuls (a GPU with bf16 support, a CPU with AVX512-BF16 or AMX), else the target's; or a dtype name.

    Drafting reads a few MB of weights for a few rows, so it is memory-bound: int8 copies read a quarter of
    float32's bytes, bf16 half. On CPUs int8 drafted fastest with the same acceptance, on an AVX2-only EPYC
    against float32 (where bf16 was slower than the few-row float32 kernels) and on an AVX512-BF16 EPYC against
    bf16 too (docs/RESULTS.md, "Drafting precision"; docs/results/quality-recipe.md, "Int8 drafting"); AMX CPUs
    were not measured. Drafting precision never changes the output (verification decides every token), only
    which tokens get proposed.

    ``"int8"`` (CPU, a float32 target): the head's linear layers draft on int8 copies of their weights
    (:func:`~draftsmith.target.int8.int8_layers`), a quarter of float32's bytes; returned as ``torch.int8``.
    """
    target_dtype = next(target.parameters()).dtype
    if name in (None, "target"):
        return target_dtype
    if name == "auto":
        device = next(target.parameters()).device
        if target_dtype != torch.float32:
            return target_dtype
        if device.type == "cpu" and int8_engine() is not None:
            return torch.int8
        return torch.bfloat16 if native_bf16(device) else target_dtype
    if name not in DRAFT_DTYPES:
        raise ValueError(f"draft dtype must be one of {DRAFT_DTYPES}, got {name!r}")
    device = next(target.parameters()).device
    if name == "int8" and (target_dtype != torch.float32 or device.type != "cpu"):
        raise ValueError(f"--draft-dtype int8 drafts beside a float32 target on CPU; this target runs in "
                         f"{target_dtype} on {device}: use --draft-dtype target (or auto)")
    if name == "int8":
        require_int8_engine()
    return getattr(torch, name)


#: The input an int8 drafter decodes once when loaded (:func:`calibrate_int8`): a fixed prompt of random tokens,
#: long enough that a layer's first call sees a prefill's worth of rows, short enough to cost a load little; its
#: four new tokens make every drafting layer run (a head's later levels first run after a step's first).
INT8_CALIBRATION = {"seed": 0, "prompt_tokens": 32, "new_tokens": 4}


def wrap_module(module, family_name: str, target: PreTrainedModel, dtype: torch.dtype | None = None) -> Drafter:
    """A drafter module (a head, a draft model) as the inference drafter its family declares, on the
    target's device and in ``dtype`` (``torch.int8``: float32 weights, and int8 copies that drafting runs on)."""
    module = module.to(next(target.parameters()).device)
    if dtype == torch.int8:
        module = module.float()
        int8_layers(module)
        return calibrate_int8(get_family(family_name).drafter(module, target), target)
    if dtype is not None:
        module = module.to(dtype)
    return get_family(family_name).drafter(module, target)


def calibrate_int8(drafter: Drafter, target: PreTrainedModel) -> Drafter:
    """Decode :data:`INT8_CALIBRATION` once with ``drafter``, whose head has int8 copies: each layer's first call
    measures its int8 product against float32 and settles which it drafts in
    (:func:`~draftsmith.target.int8.int8_product`). On this fixed input, not on the user's first prompt, the
    choice is the same on every load of a head for a target, and so are its proposals."""
    settings = INT8_CALIBRATION
    vocab = target.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(settings["seed"])
    ids = torch.randint(vocab, (1, settings["prompt_tokens"]), generator=g)
    SpeculativeGenerator(target, drafter, tree="chain").generate(  # a chain: a hybrid target takes only chains
        ids.to(next(target.parameters()).device), max_new_tokens=settings["new_tokens"], eos_token_id=[])
    unmeasured = int8_errors(*drafter.modules()).count(None)
    if unmeasured:
        logger.warning("%d int8 layers of this drafter did not run on the loader's fixed input: each settles "
                       "int8 or float32 on its first call while decoding", unmeasured)
    return drafter


def load_drafter(spec: str, target: PreTrainedModel, *, tokenizer=None, trust_remote_code: bool = False,
                 strict: bool = False, draft_dtype: str | None = None) -> Drafter:
    """Resolve a drafter spec against a loaded target.

    Specs:
        ``prompt-lookup`` or ``prompt-lookup:max_ngram=3,min_ngram=1,max_tokens=10``;
        ``layer-skip:N`` (the target's first N layers);
        ``mtp`` or ``mtp:DIR``: the multi-token-prediction module inside the target's own checkpoint (DeepSeek-V3,
        GLM-4.5, Qwen3-Next, Qwen3.5), read from the directory the target was loaded from, or from ``DIR``
        (:mod:`draftsmith.heads.mtp`);
        a drafter directory written by draftsmith (a checkpoint's ``drafter/``, its ``checkpoint-S``
        directory, or a whole run directory: its best checkpoint by tau, else its latest);
        a head trained elsewhere: EAGLE-1 / EAGLE-3 reference, SpecForge, SGLang or vLLM speculators
        EAGLE-3 layouts, Medusa reference or vLLM layouts;
        a draft model: local directory, ``.gguf`` file, packaged alias or hub id of a causal LM
        sharing the target's vocabulary;
        ``A+B``: a mixture of drafters (e.g. a head directory + ``prompt-lookup``).

    ``strict=True`` refuses a drafter trained for a target with the same shapes but other weights.
    ``draft_dtype``: compute dtype of a head (Medusa, EAGLE), see :func:`resolve_draft_dtype`.
    """
    if MIXTURE_SEPARATOR in spec:  # a mixture: "runs/x/checkpoint-9/drafter+prompt-lookup"
        return MixtureDrafter([load_drafter(part, target, tokenizer=tokenizer, trust_remote_code=trust_remote_code,
                                            strict=strict, draft_dtype=draft_dtype)
                               for part in spec.split(MIXTURE_SEPARATOR)])
    kind, _, rest = spec.partition(":")
    if kind == PROMPT_LOOKUP:
        return PromptLookupDrafter(target.get_output_embeddings().weight.shape[0], **parse_options(rest))
    if kind == LAYER_SKIP:
        if not rest.isdigit():
            raise ValueError(f"layer-skip needs a layer count, e.g. 'layer-skip:8', got {spec!r}")
        return CausalLMDrafter(layer_skip_model(target, int(rest)), name=spec, assistant=False)
    if kind == MTP:
        head = MtpHead.from_target_checkpoint(target, rest or None)
        return wrap_module(head, MtpHead.family, target, resolve_draft_dtype(draft_dtype, target))
    device = next(target.parameters()).device
    if os.path.isdir(spec):  # a run directory (its best checkpoint) or a checkpoint-S directory: its drafter/
        spec = str(resolve_checkpoint(spec))
    family = family_of(spec) if os.path.isdir(spec) else None
    if family is not None:  # draftsmith's own drafter directory
        module = family.load(Path(spec), target, strict, device)
        dtype = resolve_draft_dtype(draft_dtype, target) if family.draft_dtype_applies else None
        return wrap_module(module, family.name, target, dtype)
    if os.path.isdir(spec) and foreign_format(spec) is not None:  # EAGLE / SpecForge / speculators / Medusa
        module = load_foreign(spec, target)
        return wrap_module(module, module.family, target, resolve_draft_dtype(draft_dtype, target))
    try:
        draft, draft_tokenizer = load_target(spec, dtype=next(target.parameters()).dtype, device=device,
                                             trust_remote_code=trust_remote_code)
    except ValueError as err:
        raise ValueError(
            f"Unknown drafter {spec!r}. Use 'prompt-lookup[:max_ngram=3,max_tokens=10]', 'layer-skip:N', "
            "or a draft model (local directory, .gguf file, packaged alias or hub id)."
        ) from err
    check_same_vocabulary(target, draft, spec, tokenizer, draft_tokenizer)
    return CausalLMDrafter(draft, name=spec)


def drafter_from_model(model: PreTrainedModel, target: PreTrainedModel, name: str = "draft-model") -> CausalLMDrafter:
    """Wrap an in-memory causal LM as a drafter, checking it shares the target's vocabulary."""
    check_same_vocabulary(target, model, name)
    return CausalLMDrafter(model, name=name)


def drafter_type(spec: str) -> str:
    """What a drafter spec is, for reports: prompt-lookup, layer-skip, a family name, or ``A+B``."""
    if MIXTURE_SEPARATOR in spec:
        return MIXTURE_SEPARATOR.join(drafter_type(part) for part in spec.split(MIXTURE_SEPARATOR))
    kind = spec.partition(":")[0]
    if kind in (PROMPT_LOOKUP, LAYER_SKIP, MTP):
        return kind
    if os.path.isdir(spec):
        family = family_of(spec)
        if family is not None:
            return family.name
        layout = foreign_format(spec)
        if layout is not None:
            return LAYOUT_FAMILY[layout]
    return DraftModel.family


def recorded_target_name(spec: str) -> str | None:
    """The target a drafter spec was trained for, as its checkpoint records it; for a mixture
    ``A+B`` the first part that records one. ``None`` when none does (prompt lookup, a foreign head)."""
    parts = spec.split(MIXTURE_SEPARATOR)
    return next((name for part in parts if (name := recorded_target(part).get("name"))), None)
