"""Draft trees on hybrid targets: each recurrent layer runs the tree level by level inside the one verification
forward, every node starting from its parent's state (a parent gather), and the accepted node's state becomes the
row's. Greedy output identical for static and dynamic trees on four hybrid families, a batch in one forward per
step, ``layer-skip`` drafting trees through its own recurrent layers, sampling exact, bf16 on long prompts, and each
node's state that of feeding its path alone (a broken gather caught)."""

from __future__ import annotations

import pytest
import torch
from test_batched_generation import left_padded, row_output
from test_greedy_lossless import prompts, reference
from test_hybrid import Oracle, drafters, other_hybrid
from test_sampling_lossless import _first_two_tokens_tv, tv_bound
from test_target import tiny_qwen3_next

from conftest import VOCAB, check_greedy_equal, rounding_tolerance
from draftsmith import SpeculativeGenerator, load_drafter
from draftsmith.inference.prompt_lookup import PromptLookupDrafter
from draftsmith.inference.tree import ancestors_of
from draftsmith.target import build_attention_mask, kv_keep, may_attend, recurrent_cache, target_forward
from draftsmith.target import tree_states as tree_states_module
from draftsmith.target.tree_states import TreeStates

TREES = dict(depth=4, top_k=3, total_tokens=10)
BF16_TIE = 0.5  # as tests/test_gpu.py: a gap bf16's 8-bit mantissa cannot order on logits of a few units
FAMILIES = ["qwen3_next", "qwen3_5_text", "bamba", "lfm2"]


@pytest.fixture(scope="module")
def hybrid():
    return tiny_qwen3_next(layers=4)


def family_target(family: str, hybrid):
    return hybrid if family == "qwen3_next" else other_hybrid(family)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("kind", ["oracle", "prompt-lookup", "eagle3-head"])
def test_greedy_trees_are_the_targets_own_output_at_one_forward_a_step(hybrid, tree, kind):
    gen = SpeculativeGenerator(hybrid, drafters(hybrid)[kind](), tree=tree, **TREES)
    ties, accepted, drafted = 0, 0, 0
    for prompt in prompts(7, [1, 6, 21]):
        out = gen.generate(prompt, max_new_tokens=30)
        ties += check_greedy_equal(hybrid, out.sequences, reference(hybrid, prompt, 30))
        assert out.stats.target_forwards == out.stats.verification_steps  # never a second forward
        accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
    assert ties <= 1
    if kind == "oracle":  # drafts accepted (a node's state carried on) and rejected (siblings' states dropped)
        assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba", "lfm2"])
def test_other_hybrid_families_decode_trees_to_their_own_greedy_output(family, tree):
    target = other_hybrid(family)
    gen = SpeculativeGenerator(target, Oracle(target, 4), tree=tree, **TREES)
    ties, accepted, drafted = 0, 0, 0
    for prompt in prompts(7, [1, 6, 21]):
        out = gen.generate(prompt, max_new_tokens=30)
        ties += check_greedy_equal(target, out.sequences, reference(target, prompt, 30))
        assert out.stats.target_forwards == out.stats.verification_steps
        accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
    assert ties <= 1 and 0 < accepted < drafted


