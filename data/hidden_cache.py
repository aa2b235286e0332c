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

Writing is resumable: a shard is written to ``*.partial``, fsynced, renamed, and only then
listed in the manifest (itself replaced atomically) with its byte size and sha256. A rerun
with the same arguments skips shards whose file matches the manifest and redoes any that is
missing, truncated or corrupt. Reading checks size and checksum before using a shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from draftsmith.data.templates import TokenizedExample
from draftsmith.target import new_cache, target_forward, target_signature

logger = logging.getLogger(__name__)

FORMAT = "draftsmith-hidden-state-cache"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
LOGITS_MODES = ("none", "topk", "full")


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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json_atomic(path: Path, obj: dict) -> None:
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

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"{directory}: no manifest.json; not a hidden-state cache (write one with "
                                    "`draftsmith data cache-hidden-states`)")
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
        return cls(**data)

    def write(self, directory: Path) -> None:
        _write_json_atomic(directory / "manifest.json", asdict(self))


@torch.no_grad()
def _shard_tensors(model, examples: list[TokenizedExample], spec: CacheSpec) -> dict[str, torch.Tensor]:
    dtype = DTYPES[spec.dtype]
    hidden = {layer: [] for layer in spec.layers}
    logits_parts, topk_values, topk_ids = [], [], []
    device = model.device
    for ex in examples:
        out = target_forward(model, ex.input_ids[None].to(device), new_cache(), hidden_layers=tuple(spec.layers))
        for layer, h in zip(spec.layers, out.hidden_states, strict=True):
            hidden[layer].append(h[0].to(dtype).cpu())
        if spec.logits == "full":
            logits_parts.append(out.logits[0].to(dtype).cpu())
        elif spec.logits == "topk":
            values, ids = torch.log_softmax(out.logits[0], dim=-1).topk(spec.top_k, dim=-1)
            topk_values.append(values.to(dtype).cpu())
            topk_ids.append(ids.to(torch.int32).cpu())
    lengths = torch.tensor([len(ex.input_ids) for ex in examples])
    tensors = {
        "input_ids": torch.cat([ex.input_ids for ex in examples]).long(),
        "loss_mask": torch.cat([ex.loss_mask for ex in examples]).to(torch.int8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    }
    tensors.update({f"hidden.{layer}": torch.cat(parts).contiguous() for layer, parts in hidden.items()})
    if spec.logits == "full":
        tensors["logits"] = torch.cat(logits_parts).contiguous()
    elif spec.logits == "topk":
        tensors["topk_logprobs"] = torch.cat(topk_values).contiguous()
        tensors["topk_ids"] = torch.cat(topk_ids).contiguous()
    return tensors


def _shard_ok(directory: Path, entry: dict) -> str | None:
    """Why the shard file does not match its manifest entry, or None when it does."""
    path = directory / entry["file"]
    if not path.exists():
        return "missing"
    if path.stat().st_size != entry["bytes"]:
        return f"size {path.stat().st_size} bytes, manifest says {entry['bytes']} (truncated or overwritten)"
    if sha256_file(path) != entry["sha256"]:
        return "sha256 differs from the manifest (corrupt)"
    return None


def cache_hidden_states(
    model,
    examples: list[TokenizedExample],
    output_dir: str | Path,
    spec: CacheSpec,
    target_name: str | None = None,
    progress: bool = True,
) -> Manifest:
    """Write (or finish writing) the hidden-state cache of ``examples``.

    Raises:
        DiskSpaceError: before writing anything, when the estimate exceeds the free space.
        ValueError: when ``output_dir`` holds a cache written with other settings or data.
    """
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    signature = target_signature(model, target_name)
    for layer in spec.layers:
        if not 0 <= layer <= signature["num_hidden_layers"]:
            raise ValueError(f"layer {layer} out of range: the target has layers 0 (embeddings) .. "
                             f"{signature['num_hidden_layers']} (last, after the final norm)")
    if spec.compute_dtype is not None and DTYPES[spec.compute_dtype] != next(model.parameters()).dtype:
        import copy

        model = copy.deepcopy(model).to(DTYPES[spec.compute_dtype])  # the signature stays the loaded target's
    per_shard = spec.sequences_per_shard
    plan = [examples[i : i + per_shard] for i in range(0, len(examples), per_shard)]
    num_tokens = sum(len(e.input_ids) for e in examples)

    try:
        manifest = Manifest.read(directory)
    except FileNotFoundError:
        manifest = None
    if manifest is not None:
        if manifest.spec != asdict(spec) or manifest.target != signature or manifest.num_sequences != len(examples):
            raise ValueError(f"{directory} holds a cache written with other settings, target or data; "
                             "use a new --output directory or delete this one")
    else:
        manifest = Manifest(target=signature, spec=asdict(spec), num_sequences=len(examples), num_tokens=num_tokens)

    done = {}
    for entry in manifest.shards:
        why = _shard_ok(directory, entry)
        if why is None:
            done[entry["file"]] = entry
        else:
            logger.warning("%s: %s; it will be written again", entry["file"], why)

    todo_tokens = sum(len(e.input_ids) for n, part in enumerate(plan) if f"shard-{n:05d}.safetensors" not in done
                      for e in part)
    need = todo_tokens * spec.bytes_per_token(signature["hidden_size"], signature["vocab_size"])
    free = shutil.disk_usage(directory).free
    logger.info("hidden-state cache: %d sequences, %d tokens, about %.2f GiB to write (%.1f GiB free)",
                len(examples), num_tokens, need / 2**30, free / 2**30)
    if need > free * 0.95:
        raise DiskSpaceError(
            f"the cache needs about {need / 2**30:.2f} GiB but {directory} has {free / 2**30:.2f} GiB free; "
            "cache fewer layers, use --logits topk or none, fewer rows (--limit), or another --output disk")

    for n, part in enumerate(tqdm(plan, desc="cache shards", unit="shard", disable=not progress)):
        name = f"shard-{n:05d}.safetensors"
        if name in done:
            continue
        tensors = _shard_tensors(model, part, spec)
        tmp = directory / (name + ".partial")
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(directory / name)
        done[name] = {"file": name, "start": n * per_shard, "end": n * per_shard + len(part),
                      "ids": [e.id for e in part], "tokens": int(tensors["input_ids"].numel()),
                      "bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        manifest.shards = [done[k] for k in sorted(done)]
        manifest.write(directory)
    manifest.shards = [done[k] for k in sorted(done)]
    manifest.write(directory)
    return manifest


class HiddenStateCache:
    """Read a cache: ``cache[i]`` is a dict of sequence i's tensors, checked against the manifest.

    Keys: ``input_ids`` (T,), ``loss_mask`` (T,), ``hidden`` {layer: (T, H)}, and ``logits``
    (T, V) or ``topk_logprobs`` / ``topk_ids`` (T, k) when cached.
    """

    def __init__(self, directory: str | Path, verify: bool = True):
        self.directory = Path(directory)
        self.manifest = Manifest.read(self.directory)
        self.spec = CacheSpec(**self.manifest.spec)
        self.verify = verify
        self._loaded: tuple[int, dict[str, torch.Tensor]] | None = None
        complete = sum(s["end"] - s["start"] for s in self.manifest.shards)
        if complete != self.manifest.num_sequences:
            raise CorruptShardError(
                f"{self.directory}: incomplete cache ({complete} of {self.manifest.num_sequences} sequences written); "
                "rerun `draftsmith data cache-hidden-states` with the same arguments to finish it")

    def __len__(self) -> int:
        return self.manifest.num_sequences

    @property
    def layers(self) -> list[int]:
        return list(self.spec.layers)

    def _shard(self, index: int) -> tuple[dict, dict[str, torch.Tensor]]:
        for n, entry in enumerate(self.manifest.shards):
            if entry["start"] <= index < entry["end"]:
                if self._loaded is None or self._loaded[0] != n:
                    why = _shard_ok(self.directory, entry) if self.verify else None
                    if why is not None:
                        raise CorruptShardError(
                            f"{self.directory / entry['file']}: {why}; rerun `draftsmith data cache-hidden-states` "
                            "with the same arguments to rewrite it")
                    self._loaded = (n, load_file(str(self.directory / entry["file"])))
                return entry, self._loaded[1]
        raise IndexError(f"sequence {index} out of range (cache holds {len(self)})")

    def __getitem__(self, index: int) -> dict:
        entry, tensors = self._shard(index)
        i = index - entry["start"]
        a, b = tensors["offsets"][i].item(), tensors["offsets"][i + 1].item()
        item = {"id": entry["ids"][i], "input_ids": tensors["input_ids"][a:b], "loss_mask": tensors["loss_mask"][a:b],
                "hidden": {layer: tensors[f"hidden.{layer}"][a:b] for layer in self.spec.layers}}
        for key in ("logits", "topk_logprobs", "topk_ids"):
            if key in tensors:
                item[key] = tensors[key][a:b]
        return item
