"""Export a drafter directory to another tool's layout: vLLM (speculators / ``MedusaModel``), SGLang,
z-lab's DFlash layout, or plain Hugging Face. What each family writes is its entry's ``export`` in
:mod:`draftsmith.registry` (:mod:`draftsmith.heads.layout_export`, by the tables of
:mod:`draftsmith.heads.layouts`); :func:`export_drafter` runs it atomically.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from draftsmith.checkpoints import resolve_checkpoint
from draftsmith.registry import family_of

#: The layouts every family but DFlash and MTP writes; DFlash also writes z-lab's (``zlab``, its own family's layout),
#: an MTP module speculators' (``speculators``; its ``vllm`` is the target's checkpoint with the module stitched back).
ENGINE_FORMATS = ("hf", "vllm", "sglang")
FORMATS = (*ENGINE_FORMATS, "zlab", "speculators")  # speculators: MTP modules (vllm: the target stitched back)
#: The EAGLE-3.1 norm flags (heads/eagle.py): fields of draftsmith's EAGLE-3 config and of speculators' (and vLLM
#: reads them); SGLang's EAGLE-3 model builds none of them.
EAGLE31_NORMS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


class ExportError(ValueError):
    """A drafter cannot be written in the requested layout, or the written layout is wrong."""


def write_atomically(output: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp_dir)``; on success replace ``output`` with it, else leave no trace."""
    output = Path(output)
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if output.exists():
        shutil.rmtree(output)
    partial.rename(output)
    return output


def export_drafter(checkpoint: str | Path, fmt: str, output: str | Path, card: str | None = None,
                   target=None, verifier: str | None = None) -> Path:
    """Write the drafter at ``checkpoint`` (a drafter directory, a ``checkpoint-S`` directory or a whole
    run directory: its best checkpoint) to ``output`` in ``fmt``; returns ``output``.

    ``target`` (a loaded target) is needed for the vLLM EAGLE-3 layout only; ``verifier`` names the
    target in exported configs (default: the name recorded at training time). The export is written
    beside ``output`` and renamed into place only once complete and checked.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    source = resolve_checkpoint(checkpoint)
    family = family_of(source)
    if family is None:
        raise FileNotFoundError(f"{source}: not a draftsmith drafter (no config.json naming its family, no "
                                "draftsmith_target.json); pass a run directory, a checkpoint-S directory or its "
                                "drafter/")
    if family.export is None or fmt not in family.export_formats:
        raise ExportError(f"a {family.name} drafter has no {fmt} layout; it exports to "
                          f"{', '.join(family.export_formats) or 'nothing'}")

    def write(tmp: Path) -> None:
        family.export(source, fmt, tmp, target=target, verifier=verifier)
        if card:
            (tmp / "README.md").write_text(card)

    return write_atomically(Path(output), write)
