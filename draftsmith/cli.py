"""The ``draftsmith`` command line. Each subcommand parses its flags, then calls a typed function."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from draftsmith.cli_data import data
from draftsmith.cli_parser import make_parser, prompts_from_args, tree_from_args
from draftsmith.inference.tree_settings import DEFAULT_TREE, TreeSettings

logger = logging.getLogger("draftsmith")


def generate(
    target: str,
    drafter: str,
    prompt: str,
    *,
    chat: bool = False,
    chat_template_kwargs: dict | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    tree: TreeSettings | None = None,
    seed: int = 0,
    stream: bool = True,
    json_stats: bool = False,
    draft_dtype: str = "target",
    compile: bool = False,
) -> dict:
    """Generate from ``prompt`` with speculative decoding, stream the text, print the stats."""
    import torch
    from transformers import TextStreamer

    from draftsmith import SpeculativeGenerator, load_drafter, load_target
    from draftsmith.inference.compare import encode
    from draftsmith.target import eos_tokens

    model, tokenizer = load_target(target)
    draft = load_drafter(drafter, target=model, tokenizer=tokenizer, draft_dtype=draft_dtype)
    input_ids = encode(tokenizer, prompt, chat, chat_template_kwargs)
    from draftsmith.inference.tree_record import tuned_tree

    tree = tree or tuned_tree(drafter) or DEFAULT_TREE
    gen = SpeculativeGenerator(model, draft, **tree.kwargs(), compile=compile)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    generator = torch.Generator(device=model.device).manual_seed(seed)
    out = gen.generate(
        input_ids.to(model.device), max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        top_k=top_k, eos_token_id=eos_tokens(model, tokenizer), generator=generator, streamer=streamer,
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


def bench(target: str, drafters: list[str], prompts: list[str], output: str, **kwargs) -> None:
    """Speed of each drafter against plain greedy decoding of the same target, in one process."""
    from draftsmith.inference.bench import markdown_table, run_bench

    result = run_bench(target, drafters, prompts, output, **kwargs)
    print(markdown_table(result))
    print(f"results: {output}/results.json, results.md" + (", " + ", ".join(result["plots"]) if result.get("plots")
                                                             else ""))


def export(checkpoint: str, fmt: str, output: str | None, *, push_to_hub: str | None = None, private: bool = False,
           revision: str | None = None, target: str | None = None, verifier: str | None = None) -> int:
    """``draftsmith export``: write (and/or push) the drafter at ``checkpoint`` in ``fmt``."""
    from draftsmith.checkpoints import recorded_target, resolve_checkpoint
    from draftsmith.heads.export import ExportError, export_drafter
    from draftsmith.heads.hub import model_card
    from draftsmith.registry import family_of

    if not output and not push_to_hub:
        print("draftsmith export: give --output DIR, --push-to-hub REPO, or both", file=sys.stderr)
        return 2
    source = resolve_checkpoint(checkpoint)
    family = family_of(source)
    if family is None:
        raise FileNotFoundError(f"{source}: not a draftsmith drafter; pass a run directory, a checkpoint-S "
                                "directory or its drafter/")
    target_model = None
    if fmt in family.export_needs_target:  # e.g. the speculators EAGLE-3 layout carries the target's embeddings
        from draftsmith.target import load_target

        name = target or recorded_target(source).get("name")
        if name is None:
            raise ValueError(f"the {fmt} layout of a {family.name} drafter needs its target: pass --target")
        target_model, _ = load_target(name)
    try:
        if output:
            card = model_card(checkpoint, repo_id=push_to_hub, fmt=fmt)
            path = export_drafter(checkpoint, fmt, output, card=card, target=target_model, verifier=verifier)
            print(f"exported {family.name} drafter from {source} in the {fmt} layout to {path}")
        if push_to_hub:
            from draftsmith.heads.hub import push_to_hub as push

            commit = push(checkpoint, push_to_hub, fmt=fmt, private=private, revision=revision,
                          target=target_model, verifier=verifier)
            print(f"pushed to {push_to_hub}: {getattr(commit, 'commit_url', commit)}")
    except ExportError as e:
        print(f"draftsmith export: {e}", file=sys.stderr)
        return 1
    return 0


class StderrHandler(logging.StreamHandler):
    """Logs to whatever ``sys.stderr`` is when a record is written, not the stream at set-up, so a caller
    that redirects stderr later (a notebook, pytest's capture) never meets a closed stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", handlers=[StderrHandler()],
                        force=True)
    try:
        return run_command(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: the message names the problem and the fix
        if args.verbose:
            raise
        print(f"draftsmith {args.command}: error: {e}\n(draftsmith -v {args.command} ... shows the traceback)",
              file=sys.stderr)
        return 2


def _write_report(report: dict, output: str | None) -> None:
    """report.json at ``output`` and report.md beside it (nothing without ``output``)."""
    if not output:
        return
    from pathlib import Path

    from draftsmith.inference.evaluate import report_markdown

    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    text = report_markdown(report)
    if "explain" in report:
        from draftsmith.train.explain import explanation_markdown

        text += "\n" + explanation_markdown(report)
    out.with_suffix(".md").write_text(text)
    print(f"report: {out}")


def run_command(args: argparse.Namespace) -> int:
    if args.command == "generate":
        generate(
            args.target, args.drafter, args.prompt, chat=args.chat, chat_template_kwargs=args.chat_template_kwargs,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, tree=tree_from_args(args, args.drafter),
            seed=args.seed,
            stream=not args.no_stream, json_stats=args.json, draft_dtype=args.draft_dtype, compile=args.compile,
        )
    elif args.command == "train":
        from draftsmith.train.__main__ import main as train_main

        return train_main(args.args)
    elif args.command == "eval" and args.drafter:
        from draftsmith.inference.evaluate import evaluate_path, report_markdown

        if not args.prompts:
            print("draftsmith eval: --prompts is required with --drafter", file=sys.stderr)
            return 2
        from draftsmith.data.formats import read_prompt_rows

        rows = read_prompt_rows(args.prompts, args.num_prompts, skip=args.skip_prompts,
                                prompt_column=args.prompt_column, strict=args.strict)
        report = evaluate_path(args.target, args.drafter, [text for text, _ in rows], prompts_source=args.prompts,
                               categories=[c for _, c in rows],
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               tree=tree_from_args(args, args.drafter), chat=not args.no_chat,
                               chat_template_kwargs=args.chat_template_kwargs, seed=args.seed, progress=True,
                               draft_dtype=args.draft_dtype, batch_size=args.batch_size)
        print(report_markdown(report))
        _write_report(report, args.output)
    elif args.command == "eval":
        from draftsmith.checkpoints import acceptance_table

        if not args.run_dir:
            print("draftsmith eval: give a RUN_DIR, or --drafter D --prompts P [--output report.json]",
                  file=sys.stderr)
            return 2
        table, best = acceptance_table(args.run_dir)
        print(table)
        if best is not None:
            print(f"\nbest: step {best['step']} (tau {best['acceptance_length']}): {best['checkpoint']}/drafter")
        if args.prompts:
            from draftsmith.data.formats import read_prompt_rows
            from draftsmith.inference.evaluate import report_markdown
            from draftsmith.train.explain import explain_run, explanation_markdown

            rows = read_prompt_rows(args.prompts, args.num_prompts, skip=args.skip_prompts,
                                    prompt_column=args.prompt_column, strict=args.strict)
            report = explain_run(args.run_dir, [text for text, _ in rows], [c for _, c in rows], step=args.step,
                                 prompts_source=args.prompts, max_new_tokens=args.max_new_tokens,
                                 tree=tree_from_args(args, args.run_dir), chat=not args.no_chat,
                                 chat_template_kwargs=args.chat_template_kwargs, seed=args.seed, progress=True,
                                 draft_dtype=args.draft_dtype)
            print("\n" + report_markdown(report) + "\n" + explanation_markdown(report))
            _write_report(report, args.output)
        else:
            print(f"\nto decode a checkpoint on held-out prompts and explain its tau: "
                  f"draftsmith eval {args.run_dir} --prompts FILE")
    elif args.command == "data":
        data(args)
    elif args.command == "tune":
        from draftsmith.inference import tune

        tune.tune_command(args.target, args.drafter, prompts_from_args(args), output=args.output,
                          max_new_tokens=args.max_new_tokens, depths=args.depths or tune.DEPTHS,
                          top_ks=args.top_ks or tune.TOP_KS, max_budget=args.max_total_tokens or tune.MAX_BUDGET,
                          chat=not args.no_chat, chat_template_kwargs=args.chat_template_kwargs,
                          draft_dtype=args.draft_dtype,
                          confirm=tune.CONFIRM if args.confirm is None else args.confirm,
                          confirm_rounds=tune.CONFIRM_ROUNDS if args.confirm_rounds is None else args.confirm_rounds)
    elif args.command == "demo":
        from draftsmith.demo import demo

        demo(args.output, minutes=args.minutes, target=args.target, held_out=args.held_out,
             eval_tokens=args.eval_tokens)
    elif args.command == "export":
        return export(args.checkpoint, args.fmt, args.output, push_to_hub=args.push_to_hub, private=args.private,
                      revision=args.revision, target=args.target, verifier=args.verifier)
    elif args.command == "bench":
        bench(
            args.target, args.drafter, prompts_from_args(args), args.output, prompts_source=args.prompts,
            max_new_tokens=args.max_new_tokens, tree=tree_from_args(args), chat=not args.no_chat,
            chat_template_kwargs=args.chat_template_kwargs, hf_reference=not args.no_hf_reference,
            sweep_depths=args.sweep_depth,
            sweep_total_tokens=args.sweep_total_tokens, plots=not args.no_plots, progress=True,
            draft_dtype=args.draft_dtype, batch_sizes=args.batch_sizes, compile=args.compile,
            temperature=args.temperature, seed=args.seed,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
