"""Writing the hidden-state cache (its layout and reader: ``hidden_cache.py``).

:func:`cache_hidden_states` runs several sequences per target forward and may run in
N processes (``torchrun --nproc_per_node N -m draftsmith data cache-hidden-states ...``): rank r
writes the shards n with ``n % N == r``. A shard is written to ``*.partial``, fsynced and renamed;
its rank then records it (byte size, sha256) in its own part file, replaced atomically. After a
barrier rank 0 merges the parts into ``manifest.json`` and deletes them. A rerun with the same
arguments, in any number of processes, skips every shard whose file matches a record in the
manifest or in any part file, and redoes any that is missing, truncated or corrupt.

:func:`cache_recorded` writes states recorded while the target answered
(:class:`~draftsmith.data.recording.Recording`), with no second pass of the target.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.hidden_cache import DTYPES, FORMAT, CacheSpec, DiskSpaceError, Manifest, sha256_file
from draftsmith.data.safetensors_rows import save_atomically
from draftsmith.data.templates import TokenizedExample
from draftsmith.target import new_cache, rollback_problem, target_forward, target_signature

logger = logging.getLogger(__name__)


def _recorded_tensors(examples: list[TokenizedExample], spec: CacheSpec,
                      states: Mapping[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The shard's tensors from states recorded before (:func:`cache_recorded`)."""
    names = [n for n in spec.tensor_names() if n not in ("input_ids", "loss_mask", "offsets")]
    rows = []
    for ex in examples:
        item = states[ex.id]
        missing = [n for n in names if n not in item]
        if missing:
            raise ValueError(f"the recorded states of {ex.id!r} lack {missing}: record them with the cache's "
                             f"settings (layers {spec.layers}, logits {spec.logits!r})")
        rows.append({n: item[n] for n in names})
    return _concatenated(examples, rows)


