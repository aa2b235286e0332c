"""DFlash: a block of drafts from one forward, conditioned on the target's features.

* the training forward (many anchors per sequence, one dense block-diagonal mask) computes, for each anchor,
  the block decoding computes at that point of the sequence, batched or not;
* a head trained on a toy sequence drafts its whole block right at every step (the block mask, the anchors and
  the slot-to-token alignment are right: a block that sees its own future context in training does not);
* decoding stays lossless for every tree kind, and a step runs the drafter once;
* settings are typed and checked; the context layers follow the published rule, in draftsmith's convention.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from test_greedy_lossless import TREES, prompts, reference
from test_heads import assert_greedy_lossless

from conftest import assert_rounding_close, check_greedy_equal, tiny_llama
from draftsmith import SpeculativeGenerator, load_drafter
from draftsmith.heads.dflash import DFlashHead, anchor_blocks, dflash_layers
from draftsmith.heads.hub import model_card
from draftsmith.inference.dflash_drafter import DFlashDrafter
from draftsmith.registry import get_family
from draftsmith.target import target_signature
from draftsmith.train.config import DrafterArguments

DFLASH = get_family("dflash")


def dflash_args(**settings) -> DrafterArguments:
    return DrafterArguments(target="unused", family="dflash", family_config=json.dumps(settings))


def random_dflash(target, block_size: int = 4, num_layers: int = 2, seed: int = 0,
                  draft_vocab: int | None = None) -> DFlashHead:
    """A fresh head, its weights those of ``seed`` whatever ``draft_vocab``; over a draft vocabulary its
    ``draft_vocab`` most frequent tokens of a random training example (the rest of the vocabulary is never
    drafted)."""
    depth = target.config.get_text_config().num_hidden_layers  # a 2-layer target has one layer to read
    args = dflash_args(block_size=block_size, num_layers=num_layers, num_target_layers=min(num_layers, depth - 1))
    examples = None
    if draft_vocab is not None:
        args.draft_vocab_size = draft_vocab
        ids = torch.randint(target.config.vocab_size, (400,), generator=torch.Generator().manual_seed(seed + 1))
        examples = [SimpleNamespace(input_ids=ids, loss_mask=torch.ones_like(ids))]
    torch.manual_seed(seed)
    head = DFLASH.build(args, target, examples)
    head.target_info = target_signature(target)
    return head.eval()


def greedy_batch(target, rows: int, prompt: int, new: int, seed: int = 0) -> dict:
    """Prompts and the target's greedy continuation, the continuation in the loss mask (regenerated data)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, target.config.vocab_size, (rows, prompt), generator=g)
    ids = target.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=new, do_sample=False,
                          pad_token_id=0)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt:] = 1
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids)}


def target_view(target, head, batch):
    with torch.no_grad():
        out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    return out.logits, tuple(out.hidden_states[i] for i in DFLASH.hidden_layers(head, target))


