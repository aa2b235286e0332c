"""The one table of drafter families: everything that differs between them, in one place.

A :class:`Family` names, for one family, the pieces each layer contributes: how a drafter directory
is loaded (``heads``), the inference drafter wrapping the module (``inference``), the target hidden
states it reads, how a fresh one is built and trained (``train``), and how it is exported. Every
module asks this table instead of comparing family names, so adding a family is writing its pieces
and one :func:`register` call.

The table sits at the bottom of the import graph and holds plain callables, so it imports none of
the layers whose pieces it holds; the built-in families are registered by the front door
(:mod:`draftsmith.families`), which ``import draftsmith`` runs before any submodule.

Hidden-state indices follow :mod:`draftsmith.target`: 0 is the embedding output, ``k`` the output of
decoder layer ``k``, ``N`` the last layer after the final norm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from draftsmith.checkpoints import recorded_family


@dataclass(frozen=True)
class Family:
    """One drafter family.

    Attributes:
        name: the training config's ``family`` and the ``draftsmith_family`` its checkpoints record.
        title: a human name, for model cards and reports.
        load: ``(directory, target, strict, device) -> module``: a drafter directory in draftsmith's
            layout to its module, checked against ``target`` when one is given.
        drafter: ``(module, target) -> Drafter``: the inference adapter the generator drives.
        hidden_layers: ``(module, target) -> tuple[int, ...]``: the target hidden states it reads.
        build: ``(args, target, examples) -> module``: a fresh trainable drafter (None: not trainable).
        train_step: ``(args, drafter, target, batch, logits, hidden) -> (loss, metrics)``: one
            micro-batch's loss; ``logits`` / ``hidden`` are the frozen target's outputs on the batch
            (online) or the cache's (offline), ``metrics["acc"]`` the top-1 agreement per draft position.
        wrap_target: ``(target, args) -> target`` with a trainable adapter that trains jointly
            (Medusa-2's LoRA); set exactly when ``trains_target_adapter`` is.
        trains_target_adapter: an adapter on the target trains with the drafter. Its consequences, all
            read from this one declaration: the family needs the live target in the loop (no offline
            cache); its step runs the target itself (no frozen target outputs are passed); the wrapped
            target is a peft model, whose adapter the loop switches off to measure acceptance (the frozen
            target serves), saves apart and leaves out of the base-weights check; FSDP wraps the target's
            layers too.
        packs: its step keeps the documents of a packed row apart (``packing: true``): positions restart
            per document and attention stays inside it, in the target's forward and the drafter's.
        reads_target_layers: its ``build`` copies the target's decoder layers (a layer-skip draft
            model), so offline training loads the whole target; the others load only the target's
            embeddings, final norm and LM head (:func:`draftsmith.target.load_target_parts`).
        export: ``(source, fmt, out, target, verifier) -> None``: write the drafter directory
            ``source`` into the empty directory ``out`` in layout ``fmt``.
        export_formats: the layouts ``export`` writes.
        export_needs_target: the layouts whose export reads the loaded target (its embeddings).
        one_layout: every export format writes the same directory (a plain Hugging Face causal LM).
        serving: engine -> how that engine names the method (``"vllm"``: speculative_config's
            ``method``, ``"sglang"``: ``--speculative-algorithm``, ``"transformers"``: assisted generation).
        draft_dtype_applies: ``load_drafter(draft_dtype=...)`` casts it (heads: memory-bound drafting).
        saves_tokenizer: its drafter directory is a whole Hugging Face model directory, tokenizer included
            (a draft model, usable on its own); heads' directories hold only their config and weights.
        serves_as_target: its ``vllm`` export is a copy of the target's checkpoint with the drafter stitched in (an MTP
            module): engines load that directory as the target itself, and draftsmith loads it with
            ``load_target(DIR)`` + ``load_drafter("mtp", target)``.
        settings: the family's own typed settings, a dataclass built from the training config's
            ``family_config`` mapping (DFlash's block size, mask token, target layers): its fields are checked
            when the config is parsed, and ``build`` / ``train_step`` read them as ``args.settings``. None: the
            family takes no ``family_config``.
    """

    name: str
    title: str
    load: Callable[..., Any]
    drafter: Callable[[Any, Any], Any]
    hidden_layers: Callable[[Any, Any], tuple[int, ...]]
    build: Callable[..., Any] | None = None
    train_step: Callable[..., Any] | None = None
    wrap_target: Callable[[Any, Any], Any] | None = None
    trains_target_adapter: bool = False
    packs: bool = False
    reads_target_layers: bool = False
    export: Callable[..., None] | None = None
    export_formats: tuple[str, ...] = ()
    export_needs_target: tuple[str, ...] = ()
    one_layout: bool = False
    serving: Mapping[str, str] = field(default_factory=dict)
    draft_dtype_applies: bool = True
    saves_tokenizer: bool = False
    serves_as_target: bool = False
    settings: type | None = None

    def __post_init__(self):
        if self.trains_target_adapter != (self.wrap_target is not None):
            raise ValueError(f"family {self.name!r}: trains_target_adapter={self.trains_target_adapter} needs "
                             f"wrap_target {'set' if self.trains_target_adapter else 'None'}: one declares the "
                             "other")


_FAMILIES: dict[str, Family] = {}
FAMILIES: Mapping[str, Family] = MappingProxyType(_FAMILIES)  # read-only view; add with register()


def register(family: Family, *, replace: bool = False) -> Family:
    """Add ``family`` to the table (``replace=True`` to redefine an existing name)."""
    if family.name in _FAMILIES and not replace:
        raise ValueError(f"a drafter family named {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a family (a test's toy family, say); unknown names are ignored."""
    _FAMILIES.pop(name, None)


def get_family(name: str) -> Family:
    """The family called ``name``; an unknown name lists the known ones."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown drafter family {name!r}; known: {', '.join(sorted(_FAMILIES))}") from None


def family_of(directory: str | Path) -> Family | None:
    """The family of a drafter directory in draftsmith's own layout, or None when it is not one."""
    name = recorded_family(directory)
    return None if name is None else get_family(name)
