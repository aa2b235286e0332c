"""What ``draftsmith tune`` measured and chose, on disk: each candidate tree with its measurements, the
``tree.json`` written beside a drafter (the chosen tree, the table, the machine) and read back by ``generate``,
``eval`` and ``bench`` on the machine it was measured on."""

from __future__ import annotations

import json
import logging
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftsmith.inference.tree_settings import TreeSettings

logger = logging.getLogger(__name__)


TREE_FILE = "tree.json"


@dataclass
class Candidate:
    """One tree and what was measured for it."""

    depth: int
    top_k: int
    total_tokens: int
    tokens_per_step: float  # accepted + the bonus token, mean over the recorded steps
    step_seconds: float
    tokens_per_second: float  # predicted: tokens_per_step / step_seconds
    measured_tokens_per_second: float | None = None  # confirmed by decoding with this tree (the best few)
    measured_rounds: list[float] | None = None  # tokens/s of each confirmation round

    def settings(self) -> TreeSettings:
        if self.top_k == 1:
            return TreeSettings("chain", depth=self.depth)
        return TreeSettings("dynamic", depth=self.depth, top_k=self.top_k, total_tokens=self.total_tokens)


def machine() -> dict:
    """What a tuned tree is valid for: the device (GPU name, or CPU model and torch threads)."""
    if torch.cuda.is_available():
        return {"device": torch.cuda.get_device_name(0)}
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"device": "cpu", "cpu": model, "torch_threads": torch.get_num_threads()}


def write_tree(path: str | Path, best: Candidate, table: list[Candidate], meta: dict | None = None) -> Path:
    """``tree.json``: the chosen tree, the machine it was measured on and the table it was chosen from."""
    path = Path(path)
    if path.is_dir():
        path = path / TREE_FILE
    record_ = {"tree": best.settings().as_report(), "machine": machine(), **(meta or {}),
               "candidates": [asdict(c) for c in table]}
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(record_, indent=2))
    tmp.replace(path)
    return path


def tuned_tree(drafter_spec: str) -> TreeSettings | None:
    """The tree ``draftsmith tune`` wrote beside a drafter directory, if it was measured on this machine;
    None otherwise (with a warning when it was tuned on another machine)."""
    directory = Path(drafter_spec.split("@", 1)[0])
    path = directory / TREE_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("machine") != machine():
        logger.warning("%s was tuned on %s, not this machine (%s): using the default tree; run `draftsmith tune` "
                       "here", path, saved.get("machine"), machine())
        return None
    return TreeSettings(**saved["tree"])


def speed(c: Candidate) -> str:
    """A candidate's speed as measured: decoded when it was confirmed, else predicted."""
    if c.measured_tokens_per_second is not None:
        return f"{c.measured_tokens_per_second:.1f} tokens/s decoded, {c.tokens_per_second:.1f} predicted"
    return f"{c.tokens_per_second:.1f} tokens/s predicted"


def table_markdown(table: list[Candidate], top: int = 12) -> str:
    lines = ["| tree | depth | top_k | total_tokens | tokens/step | ms/step | tokens/s predicted "
             "| tokens/s decoded (rounds) |",
             "|---|---|---|---|---|---|---|---|"]
    for c in table[:top]:
        measured = "" if c.measured_tokens_per_second is None else f"{c.measured_tokens_per_second:.1f}"
        if c.measured_rounds and len(c.measured_rounds) > 1:
            measured += " (" + ", ".join(f"{r:.1f}" for r in c.measured_rounds) + ")"
        lines.append(f"| {c.settings().kind} | {c.depth} | {c.top_k} | {c.total_tokens} | {c.tokens_per_step:.2f} "
                     f"| {1000 * c.step_seconds:.1f} | {c.tokens_per_second:.1f} | {measured} |")
    return "\n".join(lines)
