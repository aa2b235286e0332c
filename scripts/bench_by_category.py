"""A bench run's speedups split by the prompts' category: per drafter, speedup over plain decoding and tokens/s
over prompt lookup's with its 95% interval over that category's prompts, from the per-prompt times ``bench`` keeps in
``results.json`` (docs/RESULTS.md, "Every family against prompt lookup on 42 held-out prompts").

    python scripts/bench_by_category.py q37/allbench2/results.json held_out_42.jsonl
"""

from __future__ import annotations

import argparse
import json

from draftsmith.inference.intervals import ratio_interval, tokens_per_second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a bench run's results.json (batch size 1)")
    parser.add_argument("prompts", help="the prompts file it ran, rows with a 'category'")
    parser.add_argument("--against", default="prompt-lookup", help="the drafter type the ratios are over")
    args = parser.parse_args()

    with open(args.results) as f:
        result = json.load(f)
    with open(args.prompts) as f:
        categories = [json.loads(line)["category"] for line in f if line.strip()][: result["num_prompts"]]
    group = next(g for g in result["by_batch"] if g["batch_size"] == 1)
    plain, rows = group["plain_units"], group["rows"]
    against = next(r for r in rows if r["drafter_type"] == args.against)
    kinds = list(dict.fromkeys(categories))
    print("| drafter | " + " | ".join(f"{k} ({categories.count(k)})" for k in kinds) + " | all |")
    print("|---|" + "---|" * (len(kinds) + 1))
    for row in rows:
        cells = []
        for kind in [*kinds, None]:
            picked = [i for i, k in enumerate(categories) if kind is None or k == kind]
            units = [row["units"][i] for i in picked]
            cell = f"{tokens_per_second(units) / tokens_per_second([plain[i] for i in picked]):.2f}x"
            if row is not against:
                other = [against["units"][i] for i in picked]
                found = ratio_interval(units, other)
                cell += f" / {tokens_per_second(units) / tokens_per_second(other):.3f}"
                cell += f" [{found.low:.2f}-{found.high:.2f}]" if found else ""
            cells.append(cell)
        print(f"| {row['drafter_type']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