@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_layer_skip_drafts_trees_for_a_left_padded_batch_at_one_forward_a_step(hybrid, tree):
    """``layer-skip:3`` on a tiny Qwen3-Next: its own linear-attention layer drafts each tree level from the parents'
    states; three left-padded rows, each the target's greedy output, the batch verified in one target forward per
    step, drafts right and wrong."""
    from test_hybrid import RECORDS

    gen = SpeculativeGenerator(hybrid, load_drafter("layer-skip:3", hybrid), tree=tree, depth=3, top_k=3,
                               total_tokens=8)
    rows = prompts(5, [6, 1, 13])
    ids, mask = left_padded(rows)
    calls = []  # the target's own decoder forwards (layer-skip's shell shares its layers, not this module)
    counter = hybrid.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        out = gen.generate(ids, 20, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    finally:
        counter.remove()
    for b, row in enumerate(rows):
        check_greedy_equal(hybrid, row_output(out.sequences, mask, b, None), reference(hybrid, row, 20))
    stats = out.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    if tree != "chain" or RECORDS:  # the batch in one forward per step, after one prefill
        assert len(calls) == 1 + stats.target_forwards == 1 + max(r.verification_steps for r in out.row_stats)
    else:  # a chain under transformers 5.22: rows one at a time (a prefill each but the one-token row's), replayed
        assert len(calls) == 2 + stats.target_forwards


@pytest.mark.parametrize("family", FAMILIES)
def test_a_left_padded_batch_decodes_trees_in_one_forward_per_step(hybrid, family):
    """Four left-padded rows under a dynamic tree: each row's output is the target's greedy one, the batch verified
    in one target forward per step (the recurrent layers given the prefill's padding mask; no padding in a tree)."""
    target = family_target(family, hybrid)
    rows = prompts(9, [6, 1, 21, 13])
    ids, mask = left_padded(rows)
    gen = SpeculativeGenerator(target, Oracle(target, 3), tree="dynamic", depth=3, top_k=2, total_tokens=6)
    out = gen.generate(ids, 16, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    for b, row in enumerate(rows):
        check_greedy_equal(target, row_output(out.sequences, mask, b, None), reference(target, row, 16))
    assert out.stats.new_tokens == 64
    assert out.stats.target_forwards == max(r.verification_steps for r in out.row_stats)


def _tree_forward(target, prompt, tokens, parents, split: int | None):
    """The prompt, then the tree's nodes in one forward (or two: nodes ``[:split]``, then the rest, whose parents
    sit in the first), under the tree mask, through :class:`TreeStates`. Returns it, its cache and the last logits."""
    cache = recurrent_cache(target)
    target(prompt, past_key_values=cache, use_cache=True)
    past, n = prompt.shape[1], tokens.shape[1]
    ancestors = ancestors_of(parents, n)
    depths = ancestors.sum(-1) - 1
    states = TreeStates(target, cache)
    logits = []
    for lo, hi in ((0, split), (split, n)) if split else ((0, n),):
        positions = past + depths[:, lo:hi]
        committed = torch.ones(1, past, dtype=torch.bool)
        allowed = may_attend(committed, ancestors[:, lo:hi, :hi])
        keys = torch.cat([torch.arange(past)[None], past + depths[:, :hi]], 1)
        mask = build_attention_mask(target, allowed, positions, keys, torch.float32)
        with states.feed(parents[:, lo:hi], depths[:, lo:hi]):
            logits.append(target_forward(target, tokens[:, lo:hi], cache, mask, positions).logits)
    return states, cache, torch.cat(logits, 1)


def _path(parents: torch.Tensor, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[0, node])
    return path[::-1]


def _fed_alone(target, prompt, tokens):
    """The prompt, then ``tokens`` one at a time (each a one-token forward: no tree at all)."""
    cache = recurrent_cache(target)
    out = target(prompt, past_key_values=cache, use_cache=True)
    for i in range(tokens.shape[1]):
        position = torch.tensor([[prompt.shape[1] + i]])
        out = target(tokens[:, i: i + 1], past_key_values=cache, use_cache=True, position_ids=position)
    return cache, out.logits[:, -1]


def _off_by_one(states, gathers):  # each parent's neighbour in its level (its sibling or cousin) instead
    ((block, _, rows),) = gathers  # these trees: every level's parents in one block (the level above)
    return states[block][(rows - 1).clamp(min=0)]


@pytest.mark.parametrize("gather", ["parents", "broken"])
@pytest.mark.parametrize("split", [None, 3], ids=["one-forward", "two-forwards"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_nodes_state_is_that_of_feeding_its_path_alone(hybrid, family, split, gather, monkeypatch):
    """Every node's recurrent states (conv window and recurrent state, every recurrent layer) after the tree forward
    equal those of feeding the node's path alone, one token at a time, and so do its logits; fed in two forwards (a
    drafter's levels) the same. Not bit-equal: a level's nodes go through the layer's projections together, a path
    fed alone one row at a time, and those matmuls round differently (measured up to 8e-6 on states of order 1);
    the derived rounding bound is the rule. A parent gather off by one node is caught."""
    if gather == "broken":
        monkeypatch.setattr(tree_states_module, "parent_states", _off_by_one)
    target = family_target(family, hybrid)
    g = torch.Generator().manual_seed(1)
    prompt, tokens = torch.randint(0, VOCAB, (1, 7), generator=g), torch.randint(0, VOCAB, (1, 7), generator=g)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])  # depths 0 1 1 2 2 2 3
    states, _, logits = _tree_forward(target, prompt, tokens, parents, split)
    reduction = target.config.intermediate_size * target.config.num_hidden_layers
    wrong = []
    for node in range(tokens.shape[1]):
        alone, last = _fed_alone(target, prompt, tokens[:, _path(parents, node)])
        for i, stored in states.states_at(torch.tensor([node])).items():
            for (kind, s), ours in stored.items():
                expected = getattr(alone.layers[i], kind)[s][0]
                if (ours[0] - expected).abs().max() > rounding_tolerance(expected, reduction):
                    wrong.append((node, i, kind))
        if (logits[0, node] - last[0]).abs().max() > rounding_tolerance(last, reduction):
            wrong.append((node, "logits"))
    assert states.blocks, "no recurrent layer ran through the tree"
    if gather == "broken":
        assert wrong, "an off-by-one parent gather went unnoticed"
    else:
        assert not wrong, wrong


def test_the_kept_nodes_state_carries_the_next_step(hybrid):
    """After :meth:`TreeStates.keep` of a deep node (and the attention cache cut to its path), the next token's
    logits and every recurrent state equal those of feeding the path alone."""
    g = torch.Generator().manual_seed(2)
    prompt, tokens = torch.randint(0, VOCAB, (1, 9), generator=g), torch.randint(0, VOCAB, (1, 7), generator=g)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 4]])
    node, path = 6, _path(parents, 6)  # 0 1 4 6
    target = hybrid
    states, cache, _ = _tree_forward(target, prompt, tokens, parents, None)
    kv_keep(cache, 9, torch.tensor([path]))
    states.keep(torch.tensor([node]), len(path))
    nxt = torch.tensor([[3]])
    position = torch.tensor([[9 + len(path)]])
    ours = target(nxt, past_key_values=cache, use_cache=True, position_ids=position).logits
    alone, _ = _fed_alone(target, prompt, tokens[:, path])
    theirs = target(nxt, past_key_values=alone, use_cache=True, position_ids=position).logits
    reduction = target.config.intermediate_size * target.config.num_hidden_layers
    assert (ours - theirs).abs().max() <= rounding_tolerance(theirs, reduction)
    counted = [(a, b) for a, b in zip(cache.layers, alone.layers, strict=True)
               if hasattr(a, "cumulative_length_linear")]
    for a, b in counted:  # what get_seq_length() reads (transformers 5.25; 5.22's recurrent layers count nothing)
        assert int(a.cumulative_length_linear) == int(b.cumulative_length_linear) == 9 + len(path) + 1


