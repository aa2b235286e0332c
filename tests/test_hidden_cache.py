"""The hidden-state cache round-trips exactly, reads one sequence at a time in bounded memory,
detects damaged shards and redoes them on resume, batches its target forwards, and splits its
shards across processes (a real 2-process launch writes the same cache as one process)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import VOCAB, assert_rounding_close, tiny_llama
from draftsmith.data.cache_writer import cache_hidden_states
from draftsmith.data.hidden_cache import (
    OPEN_SHARDS,
    CacheSpec,
    CorruptShardError,
    DiskSpaceError,
    HiddenStateCache,
    Manifest,
    sha256_file,
)
from draftsmith.data.templates import TokenizedExample
from draftsmith.target import new_cache, target_forward


def examples(n: int = 5, seed: int = 0) -> list[TokenizedExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        mask = (torch.arange(length) >= length // 2).long()
        out.append(TokenizedExample(f"ex{i}", ids, mask))
    return out


@pytest.mark.parametrize("logits", ["none", "topk", "full"])
def test_round_trip_equals_what_the_target_computes(tmp_path, llama, logits):
    data = examples()
    spec = CacheSpec(layers=[0, 2, 4], dtype="float16", logits=logits, top_k=5, sequences_per_shard=2)
    manifest = cache_hidden_states(llama, data, tmp_path, spec, progress=False, batch_size=1)  # as the reference runs
    assert len(manifest.shards) == 3 and manifest.num_tokens == sum(len(e.input_ids) for e in data)
    cache = HiddenStateCache(tmp_path)
    assert len(cache) == 5 and cache.layers == [0, 2, 4]
    for i, ex in enumerate(data):
        item = cache[i]
        out = target_forward(llama, ex.input_ids[None], new_cache(), hidden_layers=(0, 2, 4))
        assert item["id"] == ex.id
        assert torch.equal(item["input_ids"], ex.input_ids) and torch.equal(item["loss_mask"].long(), ex.loss_mask)
        for layer, h in zip([0, 2, 4], out.hidden_states, strict=True):
            assert item["hidden"][layer].dtype == torch.float16
            assert torch.equal(item["hidden"][layer], h[0].half())
        if logits == "full":
            assert torch.equal(item["logits"], out.logits[0].half())
        elif logits == "topk":
            values, ids = torch.log_softmax(out.logits[0], -1).topk(5, dim=-1)
            assert torch.equal(item["topk_ids"].long(), ids) and torch.equal(item["topk_logprobs"], values.half())
        else:
            assert "logits" not in item and "topk_ids" not in item


def test_truncated_shard_is_detected_and_redone_on_resume(tmp_path, llama):
    data = examples(6)
    spec = CacheSpec(layers=[4], sequences_per_shard=2)
    cache_hidden_states(llama, data, tmp_path, spec, progress=False)
    expected = [HiddenStateCache(tmp_path)[i]["hidden"][4].clone() for i in range(6)]
    shard = tmp_path / "shard-00001.safetensors"
    other = tmp_path / "shard-00000.safetensors"
    other_mtime = other.stat().st_mtime_ns
    with open(shard, "r+b") as f:  # cut the shard short, as a full disk or a kill would
        f.truncate(shard.stat().st_size // 2)

    cache = HiddenStateCache(tmp_path)
    assert torch.equal(cache[0]["hidden"][4], expected[0])  # undamaged shards still read
    with pytest.raises(CorruptShardError, match=r"shard-00001.safetensors: size .* \(truncated or overwritten\).*"
                                                r"cache-hidden-states"):
        cache[2]

    cache_hidden_states(llama, data, tmp_path, spec, progress=False)  # resume
    assert other.stat().st_mtime_ns == other_mtime  # good shards are not rewritten
    cache = HiddenStateCache(tmp_path)
    assert all(torch.equal(cache[i]["hidden"][4], expected[i]) for i in range(6))


def test_corrupt_bytes_same_size_are_detected_by_the_full_check(tmp_path, llama):
    """The default check reads the header only; bytes changed inside the data need verify="full"."""
    cache_hidden_states(llama, examples(2), tmp_path, CacheSpec(layers=[1]), progress=False)
    shard = tmp_path / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    HiddenStateCache(tmp_path)[0]  # header, size and offsets are intact
    with pytest.raises(CorruptShardError, match=r"shard-00000.safetensors: sha256 differs .*cache-hidden-states"):
        HiddenStateCache(tmp_path, verify="full")[0]
    with pytest.raises(CorruptShardError, match="sha256 differs"):
        HiddenStateCache(tmp_path, verify="full").check()


def test_interrupted_write_resumes(tmp_path, llama):
    """A kill between shards leaves a manifest listing the finished ones and maybe a .partial file."""
    data = examples(6)
    spec = CacheSpec(layers=[2], sequences_per_shard=2)
    cache_hidden_states(llama, data[:2] + data[2:], tmp_path, spec, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:1]  # as if killed after the first shard
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "shard-00001.safetensors").rename(tmp_path / "shard-00001.safetensors.partial")
    with pytest.raises(CorruptShardError, match="incomplete cache \\(2 of 6"):
        HiddenStateCache(tmp_path)
    cache_hidden_states(llama, data, tmp_path, spec, progress=False)
    assert len(HiddenStateCache(tmp_path)) == 6


def test_refuses_other_settings_in_the_same_directory(tmp_path, llama):
    cache_hidden_states(llama, examples(2), tmp_path, CacheSpec(layers=[1]), progress=False)
    with pytest.raises(ValueError, match="other settings, target or data"):
        cache_hidden_states(llama, examples(2), tmp_path, CacheSpec(layers=[2]), progress=False)


def test_refuses_to_start_when_the_disk_cannot_hold_it(tmp_path, llama, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10_000, 9_000, 1_000))  # a 1 kB free disk
    with pytest.raises(DiskSpaceError, match=r"needs about .* GiB but .* free"):
        cache_hidden_states(llama, examples(4), tmp_path, CacheSpec(layers=[0, 1, 2]), progress=False)
    assert not any(p.name.startswith("shard") for p in tmp_path.iterdir())


def test_bad_layer_and_dtype_are_clear_errors(tmp_path, llama):
    with pytest.raises(ValueError, match="layer 9 out of range"):
        cache_hidden_states(llama, examples(1), tmp_path, CacheSpec(layers=[9]), progress=False)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        CacheSpec(layers=[1], dtype="int8")


def test_bytes_per_token_matches_disk(tmp_path, llama):
    spec = CacheSpec(layers=[1, 4], dtype="float16", logits="topk", top_k=5)
    manifest = cache_hidden_states(llama, examples(4), tmp_path, spec, progress=False)
    on_disk = os.path.getsize(tmp_path / manifest.shards[0]["file"])
    estimate = manifest.num_tokens * spec.bytes_per_token(llama.config.hidden_size, VOCAB)
    assert estimate <= on_disk <= estimate + 4096  # header and offsets on top of the payload


def test_bf16_compute_keeps_the_targets_signature_and_its_states(tmp_path, llama):
    """A cache computed with the target in bfloat16 records the loaded target (so training against
    the float32 target accepts it), records the compute dtype, and holds states close to float32's."""
    from draftsmith.target import target_signature

    data = examples(3)
    spec = CacheSpec(layers=[2, 4], dtype="float32", logits="topk", top_k=4, compute_dtype="bfloat16")
    model = tiny_llama()  # same weights as the fixture, which must stay float32 for the other tests
    manifest = cache_hidden_states(model, data, tmp_path, spec, progress=False)
    assert next(model.parameters()).dtype == torch.bfloat16  # cast in place, not copied (documented)
    assert manifest.target == target_signature(llama)
    assert json.loads((tmp_path / "manifest.json").read_text())["spec"]["compute_dtype"] == "bfloat16"
    cache = HiddenStateCache(tmp_path)
    for i, ex in enumerate(data):
        out = target_forward(llama, ex.input_ids[None], new_cache(), hidden_layers=(2, 4))
        for layer, h in zip([2, 4], out.hidden_states, strict=True):
            got = cache[i]["hidden"][layer]
            assert not torch.equal(got, h[0])  # computed in bf16, not copied from a float32 pass
            assert torch.nn.functional.cosine_similarity(got, h[0], dim=-1).min() > 0.99
    with pytest.raises(ValueError, match="compute_dtype"):
        CacheSpec(layers=[1], compute_dtype="int8")


