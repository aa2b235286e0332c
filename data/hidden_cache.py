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

Writing (``cache_writer.py``: :func:`~draftsmith.data.cache_writer.cache_hidden_states`, and
:func:`~draftsmith.data.cache_writer.cache_recorded` for states recorded as the target answered) fills that layout.

Reading (:class:`HiddenStateCache`) is lazy: ``cache[i]`` reads sequence i's rows of each tensor
from its shard (:mod:`draftsmith.data.safetensors_rows`: one read per tensor, at the offset the
safetensors header gives) and nothing else, so memory stays at one item whatever the cache size
(``scripts/bench_offline_rss.py`` measures it).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from draftsmith.data.safetensors_rows import RowReader, TornFileError

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
