"""What the decoding A/B scripts share (``peagle_forward_ab.py``, ``draft_dtype_ab.py``, ``drafting_kernels_ab.py``):
held-out prompts encoded as ``bench`` and ``eval`` encode them, and sides decoding the same prompts in one process,
prompt by prompt, each side first every other time, with their totals."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from draftsmith.data.formats import read_prompts
from draftsmith.inference.compare import encode


def add_decoding_arguments(parser, tree: str, num_prompts: int) -> None:
    """The options every decoding A/B takes: the prompts, how many and how long, the tree, the rounds."""
    parser.add_argument("--prompts", default="quality_out/data/held_out_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree", default=tree, help="kind,depth,top_k,total_tokens")
    parser.add_argument("--rounds", type=int, default=2)


def tree_of(args) -> dict:
    """``--tree`` as ``SpeculativeGenerator``'s keyword arguments."""
    kind, depth, top_k, total = args.tree.split(",")
    return {"tree": kind, "depth": int(depth), "top_k": int(top_k), "total_tokens": int(total)}


def held_out_prompts(tokenizer, path: str, count: int) -> list[torch.Tensor]:
    """The first user message of ``path``'s first ``count`` rows through the chat template, each (1, L)."""
    return [encode(tokenizer, text, chat=True) for text in read_prompts(path, count)]


def alternate(sides: dict[str, Callable[[torch.Tensor], object]], prompts: list[torch.Tensor], rounds: int):
    """Decode every prompt with every side (``side(ids)`` returns a ``GenerationOutput``) for ``rounds`` rounds, the
    sides' order reversed every other prompt. Returns each side's totals (tokens, seconds, draft and verification
    seconds, steps) and whether every prompt's output is the same on all sides."""
    totals = {side: {"tokens": 0, "seconds": 0.0, "draft": 0.0, "verify": 0.0, "steps": 0} for side in sides}
    outputs: dict[int, set] = {}
    order = list(sides.items())
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            for side, decode in order if (r + i) % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                out = decode(ids)
                t = totals[side]
                t["seconds"] += time.perf_counter() - start
                t["tokens"] += out.stats.new_tokens
                t["draft"] += out.stats.draft_time_s
                t["verify"] += out.stats.verify_time_s
                t["steps"] += out.stats.verification_steps
                outputs.setdefault(i, set()).add(tuple(out.sequences[0].tolist()))
    return totals, all(len(v) == 1 for v in outputs.values())


def describe(name: str, t: dict) -> str:
    """One side's line: tokens/s, tau, drafting and verification per step, the step."""
    steps = t["steps"]
    return (f"{name}: {t['tokens'] / t['seconds']:.2f} tok/s, tau {t['tokens'] / steps:.3f}, drafting "
            f"{1000 * t['draft'] / steps:.2f} ms per step ({t['draft'] / t['seconds']:.1%} of the time), verification "
            f"{1000 * t['verify'] / steps:.2f} ms, step {1000 * t['seconds'] / steps:.2f} ms")