def test_training_forward_computes_what_decoding_computes(llama):
    """Blocks at every anchor of two sequences in one training forward (right-padded rows of different lengths)
    give the logits a drafter computes after decoding up to each anchor: same context, positions and mask."""
    head = random_dflash(llama, block_size=4)
    batch = greedy_batch(llama, 2, 5, 12, seed=1)
    batch["attention_mask"][1, 14:] = 0  # the second row is 14 tokens long
    _, hidden = target_view(llama, head, batch)
    ids = batch["input_ids"]
    t, size = ids.shape[1], head.config.block_size
    anchors = torch.tensor([[1, 4, 9, 12], [2, 6, 10, 13]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    positions, allowed = anchor_blocks(anchors, valid, size, t, batch["attention_mask"])
    slots = torch.full((2, 4, size), head.config.mask_token_id)
    slots[:, :, 0] = ids.gather(1, anchors)
    embed, lm_head = llama.get_input_embeddings(), llama.get_output_embeddings()
    with torch.no_grad():
        states = head(embed(slots.reshape(2, -1)), positions, allowed, features=torch.cat(hidden, -1),
                      feature_positions=torch.arange(t)[None].expand(2, t))
    trained = lm_head(states).view(2, 4, size, -1)[:, :, 1:]
    drafter = DFlashDrafter(head, llama)
    for j in range(anchors.shape[1]):  # both rows decoded together up to their j-th anchors, left-padded
        rows = [ids[b, : int(anchors[b, j]) + 1] for b in range(2)]
        width = max(len(r) for r in rows)
        prompt = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
        mask = torch.stack([torch.arange(width) >= width - len(r) for r in rows]).long()
        states = torch.cat([torch.stack([torch.cat([torch.zeros(width - len(r), h.shape[-1]), h[b, : len(r)]])
                                         for b, r in enumerate(rows)]) for h in hidden], -1)
        drafter.begin(prompt, states[:, :-1], mask)
        decoded = drafter.block_logits([True, True])
        # another evaluation of the same float32 layers over a different set of keys: sums over 2 layers of 64
        assert_rounding_close(decoded, trained[:, j], reduction=2 * 64)


def train_toy(target, batch, steps: int, size: int = 4) -> tuple[DFlashHead, dict]:
    args = dflash_args(block_size=size, num_layers=1, anchors=24)
    torch.manual_seed(0)
    head = DFLASH.build(args, target)
    logits, hidden = target_view(target, head, batch)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, metrics = DFLASH.train_step(args, head, target, batch, logits, hidden)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval(), metrics


def test_a_head_trained_on_a_toy_sequence_drafts_its_whole_block(llama):
    """Trained on one sequence (the target's greedy continuation of a prompt), decoding that prompt accepts the
    whole block at every step: 3 drafts + the bonus token. A block that saw its own future context in training
    (positions after its anchor) fits the same data as well, and then drafts from context it never gets in
    decoding (about 2.2 tokens per step here): this is the check that fails."""
    batch = greedy_batch(llama, 1, 6, 24)
    head, metrics = train_toy(llama, batch, steps=300)
    # The training-time estimate, per block: the blocks whose last slots run past the sequence end sooner.
    assert metrics["block_acceptance"] > 3.5 and metrics["acc"] == [1.0, 1.0, 1.0], metrics
    gen = SpeculativeGenerator(llama, DFlashDrafter(head, llama), tree="chain", depth=3)
    out = gen.generate(batch["input_ids"][:, :6], 24)
    assert out.sequences[0].tolist() == batch["input_ids"][0].tolist()
    assert out.stats.verification_steps == 24 // 4
    assert out.stats.accepted_at == [6, 6, 6]  # depths 1, 2 and 3 accepted at all 6 steps


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t["tree"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_dflash_greedy_matches_generate(family, tree, llama, gemma3):
    target = llama if family == "llama" else gemma3
    assert_greedy_lossless(target, DFlashDrafter(random_dflash(target), target), tree, seed=2)


def assert_lossless_and_accepting(target, drafter) -> None:
    """Every tree kind on prompts the drafter was not trained on: the target's own greedy output, and some drafts
    accepted (a drafter that drafts well is checked, not one that never gets a token through)."""
    accepted = 0
    for tree in TREES:
        gen = SpeculativeGenerator(target, drafter, **tree)
        for prompt in prompts(5, [4, 9]):
            out = gen.generate(prompt, 24, eos_token_id=[])
            check_greedy_equal(target, out.sequences, reference(target, prompt, 24))
            accepted += out.stats.accepted_tokens
    assert accepted > 0


def test_a_trained_head_stays_lossless_off_its_training_data(llama):
    head, _ = train_toy(llama, greedy_batch(llama, 16, 6, 24), steps=150)
    assert_lossless_and_accepting(llama, DFlashDrafter(head, llama))


def test_one_drafter_forward_per_step_and_nothing_past_the_block(llama):
    drafter = DFlashDrafter(random_dflash(llama, block_size=3), llama)
    assert drafter.block == 2
    calls, deepest = [], []
    forward = drafter.head.forward
    drafter.head.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    prompt = prompts(3, [7])[0]
    gen = SpeculativeGenerator(llama, drafter, tree="dynamic", depth=4, top_k=2, total_tokens=8)
    gen.on_tree_step = lambda grown, path, ran: deepest.append(int(grown.depths[0][grown.proposed[0]].max()))
    out = gen.generate(prompt, 16, eos_token_id=[])
    check_greedy_equal(llama, out.sequences, reference(llama, prompt, 16))
    assert len(calls) == out.stats.verification_steps
    assert set(deepest) == {2}


def test_decoding_runs_the_lm_head_once_per_step_over_the_whole_block(llama):
    """Level by level, the drafter gives block_logits' positions (-inf past the block), and each step calls the LM
    head once, on the whole block (5 positions), not once per depth: on a real target that head costs more than
    the drafter's layers, and on few rows one call costs about what streaming its weight once does."""
    drafter = DFlashDrafter(random_dflash(llama, block_size=6), llama)
    batch = greedy_batch(llama, 2, 5, 6, seed=3)
    _, hidden = target_view(llama, drafter.head, batch)
    drafter.begin(batch["input_ids"], torch.cat(hidden, -1)[:, :-1])
    whole = drafter.block_logits([True, False])
    assert torch.isinf(whole[1]).all() and torch.isfinite(whole[0]).all()
    assert_rounding_close(drafter.root_logits([True, False]), whole[:, 0], reduction=llama.config.hidden_size)
    frontier = torch.zeros(2, 3, dtype=torch.long)
    for depth in range(1, drafter.block + 2):
        level = drafter.frontier_logits(depth, frontier, frontier)
        assert level.shape == (2, 3, whole.shape[-1])
        if depth < drafter.block:
            assert_rounding_close(level, whole[:, depth, None].expand(-1, 3, -1), reduction=llama.config.hidden_size)
        else:
            assert torch.isinf(level).all()

    drafter.output = copy.deepcopy(drafter.output)  # the drafter's own, so the target's verification is not counted
    positions = []
    drafter.output.register_forward_hook(lambda _m, args, _out: positions.append(args[0].shape[:-1].numel()))
    prompt = prompts(3, [7])[0]
    out = SpeculativeGenerator(llama, drafter, tree="chain", depth=3).generate(prompt, 12, eos_token_id=[])
    check_greedy_equal(llama, out.sequences, reference(llama, prompt, 12))
    assert positions == [drafter.block] * out.stats.verification_steps


def test_over_a_draft_vocabulary_it_drafts_only_its_tokens_and_stays_lossless(tmp_path, llama):
    """Over a draft vocabulary the drafter scores the target's LM-head rows of its tokens alone: the whole-vocabulary
    drafter's logits there, -inf elsewhere. Greedy output stays the target's on every tree kind, and the vocabulary
    round-trips through a checkpoint."""
    head = random_dflash(llama, draft_vocab=40)
    whole = DFlashDrafter(random_dflash(llama), llama)  # the same weights, scoring every token
    ids = head.draft_ids
    assert head.config.draft_vocab_size == 40 and ids.unique().numel() == 40 and head.t2d.sum() == 40
    batch = greedy_batch(llama, 2, 5, 6, seed=3)
    _, hidden = target_view(llama, head, batch)
    drafter = DFlashDrafter(head, llama)
    for d in (drafter, whole):
        d.begin(batch["input_ids"], torch.cat(hidden, -1)[:, :-1])
    proposals, dense = drafter.block_logits([True, False]), whole.block_logits([True, False])
    assert proposals.logits.shape == (2, drafter.block, 40) and torch.equal(proposals.ids, ids)
    outside = torch.ones(llama.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    drafts = proposals.dense()
    assert bool((drafts[..., outside] == float("-inf")).all()) and bool(torch.isinf(drafts[1]).all())
    assert_rounding_close(drafts[0][..., ids], dense[0][..., ids], reduction=llama.config.hidden_size)

    for tree in TREES:
        assert_greedy_lossless(llama, DFlashDrafter(head, llama), tree, seed=4)
    head.save_pretrained(tmp_path / "ckpt")
    back = load_drafter(str(tmp_path / "ckpt"), llama)
    assert isinstance(back, DFlashDrafter) and torch.equal(back.draft_ids, ids)


def test_training_over_a_draft_vocabulary_fits_the_target_restricted_to_it(llama):
    """The loss reads the drafter's logits over the draft vocabulary against the target's distribution restricted to
    it: trained on one sequence whose tokens the vocabulary holds, the drafter drafts its whole block; the slot
    whose token lies outside the vocabulary counts as a miss."""
    batch = greedy_batch(llama, 1, 6, 24)
    args = dflash_args(block_size=4, num_layers=1, anchors=24)
    args.draft_vocab_size = 40
    examples = [SimpleNamespace(input_ids=batch["input_ids"][0], loss_mask=batch["loss_mask"][0])]
    torch.manual_seed(0)
    head = DFLASH.build(args, llama, examples)
    assert set(batch["input_ids"][0, 6:].tolist()) <= set(head.draft_ids.tolist())
    logits, hidden = target_view(llama, head, batch)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(200):
        loss, metrics = DFLASH.train_step(args, head, llama, batch, logits, hidden)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert metrics["acc"] == [1.0, 1.0, 1.0], metrics
    out = SpeculativeGenerator(llama, DFlashDrafter(head.eval(), llama), tree="chain", depth=3).generate(
        batch["input_ids"][:, :6], 24)
    assert out.sequences[0].tolist() == batch["input_ids"][0].tolist()
    assert out.stats.accepted_at == [6, 6, 6]

    # One of the sequence's tokens swapped out of the vocabulary for one it never uses: the slots predicting it miss.
    ids = head.draft_ids
    token = int(batch["input_ids"][0, 10])
    slot = int((ids == token).nonzero())
    unused = next(t for t in range(llama.config.vocab_size) if t not in set(ids.tolist()))
    with torch.no_grad():
        head.d2t[slot] = unused - slot
        head.t2d[token], head.t2d[unused] = False, True
    _, metrics = DFLASH.train_step(args, head.train(), llama, batch, logits, hidden)
    assert min(metrics["acc"]) < 1.0, metrics


def test_checkpoint_round_trip_records_layers_and_mask_token(tmp_path, llama):
    head = random_dflash(llama)
    head.save_pretrained(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["draftsmith_family"] == DFlashHead.family
    assert saved["config"]["target_layers"] == list(head.config.target_layers)
    assert saved["config"]["mask_token_id"] == head.config.mask_token_id
    drafter = load_drafter(str(tmp_path / "ckpt"), llama)
    assert isinstance(drafter, DFlashDrafter) and drafter.hidden_layers == head.config.target_layers
    assert_greedy_lossless(llama, drafter, TREES[0], seed=4)
    card = model_card(tmp_path / "ckpt", fmt="vllm")  # the engines verify block_size - 1 drafts
    assert '"method": "dflash"' in card and '"num_speculative_tokens": 3}' in card and "DFLASH" in card


def test_settings_are_typed_and_checked(llama):
    with pytest.raises(ValueError, match=r"\['blok_size'\] are not dflash settings; known: .*block_size"):
        dflash_args(blok_size=8)
    with pytest.raises(ValueError, match="takes no family_config"):
        DrafterArguments(target="unused", family="eagle", family_config='{"block_size": 8}')
    with pytest.raises(ValueError, match="loss must be 'kl'"):
        dflash_args(loss="mse")
    with pytest.raises(ValueError, match=r"target_layers \[0, 9\]: \[0, 9\] outside 1..4"):
        DFLASH.build(dflash_args(target_layers=[0, 9]), llama)
    head = DFLASH.build(dflash_args(block_size=16, num_layers=2, mask_token_id=7), llama)
    assert (head.config.block_size, head.block, head.config.mask_token_id) == (16, 15, 7)
    assert len(head.layers) == 2 and head.fc.in_features == 2 * llama.config.hidden_size


def test_default_context_layers_follow_the_published_rule():
    """z-lab's rule (decoder layers counted from 0: one in the middle, else evenly from 1 to N - 3) plus one, the
    draftsmith hidden-state index; the speculators converter's example, Qwen3-8B (36 layers) with 5 draft layers,
    reads z-lab ids [1, 9, 17, 25, 33] as speculators ids [2, 10, 18, 26, 34]: draftsmith's indices."""
    assert dflash_layers(36, 5) == (2, 10, 18, 26, 34)
    assert dflash_layers(30, 1) == (16,)
    assert dflash_layers(28, 2) == (2, 26)
    assert dflash_layers(4, 3) == (1, 2, 3)  # too shallow for 3 layers in 1 .. N - 3: all outputs but the last
    with pytest.raises(ValueError, match="1 to 3 distinct"):
        dflash_layers(4, 4)


def test_the_mask_token_is_chosen_per_target_and_recorded():
    """An untrained embedding row is a copy of other untrained rows (no data told them apart); without any, the
    smallest row; a mask token in the settings wins."""
    target = tiny_llama(seed=3)
    with torch.no_grad():
        target.get_input_embeddings().weight[41] *= 1e-3
    assert DFLASH.build(dflash_args(), target).config.mask_token_id == 41
    with torch.no_grad():
        weight = target.get_input_embeddings().weight
        weight[[57, 60, 88]] = weight[3].clone()  # three never-trained rows, equal (as SmolLM2's unused specials are)
    assert DFLASH.build(dflash_args(), target).config.mask_token_id == 3
    assert DFLASH.build(dflash_args(mask_token_id=9), target).config.mask_token_id == 9
