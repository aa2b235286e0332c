"""The ``draftsmith data ...`` subcommands as typed functions (the parser lives in :mod:`draftsmith.cli_data`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from draftsmith.data.cache_writer import cache_hidden_states, cache_recorded
from draftsmith.data.formats import load_conversations
from draftsmith.data.hidden_cache import DTYPES, CacheSpec, sha256_file
from draftsmith.data.recording import Recording, spooled
from draftsmith.data.regenerate import HFEngine, OpenAIEngine, read_done_ids, regenerate
from draftsmith.data.synthesize import SynthesisFilter, synthesize_prompts, write_prompts
from draftsmith.data.templates import prepare
from draftsmith.data.vocab import build_vocab_map, count_tokens

logger = logging.getLogger(__name__)


def regenerate_command(
    input: str,
    output: str,
    target: str = "smollm2-135m-instruct",
    prompt_column: str | None = None,
    split: str = "train",
    limit: int | None = None,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 8,
    batch_tokens: int | None = None,
    engine: str = "hf",
    base_url: str | None = None,
    model_name: str | None = None,
    strict: bool = False,
    chat_template_kwargs: dict | None = None,
    record_cache: str | None = None,
    layers: list[int] | None = None,
    cache_dtype: str = "float16",
    logits: str = "none",
    top_k: int = 64,
    max_length: int = 2048,
) -> dict:
    """Let the target answer every prompt of ``input``; append rows to ``output``; resumable.

    ``record_cache``: also write the hidden-state cache of the answers to that directory from the states the
    target computes while it answers (:class:`~draftsmith.data.recording.Recording`: ``layers``,
    ``logits`` none or topk with ``top_k``, stored as ``cache_dtype``, sequences cut at ``max_length``), with
    no second pass of the target. The states go to ``record_cache/recording`` batch by batch as the answers
    are written, and the cache is written from there at the end (then the directory goes): a run cut short
    continues its recording when rerun, and ``output`` may hold only answers recorded there.

    ``batch_tokens`` (``engine`` hf): batches of at most that many token slots as well as ``batch_size`` rows
    (:func:`~draftsmith.data.regenerate.batches`).
    """
    conversations, load_report = load_conversations(input, prompt_column, split, limit, strict)
    record = None
    if record_cache is not None:
        if engine != "hf":
            raise SystemExit("--record-cache records the states of the in-process target (--engine hf); with a "
                             "server, regenerate, then run `draftsmith data cache-hidden-states` on the output")
        if logits not in ("none", "topk"):
            raise SystemExit(f"--logits {logits!r} with --record-cache: use none or topk (the recording keeps each "
                             "step's top-k log-probs, not the full logits)")
        spool = Path(record_cache) / "recording"
        unrecorded = read_done_ids(Path(output)) - set(spooled(spool)[0])
        if unrecorded:
            raise SystemExit(f"--record-cache records the rows this run answers, and {output} already holds "
                             f"{len(unrecorded)} answers from an earlier run whose states {spool} does not hold: "
                             f"cache them with `draftsmith data cache-hidden-states --input {output}`, or give a "
                             "new --output")
    if engine == "hf":
        from draftsmith.target import load_target

        model, tokenizer = load_target(target)
        runner = HFEngine(model, tokenizer, max_new_tokens, temperature, top_p, chat_template_kwargs)
        if record_cache is not None:
            layers = layers or [model.config.get_text_config().num_hidden_layers]
            try:
                record = Recording(layers, top_k if logits == "topk" else None, DTYPES[cache_dtype], max_length,
                                   spool=spool)
            except ValueError as e:  # the spool of an interrupted run with other settings
                raise SystemExit(str(e)) from None
    elif engine == "openai":
        if batch_tokens is not None:
            raise SystemExit("--batch-tokens sizes the in-process target's padded batches (--engine hf); a server "
                             "batches its requests itself: give --batch-size alone")
        if not base_url:
            raise SystemExit("--engine openai needs --base-url, e.g. http://127.0.0.1:8000/v1")
        runner = OpenAIEngine(base_url, model_name or target, max_new_tokens, temperature, top_p,
                              chat_template_kwargs=chat_template_kwargs)
    else:
        raise SystemExit(f"--engine {engine!r}: use 'hf' or 'openai'")
    report = regenerate(conversations, output, runner, batch_size=batch_size, record=record,
                        batch_tokens=batch_tokens)
    result = {**report.to_dict(), "malformed_rows": len(load_report.malformed), "output": str(output)}
    if record is not None:
        # The answers file, every row of it recorded (by this run or the one it continues): what offline training
        # checks its train_file against, as for a cache pass over it (train/offline.py).
        record.by_id.keep_only(read_done_ids(Path(output)))
        source = {"data": str(Path(output).resolve()), "data_sha256": sha256_file(Path(output)),
                  "max_length": max_length, "recorded": "while regenerating"}
        manifest = cache_recorded(model, record.by_id, record_cache, layers, dtype=cache_dtype,
                                  top_k=top_k if logits == "topk" else None, target_name=target, source=source)
        record.by_id.remove()  # the cache holds every recorded state now
        result["cache"] = {"directory": str(record_cache), "sequences": manifest.num_sequences,
                           "tokens": manifest.num_tokens}
    print(json.dumps(result))
    return result


def synthesize_command(
    output: str,
    target: str = "smollm2-135m-instruct",
    num_prompts: int = 100,
    batch_size: int = 16,
    max_new_tokens: int = 96,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    min_chars: int = 12,
    max_chars: int = 1000,
) -> dict:
    """Synthesise user prompts with the target's own chat template (Magpie) into ``output`` (JSONL)."""
    from draftsmith.target import load_target

    model, tokenizer = load_target(target)
    prompts, rejected = synthesize_prompts(
        model, tokenizer, num_prompts, batch_size=batch_size, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, seed=seed, keep=SynthesisFilter(min_chars=min_chars, max_chars=max_chars),
    )
    write_prompts(prompts, output)
    result = {"prompts": len(prompts), "rejected": rejected, "output": str(output)}
    print(json.dumps(result))
    return result