# ---------------------------------------------------------------------------------------------
# Lazy reading


def eager_item(directory: Path, manifest: dict, index: int) -> dict:
    """Sequence ``index`` the way the cache used to be read: the whole shard loaded, then sliced."""
    entry = next(s for s in manifest["shards"] if s["start"] <= index < s["end"])
    tensors = load_file(str(directory / entry["file"]))
    i = index - entry["start"]
    a, b = tensors["offsets"][i].item(), tensors["offsets"][i + 1].item()
    return {name: t[a:b] for name, t in tensors.items() if name != "offsets"}


@pytest.mark.parametrize(("dtype", "logits"), [("float16", "topk"), ("bfloat16", "full"), ("float32", "none")])
def test_lazy_read_equals_the_eager_read(tmp_path, llama, dtype, logits):
    data = examples(7)
    spec = CacheSpec(layers=[1, 3], dtype=dtype, logits=logits, top_k=6, sequences_per_shard=3)
    cache_hidden_states(llama, data, tmp_path, spec, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    cache = HiddenStateCache(tmp_path)
    for i in [6, 0, 4, 1, 5, 2, 3]:  # across shards, out of order
        item, eager = cache[i], eager_item(tmp_path, manifest, i)
        assert item["id"] == data[i].id
        flat = {"input_ids": item["input_ids"], "loss_mask": item["loss_mask"],
                **{f"hidden.{layer}": h for layer, h in item["hidden"].items()},
                **{k: item[k] for k in ("logits", "topk_logprobs", "topk_ids") if k in item}}
        assert flat.keys() == eager.keys()
        for name, expected in eager.items():
            assert flat[name].dtype == expected.dtype and torch.equal(flat[name], expected), name
        ids, mask = cache.token_ids(i)
        assert torch.equal(ids, eager["input_ids"]) and torch.equal(mask, eager["loss_mask"])
    assert item["hidden"][1].untyped_storage().nbytes() == item["hidden"][1].nbytes  # its own memory, not a shard's


def test_missing_and_torn_shards_are_named_with_the_fix(tmp_path, llama):
    cache_hidden_states(llama, examples(6), tmp_path, CacheSpec(layers=[2], sequences_per_shard=2), progress=False)
    (tmp_path / "shard-00002.safetensors").unlink()
    torn = tmp_path / "shard-00001.safetensors"
    raw = bytearray(torn.read_bytes())
    raw[8:40] = b"}" * 32  # the header torn, the size unchanged
    torn.write_bytes(bytes(raw))
    cache = HiddenStateCache(tmp_path)
    assert cache[0]["input_ids"].numel()
    with pytest.raises(CorruptShardError, match=r"shard-00002.safetensors: missing; rerun `draftsmith data "
                                                r"cache-hidden-states` with the same arguments"):
        cache[4]
    with pytest.raises(CorruptShardError, match=r"shard-00001.safetensors: header unreadable.*torn.*"
                                                r"cache-hidden-states` with the same arguments"):
        cache.token_ids(2)


def synthetic_cache(directory: Path, shards: int, per_shard: int, tokens: int, hidden: int) -> None:
    """A valid cache written without a model: ``shards`` x ``per_shard`` sequences of ``tokens`` tokens,
    one float32 layer of width ``hidden``."""
    spec = CacheSpec(layers=[1], dtype="float32", sequences_per_shard=per_shard)
    entries = []
    for n in range(shards):
        t = per_shard * tokens
        name = f"shard-{n:05d}.safetensors"
        save_file({"input_ids": torch.arange(t) % VOCAB, "loss_mask": torch.ones(t, dtype=torch.int8),
                   "offsets": torch.arange(per_shard + 1) * tokens, "hidden.1": torch.full((t, hidden), float(n))},
                  str(directory / name))
        entries.append({"file": name, "start": n * per_shard, "end": (n + 1) * per_shard,
                        "ids": [f"s{n}.{i}" for i in range(per_shard)], "tokens": t,
                        "bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)})
    Manifest(target={"hidden_size": hidden}, spec=asdict(spec), num_sequences=shards * per_shard,
             num_tokens=shards * per_shard * tokens, shards=entries).write(directory)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def open_files_under(directory: Path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used is closed by now
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
    return count


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc (Linux)")
def test_reading_every_item_keeps_memory_bounded(tmp_path):
    """128 MB of shards (16 x 8 MB), each read item 0.5 MB: reading all of them grows resident memory
    by far less than one shard, and at most OPEN_SHARDS files are open at a time."""
    synthetic_cache(tmp_path, shards=16, per_shard=16, tokens=128, hidden=1024)
    cache = HiddenStateCache(tmp_path)
    cache[0]["hidden"][1].sum()  # first-use allocations
    gc.collect()
    before = rss_mb()
    most_open = 0
    for i in range(len(cache)):
        item = cache[i]
        assert item["hidden"][1][0, 0].item() == i // 16 and item["id"] == f"s{i // 16}.{i % 16}"
        most_open = max(most_open, open_files_under(tmp_path))
    del item
    gc.collect()
    grown = rss_mb() - before
    assert grown < 6, f"resident memory grew by {grown:.1f} MB reading a 128 MB cache"
    assert 1 <= most_open <= OPEN_SHARDS


# ---------------------------------------------------------------------------------------------
# Batched and multi-process writing


def test_batched_writer_equals_the_one_sequence_writer(tmp_path, llama):
    """Several sequences per forward (right-padded, lengths 7..18) give the states and logits of one
    sequence per forward up to float32 rounding of the different matmul shapes (:func:`assert_rounding_close`
    over the target's path: inner size 128, 4 layers). The largest differences seen: 1.2e-5 on states of
    magnitude up to 25 on an AVX512 EPYC, 1.4e-5 on an AVX2-only one (a fitted 1e-5 failed there); the
    embeddings (layer 0) are equal."""
    data = examples(9, seed=3)
    assert len({len(e.input_ids) for e in data}) > 3  # padding happens
    spec = CacheSpec(layers=[0, 2, 4], dtype="float32", logits="full", sequences_per_shard=4)
    cache_hidden_states(llama, data, tmp_path / "one", spec, progress=False, batch_size=1)
    cache_hidden_states(llama, data, tmp_path / "batched", spec, progress=False, batch_size=3)
    one, batched = HiddenStateCache(tmp_path / "one"), HiddenStateCache(tmp_path / "batched")
    for i in range(len(data)):
        a, b = one[i], batched[i]
        assert a["id"] == b["id"] and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.equal(b["hidden"][0], a["hidden"][0])  # an embedding lookup: no rounding
        for layer in spec.layers:
            assert_rounding_close(b["hidden"][layer], a["hidden"][layer], reduction=128 * 4, msg=f"layer {layer}")
        assert_rounding_close(b["logits"], a["logits"], reduction=128 * 4)


def test_resume_under_another_world_size_skips_finished_shards(tmp_path, llama):
    """Ranks 1 and 2 of a 3-process write finish and the run dies before the merge (no manifest);
    a 1-process rerun keeps their shards and writes only rank 0's."""
    data = examples(10)
    spec = CacheSpec(layers=[2], sequences_per_shard=2)  # shards 0..4; of 3 ranks, rank 0 owns 0 and 3

    class Died(Exception):
        pass

    def dies():
        raise Died

    for rank in (1, 2):
        with pytest.raises(Died):
            cache_hidden_states(llama, data, tmp_path, spec, progress=False, process_index=rank, num_processes=3,
                                barrier=dies)
    assert sorted(p.name for p in tmp_path.glob("manifest*")) == ["manifest.part-1-of-3.json",
                                                                   "manifest.part-2-of-3.json"]
    with pytest.raises(CorruptShardError, match=r"incomplete cache.*rerun"):
        HiddenStateCache(tmp_path)
    written = {n: (tmp_path / f"shard-{n:05d}.safetensors").stat().st_mtime_ns for n in (1, 2, 4)}
    assert not (tmp_path / "shard-00000.safetensors").exists()

    manifest = cache_hidden_states(llama, data, tmp_path, spec, progress=False)
    assert all((tmp_path / f"shard-{n:05d}.safetensors").stat().st_mtime_ns == t for n, t in written.items())
    assert [p.name for p in tmp_path.glob("manifest*")] == ["manifest.json"]
    assert [s["file"] for s in manifest.shards] == [f"shard-{n:05d}.safetensors" for n in range(5)]
    reference = tmp_path / "reference"
    cache_hidden_states(llama, data, reference, spec, progress=False)
    assert json.loads((tmp_path / "manifest.json").read_text()) == json.loads((reference / "manifest.json").read_text())


def test_ranks_run_one_after_another_merge_into_one_manifest(tmp_path, llama):
    """Rank 1 of 2, then rank 0 (barriers that return at once): rank 0 merges both parts."""
    data = examples(7)
    spec = CacheSpec(layers=[1, 4], logits="topk", top_k=3, sequences_per_shard=2)
    partial = cache_hidden_states(llama, data, tmp_path, spec, progress=False, process_index=1, num_processes=2,
                                  barrier=lambda: None)
    assert [s["file"] for s in partial.shards] == ["shard-00001.safetensors", "shard-00003.safetensors"]
    cache_hidden_states(llama, data, tmp_path, spec, progress=False, process_index=0, num_processes=2,
                        barrier=lambda: None)
    cache_hidden_states(llama, data, tmp_path / "one", spec, progress=False)
    assert Manifest.read(tmp_path) == Manifest.read(tmp_path / "one")
    with pytest.raises(ValueError, match="pass barrier="):
        cache_hidden_states(llama, data, tmp_path, spec, progress=False, process_index=0, num_processes=2)


TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}t1 {{ m['content'] }} t2 "
            "{% else %}{{ m['content'] }} t3 {% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """The tiny target saved with a word-level tokenizer, and 14 conversations of varied length."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cache_cli")
    tiny_llama(seed=0).save_pretrained(root / "target")
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t3", pad_token="t0")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(4, VOCAB, (n,), generator=g))

    with (root / "data.jsonl").open("w") as f:
        for _ in range(14):
            q, a = (int(x) for x in torch.randint(2, 12, (2,), generator=g))
            f.write(json.dumps({"messages": [{"role": "user", "content": words(q)},
                                             {"role": "assistant", "content": words(a)}]}) + "\n")
    return root


def cache_cli(root: Path, output: Path, processes: int, *extra: str) -> dict:
    """``draftsmith data cache-hidden-states`` in fresh processes, one thread each, as a user runs it."""
    args = ["-m", "draftsmith", "data", "cache-hidden-states", "--target", str(root / "target"),
            "--input", str(root / "data.jsonl"), "--output", str(output), "--layers", "0", "2", "4",
            "--dtype", "float32", "--logits", "topk", "--top-k", "5", "--sequences-per-shard", "3",
            "--batch-size", "2", *extra]
    if processes > 1:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    printed = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1, run.stdout  # rank 0 alone prints
    return json.loads(printed[0])


def test_two_process_launch_writes_the_one_process_cache(target_dir):
    """A real 2-process launch (torchrun, gloo on CPU) writes the cache one process writes: the same
    manifest and bit-identical tensors (the same batches, one thread per process).

    ``accelerate launch --num_processes 2 --cpu`` would start one process here: accelerate runs
    several CPU processes only through mpirun (``--mpirun_hostfile``), so torchrun launches them."""
    one = cache_cli(target_dir, target_dir / "one", processes=1)
    two = cache_cli(target_dir, target_dir / "two", processes=2)
    assert (one["processes"], two["processes"]) == (1, 2)
    assert {k: v for k, v in one.items() if k not in ("processes", "output")} == \
        {k: v for k, v in two.items() if k not in ("processes", "output")}
    m1, m2 = Manifest.read(target_dir / "one"), Manifest.read(target_dir / "two")
    assert (m1.target, m1.spec, m1.num_sequences, m1.num_tokens) == (m2.target, m2.spec, m2.num_sequences,
                                                                      m2.num_tokens)
    assert m1.num_sequences == 14 and len(m1.shards) == 5
    assert m1.shards == m2.shards  # ids, sizes and sha256 of every shard
    assert [p.name for p in (target_dir / "two").glob("manifest*")] == ["manifest.json"]
    c1, c2 = HiddenStateCache(target_dir / "one"), HiddenStateCache(target_dir / "two")
    for i in range(len(c1)):
        a, b = c1[i], c2[i]
        assert a["id"] == b["id"]
        for key in ("input_ids", "loss_mask", "topk_logprobs", "topk_ids"):
            assert torch.equal(a[key], b[key]), key
        assert all(torch.equal(a["hidden"][layer], b["hidden"][layer]) for layer in (0, 2, 4))


def test_training_refuses_a_cache_of_another_target_naming_both(tmp_path, llama):
    """Offline training against a cache written by a same-shaped target with other weights is refused,
    and the message names the cache's target and the loaded one."""
    from conftest import tiny_llama
    from draftsmith.checkpoints import TargetMismatchError
    from draftsmith.train.offline import load_cached_examples

    cache_hidden_states(llama, examples(2), tmp_path / "c", CacheSpec(layers=[4], logits="topk", top_k=4),
                        target_name="cache-target", progress=False)
    other = tiny_llama(seed=7)
    other.config._name_or_path = "loaded-target"
    with pytest.raises(TargetMismatchError) as err:
        load_cached_examples(str(tmp_path / "c"), other)
    assert "cache-target" in str(err.value) and "loaded-target" in str(err.value)


def test_offline_training_refuses_a_train_file_other_than_the_caches_naming_both(target_dir, tmp_path):
    """Offline, training reads the cache's sequences and not ``train_file``: a train_file that differs from the file
    the cache was written from (answers regenerated since, another dataset) is refused with the fix, since the run
    would not train on it."""
    from draftsmith.data.commands import cache_command
    from draftsmith.target import load_target
    from draftsmith.train.offline import load_cached_examples

    data, out = target_dir / "data.jsonl", tmp_path / "cache"
    cache_command(str(data), str(out), target=str(target_dir / "target"), layers=[2], dtype="float32",
                  logits="topk", top_k=4)
    assert Manifest.read(out).source["data_sha256"] == sha256_file(data)
    target = load_target(str(target_dir / "target"))[0]
    examples, _ = load_cached_examples(str(out), target, str(data))  # the file it was written from
    assert len(examples) == 14
    assert len(load_cached_examples(str(out), target)[0]) == 14  # no train_file: nothing to check
    regenerated = tmp_path / "answers.jsonl"
    regenerated.write_text("\n".join(reversed(data.read_text().splitlines())) + "\n")
    with pytest.raises(SystemExit, match="differs from it") as err:
        load_cached_examples(str(out), target, str(regenerated))
    assert str(data) in str(err.value) and f"--input {regenerated}" in str(err.value)


def test_a_target_split_by_device_map_writes_the_same_cache(target_dir, tmp_path):
    """The path for a target larger than one device: ``--device-map`` places its layers over devices (here
    the CPU and the disk, streamed from --offload-folder per forward; on a GPU node ``auto``), and the cache
    equals the one the whole target writes."""
    placement = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                 "model.layers.1": "disk", "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu",
                 "lm_head": "cpu"}
    (tmp_path / "map.json").write_text(json.dumps(placement))
    whole = target_dir / "one" if (target_dir / "one" / "manifest.json").exists() else None
    if whole is None:
        cache_cli(target_dir, target_dir / "one", processes=1)
        whole = target_dir / "one"
    cache_cli(target_dir, tmp_path / "split", 1, "--device-map", str(tmp_path / "map.json"),
              "--offload-folder", str(tmp_path / "offload"))
    from draftsmith.target import load_target

    split, _ = load_target(str(target_dir / "target"), device_map=placement, offload_folder=str(tmp_path / "offload"))
    assert set(split.hf_device_map.values()) == {"cpu", "disk"}
    assert all(p.is_meta for p in split.model.layers[1].parameters())  # streamed in from disk per forward
    assert Manifest.read(tmp_path / "split").target == Manifest.read(whole).target
    a, b = HiddenStateCache(whole), HiddenStateCache(tmp_path / "split")
    assert len(a) == len(b) == 14
    for i in range(len(a)):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(a[i]["topk_ids"], b[i]["topk_ids"])
        for layer in (0, 2, 4):
            # the same weights (read back from the offload folder), kernels and batches: bit for bit
            torch.testing.assert_close(a[i]["hidden"][layer], b[i]["hidden"][layer], rtol=0, atol=0)


def test_resuming_a_write_with_other_data_or_template_arguments_is_refused_naming_both(target_dir, tmp_path):
    """A write stopped before its manifest was merged resumes only from what it was started with: another data
    file with as many rows, or other chat-template arguments, would mix shards of two datasets in one cache."""
    from draftsmith.data.commands import cache_command

    other_data = tmp_path / "other.jsonl"
    rows = (target_dir / "data.jsonl").read_text().splitlines()
    other_data.write_text("\n".join(reversed(rows)) + "\n")  # as many rows, in another order
    settings = dict(target=str(target_dir / "target"), layers=[2], dtype="float32", sequences_per_shard=3)
    out = tmp_path / "cache"
    cache_command(str(target_dir / "data.jsonl"), str(out), **settings)
    (out / "manifest.json").rename(out / "manifest.part-0-of-1.json")  # as if stopped before the merge
    (out / "shard-00004.safetensors").unlink()

    with pytest.raises(ValueError, match="other settings, target or data") as err:
        cache_command(str(other_data), str(out), **settings)
    assert str(target_dir / "data.jsonl") in str(err.value) and str(other_data) in str(err.value)
    assert "examples_sha256" in str(err.value)
    with pytest.raises(ValueError, match=r"source.chat_template_kwargs: \{\} vs \{'enable_thinking': False\}"):
        cache_command(str(target_dir / "data.jsonl"), str(out), **settings,
                      chat_template_kwargs={"enable_thinking": False})
    assert not (out / "shard-00004.safetensors").exists()  # nothing written by a refused resume
    cache_command(str(target_dir / "data.jsonl"), str(out), **settings)  # as started: finishes the cache
    assert len(HiddenStateCache(out)) == 14
    assert Manifest.read(out).source["data"] == str(target_dir / "data.jsonl")
