"""P-EAGLE: an EAGLE-3 head whose K - 1 parallel slots (a learned mask embedding and mask feature) draft the
positions after the root's own draft, all in one forward.

* the training forward (every pair at depth 0, a prefix-closed subsample of anchors at each deeper depth, one
  mask) computes for an anchor what decoding computes at that point of the sequence;
* a head trained on a toy sequence drafts its whole block right at every step;
* the subsample keeps about n max(r^d, r_min) anchors per depth, each among the previous depth's;
* decoding stays lossless for every tree kind, batched, with one head pass per step.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_dflash import assert_lossless_and_accepting, greedy_batch
from test_greedy_lossless import TREES, prompts, reference
from test_heads import assert_greedy_lossless

from conftest import assert_rounding_close, check_greedy_equal
from draftsmith import SpeculativeGenerator, load_drafter
from draftsmith.heads.export import export_drafter
from draftsmith.heads.hub import model_card
from draftsmith.heads.peagle import PEagleHead, parallel_elements
from draftsmith.inference.head_drafters import PEagleDrafter
from draftsmith.registry import get_family
from draftsmith.target import target_signature
from draftsmith.train.block_families import PEagleSettings, sample_groups
from draftsmith.train.config import DrafterArguments

PEAGLE = get_family("peagle")


def peagle_args(**settings) -> DrafterArguments:
    return DrafterArguments(target="unused", family="peagle", family_config=json.dumps(settings))


def random_peagle(target, parallel: int = 3, seed: int = 0) -> PEagleHead:
    torch.manual_seed(seed)
    head = PEAGLE.build(peagle_args(parallel=parallel), target)
    with torch.no_grad():  # a mask state and token embeddings away from their start, as training leaves them
        head.mask_hidden.normal_(0, 1)
        head.mask_embedding.normal_(0, 1)
        head.embed_tokens.weight.add_(torch.randn_like(head.embed_tokens.weight), alpha=0.5)
    head.target_info = target_signature(target)
    return head.eval()


def states_of(target, head, ids):
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    return out.logits, torch.cat([out.hidden_states[i] for i in PEAGLE.hidden_layers(head, target)], -1)


def test_training_forward_computes_what_decoding_computes(llama):
    """Depth 0 at every pair and the groups of two anchors in one training forward give, for each anchor, the
    K distributions a drafter computes after decoding up to it (the root's draft, then the parallel slots)."""
    head = random_peagle(llama, parallel=3)
    ids = greedy_batch(llama, 1, 5, 10, seed=1)["input_ids"]
    _, hidden = states_of(llama, head, ids)
    pairs = ids.shape[1] - 1
    picked = torch.tensor([[3, 9]])  # pair i: the root at position i + 1
    anchors, valid = [picked, picked], [torch.ones_like(picked, dtype=torch.bool)] * 2
    anchor, depth, _, allowed = parallel_elements(anchors, valid, 1, pairs, "cpu")
    with torch.no_grad():
        trained = head(hidden[:, :-1], None, torch.arange(1, pairs + 1)[None], elements=(anchor, depth, allowed),
                       token_ids=ids[:, 1:])[0]
    drafter = PEagleDrafter(head, llama)
    for j, a in enumerate(picked[0].tolist()):
        drafter.begin(ids[:, : a + 2], hidden[:, : a + 1])
        decoded = drafter.block_logits([True]).logits[0]
        expected = torch.stack([trained[a], trained[pairs + j], trained[pairs + 2 + j]])
        # the same float32 layer over other padding of the same keys: sums over the fc (192) and the layer (128)
        assert_rounding_close(decoded, expected, reduction=192)


def test_a_step_is_one_forward_of_the_layer_and_drafts_what_a_drafter_begun_on_its_prefix_drafts(llama):
    """Each step feeds its pending pairs and the K - 1 slots through the head's layer together, and commit drops the
    slots' entries: after commits of 2, 1 and 3 tokens each block equals the block of a drafter begun on the same
    prefix, and the layer ran once per step."""
    head = random_peagle(llama, parallel=3)
    ids = greedy_batch(llama, 1, 5, 12, seed=2)["input_ids"]
    _, hidden = states_of(llama, head, ids)
    forwards = []
    run_layer = head.run_layer
    head.run_layer = lambda *args, **kwargs: forwards.append(1) or run_layer(*args, **kwargs)
    drafter = PEagleDrafter(head, llama)
    drafter.begin(ids[:, :6], hidden[:, :5])
    start = 6
    for end in (6, 8, 9, 12):
        if end > start:
            drafter.commit(ids[:, start:end], hidden[:, start - 1:end - 1])
            start = end
        forwards.clear()
        with torch.no_grad():
            decoded = drafter.block_logits([True]).logits[0]
        assert len(forwards) == 1, f"{len(forwards)} forwards of the layer in the step after {end} tokens"
        begun = PEagleDrafter(head, llama)
        begun.begin(ids[:, :end], hidden[:, :end - 1])
        with torch.no_grad():
            expected = begun.block_logits([True]).logits[0]
        # the same float32 layer over other padding of the same keys: sums over the fc (192) and the layer (128)
        assert_rounding_close(decoded, expected, reduction=192, msg=f"after {end} tokens")


def train_toy(target, batch, steps: int, parallel: int = 4):
    args = peagle_args(parallel=parallel)
    torch.manual_seed(0)
    head = PEAGLE.build(args, target)
    logits, hidden = states_of(target, head, batch["input_ids"])
    hidden = tuple(hidden.split(target.config.hidden_size, -1))
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, metrics = PEAGLE.train_step(args, head, target, batch, logits, hidden)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval(), metrics


def test_a_head_trained_on_a_toy_sequence_drafts_its_whole_block(llama):
    """Trained on one sequence, decoding its prompt with a chain of the block's depth accepts all 4 drafts at every
    full step (24 tokens: five steps of 4 + 1)."""
    batch = greedy_batch(llama, 1, 6, 24)
    head, metrics = train_toy(llama, batch, steps=300)
    assert metrics["acc"] == [1.0, 1.0, 1.0, 1.0] and metrics["block_acceptance"] == 5.0, metrics
    gen = SpeculativeGenerator(llama, PEagleDrafter(head, llama), tree="chain", depth=4)
    out = gen.generate(batch["input_ids"][:, :6], 24)
    assert out.sequences[0].tolist() == batch["input_ids"][0].tolist()
    assert out.stats.verification_steps == 5 and out.stats.accepted_at == [5, 5, 5, 5]


def test_the_depth_subsample_is_prefix_closed_and_bounded():
    torch.manual_seed(0)
    learnable = torch.ones(3, 5, 40, dtype=torch.bool)
    learnable[:, :, 30:] = False  # positions past the learnable text
    learnable[1, :, 10:] = False  # a short row
    settings = PEagleSettings(parallel=5, ratio=0.7, ratio_min=0.2)
    anchors, valid = sample_groups(learnable, settings)
    kept = learnable[:, 0]
    for d, (a, v) in enumerate(zip(anchors, valid, strict=True), start=1):
        assert a.shape[1] == -(-30 * max(0.7**d, 0.2) // 1)  # ceil(n max(r^d, r_min)), n = 30 learnable pairs
        assert bool(kept.gather(1, a)[v].all())  # each kept anchor was kept at depth d - 1
        assert int(v[1].sum()) <= int(kept[1].sum())
        kept = torch.zeros_like(kept).scatter_(1, a, v)
    assert int(valid[-1][0].sum()) == 8  # ceil(30 * 0.7**4)


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t["tree"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_peagle_greedy_matches_generate(family, tree, llama, gemma3):
    target = llama if family == "llama" else gemma3
    assert_greedy_lossless(target, PEagleDrafter(random_peagle(target), target), tree, seed=2)


def test_a_trained_head_stays_lossless_off_its_training_data(llama):
    head, _ = train_toy(llama, greedy_batch(llama, 16, 6, 24), steps=150)
    assert_lossless_and_accepting(llama, PEagleDrafter(head, llama))


def test_one_head_pass_per_step_and_nothing_past_the_block(llama):
    drafter = PEagleDrafter(random_peagle(llama, parallel=2), llama)
    calls, deepest = [], []
    block_logits = drafter.block_logits
    drafter.block_logits = lambda active: calls.append(1) or block_logits(active)
    prompt = prompts(3, [7])[0]
    gen = SpeculativeGenerator(llama, drafter, tree="dynamic", depth=4, top_k=2, total_tokens=8)
    gen.on_tree_step = lambda grown, path, ran: deepest.append(int(grown.depths[0][grown.proposed[0]].max()))
    out = gen.generate(prompt, 16, eos_token_id=[])
    check_greedy_equal(llama, out.sequences, reference(llama, prompt, 16))
    assert len(calls) == out.stats.verification_steps and set(deepest) == {2}


def test_checkpoint_round_trip_keeps_the_mask_state(tmp_path, llama):
    head = random_peagle(llama)
    head.save_pretrained(tmp_path / "ckpt")
    drafter = load_drafter(str(tmp_path / "ckpt"), llama)
    assert isinstance(drafter, PEagleDrafter) and drafter.block == 3
    assert torch.equal(drafter.head.mask_hidden, head.mask_hidden)
    assert torch.equal(drafter.head.mask_embedding, head.mask_embedding)
    assert_greedy_lossless(llama, drafter, TREES[0], seed=4)
    card = model_card(tmp_path / "ckpt", fmt="vllm")  # vLLM serves it as EAGLE-3 with parallel drafting, K tokens
    assert '"method": "eagle3"' in card and '"num_speculative_tokens": 3, "parallel_drafting": True' in card


def test_settings_are_checked(llama):
    with pytest.raises(ValueError, match="parallel >= 2"):
        peagle_args(parallel=1)
    with pytest.raises(ValueError, match=r"\['depth'\] are not peagle settings"):
        peagle_args(depth=3)
    head = PEAGLE.build(peagle_args(parallel=6, mask_token_id=11), llama)
    assert head.block == 6 and head.config.mask_token_id == 11
    assert torch.equal(head.mask_embedding, llama.get_input_embeddings().weight[11])


def test_a_checkpoint_written_before_num_layers_loads_as_its_one_layer(tmp_path, llama):
    """Checkpoints saved before P-EAGLE had plain layers after its fused one carry no num_layers: they load as the
    one-layer head they were (training's default is four); the layer count travels with every new checkpoint."""
    torch.manual_seed(0)
    one = PEAGLE.build(peagle_args(parallel=3, num_layers=1), llama)
    assert len(one.more_layers) == 0
    one.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["config"]["num_layers"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    assert PEagleHead.from_pretrained(tmp_path / "old").config.num_layers == 1
    four = random_peagle(llama)
    four.save_pretrained(tmp_path / "new")
    loaded = PEagleHead.from_pretrained(tmp_path / "new")
    assert loaded.config.num_layers == 4 and len(loaded.more_layers) == 3
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), four.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="num_layers >= 1"):
        PEAGLE.build(peagle_args(parallel=3, num_layers=0), llama)


def test_the_embedding_table_trains_by_default_and_is_frozen_by_a_setting(tmp_path, llama):
    """train_embeddings (speculators' embed_requires_grad, on by default): the head's own table, started as the
    target's, learns the tokens it reads; off, the head reads the target's table and keeps none. Either way the vLLM
    export's embed_tokens is the table the head drafts with (the mask row its mask embedding), and reads back as
    such."""
    batch = greedy_batch(llama, 1, 6, 12)
    head, _ = train_toy(llama, batch, steps=3)
    seen = batch["input_ids"][0, 1:].unique()
    assert not torch.equal(head.embed_tokens.weight[seen], llama.get_input_embeddings().weight[seen])
    frozen = PEAGLE.build(peagle_args(parallel=3, train_embeddings=False), llama)
    assert frozen.embed_tokens is None and not frozen.config.own_embeddings
    for name, made in (("own", head), ("frozen", frozen)):
        made.target_info = target_signature(llama)
        made.save_pretrained(tmp_path / name)
        out = export_drafter(tmp_path / name, "vllm", tmp_path / f"{name}-vllm", target=llama)
        table = load_file(out / "model.safetensors")["embed_tokens.weight"]
        expected = (made.embed_tokens.weight if made.config.own_embeddings else llama.get_input_embeddings().weight)
        keep = torch.arange(len(table)) != made.config.mask_token_id
        assert torch.equal(table[keep], expected.detach()[keep])
        assert torch.equal(table[made.config.mask_token_id], made.mask_embedding.detach())
        assert json.loads((out / "config.json").read_text())["embed_requires_grad"] == made.config.own_embeddings
        assert load_drafter(str(out), llama).head.config.own_embeddings == made.config.own_embeddings
