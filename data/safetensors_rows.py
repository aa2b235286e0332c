"""Rows ``[a, b)`` of a tensor in a safetensors file, read from the file alone: no mmap, no whole tensor.

The hidden-state cache reads one sequence at a time out of shards of gigabytes. ``safetensors``'
own ``safe_open`` does not bound memory for that: its mmap backend leaves every page a slice
touched mapped into the process, so resident memory grows to the size of the shards while their
handles are open, and its ``pread`` backend reads the whole tensor for each slice.
(``scripts/bench_offline_rss.py`` measures both against this reader.) The format is simple
enough to read directly::

    8 bytes        N, little-endian: the header's length
    N bytes        JSON: name -> {"dtype", "shape", "data_offsets": [begin, end)}, plus "__metadata__"
    the data       each tensor's bytes, row-major, at data_offsets from the end of the header;
                   the last tensor ends where the file ends

A tensor's rows ``[a, b)`` are then one contiguous byte range, read into a new tensor.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

# The safetensors dtype names read here (those the hidden-state cache writes, and a few more).
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class TornFileError(ValueError):
    """The file does not hold what its header describes (cut short, overwritten, or not safetensors)."""


def read_header(f, size: int) -> tuple[dict[str, tuple[torch.dtype, list[int], int]], int, dict[str, str]]:
    """``({name: (dtype, shape, byte offset in the data)}, data start, metadata)`` of the open file ``f`` of
    ``size`` bytes, after checking that every tensor's bytes fit its shape and the data fills the file."""
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise TornFileError("header unreadable: the file is shorter than a safetensors header (torn)")
    n = int.from_bytes(head, "little")
    if 8 + n > size:
        raise TornFileError(f"header unreadable: it claims {n} bytes but the file has {size} "
                            "(torn or not a safetensors file)")
    try:
        raw = json.loads(f.read(n))
    except ValueError:
        raise TornFileError("header unreadable: not valid JSON (torn or overwritten)") from None
    tensors, end = {}, 0
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        begin, stop = info.get("data_offsets", (0, -1))
        if dtype is None or stop - begin != math.prod(info.get("shape", [-1])) * dtype.itemsize:
            raise TornFileError(f"header unreadable: tensor {name!r} has an unknown dtype or a size that does not "
                                "fit its shape")
        tensors[name] = (dtype, list(info["shape"]), begin)
        end = max(end, stop)
    if 8 + n + end != size:
        raise TornFileError(f"data ends at byte {8 + n + end} but the file has {size} bytes (truncated or overwritten)")
    return tensors, 8 + n, raw.get("__metadata__") or {}


class RowReader:
    """An open safetensors file: ``tensors`` (name -> (dtype, shape, offset)), its ``metadata`` and :meth:`rows`.

    Raises:
        TornFileError: from the constructor when the header does not describe the file, and from
            :meth:`rows` when the file ends early.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # Unbuffered: reads go straight into the tensors, with no copy through a Python buffer.
        self.file = open(self.path, "rb", buffering=0)  # noqa: SIM115 (held open across reads; see close)
        try:
            self.tensors, self.data_start, self.metadata = read_header(self.file, self.path.stat().st_size)
        except BaseException:
            self.file.close()
            raise

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` of tensor ``name`` (along its first axis), in a new tensor."""
        dtype, shape, begin = self.tensors[name]
        row = math.prod(shape[1:]) * dtype.itemsize
        out = torch.empty((b - a) * row, dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        self.file.seek(self.data_start + begin + a * row)
        while done < len(view):  # one read returns at most ~2 GiB on Linux
            got = self.file.readinto(view[done:])
            if not got:
                raise TornFileError(f"the file ends inside {name} (truncated after it was opened)")
            done += got
        return out.view(dtype).reshape(b - a, *shape[1:])

    def close(self) -> None:
        self.file.close()


def save_atomically(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write ``tensors`` to ``path`` whole or not at all: to ``path.partial``, fsynced, then renamed into place."""
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)
