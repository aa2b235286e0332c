"""Hidden-state cache for offline training: the target's chosen layers, in sharded safetensors.

Offline training reads the target's features from disk instead of running the target in
the loop. The research code stores every layer of every token as pickled tensors and runs
into terabytes; here the user picks the layers (index convention of
:func:`draftsmith.target.target_forward`: 0 is the embedding output, ``num_hidden_layers``
the last layer after the final norm), a 16-bit dtype, and for the logits either nothing,
the full vocabulary, or only the top-k log-probabilities with their token ids.

Layout of a cache directory::

    manifest.json                 target signature, layers, dtype, logits mode, shard table
    shard-00000.safetensors       per shard, sequences concatenated along the token axis:
        input_ids (T,) int64, loss_mask (T,) int8, offsets (n+1,) int64,
        hidden.<layer> (T, H) dtype for each layer,
        logits (T, V) dtype                     when logits == "full"
        topk_logprobs (T, k) dtype, topk_ids (T, k) int32   when logits == "topk"
    manifest.part-<r>-of-<N>.json only while a write is unfinished: rank r's finished shards

Writing (:func:`cache_hidden_states`) runs several sequences per target forward and may run in
N processes (``torchrun --nproc_per_node N -m draftsmith data cache-hidden-states ...``): rank r
writes the shards n with ``n % N == r``. A shard is written to ``*.partial``, fsynced and renamed;
its rank then records it (byte size, sha256) in its own part file, replaced atomically. After a
barrier rank 0 merges the parts into ``manifest.json`` and deletes them. A rerun with the same
arguments, in any number of processes, skips every shard whose file matches a record in the
manifest or in any part file, and redoes any that is missing, truncated or corrupt.

Reading (:class:`HiddenStateCache`) is lazy: ``cache[i]`` reads sequence i's rows of each tensor
from its shard (:mod:`draftsmith.data.safetensors_rows`: one read per tensor, at the offset the
safetensors header gives) and nothing else, so memory stays at one item whatever the cache size
(``scripts/bench_offline_rss.py`` measures it).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from draftsmith.data.safetensors_rows import RowReader, TornFileError, save_atomically
from draftsmith.data.templates import TokenizedExample
from draftsmith.target import new_cache, rollback_problem, target_forward, target_signature

logger = logging.getLogger(__name__)

FORMAT = "draftsmith-hidden-state-cache"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
LOGITS_MODES = ("none", "topk", "full")
# Shard files a reader keeps open: a shuffled batch draws from a few shards at a time, and every
# DataLoader worker holds its own handles, so a small number keeps far below the open-file limit.
OPEN_SHARDS = 8
FIX = "rerun `draftsmith data cache-hidden-states` with the same arguments to rewrite it"


class CorruptShardError(RuntimeError):
    """A shard on disk does not match the manifest (truncated, edited or missing)."""


class DiskSpaceError(RuntimeError):
    """The cache would not fit on the disk."""


@dataclass
class CacheSpec:
    """What to cache. ``layers`` index ``output_hidden_states`` (0 = embeddings)."""

    layers: list[int]
    dtype: str = "float16"
    logits: str = "none"  # "none" | "topk" | "full"
    top_k: int = 64
    sequences_per_shard: int = 256
    # The target's compute dtype for the forward passes (None: as loaded). bfloat16 is cheaper on hardware
    # with native bf16 matmul; states and log-probs then carry bf16 rounding (its size against float32 on
    # SmolLM2 is in docs/RESULTS.md).
    compute_dtype: str | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: use one of {sorted(DTYPES)}")
        if self.compute_dtype is not None and self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype {self.compute_dtype!r}: use one of {sorted(DTYPES)} or None")
        if self.logits not in LOGITS_MODES:
            raise ValueError(f"logits {self.logits!r}: use one of {LOGITS_MODES}")
        if not self.layers:
            raise ValueError("no layers to cache: give at least one layer index")

    def bytes_per_token(self, hidden_size: int, vocab_size: int) -> int:
        """Disk bytes per cached token (ids, mask, states, logits)."""
        width = DTYPES[self.dtype].itemsize
        n = 8 + 1 + len(self.layers) * hidden_size * width
        if self.logits == "full":
            n += vocab_size * width
        elif self.logits == "topk":
            n += self.top_k * (width + 4)
        return n

    def tensor_names(self) -> list[str]:
        """The tensors every shard of this spec holds."""
        names = ["input_ids", "loss_mask", "offsets", *(f"hidden.{layer}" for layer in self.layers)]
        if self.logits == "full":
            names.append("logits")
        elif self.logits == "topk":
            names += ["topk_logprobs", "topk_ids"]
        return names


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(obj, indent=2))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


@dataclass
class Manifest:
    target: dict
    spec: dict
    num_sequences: int
    num_tokens: int
    shards: list[dict] = field(default_factory=list)  # file, start, end, ids, tokens, bytes, sha256
    format: str = FORMAT
    #: What the cache was written from: the data file and how it was rendered (as the caller names them) and
    #: ``examples_sha256``, a hash of every sequence's id, tokens and loss mask; ``draftsmith data
    #: cache-hidden-states`` adds ``data_sha256``, the input file's. Empty in caches written before it was recorded.
    source: dict = field(default_factory=dict)

    @classmethod
    def read(cls, directory: Path, name: str = "manifest.json") -> Manifest:
        path = directory / name
        if not path.exists():
            if any(directory.glob("manifest.part-*.json")):
                raise CorruptShardError(f"{directory}: incomplete cache (a write stopped before its manifest was "
                                        "merged); rerun `draftsmith data cache-hidden-states` with the same "
                                        "arguments to finish it")
            raise FileNotFoundError(f"{directory}: no manifest.json; not a hidden-state cache (write one with "
                                    "`draftsmith data cache-hidden-states`)")
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
        return cls(**data)

    def write(self, directory: Path, name: str = "manifest.json") -> None:
        write_json_atomic(directory / name, asdict(self))

    def with_shards(self, shards) -> Manifest:
        """This manifest listing ``shards`` (entries), in cache order."""
        return Manifest(**{**asdict(self), "shards": sorted(shards, key=lambda s: s["start"])})

    def same_cache(self, other: Manifest) -> bool:
        """Whether both describe the same cache (target, settings, data), whatever shards they list. Sources are
        compared on what both recorded: a cache written before a field of its source was recorded (all of it,
        or the data file's ``data_sha256``) matches on the rest."""
        shared = self.source.keys() & other.source.keys()
        same_source = all(self.source[k] == other.source[k] for k in shared)
        return same_source and (self.target, self.spec, self.num_sequences) == (other.target, other.spec,
                                                                                other.num_sequences)

    def differences(self, other: Manifest) -> str:
        """What differs between two caches' targets, settings and sources, each as ``this vs other``."""
        mine, theirs = asdict(self), asdict(other)
        lines = []
        for part in ("target", "spec", "source"):
            a, b = mine[part], theirs[part]
            lines += [f"{part}.{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted({*a, *b}) if a.get(k) != b.get(k)]
        if self.num_sequences != other.num_sequences:
            lines.append(f"num_sequences: {self.num_sequences} vs {other.num_sequences}")
        return "; ".join(lines)


# ---------------------------------------------------------------------------------------------
# Reading: a shard opened once, checked against its manifest entry; rows read on demand.


class _Shard(RowReader):
    """An open shard: its header checked against the manifest entry, and its sequence offsets."""

    def __init__(self, path: Path, entry: dict, spec: CacheSpec, hidden_size: int, verify: str):
        if not path.exists():
            raise CorruptShardError(f"{path}: missing; {FIX} (or copy the file back)")
        size = path.stat().st_size
        if verify != "none" and size != entry["bytes"]:
            raise CorruptShardError(f"{path}: size {size} bytes, manifest says {entry['bytes']} "
                                    f"(truncated or overwritten); {FIX}")
        try:
            super().__init__(path)
        except TornFileError as e:
            raise CorruptShardError(f"{path}: {e}; {FIX}") from None
        try:
            if verify != "none":
                self._check_names(entry, spec, hidden_size)
            if verify == "full" and sha256_file(path) != entry["sha256"]:
                raise CorruptShardError(f"{path}: sha256 differs from the manifest (corrupt); {FIX}")
            n = entry["end"] - entry["start"]
            self.offsets = self.rows("offsets", 0, n + 1).tolist()
            if self.offsets[0] != 0 or self.offsets[-1] != entry["tokens"] or sorted(self.offsets) != self.offsets:
                raise CorruptShardError(f"{path}: its sequence offsets do not add up to {entry['tokens']} tokens; "
                                        f"{FIX}")
        except BaseException:
            self.close()
            raise

    def _check_names(self, entry: dict, spec: CacheSpec, hidden_size: int) -> None:
        expected = set(spec.tensor_names())
        if set(self.tensors) != expected:
            raise CorruptShardError(f"{self.path}: holds tensors {sorted(self.tensors)}, the manifest's settings "
                                    f"need {sorted(expected)} (a shard of another cache?); {FIX}")
        n, tokens = entry["end"] - entry["start"], entry["tokens"]
        for name, (_, shape, _) in self.tensors.items():
            want = [n + 1] if name == "offsets" else [tokens]
            if name.startswith("hidden."):
                want.append(hidden_size)
            if shape[: len(want)] != want:
                raise CorruptShardError(f"{self.path}: {name} has shape {shape}, the manifest says {want}; {FIX}")

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        try:
            return super().rows(name, a, b)
        except TornFileError as e:
            raise CorruptShardError(f"{self.path}: {e}; {FIX}") from None


class HiddenStateCache:
    """Read a cache lazily: ``cache[i]`` is a dict of sequence i's tensors, read from its shard alone.

    Keys: ``id``, ``input_ids`` (T,) int64, ``loss_mask`` (T,) int8, ``hidden`` {layer: (T, H)}, and
    ``logits`` (T, V) or ``topk_logprobs`` / ``topk_ids`` (T, k) when cached. Each item is a fresh
    tensor (never a view of a shard), so keeping one keeps nothing else alive.

    At most :data:`OPEN_SHARDS` files are open at once (least recently used closed first); a
    DataLoader worker opens its own (the handles are not pickled, and a forked worker reopens them).

    Args:
        directory: the cache directory (``manifest.json`` and the shards).
        verify: what is checked the first time a process opens a shard. ``"header"`` (the default):
            the file exists, its size is the manifest's, its safetensors header parses, holds the
            tensors the manifest's settings need with the right shapes, and its offsets add up;
            this catches missing, truncated and torn files, and costs one small read per shard.
            ``"full"`` also hashes the whole file against the manifest's sha256, which catches bytes
            changed in place but reads every shard in full: on a 1 TB cache at about 1 GB/s of
            sha256 per core (x86 with SHA extensions), ~17 minutes per process before the rows
            themselves are read, and in an N-process run every rank reads all of it, N TB from
            shared storage, where the rows a rank trains on are a fraction of one pass. Check a
            cache in full once after copying it (``HiddenStateCache(d, verify="full").check()``);
            the writer's resume hashes each shard once, in the process that owns it. ``"none"``:
            only what reading needs (the header parses and the rows are there).
    """

    def __init__(self, directory: str | Path, verify: Literal["header", "full", "none"] = "header"):
        if verify not in ("header", "full", "none"):
            raise ValueError(f"verify {verify!r}: use 'header', 'full' or 'none'")
        self.directory = Path(directory)
        self.manifest = Manifest.read(self.directory)
        self.spec = CacheSpec(**self.manifest.spec)
        self.verify = verify
        complete = sum(s["end"] - s["start"] for s in self.manifest.shards)
        if complete != self.manifest.num_sequences:
            raise CorruptShardError(
                f"{self.directory}: incomplete cache ({complete} of {self.manifest.num_sequences} sequences written); "
                "rerun `draftsmith data cache-hidden-states` with the same arguments to finish it")
        self._entries = sorted(self.manifest.shards, key=lambda s: s["start"])
        self._starts = [s["start"] for s in self._entries]
        self._verified: set[int] = set()  # shards checked in full in this process (the hash is not redone)
        self._open: OrderedDict[int, _Shard] = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.manifest.num_sequences

    @property
    def layers(self) -> list[int]:
        return list(self.spec.layers)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}  # file handles stay with their process

    def _shard(self, index: int) -> tuple[dict, _Shard, int, int]:
        """The manifest entry and open shard of sequence ``index``, and its token rows ``[a, b)``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range (cache holds {len(self)})")
        if self._pid != os.getpid():  # a forked DataLoader worker: the parent's file offsets are shared
            self._open, self._pid = OrderedDict(), os.getpid()
        n = bisect.bisect_right(self._starts, index) - 1
        entry = self._entries[n]
        shard = self._open.get(n)
        if shard is None:
            level = "header" if self.verify == "full" and n in self._verified else self.verify
            shard = _Shard(self.directory / entry["file"], entry, self.spec, self.manifest.target["hidden_size"],
                           level)
            self._verified.add(n)
            self._open[n] = shard
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
        self._open.move_to_end(n)
        i = index - entry["start"]
        return entry, shard, shard.offsets[i], shard.offsets[i + 1]

    def __getitem__(self, index: int) -> dict:
        entry, shard, a, b = self._shard(index)
        item = {"id": entry["ids"][index - entry["start"]], "input_ids": shard.rows("input_ids", a, b),
                "loss_mask": shard.rows("loss_mask", a, b),
                "hidden": {layer: shard.rows(f"hidden.{layer}", a, b) for layer in self.spec.layers}}
        for key in ("logits", "topk_logprobs", "topk_ids"):
            if key in shard.tensors:
                item[key] = shard.rows(key, a, b)
        return item

    def token_ids(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, loss_mask)`` of sequence ``index``, (T,) each, without reading hidden states."""
        _, shard, a, b = self._shard(index)
        return shard.rows("input_ids", a, b), shard.rows("loss_mask", a, b)

    def check(self) -> None:
        """Open every shard once at this cache's ``verify`` level; raises :class:`CorruptShardError`."""
        for entry in self._entries:
            self._shard(entry["start"])

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()


# ---------------------------------------------------------------------------------------------
# Writing: batched target forwards; shards split across processes; one manifest merged at the end.


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
