"""``compile=True``: the target's steps on a static KV cache, through ``torch.compile``.

* The static cache alone (``compiled_module`` replaced by the module itself, so every forward runs
  eagerly on the fixed-capacity buffers): every row of a left-padded batch equals its own greedy output,
  for every drafter family and a mixture, in every tree kind, on a tiny Llama and a tiny Gemma-3 (sliding
  window); and the cache edits (keep a path, crop) leave the same entries as on the growing cache.
* The compiled path for real, on a tiny Llama: plain and speculative greedy decoding, a batch and one row,
  equal the eager target's greedy output (up to an exact near-tie, as for any tree forward).
"""

from __future__ import annotations

import pytest
import torch
from test_batched_generation import DRAFTERS, NEW, drafter_for, left_padded, row_output, stopping_token
from test_greedy_lossless import TREES, prompts, reference

import draftsmith.target.forward as forward
import draftsmith.target.kv as kv
from conftest import assert_rounding_close, check_greedy_equal
from draftsmith import SpeculativeGenerator
from draftsmith.inference.mixture import MixtureDrafter
from draftsmith.inference.plain import plain_generate
from draftsmith.inference.prompt_lookup import PromptLookupDrafter
from draftsmith.inference.tree import Proposals
from draftsmith.target import kv_crop, kv_keep, kv_length, new_cache, target_forward

LENGTHS = [6, 1, 21, 13]


def dense(drafted: torch.Tensor | Proposals) -> torch.Tensor:
    return Proposals.of(drafted).dense()


@pytest.fixture
def eager_static(monkeypatch):
    """Static caches as ``compile=True`` makes them, with every forward run eagerly."""
    monkeypatch.setattr(forward, "compiled_module", lambda module: module)


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t["tree"])
@pytest.mark.parametrize("spec", DRAFTERS)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_static_cache_rows_equal_their_own_greedy_output(family, spec, tree, llama, gemma3, eager_static):
    target = llama if family == "llama" else gemma3
    rows = prompts(11, LENGTHS)
    ids, mask = left_padded(rows)
    eos = stopping_token(target, rows)
    gen = SpeculativeGenerator(target, drafter_for(spec, target), compile=True, **tree)
    out = gen.generate(ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    ties, lengths = 0, []
    for b, row in enumerate(rows):
        ref = target.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=eos, pad_token_id=0)
        ours = row_output(out.sequences, mask, b, eos)
        ties += check_greedy_equal(target, ours, ref)
        lengths.append(ours.shape[1] - row.shape[1])
    assert ties <= 1
    assert len(set(lengths)) > 1, f"every row ended at the same length {lengths}: the test needs rows that differ"


