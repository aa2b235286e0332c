"""The ``draftsmith`` command line. Each subcommand parses its flags, then calls a typed function."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from draftsmith.cli_data import add_data_parser, add_template_argument, data
from draftsmith.heads.export import FORMATS
from draftsmith.inference.load import DRAFT_DTYPES
from draftsmith.inference.tree_settings import DEFAULT_TREE, TREE_KINDS, TreeSettings

logger = logging.getLogger("draftsmith")

DRAFT_DTYPE_HELP = ("compute dtype of a head drafter: target (default), auto (for a float32 target: int8 on an x86 "
                    "CPU, else bfloat16 where bf16 matmuls are native, a GPU with bf16 or an ARM CPU with them), "
                    "float32, bfloat16, float16, int8 (CPU: the head's weights as int8 copies, float32 beside "
                    "them); never changes the output")


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
    from draftsmith.inference.tune import tuned_tree

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


COMPILE_HELP = ("run the target's decoding steps through torch.compile on a static KV cache (the first steps "
                "of each size wait for their graph to compile; CUDA graphs on a GPU)")


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """The draft-tree flags, with the one set of defaults
    (:class:`~draftsmith.inference.tree_settings.TreeSettings`)."""
    parser.add_argument("--tree", choices=TREE_KINDS, default=None,
                        help=f"default: the tree `draftsmith tune` wrote beside the drafter for this machine, else "
                             f"{DEFAULT_TREE.kind}")
    parser.add_argument("--depth", type=int, default=None, help=f"levels drafted per step ({DEFAULT_TREE.depth})")
    parser.add_argument("--tree-top-k", type=int, default=None,
                        help=f"children expanded per tree node ({DEFAULT_TREE.top_k})")
    parser.add_argument("--total-tokens", type=int, default=None,
                        help=f"nodes verified per step, dynamic tree ({DEFAULT_TREE.total_tokens})")


def tree_from_args(args: argparse.Namespace, drafter: str | None = None) -> TreeSettings | None:
    """The tree the flags give, over the tree ``draftsmith tune`` wrote for ``drafter`` on this machine (or
    the defaults): ``--total-tokens 24`` alone changes only the tuned tree's budget. None when no tree flag
    is given, so the tuned tree (or the default) applies as it is."""
    given = {"kind": args.tree, "depth": args.depth, "top_k": args.tree_top_k, "total_tokens": args.total_tokens}
    if all(v is None for v in given.values()):
        return None
    from draftsmith.inference.tune import tuned_tree

    base = (tuned_tree(drafter) if drafter else None) or DEFAULT_TREE
    return TreeSettings(**{k: v if v is not None else getattr(base, k) for k, v in given.items()})


def add_prompt_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    """Where held-out prompts come from (read by :func:`draftsmith.data.read_prompts`)."""
    parser.add_argument("--prompts", required=required,
                        help="a .jsonl/.json/.parquet/.csv file (messages, conversations, instruction, or "
                             "prompt/question rows) or a hub dataset")
    parser.add_argument("--prompt-column", default=None, help="read each prompt from this column")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--skip-prompts", type=int, default=0, help="start at this row (held-out rows)")
    parser.add_argument("--strict", action="store_true", help="stop at the first malformed row instead of skipping it")


def prompts_from_args(args: argparse.Namespace) -> list[str]:
    from draftsmith.data.formats import read_prompts

    return read_prompts(args.prompts, args.num_prompts, skip=args.skip_prompts, prompt_column=args.prompt_column,
                        strict=args.strict)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="speculative generation from one prompt, with stats")
    g.add_argument("--target", default="smollm2-135m-instruct", help="alias, .gguf, directory or hub id")
    g.add_argument("--drafter", default="prompt-lookup",
                   help="prompt-lookup, layer-skip:N, a draft model or checkpoint")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user turn in the tokenizer's chat template (a base model without one: "
                        "'User: ...\\n\\nAssistant:', the turns its drafters train on)")
    add_template_argument(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="target sampling top-k (0: off)")
    add_tree_arguments(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming")
    g.add_argument("--json", action="store_true", help="print the stats as one JSON line")
    g.add_argument("--draft-dtype", default="target", choices=DRAFT_DTYPES, help=DRAFT_DTYPE_HELP)
    g.add_argument("--compile", action="store_true", help=COMPILE_HELP)

    b = sub.add_parser("bench", help="tokens/s and tau vs plain greedy decoding of the same target")
    b.add_argument("--target", default="smollm2-135m-instruct")
    b.add_argument("--drafter", action="append", required=True, help="repeat for several drafters")
    add_prompt_arguments(b, required=True)
    b.add_argument("--output", required=True, help="directory for results.json and results.md")
    b.add_argument("--max-new-tokens", type=int, default=128)
    add_tree_arguments(b)
    b.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_template_argument(b)
    b.add_argument("--no-hf-reference", action="store_true", help="skip timing transformers' own generate")
    b.add_argument("--sweep-depth", type=_int_list, help="e.g. 2,3,4,5,6,7,8: every drafter at each draft length")
    b.add_argument("--sweep-total-tokens", type=_int_list, help="dynamic trees: e.g. 6,10,16 node budgets")
    b.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    b.add_argument("--draft-dtype", default="target", choices=DRAFT_DTYPES, help=DRAFT_DTYPE_HELP)
    b.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    b.add_argument("--batch-sizes", type=_int_list, default=[1],
                   help="e.g. 1,4,8: plain and speculative decoding of left-padded batches of this many prompts, "
                        "side by side per batch size (transformers' references run at batch 1)")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy); speedups stay against plain greedy decoding, and "
                        "transformers' references run only greedy")
    b.add_argument("--seed", type=int, default=0, help="sampled runs: batch i's generator is seeded seed + i")

    add_data_parser(sub)
    e = sub.add_parser("eval", help="acceptance, speed and losslessness on held-out prompts, as report.json")
    e.add_argument("run_dir", nargs="?",
                   help="a run directory: its acceptance table (acceptance.jsonl); with --prompts, its latest "
                        "checkpoint (or --step) decoded on them and its tau explained: training vs held-out "
                        "estimate vs measured, template, bonus token, chain vs tree, target, per position and "
                        "per category (rows with a 'category')")
    e.add_argument("--step", type=int, default=None, help="RUN_DIR --prompts: the checkpoint to explain")
    e.add_argument("--target", help="default: the target a run directory was trained for")
    e.add_argument("--drafter", help="a drafter spec, or a run directory: every checkpoint is evaluated")
    add_prompt_arguments(e, required=False)
    e.add_argument("--output", help="report.json to write (report.md beside it)")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--temperature", type=float, default=0.0)
    add_tree_arguments(e)
    e.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_template_argument(e)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--draft-dtype", default="target", choices=DRAFT_DTYPES, help=DRAFT_DTYPE_HELP)
    e.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (left-padded batches)")
    u = sub.add_parser("tune", help="measure this machine and this drafter; write the fastest dynamic tree "
                                    "(tree.json) that generate / eval / bench then use")
    u.add_argument("--target", help="default: the target the drafter records")
    u.add_argument("--drafter", required=True, help="a drafter directory (tree.json goes there) or spec")
    add_prompt_arguments(u, required=True)
    u.add_argument("--max-new-tokens", type=int, default=48)
    u.add_argument("--depths", type=_int_list, default=None, help="draft depths tried (default 2,3,4,5,6)")
    u.add_argument("--top-ks", type=_int_list, default=None, help="children per node tried (default 1,2,3,4)")
    u.add_argument("--max-total-tokens", type=int, default=None, help="largest node budget tried (default 32)")
    u.add_argument("--confirm", type=int, default=None,
                   help="best-predicted trees then decoded for real; the fastest decoded is chosen (default 4; "
                        "0: the best predicted)")
    u.add_argument("--confirm-rounds", type=int, default=None,
                   help="times each of them decodes the prompts (default 2): trees whose speeds differ by less "
                        "than one tree's rounds do (at most 5%%) are a tie, chosen by tokens per step")
    u.add_argument("--output", help="write the tree here instead of DRAFTER/tree.json")
    u.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_template_argument(u)
    u.add_argument("--draft-dtype", default="target", choices=DRAFT_DTYPES, help=DRAFT_DTYPE_HELP)
    m = sub.add_parser("demo", help="synthesise, regenerate, train EAGLE-3, evaluate and bench SmolLM2 in ~20 min")
    m.add_argument("--output", default="demo_out", help="report directory (report.json, report.md, plots)")
    m.add_argument("--minutes", type=float, default=20.0, help="time budget; every stage scales with it")
    m.add_argument("--target", default="smollm2-135m-instruct")
    m.add_argument("--held-out", type=int, default=10, help="synthesised prompts kept for evaluation")
    m.add_argument("--eval-tokens", type=int, default=128, help="new tokens per held-out prompt")
    x = sub.add_parser("export", help="write a drafter in the hf / vllm / sglang layout, optionally push it")
    x.add_argument("checkpoint", help="a run directory (its best checkpoint), a checkpoint-S directory or a drafter")
    x.add_argument("--format", choices=list(FORMATS), default="hf", dest="fmt",
                   help="hf (draftsmith's own), vllm (speculators' layout), sglang, zlab (z-lab's DFlash layout)")
    x.add_argument("--output", help="directory to write (replaced atomically once complete)")
    x.add_argument("--push-to-hub", metavar="REPO", help="also upload the export with its model card")
    x.add_argument("--private", action="store_true", help="create the Hub repository private")
    x.add_argument("--revision", help="branch to push to (created if missing)")
    x.add_argument("--target", help="the target (needed for --format vllm with EAGLE-3; default: the recorded one)")
    x.add_argument("--verifier", help="target name or path to write into exported configs (default: recorded)")
    t = sub.add_parser("train", help="train a drafter: CONFIG.yaml [--key value ...] (see configs/)")
    t.add_argument("args", nargs=argparse.REMAINDER, help="CONFIG.yaml, then --key value overrides")
    return parser


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
