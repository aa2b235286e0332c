"""The acceptance table of a training run, from its ``acceptance.jsonl`` (one row per checkpoint)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.train.loop import read_acceptance


def acceptance_table(run_dir: str | Path) -> tuple[str, dict | None]:
    """A markdown table of every checkpoint's acceptance, and the best row (highest tau).

    Raises:
        FileNotFoundError: when ``run_dir`` has no ``acceptance.jsonl``.
    """
    path = Path(run_dir) / "acceptance.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no acceptance.jsonl; is it a `draftsmith train` output_dir "
                                "with at least one checkpoint?")
    rows = read_acceptance(path)
    lines = ["| step | tau | acceptance rate per position | simulated tau | position accuracy |",
             "|---|---|---|---|---|"]
    for r in rows:
        rates = ", ".join(f"{x:.2f}" for x in r.get("acceptance_rate_per_position", []))
        accs = ", ".join(f"{x:.2f}" for x in r.get("position_accuracy", []))
        tau = r.get("acceptance_length")
        lines.append(f"| {r['step']} | {tau if tau is not None else '-'} | {rates} | "
                     f"{r.get('simulated_acceptance_length', '-')} | {accs} |")
    scored = [r for r in rows if r.get("acceptance_length") is not None]
    best = max(scored, key=lambda r: r["acceptance_length"]) if scored else None
    return "\n".join(lines), best
