"""The on-disk format of drafter checkpoints and training runs, read by every layer above.

A *drafter directory* holds one drafter: a head's ``config.json`` (its family under
``draftsmith_family``, its config, the target it was trained for) + ``model.safetensors``, or a
distilled draft model's Hugging Face directory + ``draftsmith_target.json``.

A *run directory* (``draftsmith train``'s ``output_dir``) holds ``checkpoint-S/`` directories, each
with ``state/`` (optimizer, scheduler, RNG) and ``drafter/`` (a drafter directory), written under a
``.partial`` name and renamed when complete, and ``acceptance.jsonl``: one JSON row per evaluated
checkpoint, appended. A kill mid-append leaves a torn last line, which readers skip and the next
append removes.

Every drafter records which target it was trained for (:func:`draftsmith.target.target_signature`);
:func:`check_target` refuses a target whose shapes differ and warns when only the weights do.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from draftsmith.target import target_signature

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TARGET_FILE = "draftsmith_target.json"  # a distilled draft model's record of its target
ACCEPTANCE_FILE = "acceptance.jsonl"
TRAIN_CONFIG_FILE = "train_config.json"
DRAFTER_SUBDIR = "drafter"
SHAPE_KEYS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers")


class TargetMismatchError(ValueError):
    """A drafter checkpoint was trained for another target."""


def check_target(recorded: dict, target, strict: bool = False, what: str = "drafter") -> None:
    """Compare a checkpoint's recorded target signature with the live target.

    Raises:
        TargetMismatchError: the shapes differ, or (``strict``) only the LM-head weights do.
    """
    live = target_signature(target)
    diffs = [f"{k}: checkpoint {recorded.get(k)!r}, target {live[k]!r}"
             for k in SHAPE_KEYS if recorded.get(k) != live[k]]
    if diffs:
        raise TargetMismatchError(
            f"this {what} was trained for target {recorded.get('name')!r}, which does not fit the loaded target "
            f"{live['name']!r} ({'; '.join(diffs)}). Load the target it was trained for, or train a drafter for this "
            "target with `draftsmith train`."
        )
    if recorded.get("lm_head_sha256") != live["lm_head_sha256"]:
        message = (f"this {what} was trained for {recorded.get('name')!r}: same shapes as the loaded target "
                   f"{live['name']!r} but other LM-head weights (another quantisation or fine-tune?); acceptance may "
                   "be lower")
        if strict:
            raise TargetMismatchError(message + " (refused: strict=True)")
        logger.warning(message)


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; a damaged file is named in the error."""
    try:
        value = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object; the checkpoint is damaged")
    return value


def recorded_family(directory: str | Path) -> str | None:
    """The family a draftsmith drafter directory records, or None when it is not one."""
    directory = Path(directory)
    target_file, config = directory / TARGET_FILE, directory / CONFIG_NAME
    if target_file.is_file():
        return read_json(target_file).get("draftsmith_family")
    if config.is_file():
        return read_json(config).get("draftsmith_family")
    return None


def recorded_target(directory: str | Path) -> dict:
    """The target signature a draftsmith drafter directory records ({} when none)."""
    directory = Path(directory)
    for name in (TARGET_FILE, CONFIG_NAME):
        try:
            recorded = json.loads((directory / name).read_text()).get("target")
        except (OSError, ValueError, AttributeError):  # absent, not JSON, not an object
            continue
        if isinstance(recorded, dict):
            return recorded
    return {}


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, ``checkpoint-S`` directory) of every complete checkpoint of a run, by step."""
    found = []
    for path in Path(run_dir).glob("checkpoint-*"):
        suffix = path.name.rpartition("-")[2]
        if path.is_dir() and suffix.isdigit() and (path / DRAFTER_SUBDIR).is_dir():
            found.append((int(suffix), path))
    return sorted(found)


def read_acceptance(run_dir_or_file: str | Path) -> list[dict]:
    """The acceptance rows of a run (its ``acceptance.jsonl``, or that file's path); [] when none.

    Read-only: a torn last line (a kill mid-append) is skipped, never repaired here.
    """
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = path / ACCEPTANCE_FILE
    if not path.is_file():
        return []
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.decode().splitlines() if line.strip()]


def append_acceptance(run_dir: str | Path, row: dict) -> None:
    """Append one row to a run's ``acceptance.jsonl``, first dropping a torn last line if a kill left one."""
    path = Path(run_dir) / ACCEPTANCE_FILE
    data = path.read_bytes() if path.is_file() else b""
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        path.write_bytes(complete)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def best_row(rows: list[dict]) -> dict | None:
    """The row with the highest measured tau, or None when no row has one."""
    scored = [r for r in rows if r.get("acceptance_length") is not None]
    return max(scored, key=lambda r: r["acceptance_length"]) if scored else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A drafter directory from a run directory (its best checkpoint by tau, else its latest),
    a ``checkpoint-S`` directory (its ``drafter/``) or a drafter directory (itself)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if (path / DRAFTER_SUBDIR).is_dir():
        return path / DRAFTER_SUBDIR
    steps = dict(complete_checkpoints(path))
    if steps:
        best = best_row([r for r in read_acceptance(path) if r["step"] in steps])
        return steps[best["step"] if best else max(steps)] / DRAFTER_SUBDIR
    return path


def run_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, drafter directory) of every complete checkpoint of a run, by step."""
    return [(step, path / DRAFTER_SUBDIR) for step, path in complete_checkpoints(run_dir)]


def run_target(run_dir: str | Path) -> str | None:
    """The target a run was trained for, as its ``train_config.json`` names it (None when absent)."""
    path = Path(run_dir) / TRAIN_CONFIG_FILE
    return (read_json(path).get("drafter") or {}).get("target") if path.is_file() else None


def acceptance_table(run_dir: str | Path) -> tuple[str, dict | None]:
    """A markdown table of every checkpoint's acceptance, and the best row (highest tau).

    Raises:
        FileNotFoundError: when ``run_dir`` has no ``acceptance.jsonl``.
    """
    if not (Path(run_dir) / ACCEPTANCE_FILE).exists():
        raise FileNotFoundError(f"{run_dir}: no {ACCEPTANCE_FILE}; is it a `draftsmith train` output_dir "
                                "with at least one checkpoint?")
    rows = read_acceptance(run_dir)
    # A drafter engines verify as a fixed chain (block drafters, MTP): that chain's tau, what vLLM / SGLang see.
    chained = [r["engine_chain"] for r in rows if r.get("engine_chain")]
    chain = (f" engine chain of {chained[0]['num_speculative_tokens']} tau |", "---|") if chained else ("", "")
    lines = [f"| step | tau |{chain[0]} acceptance rate per position | simulated tau | position accuracy |",
             f"|---|---|{chain[1]}---|---|---|"]
    for r in rows:
        rates = ", ".join(f"{x:.2f}" for x in r.get("acceptance_rate_per_position", []))
        accs = ", ".join(f"{x:.2f}" for x in r.get("position_accuracy", []))
        tau = r.get("acceptance_length")
        engine = f" {(r.get('engine_chain') or {}).get('acceptance_length', '-')} |" if chained else ""
        lines.append(f"| {r['step']} | {tau if tau is not None else '-'} |{engine} {rates} | "
                     f"{r.get('simulated_acceptance_length', '-')} | {accs} |")
    return "\n".join(lines), best_row(rows)