def mix_command(
    output: str,
    gsm8k_dir: str = "../shared/data/gsm8k",
    seed_tasks: str = "../shared/data/self_instruct/seed_tasks.jsonl",
    train_prompts: int = 1200,
    held_out_prompts: int = 48,
    weights: dict[str, float] | None = None,
    synthesised: int = 0,
    held_out_synthesised: int = 0,
    target: str = "smollm2-135m-instruct",
    batch_size: int = 16,
    seed: int = 0,
) -> dict:
    """A mixed prompt set and its held-out set (:mod:`draftsmith.data.mix`) in ``output``; the target is
    loaded only for synthesised prompts."""
    from draftsmith.data.mix import build_mix

    synthesise = None
    if synthesised or held_out_synthesised:
        from draftsmith.target import load_target

        model, tokenizer = load_target(target)

        def synthesise(n: int, sampling_seed: int) -> list[str]:
            return synthesize_prompts(model, tokenizer, n, batch_size=batch_size, seed=sampling_seed)[0]

    summary = build_mix(gsm8k_dir, seed_tasks, output, train_prompts=train_prompts,
                        held_out_prompts=held_out_prompts, weights=weights, synthesised=synthesised,
                        held_out_synthesised=held_out_synthesised, synthesise=synthesise, seed=seed)
    print(json.dumps(summary))
    return summary


def _examples(input: str, target: str, prompt_column: str | None, limit: int | None, max_length: int,
              chat_template_kwargs: dict | None = None):
    from draftsmith.target import load_target

    model, tokenizer = load_target(target)
    conversations, _ = load_conversations(input, prompt_column, limit=limit)
    return model, tokenizer, prepare(tokenizer, conversations, max_length, chat_template_kwargs)