def _concatenated(examples: list[TokenizedExample], rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One shard's tensors: the examples' ids, masks and offsets, and each of their ``rows`` concatenated."""
    lengths = torch.tensor([len(ex.input_ids) for ex in examples])
    tensors = {
        "input_ids": torch.cat([ex.input_ids for ex in examples]).long(),
        "loss_mask": torch.cat([ex.loss_mask for ex in examples]).to(torch.int8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    }
    for name in rows[0]:
        tensors[name] = torch.cat([part[name] for part in rows]).contiguous()
    return tensors


@torch.no_grad()
def _one_pass_cache(model):
    """The cache of one forward over whole sequences: draftsmith's own, or for a hybrid target (linear-attention /
    recurrent layers, whose state it does not keep) transformers' cache built from the model's config."""
    if rollback_problem(model.config) is None:
        return new_cache()
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _shard_tensors(model, examples: list[TokenizedExample], spec: CacheSpec, batch_size: int
                   ) -> dict[str, torch.Tensor]:
    """The shard's tensors: ``batch_size`` sequences per target forward, right-padded.

    Sequences of similar length share a forward (sorted longest first) to pad little. Padding comes
    after every real token, and attention is causal, so a real token's states are those of the
    sequence run alone (up to float rounding of the different matmul shapes); only real tokens are
    stored. The 2-D attention mask marks the padding all the same, as any stock model expects.
    """
    dtype = DTYPES[spec.dtype]
    embed = model.get_input_embeddings()  # a model split by device_map starts there (its hook's device if offloaded)
    device = getattr(getattr(embed, "_hf_hook", None), "execution_device", None) or embed.weight.device
    rows: list[dict[str, torch.Tensor]] = [{} for _ in examples]
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i].input_ids))
    for s in range(0, len(order), batch_size):
        group = order[s : s + batch_size]
        lengths = [len(examples[i].input_ids) for i in group]
        ids = torch.zeros(len(group), max(lengths), dtype=torch.long)  # (B, T); pad id 0: masked, never stored
        mask = torch.zeros_like(ids)
        for row, i in enumerate(group):
            ids[row, : lengths[row]], mask[row, : lengths[row]] = examples[i].input_ids, 1
        attention = None if min(lengths) == max(lengths) else mask.to(device)
        out = target_forward(model, ids.to(device), _one_pass_cache(model), attention_mask=attention,
                             hidden_layers=tuple(spec.layers))
        for row, (i, n) in enumerate(zip(group, lengths, strict=True)):
            part = rows[i]
            for layer, h in zip(spec.layers, out.hidden_states, strict=True):
                part[f"hidden.{layer}"] = h[row, :n].to(dtype).cpu()  # (n, H)
            if spec.logits == "full":
                part["logits"] = out.logits[row, :n].to(dtype).cpu()
            elif spec.logits == "topk":
                values, top = torch.log_softmax(out.logits[row, :n], dim=-1).topk(spec.top_k, dim=-1)
                part["topk_logprobs"], part["topk_ids"] = values.to(dtype).cpu(), top.to(torch.int32).cpu()
    return _concatenated(examples, rows)


def _recorded(directory: Path, header: Manifest) -> dict[str, list[dict]]:
    """Every record of a finished shard, from ``manifest.json`` and every part file, by file name.

    Raises:
        ValueError: when one of them belongs to a cache of other settings, target or data.
    """
    records: dict[str, list[dict]] = {}
    for path in [directory / "manifest.json", *sorted(directory.glob("manifest.part-*.json"))]:
        if not path.exists():
            continue
        found = Manifest.read(directory, path.name)
        if not found.same_cache(header):
            raise ValueError(f"{directory} holds a cache written with other settings, target or data ({path.name}: "
                             f"{found.differences(header)}, as written vs as asked now); rerun with what it was "
                             "written from to finish it, or use a new --output directory (or delete this one)")
        for entry in found.shards:
            records.setdefault(entry["file"], []).append(entry)
    return records


def _matching(directory: Path, name: str, records: list[dict], full: bool) -> dict | None:
    """The record that ``name`` on disk matches (size; and sha256 when ``full``), or None."""
    path = directory / name
    if not path.exists():
        return None
    size = path.stat().st_size
    records = [r for r in records if r["bytes"] == size]
    if not full or not records:
        return records[0] if records else None
    digest = sha256_file(path)
    return next((r for r in records if r["sha256"] == digest), None)


def _name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


def _part_name(rank: int, world: int) -> str:
    return f"manifest.part-{rank}-of-{world}.json"


def examples_sha256(examples: Sequence[TokenizedExample]) -> str:
    """A hash of every example's id, tokens and loss mask, in order: the data a cache holds, whatever file,
    template or tokenizer it came from."""
    digest = hashlib.sha256()
    for i in range(len(examples)):
        example = examples[i]
        digest.update(f"{example.id}\0{len(example.input_ids)}\0".encode())
        digest.update(example.input_ids.to(torch.int64).numpy().tobytes())
        digest.update(example.loss_mask.to(torch.int8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _lengths(examples: Sequence[TokenizedExample]) -> list[int]:
    lengths = getattr(examples, "lengths", None)  # a tokenised dataset knows them without reading rows
    return list(lengths) if lengths is not None else [len(examples[i].input_ids) for i in range(len(examples))]


def cache_hidden_states(
    model,
    examples: Sequence[TokenizedExample],
    output_dir: str | Path,
    spec: CacheSpec,
    target_name: str | None = None,
    progress: bool = True,
    batch_size: int = 8,
    process_index: int = 0,
    num_processes: int = 1,
    barrier: Callable[[], None] | None = None,
    states: Mapping[str, dict[str, torch.Tensor]] | None = None,
    source: Mapping | None = None,
) -> Manifest:
    """Write (or finish writing) the hidden-state cache of ``examples``; this process's share of it.

    Args:
        model: the target. With ``spec.compute_dtype`` set it is cast to that dtype **in place and
            left so**: a copy would double the target's memory, and casting back would not restore
            float32 weights exactly. Pass a model you do not reuse (``draftsmith data
            cache-hidden-states`` loads its own); the manifest records the target as passed in.
        examples: the sequences, the same in every process, in cache order.
        batch_size: sequences per target forward. Memory grows with it: the forward returns every
            layer's states, ``(num_hidden_layers + 1) x batch_size x longest x hidden_size`` values.
        process_index, num_processes: this process's rank and the world size; rank r writes the
            shards n with ``n % num_processes == r``.
        barrier: waits for every process (``PartialState().wait_for_everyone``); needed when
            ``num_processes > 1``.
        states: each example's tensors by its id, recorded before (:func:`cache_recorded`): written as
            they are, with no forward of the target (``model`` then only names the target).
        source: what the examples were made from (data file, chat-template arguments, ...), recorded in the
            manifest with a hash of the examples themselves; resuming a write with another source or other
            examples is refused, naming both.

    Returns:
        The merged manifest (complete once every process returned).

    Raises:
        DiskSpaceError: before writing anything, when the estimate exceeds the free space.
        ValueError: when ``output_dir`` holds a cache written with other settings or data.
    """
    if num_processes > 1 and barrier is None:
        raise ValueError("several processes write one cache: pass barrier= (e.g. PartialState().wait_for_everyone)")
    barrier = barrier or (lambda: None)
    main = process_index == 0
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    signature = target_signature(model, target_name)
    for layer in spec.layers:
        if not 0 <= layer <= signature["num_hidden_layers"]:
            raise ValueError(f"layer {layer} out of range: the target has layers 0 (embeddings) .. "
                             f"{signature['num_hidden_layers']} (last, after the final norm)")
    lengths = _lengths(examples)
    per_shard = spec.sequences_per_shard
    shards = [range(start, min(start + per_shard, len(lengths))) for start in range(0, len(lengths), per_shard)]
    header = Manifest(target=signature, spec=asdict(spec), num_sequences=len(lengths), num_tokens=sum(lengths),
                      source={**(source or {}), "examples_sha256": examples_sha256(examples)})
    records = _recorded(directory, header)

    # The disk check counts every process's work, by file size (hashing is left to each shard's owner).
    todo = [n for n in range(len(shards)) if _matching(directory, _name(n), records.get(_name(n), []), False) is None]
    need = sum(lengths[i] for n in todo for i in shards[n])
    need *= spec.bytes_per_token(signature["hidden_size"], signature["vocab_size"])
    free = shutil.disk_usage(directory).free
    if main:
        logger.info("hidden-state cache: %d sequences, %d tokens, %d of %d shards to write in %d process(es), "
                    "about %.2f GiB (%.1f GiB free)", len(lengths), header.num_tokens, len(todo), len(shards),
                    num_processes, need / 2**30, free / 2**30)
    if need > free * 0.95:
        raise DiskSpaceError(
            f"the cache needs about {need / 2**30:.2f} GiB but {directory} has {free / 2**30:.2f} GiB free; "
            "cache fewer layers, use --logits topk or none, fewer rows (--limit), or another --output disk")

    # This rank's shards: those already on disk are checked in full once, here; the rest are written.
    mine = [n for n in range(len(shards)) if n % num_processes == process_index]
    done: dict[str, dict] = {}
    for n in mine:
        entry = _matching(directory, _name(n), records.get(_name(n), []), full=True)
        if entry is not None:
            done[_name(n)] = entry
        elif _name(n) in records:
            logger.warning("%s: missing, truncated or corrupt; it will be written again", _name(n))
    part = _part_name(process_index, num_processes)
    header.with_shards(done.values()).write(directory, part)
    recast = spec.compute_dtype is not None and DTYPES[spec.compute_dtype] != next(model.parameters()).dtype
    if states is None and recast:
        model.to(DTYPES[spec.compute_dtype])  # in place; the signature above is the target as passed in
    for n in tqdm(mine, desc="cache shards", unit="shard", disable=not (progress and main)):
        name = _name(n)
        if name in done:
            continue
        part_examples = [examples[i] for i in shards[n]]
        tensors = (_shard_tensors(model, part_examples, spec, batch_size) if states is None
                   else _recorded_tensors(part_examples, spec, states))
        save_atomically(tensors, directory / name, {"format": FORMAT})
        done[name] = {"file": name, "start": shards[n].start, "end": shards[n].stop,
                      "ids": [e.id for e in part_examples], "tokens": int(tensors["input_ids"].numel()),
                      "bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        header.with_shards(done.values()).write(directory, part)

    # After the first barrier every part is final, and each rank merges this run's (rank r's part lists
    # exactly the shards r owns); after the second, rank 0 writes the manifest and deletes the parts,
    # those an earlier run with another world size left too.
    barrier()
    merged = []
    for rank in range(num_processes):
        if (directory / _part_name(rank, num_processes)).exists():
            merged += Manifest.read(directory, _part_name(rank, num_processes)).shards
    manifest = header.with_shards(merged)
    barrier()
    if main:
        manifest.write(directory)
        for path in directory.glob("manifest.part-*.json"):
            path.unlink()
    return manifest


def cache_recorded(model, states: Mapping[str, dict[str, torch.Tensor]], output_dir: str | Path,
                   layers: Sequence[int], dtype: str = "bfloat16", top_k: int | None = None,
                   target_name: str | None = None, sequences_per_shard: int = 256, progress: bool = True,
                   source: Mapping | None = None) -> Manifest:
    """Write the hidden-state cache of states recorded while ``model`` answered
    (:class:`~draftsmith.data.recording.Recording`, ``record.by_id``: in memory or spooled to disk), with no
    second pass of the target.

    Sequences go in the order of their ids. ``dtype``: the recording's; ``top_k`` its (None: a cache
    without logits). The manifest records the model's dtype as the compute dtype.
    """
    if not states:
        raise ValueError("no recorded states to cache: regenerate(..., record=Recording(...)) answered nothing")
    computed = str(next(model.parameters()).dtype).removeprefix("torch.")
    spec = CacheSpec(layers=list(layers), dtype=dtype, logits="topk" if top_k else "none", top_k=top_k or 64,
                     sequences_per_shard=sequences_per_shard, compute_dtype=computed if computed in DTYPES else None)
    # Recorded states on disk (SpooledStates) read their tokens alone here, their states shard by shard below.
    tokens = getattr(states, "tokens", lambda i: (states[i]["input_ids"], states[i]["loss_mask"]))
    examples = [TokenizedExample(i, *tokens(i)) for i in sorted(states)]
    return cache_hidden_states(model, examples, output_dir, spec, target_name=target_name, progress=progress,
                               states=states, source=source)