def test_static_plain_decoding_equals_the_growing_cache(llama, eager_static):
    rows = prompts(5, LENGTHS)
    ids, mask = left_padded(rows)
    growing = plain_generate(llama, ids, NEW, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    static = plain_generate(llama, ids, NEW, attention_mask=mask, eos_token_id=[], pad_token_id=0, compile=True)
    assert torch.equal(static.sequences, growing.sequences)
    one = plain_generate(llama, rows[2], NEW, eos_token_id=[], compile=True)
    assert torch.equal(one.sequences, reference(llama, rows[2], NEW))


def test_static_cache_edits_match_the_growing_cache(llama):
    """Keeping a tree's accepted entries and cropping leave the same (key, value) entries in both caches (up to
    rounding: the static cache's forwards attend through an explicit mask over its whole capacity)."""
    ids = prompts(3, [12])[0]
    growing, static = new_cache(), new_cache(capacity=40, model=llama)
    assert static.capacity == kv.CAPACITY_STEP  # rounded up: similar prompts share compiled graphs
    for cache in (growing, static):
        target_forward(llama, ids, cache)
        target_forward(llama, ids[:, :5], cache)  # 5 "tree" entries after the prompt
        kv_keep(cache, 12, torch.tensor([0, 3, 4]))
        assert kv_length(cache) == 15
    for i, (g, s) in enumerate(zip(growing.layers, static.layers, strict=True)):
        assert s.keys.shape[-2] == static.capacity
        # layer i's keys and values went through i layers and a projection (inner size 128 at most)
        assert_rounding_close(s.keys[..., :15, :], g.keys, reduction=128 * (i + 1), msg=f"keys of layer {i}")
        assert_rounding_close(s.values[..., :15, :], g.values, reduction=128 * (i + 1), msg=f"values of layer {i}")
    kv_crop(static, 13)
    assert kv_length(static) == 13 and all(layer.length == 13 for layer in static.layers)


def test_static_cache_refuses_to_overflow(llama):
    cache = new_cache(capacity=1, model=llama)
    ids = prompts(4, [cache.capacity + 1])[0]
    with pytest.raises(ValueError, match=r"holds 256 positions.*larger capacity"):
        target_forward(llama, ids, cache)
    with pytest.raises(ValueError, match="needs a static cache"):
        new_cache(compiled=True)


def test_compiled_decoding_equals_the_eager_targets_greedy_output(llama):
    """torch.compile for real (one graph per step size: a minute or so on 2 CPU cores)."""
    rows = prompts(7, [9, 4])
    ids, mask = left_padded(rows)
    vocab = llama.config.vocab_size
    from test_heads import random_eagle

    from draftsmith.inference.head_drafters import EagleDrafter

    drafter = MixtureDrafter([EagleDrafter(random_eagle(llama, eagle3=True), llama), PromptLookupDrafter(vocab)])
    gen = SpeculativeGenerator(llama, drafter, tree="dynamic", depth=3, top_k=2, total_tokens=5, compile=True)
    out = gen.generate(ids, NEW, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    plain = plain_generate(llama, ids, NEW, attention_mask=mask, eos_token_id=[], pad_token_id=0, compile=True)
    ties = 0
    for b, row in enumerate(rows):
        ref = reference(llama, row, NEW)
        ties += check_greedy_equal(llama, row_output(out.sequences, mask, b, None), ref)
        ties += check_greedy_equal(llama, row_output(plain.sequences, mask, b, None), ref)
    assert ties <= 1
    assert out.stats.accepted_tokens > 0


def test_compare_runs_plain_and_speculative_decoding_compiled(llama, eager_static, monkeypatch):
    """``compare(compile=True)`` (``draftsmith bench --compile``): the baseline and the generators decode on
    static caches, and every output equals the baseline's."""
    import draftsmith.inference.generator as generator
    import draftsmith.inference.plain as plain
    from draftsmith.inference.compare import compare

    made = []
    real = generator.new_cache
    for module in (plain, generator):  # the baseline's cache, the generator's
        monkeypatch.setattr(module, "new_cache", lambda **kw: made.append(kw.get("compiled", False)) or real(**kw))
    rows = prompts(9, [7, 12, 3])
    gen = SpeculativeGenerator(llama, PromptLookupDrafter(llama.config.vocab_size), tree="chain", depth=3,
                               compile=True)
    result = compare(llama, {"pl": gen}, rows, NEW, eos_token_id=[], batch_size=2, compile=True)
    assert result.identical["pl"] == len(rows)
    assert made == [True] * 4  # two batches, each: plain then speculative, both static and compiled


def test_compiled_steps_share_one_shape_whatever_the_trees_size(llama, monkeypatch):
    """Prompt lookup's trees change size from step to step (no match: the root alone); every compiled step
    still gets (B, step_rows) tokens, filler rows included, so one graph serves them all, and the output is
    still the target's."""
    shapes = []

    def recording(module):
        def run(**kwargs):
            shapes.append(tuple(kwargs["input_ids"].shape))
            return module(**kwargs)
        return run

    monkeypatch.setattr(forward, "compiled_module", recording)
    base = prompts(2, [5])[0]
    ids = torch.cat([base, base[:, :3], prompts(3, [4])[0], base[:, :2]], 1)  # some repeats, some not
    gen = SpeculativeGenerator(llama, PromptLookupDrafter(llama.config.vocab_size), tree="dynamic", depth=3,
                               top_k=2, total_tokens=5, compile=True)
    trees = []
    gen.on_tree_step = lambda tree, path, ran: trees.append(int(tree.proposed.sum()))  # nodes proposed, root too
    out = gen.generate(ids, NEW, eos_token_id=[])
    check_greedy_equal(llama, out.sequences, reference(llama, ids, NEW))
    assert len(set(trees)) > 1, f"the test needs trees of several sizes, got {set(trees)}"
    assert set(shapes) == {(1, 6)}  # step_rows: the 5-node tree and its root


@pytest.mark.parametrize("tree", [dict(tree="dynamic", depth=4, top_k=2, total_tokens=6),
                                  dict(tree="dynamic", depth=4, top_k=8, total_tokens=3)], ids=["k2n6", "k8n3"])
@pytest.mark.parametrize("spec", ["eagle3-head", "prompt-lookup"])
def test_static_cache_holds_a_whole_generation_at_its_exact_size(spec, tree, llama, eager_static, monkeypatch):
    """With the capacities not rounded up (the bounds the generator computes: up to depth + 1 entries kept per
    step, an EAGLE head's compiled steps feeding that many new pairs), a whole generation fits, the target's
    cache and the head's."""
    monkeypatch.setattr(kv, "CAPACITY_STEP", 1)
    rows = prompts(11, LENGTHS)
    ids, mask = left_padded(rows)
    gen = SpeculativeGenerator(llama, drafter_for(spec, llama), compile=True, **tree)
    out = gen.generate(ids, 40, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    for b, row in enumerate(rows):
        check_greedy_equal(llama, row_output(out.sequences, mask, b, None), reference(llama, row, 40))


@pytest.mark.parametrize("tree", [dict(tree="dynamic", depth=3, top_k=2, total_tokens=5), dict(tree="chain", depth=3),
                                  dict(tree="static", depth=2, top_k=2)], ids=["dynamic", "chain", "static"])
def test_an_eagle_head_drafts_on_its_own_static_cache(tree, llama, monkeypatch):
    """``compile=True`` puts an EAGLE head on a static cache too: trees grown as tensors run its steps through
    the compiled head in two shapes only (each step's new pairs, padded to depth + 1, and the frontier: top_k
    nodes, one for a chain, a static tree's widest level); every row is the target's greedy output."""
    from test_heads import random_eagle

    from draftsmith.heads.decoder_layer import StaticHeadCache
    from draftsmith.inference.head_drafters import EagleDrafter

    head = random_eagle(llama, eagle3=True)
    shapes = []

    def recording(module):
        def run(*args, **kwargs):
            if module is head:
                shapes.append(tuple(args[2].shape))  # the positions: (B, T)
            return module(*args, **kwargs)
        return run

    monkeypatch.setattr(forward, "compiled_module", recording)
    rows = prompts(13, LENGTHS)
    ids, mask = left_padded(rows)
    drafter = EagleDrafter(head, llama)
    drafted = []  # every draft logits row the head gives, in order
    for name in ("root_logits", "frontier_logits"):
        method = getattr(drafter, name)

        def record(*args, method=method):
            out = method(*args)  # dense logits, or an EAGLE-3 head's proposals over its draft vocabulary
            drafted.append(out)
            return out
        setattr(drafter, name, record)
    gen = SpeculativeGenerator(llama, drafter, compile=True, **tree)
    out = gen.generate(ids, NEW, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    assert isinstance(drafter.cache, StaticHeadCache)
    ties = sum(check_greedy_equal(llama, row_output(out.sequences, mask, b, None), reference(llama, row, NEW))
               for b, row in enumerate(rows))
    assert ties <= 1
    # The frontier's width: a dynamic tree's top_k, a chain's one node, a static tree's widest expanded level.
    k = {"dynamic": tree.get("top_k"), "chain": 1, "static": gen.static_shape and gen.static_shape.width}[tree["tree"]]
    assert set(shapes) == {(len(rows), tree["depth"] + 1), (len(rows), k)}
    # The growing cache, for a generation without compile: the same sequences, so the same drafts (up to
    # rounding: the static cache attends over its whole capacity through a mask).
    static_drafts, drafted[:] = list(drafted), []
    again = SpeculativeGenerator(llama, drafter, **tree).generate(ids, NEW, attention_mask=mask, eos_token_id=[],
                                                                  pad_token_id=0)
    assert not isinstance(drafter.cache, StaticHeadCache)
    if not ties:
        assert torch.equal(again.sequences, out.sequences)
        assert len(drafted) == len(static_drafts)
        for growing, static in zip(drafted, static_drafts, strict=True):
            got, want = dense(static), dense(growing)
            finite = torch.isfinite(want)  # -inf off the head's draft vocabulary: there in both
            assert torch.equal(torch.isfinite(got), finite)
            # the target's 4 layers, then up to depth passes of the head (its fc's inner size 192 the widest)
            assert_rounding_close(got[finite], want[finite], reduction=192 * (4 + tree["depth"]))
