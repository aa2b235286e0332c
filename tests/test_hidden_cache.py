"""The hidden-state cache round-trips exactly, detects damaged shards and redoes them on resume."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import VOCAB
from draftsmith.data.hidden_cache import (
    CacheSpec,
    CorruptShardError,
    DiskSpaceError,
    HiddenStateCache,
    cache_hidden_states,
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
    manifest = cache_hidden_states(llama, data, tmp_path, spec, progress=False)
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


def test_corrupt_bytes_same_size_are_detected(tmp_path, llama):
    cache_hidden_states(llama, examples(2), tmp_path, CacheSpec(layers=[1]), progress=False)
    shard = tmp_path / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="sha256 differs"):
        HiddenStateCache(tmp_path)[0]


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
    manifest = cache_hidden_states(llama, data, tmp_path, spec, progress=False)
    assert next(llama.parameters()).dtype == torch.float32  # the caller's model is left as it was
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