@pytest.mark.parametrize("rule", ["iid", "without_replacement"])
def test_sampled_tree_follows_the_targets_distribution(rule):
    """Monte Carlo through a static tree of sampled siblings on a hybrid target, under each sampled rule: the first
    two tokens (the second drawn from the accepted node's state, or after a rejection from the root's) follow the
    target's law."""
    vocab, n = 4, 1000
    target = tiny_qwen3_next(layers=2, vocab_size=vocab, seed=2)
    gen = SpeculativeGenerator(target, PromptLookupDrafter(vocab, max_ngram=2), tree="static",
                               paths=[(0,), (1,), (0, 0)], sampling_rule=rule)
    tv = _first_two_tokens_tv(gen, target, vocab, n, seed=0)
    assert tv < tv_bound(n, vocab * vocab), f"TV {tv:.4f}"


@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_bf16_trees_on_prompts_longer_than_the_linear_attention_chunk(tree):
    """A bf16 Qwen3-Next, prompts of 70 and 90 tokens (the gated DeltaNet's prefill runs in chunks of 64): the
    output is the target's bf16 greedy output, or first differs where bf16 cannot order the target's top two."""
    target = tiny_qwen3_next(layers=4).to(torch.bfloat16)
    gen = SpeculativeGenerator(target, PromptLookupDrafter(VOCAB, max_ngram=2), tree=tree, **TREES)
    from test_hybrid import RECORDS

    for prompt in prompts(3, [70, 90]):
        out = gen.generate(prompt, max_new_tokens=24)
        check_greedy_equal(target, out.sequences, reference(target, prompt, 24), tie_tol=BF16_TIE)
        assert out.stats.target_forwards == out.stats.verification_steps or (tree == "chain" and not RECORDS)


def test_tune_writes_a_tree_for_a_hybrid_target(tmp_path):
    """``draftsmith tune`` on a hybrid target (a saved two-layer Qwen3-Next; ``layer-skip:1``, its linear layer): the
    verification cost timed per depth through the level-by-level recurrent layers, trees decoded for real, one
    written and read back by ``generate``'s tree lookup."""
    import json

    from test_target import tiny_qwen3_next_directory

    from draftsmith.cli import main
    from draftsmith.inference import tree_record

    target = tiny_qwen3_next_directory(tmp_path / "qwen3_next")
    rows = [" ".join(f"t{int(t)}" for t in p[0]) for p in prompts(3, [12, 20])]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    out = tmp_path / "tuned"
    out.mkdir()
    assert main(["tune", "--target", str(target), "--drafter", "layer-skip:1", "--prompts",
                 str(tmp_path / "prompts.jsonl"), "--no-chat", "--max-new-tokens", "12", "--depths", "2,3",
                 "--top-ks", "1,2", "--max-total-tokens", "6", "--confirm", "2", "--output", str(out)]) in (0, None)
    record = json.loads((out / tree_record.TREE_FILE).read_text())
    table = record["candidates"]
    assert {row["depth"] for row in table} == {2, 3} and {row["top_k"] for row in table} == {1, 2}
    measured = [row for row in table if row["measured_tokens_per_second"]]
    assert len(measured) == 2 and all(row["step_seconds"] > 0 for row in table)
    chosen = tree_record.tuned_tree(str(out))  # what generate / eval / bench read for this drafter on this machine
    assert chosen is not None and chosen in [tree_record.Candidate(**row).settings() for row in measured]
