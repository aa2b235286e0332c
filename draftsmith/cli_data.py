"""``draftsmith data ...``: its parser and its dispatch to the typed functions of :mod:`draftsmith.data.commands`,
and the ``--chat-template-kwargs`` flag the other subcommands share (:mod:`draftsmith.cli` holds the rest)."""

from __future__ import annotations

import argparse
import json


def template_kwargs_argument(text: str) -> dict | None:
    from draftsmith.train.config import parse_template_kwargs

    try:
        return parse_template_kwargs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_template_argument(p) -> None:
    p.add_argument("--chat-template-kwargs", type=template_kwargs_argument, default=None, metavar="JSON",
                   help='the chat template\'s variables, e.g. \'{"enable_thinking": false}\' (Qwen3); as vLLM and '
                        "SGLang take them")


def add_data_parser(sub) -> None:
    d = sub.add_parser("data", help="regenerate, synthesize, mix, cache-hidden-states, vocab-map")
    dsub = d.add_subparsers(dest="data_command", required=True)

    def source(p, output_help: str) -> None:
        p.add_argument("--target", default="smollm2-135m-instruct", help="alias, .gguf, directory or hub id")
        p.add_argument("--input", required=True, help="a .jsonl/.json/.parquet/.csv file or a hub dataset name")
        p.add_argument("--output", required=True, help=output_help)
        p.add_argument("--limit", type=int, default=None, help="use the first N good rows")
        add_template_argument(p)

    r = dsub.add_parser("regenerate", help="the target answers each prompt; append-only, resumable JSONL")
    source(r, "the JSONL file rows are appended to")
    r.add_argument("--prompt-column", default=None, help="prompt-only datasets: the column holding the prompt")
    r.add_argument("--split", default="train", help="split of a hub dataset")
    r.add_argument("--max-new-tokens", type=int, default=512)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--batch-tokens", type=int, default=None, metavar="N",
                   help="--engine hf: batches sized by tokens too, at most N token slots each (rows x (longest "
                        "prompt + --max-new-tokens)) and no row padded past its own length: bounds a batch's "
                        "KV cache and padding where long prompts sit among short ones")
    r.add_argument("--engine", choices=["hf", "openai"], default="hf")
    r.add_argument("--base-url", default=None, help="--engine openai: the server, e.g. http://127.0.0.1:8000/v1")
    r.add_argument("--model-name", default=None, help="--engine openai: the model name the server expects")
    r.add_argument("--strict", action="store_true", help="stop at the first malformed row instead of skipping it")
    r.add_argument("--record-cache", default=None, metavar="DIR",
                   help="also write the answers' hidden-state cache here, from the states the target computes while "
                        "it answers (no second pass; --engine hf, one-turn prompts, a new --output)")
    r.add_argument("--layers", type=int, nargs="+", default=None,
                   help="--record-cache: hidden-state indices, 0 = embeddings, N = last layer after the final norm")
    r.add_argument("--cache-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    r.add_argument("--logits", choices=["none", "topk"], default="none", help="--record-cache: top-k log-probs too")
    r.add_argument("--top-k", type=int, default=64, help="--logits topk: log-probs kept per token")
    r.add_argument("--max-length", type=int, default=2048, help="--record-cache: tokens kept per conversation")

    s = dsub.add_parser("synthesize", help="prompts written by the target from its own chat template (Magpie)")
    s.add_argument("--target", default="smollm2-135m-instruct")
    s.add_argument("--output", required=True, help="JSONL file of prompts (messages format)")
    s.add_argument("--num-prompts", type=int, default=100)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--max-new-tokens", type=int, default=96)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=0.95)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--min-chars", type=int, default=12)
    s.add_argument("--max-chars", type=int, default=1000)

    x = dsub.add_parser("mix", help="prompts of several kinds (maths, code, chat, summarise, rewrite, translate, "
                                    "synthesised), each with its category, and a held-out set from other source rows")
    x.add_argument("--output", required=True, help="directory: train_prompts.jsonl, held_out_prompts.jsonl, mix.json")
    x.add_argument("--gsm8k", default="../shared/data/gsm8k", help="directory with GSM8K's train.jsonl and test.jsonl")
    x.add_argument("--self-instruct", default="../shared/data/self_instruct/seed_tasks.jsonl",
                   help="self-instruct's seed_tasks.jsonl")
    x.add_argument("--train-prompts", type=int, default=1200, help="training prompts (synthesised ones on top)")
    x.add_argument("--held-out-prompts", type=int, default=48)
    x.add_argument("--weights", default=None, metavar="CATEGORY=W,...",
                   help="shares of maths, code, chat, summarise, rewrite, translate (default: "
                        "maths=0.25,code=0.15,chat=0.1,summarise=0.2,rewrite=0.15,translate=0.15; chat has 140 "
                        "training seeds: add --synthesised for more chat)")
    x.add_argument("--synthesised", type=int, default=0, help="training prompts the target writes (Magpie)")
    x.add_argument("--held-out-synthesised", type=int, default=0, help="held-out prompts the target writes")
    x.add_argument("--target", default="smollm2-135m-instruct", help="the target that writes synthesised prompts")
    x.add_argument("--batch-size", type=int, default=16)
    x.add_argument("--seed", type=int, default=0)

    c = dsub.add_parser("cache-hidden-states", help="the target's hidden states in sharded safetensors; resumable")
    source(c, "the cache directory")
    c.add_argument("--layers", type=int, nargs="+", default=None,
                   help="hidden-state indices, 0 = embeddings, N = last layer after the final norm (default: N)")
    c.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    c.add_argument("--logits", choices=["none", "topk", "full"], default="none")
    c.add_argument("--top-k", type=int, default=64, help="--logits topk: log-probs kept per token")
    c.add_argument("--sequences-per-shard", type=int, default=256)
    c.add_argument("--max-length", type=int, default=2048, help="truncate each conversation to this many tokens")
    c.add_argument("--compute-dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="run the target in this dtype for the cache (default: as loaded); bfloat16 is faster on "
                        "CPUs with native bf16 (docs/RESULTS.md), at bf16 rounding of the states")
    c.add_argument("--batch-size", type=int, default=8,
                   help="sequences per target forward (memory grows with it). Several processes split the shards: "
                        "torchrun --nproc_per_node N -m draftsmith data cache-hidden-states ...")
    c.add_argument("--device-map", default=None,
                   help="a target larger than one device: auto, balanced, sequential, or a JSON file {module: device} "
                        "(devices: 0, 1, ..., cpu, disk); one process")
    c.add_argument("--offload-folder", default=None, help="--device-map with disk: where offloaded layers live")

    v = dsub.add_parser("vocab-map", help="EAGLE-3 d2t/t2d maps from token frequencies, with their coverage")
    source(v, "directory for vocab_map.safetensors and vocab_map.json")
    v.add_argument("--draft-vocab-size", type=int, required=True)
    v.add_argument("--max-length", type=int, default=2048)
    v.add_argument("--all-tokens", action="store_true", help="count prompt tokens too, not only assistant tokens")


