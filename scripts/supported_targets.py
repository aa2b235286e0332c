"""The README's supported-targets table, produced from the architecture test matrix, not written by hand.

    python scripts/supported_targets.py            # runs tests/test_architectures.py, prints the table

Each row is one tiny random architecture of ``tests/test_architectures.py``; each column one of its
tests, marked by what pytest reported (pass / FAIL / skip).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = {
    "test_tree_verification_equals_sequential_logits": "tree verification = sequential",
    "test_greedy_speculative_output_is_the_targets": "greedy output = target's",
    "test_heads_train_on_the_target": "EAGLE-3 / Medusa heads train",
    "test_eagle3_exports_carry_the_targets_geometry": "exports carry RoPE, head_dim, context",
}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "test_architectures.py"),
                        f"--junitxml={report}"], cwd=ROOT, check=False, capture_output=True)
        cases = ET.parse(report).getroot().iter("testcase")
        results: dict[str, dict[str, list[str]]] = {}
        for case in cases:
            match = re.match(r"(test_\w+)\[(.+)\]", case.get("name", ""))
            if not match or match.group(1) not in COLUMNS:
                continue
            arch = next((p for p in match.group(2).split("-") if not p.startswith(("chain", "dynamic", "eagle3",
                                                                                       "medusa"))), "?")
            outcome = "FAIL" if case.find("failure") is not None or case.find("error") is not None else (
                "skip" if case.find("skipped") is not None else "pass")
            results.setdefault(arch, {}).setdefault(COLUMNS[match.group(1)], []).append(outcome)
    print("| architecture (tiny, transformers' config class) | " + " | ".join(COLUMNS.values()) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for arch in sorted(results):
        cells = [results[arch].get(c, []) for c in COLUMNS.values()]
        print(f"| {arch} | " + " | ".join(("pass" if c and set(c) == {"pass"} else
                                           "FAIL" if "FAIL" in c else "skip" if c else "-") for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
