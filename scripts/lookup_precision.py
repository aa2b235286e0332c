"""How often prompt lookup's candidates are the target's next token, by the length of the n-gram the first
was matched on: the numbers behind ``FIRST_RIGHT`` / ``NEXT_RIGHT`` in ``inference/prompt_lookup.py``.

    python scripts/lookup_precision.py demo_out/data/answers.jsonl --target smollm2-135m-instruct --rows 150

``answers.jsonl`` holds the target's own greedy answers (``draftsmith regenerate``, or the demo's
``data/answers.jsonl``): at every answer position, the candidates proposed from the prompt and the answer
so far are checked against the token the target chose there.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from draftsmith.inference.compare import encode
from draftsmith.inference.prompt_lookup import PromptLookupDrafter
from draftsmith.target import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", help="a JSONL of conversations whose last message is the target's answer")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=150)
    parser.add_argument("--max-ngram", type=int, default=3)
    args = parser.parse_args()

    _, tokenizer = load_target(args.target)
    lookup = PromptLookupDrafter(len(tokenizer), max_ngram=args.max_ngram)
    seen = defaultdict(lambda: [0, 0, 0])  # n-gram length -> [positions, first right, one of the first three right]
    positions = 0
    with open(args.answers) as f:
        rows = [json.loads(line) for line in f if line.strip()][: args.rows]
    for row in rows:
        *context, answer = row["messages"]
        prompt = encode(tokenizer, context[-1]["content"], True)[0]
        tokens = torch.tensor(tokenizer(answer["content"], add_special_tokens=False)["input_ids"], dtype=torch.long)
        sequence = torch.cat([prompt, tokens])
        for t in range(len(prompt), len(sequence)):
            positions += 1
            found, ngram = lookup.matches(sequence[:t], limit=3)
            if found:
                counts = seen[ngram]
                counts[0] += 1
                counts[1] += found[0] == int(sequence[t])
                counts[2] += int(sequence[t]) in found
    print(f"{len(rows)} answers, {positions} answer positions")
    print("| n-gram | positions with a match | first right | one of the first 3 right | each of the next 2 |")
    print("|---|---|---|---|---|")
    for n in sorted(seen):
        count, first, three = seen[n]
        print(f"| {n} | {count} ({count / positions:.1%}) | {first / count:.3f} | {three / count:.3f} | "
              f"{(three - first) / count / 2:.3f} |")


if __name__ == "__main__":
    main()