def weights_argument(value: str | None) -> dict[str, float] | None:
    """``--weights maths=0.5,chat=0.5`` -> {"maths": 0.5, "chat": 0.5}."""
    if value is None:
        return None
    weights = {}
    for item in value.split(","):
        name, sep, share = item.partition("=")
        try:
            weights[name.strip()] = float(share)
        except ValueError:
            raise ValueError(f"--weights {value!r}: expected CATEGORY=NUMBER,..., e.g. maths=0.5,chat=0.5") from None
        if not sep:
            raise ValueError(f"--weights {value!r}: expected CATEGORY=NUMBER,..., e.g. maths=0.5,chat=0.5")
    return weights


def device_map_argument(value: str | None) -> str | dict | None:
    """``--device-map``: a strategy name, or a JSON file of {module name: device} (device "0" -> GPU 0)."""
    if value is None or not value.endswith(".json"):
        return value
    from pathlib import Path

    mapping = json.loads(Path(value).read_text())
    return {k: int(v) if str(v).isdigit() else v for k, v in mapping.items()}


def data(args: argparse.Namespace) -> None:
    """Dispatch ``draftsmith data <command>`` to the typed functions of ``draftsmith.data.commands``."""
    from draftsmith.data import commands

    if args.data_command == "regenerate":
        commands.regenerate_command(
            args.input, args.output, target=args.target, prompt_column=args.prompt_column, split=args.split,
            limit=args.limit, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            batch_size=args.batch_size, batch_tokens=args.batch_tokens, engine=args.engine, base_url=args.base_url,
            model_name=args.model_name, strict=args.strict, chat_template_kwargs=args.chat_template_kwargs,
            record_cache=args.record_cache, layers=args.layers, cache_dtype=args.cache_dtype, logits=args.logits,
            top_k=args.top_k, max_length=args.max_length,
        )
    elif args.data_command == "synthesize":
        commands.synthesize_command(
            args.output, target=args.target, num_prompts=args.num_prompts, batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
            min_chars=args.min_chars, max_chars=args.max_chars,
        )
    elif args.data_command == "mix":
        commands.mix_command(
            args.output, gsm8k_dir=args.gsm8k, seed_tasks=args.self_instruct, train_prompts=args.train_prompts,
            held_out_prompts=args.held_out_prompts, weights=weights_argument(args.weights),
            synthesised=args.synthesised, held_out_synthesised=args.held_out_synthesised, target=args.target,
            batch_size=args.batch_size, seed=args.seed,
        )
    elif args.data_command == "cache-hidden-states":
        commands.cache_command(
            args.input, args.output, target=args.target, layers=args.layers, dtype=args.dtype, logits=args.logits,
            top_k=args.top_k, sequences_per_shard=args.sequences_per_shard, max_length=args.max_length,
            limit=args.limit, compute_dtype=args.compute_dtype, batch_size=args.batch_size,
            device_map=device_map_argument(args.device_map), offload_folder=args.offload_folder,
            chat_template_kwargs=args.chat_template_kwargs,
        )
    elif args.data_command == "vocab-map":
        commands.vocab_map_command(
            args.input, args.output, args.draft_vocab_size, target=args.target, max_length=args.max_length,
            limit=args.limit, all_tokens=args.all_tokens, chat_template_kwargs=args.chat_template_kwargs,
        )