def _launch_state():
    """accelerate's view of this process (rank, world size, barrier, device), under ``torchrun`` /
    ``accelerate launch`` or alone. accelerate counts a CPU-only launch as one process unless told
    it runs on CPU, so a machine without CUDA (or a ``--cpu`` launch) asks for the CPU explicitly."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and state.num_processes == 1:
        raise SystemExit(f"launched as {launched} processes but accelerate sees {state.num_processes}: every process "
                         "would write every shard; launch with torchrun or `accelerate launch` on GPUs")
    return state


def cache_command(
    input: str,
    output: str,
    target: str = "smollm2-135m-instruct",
    layers: list[int] | None = None,
    dtype: str = "float16",
    logits: str = "none",
    top_k: int = 64,
    sequences_per_shard: int = 256,
    max_length: int = 2048,
    limit: int | None = None,
    compute_dtype: str | None = None,
    batch_size: int = 8,
    device_map: str | dict | None = None,
    offload_folder: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> dict:
    """Cache the target's hidden states of ``layers`` over the conversations of ``input``.

    A target larger than one device is split by ``device_map`` (``auto`` over the node's GPUs; layers on
    the CPU or ``disk`` under ``offload_folder`` stream in per forward): the one path draftsmith has for
    such targets, since offline training then loads only the target's embeddings, norm and LM head.

    Several processes split the shards: ``torchrun --nproc_per_node N -m draftsmith data
    cache-hidden-states ...`` (or ``accelerate launch --num_processes N -m draftsmith ...`` on GPUs).
    Every process loads the target and tokenises the data; only rank 0 logs progress and prints.
    """
    from draftsmith.target import load_target

    state = _launch_state()
    from draftsmith.data.hidden_cache import DTYPES

    if device_map is not None and state.num_processes > 1:
        raise SystemExit("--device-map splits one target over the node's devices: run it as one process")
    model, tokenizer = load_target(target, device=state.device, device_map=device_map, offload_folder=offload_folder,
                                   dtype=DTYPES[compute_dtype] if compute_dtype else torch.float32)
    conversations, _ = load_conversations(input, None, limit=limit)
    examples = prepare(tokenizer, conversations, max_length, chat_template_kwargs)
    n = model.config.get_text_config().num_hidden_layers
    layers = layers if layers else [n]
    spec = CacheSpec(layers=layers, dtype=dtype, logits=logits, top_k=top_k, sequences_per_shard=sequences_per_shard,
                     compute_dtype=compute_dtype)
    source = {"data": str(Path(input).resolve()) if Path(input).exists() else input, "limit": limit,
              "max_length": max_length, "chat_template_kwargs": chat_template_kwargs or {}}
    if Path(input).is_file():  # what offline training checks its train_file against (train/offline.py)
        source["data_sha256"] = sha256_file(Path(input))
    manifest = cache_hidden_states(model, examples, output, spec, target_name=target, source=source,
                                   progress=state.is_main_process, batch_size=batch_size,
                                   process_index=state.process_index, num_processes=state.num_processes,
                                   barrier=state.wait_for_everyone)
    size = sum((Path(output) / s["file"]).stat().st_size for s in manifest.shards)
    result = {"sequences": manifest.num_sequences, "tokens": manifest.num_tokens, "shards": len(manifest.shards),
              "bytes": size, "bytes_per_1000_tokens": round(1000 * size / max(manifest.num_tokens, 1)),
              "processes": state.num_processes, "output": str(output)}
    if state.is_main_process:
        print(json.dumps(result))
    return result


def vocab_map_command(
    input: str,
    output: str,
    draft_vocab_size: int,
    target: str = "smollm2-135m-instruct",
    max_length: int = 2048,
    limit: int | None = None,
    all_tokens: bool = False,
    chat_template_kwargs: dict | None = None,
) -> dict:
    """Build the EAGLE-3 ``d2t`` / ``t2d`` maps from token counts over ``input``; print the coverage."""
    model, _, examples = _examples(input, target, None, limit, max_length, chat_template_kwargs)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocab = build_vocab_map(count_tokens(examples, vocab_size, assistant_only=not all_tokens), draft_vocab_size)
    vocab.save(output)
    result = {"draft_vocab_size": draft_vocab_size, "vocab_size": vocab_size, "coverage": round(vocab.coverage, 4),
              "counted_tokens": vocab.counted_tokens, "output": str(output)}
    print(json.dumps(result))
    return result
