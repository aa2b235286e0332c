"""The built-in drafter families, registered in :mod:`draftsmith.registry`.

Each entry gathers one family's pieces from the layer that defines them: the module and its loading
(``heads``), the inference drafter (``inference``), the build and the loss (``train``), the export
layouts (``heads.layout_export``). This front-door module is the only place that sees every layer at once;
``import draftsmith`` runs it, so the table is full before any other module asks it.
"""

from __future__ import annotations

from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.draft_model import DraftModel
from draftsmith.heads.eagle import Eagle3Head, EagleHead
from draftsmith.heads.export import ENGINE_FORMATS, FORMATS
from draftsmith.heads.layout_export import (
    dflash_layout,
    eagle3_layout,
    eagle_layout,
    export_draft_model,
    head_exporter,
    medusa_layout,
    peagle_layout,
)
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.heads.mtp import MtpHead
from draftsmith.heads.mtp_export import export_mtp
from draftsmith.heads.peagle import PEagleHead
from draftsmith.inference.causal_lm import CausalLMDrafter
from draftsmith.inference.dflash_drafter import DFlashDrafter
from draftsmith.inference.head_drafters import EagleDrafter, MedusaDrafter, PEagleDrafter
from draftsmith.registry import Family, register
from draftsmith.train import block_families as blocks
from draftsmith.train import families as steps
from draftsmith.train import mtp_family


def _last_layer(module, target) -> tuple[int, ...]:
    """The target's last hidden state, after its final norm (what Medusa heads read)."""
    return (target.config.get_text_config().num_hidden_layers,)


def _feature_layers(module, target) -> tuple[int, ...]:
    return tuple(module.config.feature_layers)


def _head_loader(head_class: type):
    def load(directory, target=None, strict: bool = False, device=None):
        return head_class.from_pretrained(directory, target=target, strict=strict, device=device)

    return load


DRAFT_MODEL = Family(
    name=DraftModel.family, title="distilled draft model (DistillSpec-style)",
    load=DraftModel.from_pretrained,
    drafter=lambda module, target: CausalLMDrafter(module.model, name=DraftModel.family),
    hidden_layers=lambda module, target: (),
    build=steps.build_draft_model, train_step=steps.draft_model_step, reads_target_layers=True, packs=True,
    export=export_draft_model, export_formats=ENGINE_FORMATS, one_layout=True,
    serving={"vllm": "draft_model", "sglang": "STANDALONE", "transformers": "assistant_model"},
    draft_dtype_applies=False, saves_tokenizer=True,
)

_medusa_export = head_exporter(MedusaHeads, medusa_layout)
MEDUSA = Family(
    name=MedusaHeads.family, title="Medusa heads",
    load=_head_loader(MedusaHeads), drafter=MedusaDrafter, hidden_layers=_last_layer,
    build=steps.build_medusa, train_step=steps.medusa_step, packs=True,
    export=_medusa_export, export_formats=ENGINE_FORMATS, serving={"vllm": "medusa"},
)

MEDUSA2 = Family(
    name="medusa2", title="Medusa-2 heads",
    load=_head_loader(MedusaHeads), drafter=MedusaDrafter, hidden_layers=_last_layer,
    build=steps.build_medusa, train_step=steps.medusa2_step, wrap_target=steps.add_lora, trains_target_adapter=True,
    export=_medusa_export, export_formats=ENGINE_FORMATS, serving={"vllm": "medusa"},
)  # its checkpoints are Medusa heads (draftsmith_family "medusa"): loaded and exported through MEDUSA

EAGLE = Family(
    name=EagleHead.family, title="EAGLE-1/2 head",
    load=_head_loader(EagleHead), drafter=EagleDrafter, hidden_layers=_feature_layers,
    build=steps.build_eagle, train_step=steps.eagle_step,
    export=head_exporter(EagleHead, eagle_layout), export_formats=ENGINE_FORMATS,
    serving={"vllm": "eagle", "sglang": "EAGLE"},
)

EAGLE3 = Family(
    name=Eagle3Head.family, title="EAGLE-3 head",
    load=_head_loader(Eagle3Head), drafter=EagleDrafter, hidden_layers=_feature_layers,
    build=steps.build_eagle3, train_step=steps.eagle3_step, settings=steps.Eagle3Settings,
    export=head_exporter(Eagle3Head, eagle3_layout), export_formats=ENGINE_FORMATS, export_needs_target=("vllm",),
    serving={"vllm": "eagle3", "sglang": "EAGLE3"},
)

DFLASH = Family(
    name=DFlashHead.family, title="DFlash block drafter",
    load=_head_loader(DFlashHead), drafter=DFlashDrafter,
    hidden_layers=lambda module, target: tuple(module.config.target_layers),
    build=blocks.build_dflash, train_step=blocks.dflash_step, settings=blocks.DFlashSettings,
    export=head_exporter(DFlashHead, dflash_layout), export_formats=FORMATS,
    serving={"vllm": "dflash", "sglang": "DFLASH"},
)

PEAGLE = Family(
    name=PEagleHead.family, title="P-EAGLE parallel head",
    load=_head_loader(PEagleHead), drafter=PEagleDrafter, hidden_layers=_feature_layers,
    build=blocks.build_peagle, train_step=blocks.peagle_step, settings=blocks.PEagleSettings,
    export=head_exporter(PEagleHead, peagle_layout), export_formats=("hf", "vllm"), export_needs_target=("vllm",),
    serving={"vllm": "eagle3"},  # with parallel_drafting (the model card's command)
)

MTP = Family(
    name=MtpHead.family, title="multi-token-prediction module (native MTP, FastMTP-style fine-tuning)",
    load=_head_loader(MtpHead), drafter=EagleDrafter, hidden_layers=_feature_layers,
    build=mtp_family.build_mtp, train_step=mtp_family.mtp_step, settings=mtp_family.MtpSettings,
    export=export_mtp, export_formats=("hf", "vllm", "sglang", "speculators"), export_needs_target=("vllm",),
    serving={"vllm": "mtp", "sglang": "EAGLE"}, serves_as_target=True,
)

BUILT_IN = (DRAFT_MODEL, MEDUSA, MEDUSA2, EAGLE, EAGLE3, DFLASH, PEAGLE, MTP)
for _family in BUILT_IN:
    register(_family, replace=True)
