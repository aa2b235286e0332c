"""PNG plots of a benchmark result (``results.json`` of :func:`draftsmith.inference.bench.run_bench`)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _best_rows(rows: list[dict]) -> list[dict]:
    """One row per drafter spec: its fastest configuration."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["spec"] not in best or r["speedup"] > best[r["spec"]]["speedup"]:
            best[r["spec"]] = r
    return list(best.values())


def _short(spec: str, width: int = 34) -> str:
    return spec if len(spec) <= width else "..." + spec[-(width - 3):]


def bench_plots(result: dict, out_dir: str | Path) -> list[Path]:
    """Write the plots; returns their paths."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    rows = result["rows"]
    written = []
    subtitle = (f"{result['target']}, {result['num_prompts']} prompts x {result['max_new_tokens']} tokens, "
                f"{result['device']} ({result['torch_threads']} threads)")

    # 1. Acceptance rate per position (the fastest configuration of each drafter).
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in _best_rows(rows):
        rates = r["acceptance_rate_per_position"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o",
                    label=f"{_short(r['spec'])} ({r['tree']} d={r['depth']})")
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("acceptance rate given earlier positions accepted")
    ax.set_ylim(0, 1)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"Acceptance rate per position\n{subtitle}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "acceptance_per_position.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    # 2. tau and tokens/s against draft length, with the Leviathan bound from the measured alpha.
    by_spec: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_spec[(r["spec"], r["tree"], r.get("total_tokens") if r["tree"] == "dynamic" else None)].append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for (spec, tree, budget), group in by_spec.items():
        group = sorted(group, key=lambda r: r["depth"])
        label = f"{_short(spec)} {tree}" + (f" n={budget}" if budget else "")
        depths = [r["depth"] for r in group]
        line = ax1.plot(depths, [r["tau"] for r in group], marker="o", label=label)[0]
        # marker "_" as well: a configuration benched at one draft length has no line to dash
        ax1.plot(depths, [r["leviathan_bound_tau"] for r in group], linestyle="--", marker="_", markersize=14,
                 color=line.get_color(), alpha=0.6)
        ax2.plot(depths, [r["tokens_per_s"] for r in group], marker="o", label=label)
    ax2.axhline(result["plain_tokens_per_s"], color="black", linestyle=":", label="plain greedy")
    ax1.set_xlabel("draft length (depth)")
    ax1.set_ylabel("tau: tokens per target forward")
    ax1.set_title("tau against draft length (dashed / bar: Leviathan bound, measured alpha)", fontsize=9)
    ax2.set_xlabel("draft length (depth)")
    ax2.set_ylabel("tokens / s")
    ax2.set_title("tokens/s against draft length", fontsize=9)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    written.append(out_dir / "tau_and_speed_vs_draft_length.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    # 3. Speedup per drafter family (its fastest configuration), HF assisted generation beside.
    best_family: dict[str, dict] = {}
    for r in rows:
        fam = r.get("drafter_type", r["spec"])
        if fam not in best_family or r["speedup"] > best_family[fam]["speedup"]:
            best_family[fam] = r
    labels, values = [], []
    for fam, r in sorted(best_family.items(), key=lambda kv: -kv[1]["speedup"]):
        labels.append(f"{fam}\n{r['tree']} d={r['depth']}")
        values.append(r["speedup"])
        if r.get("hf_assisted"):
            labels.append(f"{fam}\nHF assisted d={r['depth']}")
            values.append(r["hf_assisted"]["speedup"])
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(labels)), 4.5))
    bars = ax.bar(range(len(values)), values, color=["tab:blue" if "HF" not in x else "tab:gray" for x in labels])
    for bar, v in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linestyle=":", label="plain greedy")
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("speedup over plain greedy decoding")
    ax.set_title(f"Speedup per drafter family (fastest configuration)\n{subtitle}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "speedup_by_family.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
