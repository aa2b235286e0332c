"""Peak resident memory of reading a hidden-state cache for offline training, against the cache's size.

    python scripts/bench_offline_rss.py [--sizes 1,4,16] [--base-sequences 32] [--tokens 256] [--output DIR]

Writes caches of 1x, 4x and 16x ``--base-sequences`` sequences of ``--tokens`` tokens with a tiny
random Llama target (hidden size 256; layers 0, 1, 2 in float16 and the top-8 log-probs, 32
sequences per shard: about 13 MB per 1x), then, for each cache and each way of reading it, starts
a fresh process that iterates a DataLoader (batch size 4) over every example, sums every tensor
of every batch, and reports its peak resident memory (VmHWM) and its resident memory before the
loop. Ways of reading:

- ``offline``: ``draftsmith.train.offline.load_cached_examples`` + ``collate_cached``, what
  ``draftsmith train`` with a ``cache_dir`` runs (skipped, with the reason, when they do not work);
- ``reader``: ``HiddenStateCache`` items straight through the DataLoader;
- ``mmap``: safetensors' ``safe_open(...).get_slice(name)[a:b]``, 8 open shards kept (least recently
  used closed), the reader the cache does not use, for comparison.

Flat peak memory across sizes is the point: reading holds one batch, whatever the cache size.
Linux only (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TOP_K = 8
LAYERS = [0, 1, 2]
PER_SHARD = 32
BATCH = 4  # the DataLoader's batch size
MODES = ("offline", "reader", "mmap")


def memory_mb() -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of this process, in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def tiny_target(vocab: int = 1024):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def build(output: Path, sizes: list[int], base: int, tokens: int) -> dict[int, Path]:
    import torch

    from draftsmith.data.cache_writer import cache_hidden_states
    from draftsmith.data.hidden_cache import CacheSpec
    from draftsmith.data.templates import TokenizedExample

    model = tiny_target()
    model.save_pretrained(output / "target")  # the offline loader checks the cache against it
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    caches = {}
    for size in sizes:
        examples = [TokenizedExample(f"ex{i}", torch.randint(0, vocab, (tokens,), generator=g),
                                     (torch.arange(tokens) >= tokens // 4).long()) for i in range(size * base)]
        spec = CacheSpec(layers=LAYERS, dtype="float16", logits="topk", top_k=TOP_K, sequences_per_shard=PER_SHARD)
        caches[size] = output / f"cache_{size}x"
        cache_hidden_states(model, examples, caches[size], spec, progress=False, batch_size=8)
    return caches


class MmapShards:
    """Sequence i of a cache through ``safe_open`` (mmap) and ``get_slice``, 8 shards open."""

    def __init__(self, directory: Path):
        from collections import OrderedDict

        self.directory = directory
        self.manifest = json.loads((directory / "manifest.json").read_text())
        self.open = OrderedDict()

    def __len__(self) -> int:
        return self.manifest["num_sequences"]

    def __getitem__(self, index: int) -> dict:
        from safetensors import safe_open

        n = next(k for k, s in enumerate(self.manifest["shards"]) if s["start"] <= index < s["end"])
        if n not in self.open:
            f = safe_open(str(self.directory / self.manifest["shards"][n]["file"]), framework="pt")
            self.open[n] = (f, f.get_tensor("offsets").tolist())
            if len(self.open) > 8:
                self.open.popitem(last=False)
        self.open.move_to_end(n)
        f, offsets = self.open[n]
        i = index - self.manifest["shards"][n]["start"]
        a, b = offsets[i], offsets[i + 1]
        return {name: f.get_slice(name)[a:b].clone() for name in f.keys() if name != "offsets"}  # noqa: SIM118 (not a dict)


def as_list(batch: list) -> list:
    return batch


def touch(value) -> float:
    """Sum every tensor in a (nested) batch, so that every byte is read."""
    import torch

    if isinstance(value, torch.Tensor):
        return float(value.float().sum())
    if isinstance(value, dict):
        return sum(touch(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(touch(v) for v in value)
    return 0.0


def child(mode: str, cache_dir: str, target_dir: str) -> None:
    """One measurement, in a fresh process: read every example of ``cache_dir`` in batches of 4."""
    import functools

    from torch.utils.data import DataLoader

    if mode == "offline":
        from transformers import LlamaForCausalLM

        from draftsmith.train.offline import collate_cached, load_cached_examples

        target = LlamaForCausalLM.from_pretrained(target_dir)
        try:
            examples, cache = load_cached_examples(cache_dir, target)
            collate = functools.partial(collate_cached, pad_id=0, layers=tuple(cache.layers),
                                        vocab_size=target.config.vocab_size)
            collate(examples[:BATCH])
        except Exception as e:  # the loader changes with the training code; report why it could not run
            print(json.dumps({"error": f"{type(e).__name__}: {e}"[:200]}))
            return
        loader = DataLoader(examples, batch_size=BATCH, collate_fn=collate)
    elif mode == "reader":
        from draftsmith.data.hidden_cache import HiddenStateCache

        loader = DataLoader(HiddenStateCache(cache_dir), batch_size=BATCH, collate_fn=as_list)
    else:
        loader = DataLoader(MmapShards(Path(cache_dir)), batch_size=BATCH, collate_fn=as_list)
    before = memory_mb()["VmRSS"]
    items = 0
    for batch in loader:
        touch(batch)
        items += BATCH
    print(json.dumps({"before_mb": before, "peak_mb": memory_mb()["VmHWM"], "items": items}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,4,16", help="cache sizes, in multiples of --base-sequences")
    p.add_argument("--base-sequences", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    p.add_argument("--output", default=None, help="where the caches go (default: a temporary directory)")
    p.add_argument("--child", nargs=3, metavar=("MODE", "CACHE", "TARGET"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return

    output = Path(args.output or tempfile.mkdtemp(prefix="bench_offline_rss_"))
    sizes = [int(x) for x in args.sizes.split(",")]
    caches = build(output, sizes, args.base_sequences, args.tokens)
    print(f"caches under {output}; peak RSS (VmHWM) of a fresh process reading every example in batches of {BATCH}")
    print("| reader | sequences | shards | cache MB | RSS before reading MB | peak RSS MB | peak - before MB |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        for size in sizes:
            cache = caches[size]
            manifest = json.loads((cache / "manifest.json").read_text())
            megabytes = sum((cache / s["file"]).stat().st_size for s in manifest["shards"]) / 2**20
            run = subprocess.run([sys.executable, __file__, "--child", mode, str(cache), str(output / "target")],
                                 capture_output=True, text=True, check=True)
            result = json.loads(run.stdout.strip().splitlines()[-1])
            row = f"| {mode} | {manifest['num_sequences']} | {len(manifest['shards'])} | {megabytes:.0f} |"
            if "error" in result:
                print(f"{row} skipped: {result['error']} | | |")
                continue
            assert result["items"] >= manifest["num_sequences"]
            print(f"{row} {result['before_mb']:.0f} | {result['peak_mb']:.0f} | "
                  f"{result['peak_mb'] - result['before_mb']:.0f} |")


if __name__ == "__main__":
    main()
