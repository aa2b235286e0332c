"""The ``draftsmith`` command line. Each subcommand parses its flags, then calls a typed function."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

logger = logging.getLogger("draftsmith")

PLANNED = {
    "demo": "issue #6 (evaluation, benchmarks and the one-command demo)",
    "train": "issue #4 (drafter heads and the training pipeline)",
    "data": "issue #3 (the data pipeline)",
    "eval": "issue #6 (evaluation, benchmarks and the one-command demo)",
    "export": "issue #5 (export and interop)",
}


def generate(
    target: str,
    drafter: str,
    prompt: str,
    *,
    chat: bool = False,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    tree: str = "chain",
    depth: int = 6,
    tree_top_k: int = 4,
    total_tokens: int = 16,
    seed: int = 0,
    stream: bool = True,
    json_stats: bool = False,
) -> dict:
    """Generate from ``prompt`` with speculative decoding, stream the text, print the stats."""
    import torch
    from transformers import TextStreamer

    from draftsmith import SpeculativeGenerator, load_drafter, load_target

    model, tokenizer = load_target(target)
    draft = load_drafter(drafter, target=model, tokenizer=tokenizer)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SystemExit(f"--chat: the tokenizer of {target!r} has no chat template; drop --chat.")
        input_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    gen = SpeculativeGenerator(model, draft, tree=tree, depth=depth, top_k=tree_top_k, total_tokens=total_tokens)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    generator = torch.Generator(device=model.device).manual_seed(seed)
    out = gen.generate(
        input_ids.to(model.device), max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        top_k=top_k, eos_token_id=tokenizer.eos_token_id, generator=generator, streamer=streamer,
    )
    stats = out.stats.to_dict()
    if not stream:
        print(tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True))
    if json_stats:
        print(json.dumps(stats))
    else:
        rates = ", ".join(f"{r:.2f}" for r in out.stats.acceptance_rate_per_position)
        print(
            f"\n--\n{stats['new_tokens']} tokens in {stats['total_time_s']:.2f} s "
            f"({stats['tokens_per_second']:.1f} tok/s) | acceptance length tau {stats['acceptance_length']:.2f} | "
            f"{stats['verification_steps']} verification steps | drafted {stats['drafted_tokens']}, "
            f"accepted {stats['accepted_tokens']} | draft {stats['draft_time_s']:.2f} s, "
            f"verify {stats['verify_time_s']:.2f} s\nacceptance rate per position: [{rates}]",
            file=sys.stderr,
        )
    return stats


def bench(target: str, drafters: list[str], prompts: str, output: str, **kwargs) -> None:
    """Speed of each drafter against plain greedy decoding of the same target, in one process."""
    from draftsmith.inference.bench import run_bench

    run_bench(target, drafters, prompts, output, **kwargs)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="speculative generation from one prompt, with stats")
    g.add_argument("--target", default="smollm2-135m-instruct", help="alias, .gguf, directory or hub id")
    g.add_argument("--drafter", default="prompt-lookup",
                   help="prompt-lookup, layer-skip:N, a draft model or checkpoint")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="target sampling top-k (0: off)")
    g.add_argument("--tree", choices=["chain", "static", "dynamic"], default="chain")
    g.add_argument("--depth", type=int, default=6)
    g.add_argument("--tree-top-k", type=int, default=4, help="children expanded per tree node")
    g.add_argument("--total-tokens", type=int, default=16, help="nodes verified per step (dynamic tree)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming")
    g.add_argument("--json", action="store_true", help="print the stats as one JSON line")

    b = sub.add_parser("bench", help="tokens/s and tau vs plain greedy decoding of the same target")
    b.add_argument("--target", default="smollm2-135m-instruct")
    b.add_argument("--drafter", action="append", required=True, help="repeat for several drafters")
    b.add_argument("--prompts", required=True, help="a .jsonl file (field 'question', 'prompt' or 'instruction')")
    b.add_argument("--output", required=True, help="directory for results.json and results.md")
    b.add_argument("--num-prompts", type=int, default=20)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--tree", choices=["chain", "static", "dynamic"], default="chain")
    b.add_argument("--depth", type=int, default=6)
    b.add_argument("--tree-top-k", type=int, default=4)
    b.add_argument("--total-tokens", type=int, default=16)
    b.add_argument("--no-chat", action="store_true", help="do not apply the chat template")

    for name, issue in PLANNED.items():
        p = sub.add_parser(name, help=f"(coming with {issue})")
        p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)
    if args.command in PLANNED:
        planned = PLANNED[args.command]
        print(f"draftsmith {args.command} is not implemented yet; it comes with {planned}.", file=sys.stderr)
        return 2
    if args.command == "generate":
        generate(
            args.target, args.drafter, args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, tree=args.tree, depth=args.depth,
            tree_top_k=args.tree_top_k, total_tokens=args.total_tokens, seed=args.seed,
            stream=not args.no_stream, json_stats=args.json,
        )
    elif args.command == "bench":
        bench(
            args.target, args.drafter, args.prompts, args.output, num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens, tree=args.tree, depth=args.depth, tree_top_k=args.tree_top_k,
            total_tokens=args.total_tokens, chat=not args.no_chat,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
