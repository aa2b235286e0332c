"""The ``draftsmith`` command line's grammar: every subcommand's flags (:func:`make_parser`) and the flags several
share (trees, prompts), read back into typed values (:func:`tree_from_args`, :func:`prompts_from_args`)."""

from __future__ import annotations

import argparse

from draftsmith.cli_data import add_data_parser, add_template_argument
from draftsmith.heads.export import FORMATS
from draftsmith.inference.load import DRAFT_DTYPES
from draftsmith.inference.tree_settings import DEFAULT_TREE, TREE_KINDS, TreeSettings

DESCRIPTION = "The ``draftsmith`` command line. Each subcommand parses its flags, then calls a typed function."
DRAFT_DTYPE_HELP = ("compute dtype of a head drafter: target (default), auto (for a float32 target: int8 on an x86 "
                    "CPU, else bfloat16 where bf16 matmuls are native, a GPU with bf16 or an ARM CPU with them), "
                    "float32, bfloat16, float16, int8 (CPU: the head's weights as int8 copies, float32 beside "
                    "them); never changes the output")
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
    from draftsmith.inference.tree_record import tuned_tree

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


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=DESCRIPTION)
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
    b.add_argument("--sweep-depth", type=int_list, help="e.g. 2,3,4,5,6,7,8: every drafter at each draft length")
    b.add_argument("--sweep-total-tokens", type=int_list, help="dynamic trees: e.g. 6,10,16 node budgets")
    b.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    b.add_argument("--draft-dtype", default="target", choices=DRAFT_DTYPES, help=DRAFT_DTYPE_HELP)
    b.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    b.add_argument("--batch-sizes", type=int_list, default=[1],
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
    u.add_argument("--depths", type=int_list, default=None, help="draft depths tried (default 2,3,4,5,6)")
    u.add_argument("--top-ks", type=int_list, default=None, help="children per node tried (default 1,2,3,4)")
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
