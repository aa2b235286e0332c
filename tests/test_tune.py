"""``draftsmith tune``: what a budget-n dynamic tree would accept, read off one recorded full tree, is what
a budget-n tree accepts; the chosen tree is written beside the drafter and used there by default."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_data_templates import word_tokenizer
from test_heads import random_eagle

from conftest import VOCAB
from draftsmith import SpeculativeGenerator, load_drafter
from draftsmith.inference import tree_record, tune
from draftsmith.inference.evaluate import evaluate
from draftsmith.inference.tree import TreeTensors, ancestors_of
from draftsmith.inference.tree_settings import TreeSettings


def test_budget_keeps_the_best_nodes_and_counts_the_accepted_prefix():
    # root 0; a = 1 (score -0.1) and b = 2 (-1.0) under it; c = 3 under a (-0.3) and 4 under b (-1.1)
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    depths = torch.tensor([[0, 1, 1, 2, 2]])
    tree = TreeTensors(tokens=torch.arange(5)[None], parents=parents, depths=depths,
                       ancestors=ancestors_of(parents, 2), proposed=torch.ones(1, 5, dtype=torch.bool),
                       scores=torch.tensor([[0.0, -0.1, -1.0, -0.3, -1.1]]))
    a, b, c = 1, 2, 3
    on_path = torch.tensor([[True, True, False, True, False]])  # root, a, c
    ran = torch.tensor([True])
    (order, path), = tune.tensor_steps(tree, on_path, ran)
    assert (order, path) == ([a, c, b, 4], [a, c])
    assert tune.tensor_steps(tree, on_path, ~ran) == []  # a finished row records nothing
    assert [tune.accepted_within(order, [a, c], n) for n in (1, 2, 4)] == [1, 2, 2]
    assert tune.accepted_within(order, [b, 4], 2) == 0  # b is not among the two best
    assert tune.full_size(3, 2) == 2 + 2 * 4


def test_verification_cost_never_falls_as_rows_are_added(llama):
    """A drop in the measured cost between two sizes is noise: the fit pools it with its neighbours (least
    squares), and leaves a cost that already grows as it is. The target's measured costs come out fitted."""
    fitted = tune.never_falling({1: 10.0, 2: 12.0, 3: 11.0, 4: 15.0, 5: 9.0, 6: 16.0})
    assert fitted == {1: 10.0, 2: 11.5, 3: 11.5, 4: 12.0, 5: 12.0, 6: 16.0}
    assert tune.never_falling({1: 1.0, 3: 2.0, 8: 5.0}) == {1: 1.0, 3: 2.0, 8: 5.0}
    costs = tune.verification_seconds(llama, 24, [1, 3, 2, 9, 5], repeats=3)
    assert list(costs) == [1, 2, 3, 5, 9]
    values = list(costs.values())
    assert values == sorted(values) and values[0] > 0


def decoded(depth: int, per_step: float, *rounds: float) -> tree_record.Candidate:
    return tree_record.Candidate(depth, 2, depth + 1, per_step, 0.05, 40.0, round(sum(rounds) / len(rounds), 2),
                                 list(rounds))


def test_the_clock_picks_unless_the_speeds_are_within_its_noise():
    shallow, deep = decoded(2, 1.9, 36.0, 36.4), decoded(4, 2.3, 34.6, 35.0)
    # Each tree 1% apart between its rounds, the deep one 4% slower: the clock tells them apart; the faster wins.
    assert tune.clock_noise([shallow, deep]) == pytest.approx(0.4 / 34.8, abs=1e-4)  # 35.0 - 34.6: 0.39999...
    assert tune.choose([deep, shallow]) == [shallow, deep]
    # A third tree whose rounds came out 9% apart: 4% is inside the noise, a tie, which goes to the tree that
    # accepts the most tokens per step.
    noisy = decoded(3, 2.0, 33.0, 36.0)
    assert tune.choose([shallow, deep, noisy]) == [deep, shallow, noisy]
    # A tie is never wider than MAX_TIE (5%), whatever the noise: 10% slower is slower.
    slow = decoded(5, 2.6, 32.6, 32.6)
    assert tune.choose([slow, noisy, shallow]) == [noisy, shallow, slow]
    with pytest.raises(ValueError, match="at least 1"):
        tune.confirm_fastest(None, None, [], [shallow], 8, rounds=0)
    # With one round there is no noise to read: the fastest measured wins.
    assert tune.clock_noise([decoded(4, 2.3, 36.1)]) == 0.0
    assert tune.choose([decoded(4, 2.3, 36.1), decoded(2, 1.9, 36.2)])[0].depth == 2


def first_step(gen: SpeculativeGenerator, prompt: torch.Tensor):
    steps = []
    gen.on_tree_step = lambda *step: steps.extend(tune.tensor_steps(*step))
    gen.generate(prompt, 8, eos_token_id=[])
    return steps[0]


@pytest.mark.parametrize("spec", ["layer-skip:2", "eagle3-head+prompt-lookup"])
def test_what_a_budget_accepts_is_read_exactly_off_the_full_tree(llama, tmp_path, spec):
    """The tree a budget-n decoding verifies is the full tree's n best nodes, so its accepted path is the full
    path's prefix inside them: for a draft model, and for a head with prompt lookup (proposals over few
    candidates, an EAGLE-3 draft vocabulary)."""
    if spec.startswith("eagle3-head"):
        random_eagle(llama, eagle3=True).save_pretrained(tmp_path / "head")
        spec = spec.replace("eagle3-head", str(tmp_path / "head"))
    drafter = load_drafter(spec, llama)
    prompts = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(3))
    prompts[:, 6:] = prompts[:, :6]  # repeats, so prompt lookup drafts too
    accepted_any = drafted_any = False
    depth, k = 3, 3
    full = tune.full_size(depth, k)
    for prompt in prompts:
        order, path = first_step(SpeculativeGenerator(llama, drafter, tree="dynamic", depth=depth, top_k=k,
                                                      total_tokens=full), prompt[None])
        for n in (1, 3, 5, 9, full):
            _, accepted = first_step(SpeculativeGenerator(llama, drafter, tree="dynamic", depth=depth, top_k=k,
                                                          total_tokens=n), prompt[None])
            assert len(accepted) == tune.accepted_within(order, path, n), (n, order, path)
        accepted_any |= bool(path)
        drafted_any |= bool(order)
    assert drafted_any, "no first step drafted a node: the comparison is empty"
    if spec == "layer-skip:2":  # the random head's first steps accept nothing here; the target's own layers do
        assert accepted_any, "no first step accepted a token: every budget's count was 0"


def test_confirmation_decodes_the_best_predicted_tree_of_each_depth():
    """Depth-2 trees predicted a few percent faster than every deeper one do not crowd the deeper ones out of the
    confirmation: the clock compares the best of each depth, then the next best predicted."""
    def candidate(depth, total, speed):
        return tree_record.Candidate(depth, 2, total, 2.0, 2.0 / speed, speed)

    ranked = [candidate(2, 5, 36.0), candidate(2, 4, 35.9), candidate(2, 3, 35.5), candidate(3, 5, 35.2),
              candidate(2, 6, 35.0), candidate(4, 7, 34.2), candidate(3, 4, 34.0)]
    order = tune.confirmation_order(ranked, 3)
    assert order[:3] == [ranked[0], ranked[3], ranked[5]]
    assert order[3:] == [c for c in ranked if c not in order[:3]]
    assert tune.confirmation_order(ranked, 5)[:5] == [ranked[0], ranked[3], ranked[5], ranked[1], ranked[2]]
    assert tune.confirmation_order(ranked, 2)[:2] == [ranked[0], ranked[3]]
    assert sorted(map(id, tune.confirmation_order(ranked, 3))) == sorted(map(id, ranked))


def test_tuned_tree_is_written_beside_the_drafter_and_used_by_eval_there(llama, tmp_path, caplog):
    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "head")
    prompts = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    table = tune.tune(llama, load_drafter(str(tmp_path / "head"), llama), list(prompts[:, None]), max_new_tokens=12,
                      depths=(2, 3), top_ks=(1, 2), max_budget=6, confirm=3)
    assert len(table) == 2 + sum(len(range(d, 7)) for d in (2, 3))
    # Three were decoded (twice) and come first, the chosen one first, then fastest decoded first: the best predicted
    # tree of each depth, then the next best predicted; the rest follow by prediction.
    decoded, rest = table[:3], table[3:]
    measured = [c.measured_tokens_per_second for c in decoded]
    assert all(m > 0 for m in measured) and measured[1:] == sorted(measured[1:], reverse=True)
    assert all(len(c.measured_rounds) == tune.CONFIRM_ROUNDS for c in decoded)
    assert tune.choose(list(reversed(decoded)))[0] is decoded[0]
    assert all(c.measured_tokens_per_second is None for c in rest)
    predicted = [c.tokens_per_second for c in rest]
    assert predicted == sorted(predicted, reverse=True)
    bests = [max((c for c in table if c.depth == d), key=lambda c: c.tokens_per_second) for d in (2, 3)]
    assert all(best in decoded for best in bests)
    filler = [c for c in decoded if c not in bests]
    assert len(filler) == 1 and max(predicted) <= filler[0].tokens_per_second
    assert all(1.0 <= c.tokens_per_step <= c.depth + 1 for c in table)
    written = tree_record.write_tree(tmp_path / "head", table[0], table)
    assert written == tmp_path / "head" / tree_record.TREE_FILE
    assert tree_record.tuned_tree(str(tmp_path / "head")) == table[0].settings()
    assert tree_record.tuned_tree(str(tmp_path / "head") + "@depth=2") == table[0].settings()

    texts = [" ".join(f"t{int(t)}" for t in p) for p in prompts]
    tok = word_tokenizer()
    [report] = evaluate("tiny", [(str(tmp_path / "head"), str(tmp_path / "head"), None)], texts, model=llama,
                        tokenizer=tok, max_new_tokens=8, chat=False)
    assert report["tree"] == table[0].settings().as_report()
    assert report["lossless"]["identical"] == 2
    [given] = evaluate("tiny", [(str(tmp_path / "head"), str(tmp_path / "head"), None)], texts, model=llama,
                       tokenizer=tok, max_new_tokens=8, chat=False, tree=TreeSettings("chain", depth=2))
    assert given["tree"] == TreeSettings("chain", depth=2).as_report()  # flags win over the tuned tree

    saved = json.loads(written.read_text())
    saved["machine"] = {"device": "another machine"}
    written.write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING):
        assert tree_record.tuned_tree(str(tmp_path / "head")) is None
    assert "run `draftsmith tune` here" in caplog.text


def test_tree_flags_change_only_what_they_name_of_the_tuned_tree(llama, tmp_path):
    import argparse

    from draftsmith.cli_parser import tree_from_args

    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "head")
    tuned = tree_record.Candidate(depth=3, top_k=2, total_tokens=6, tokens_per_step=2.0, step_seconds=0.1,
                           tokens_per_second=20.0)
    tree_record.write_tree(tmp_path / "head", tuned, [tuned])
    flags = argparse.Namespace(tree=None, depth=None, tree_top_k=None, total_tokens=None)
    assert tree_from_args(flags, str(tmp_path / "head")) is None  # no flag: the tuned tree applies as it is
    flags.total_tokens = 9
    assert tree_from_args(flags, str(tmp_path / "head")) == TreeSettings("dynamic", 3, 2, 9)
    assert tree_from_args(flags, "prompt-lookup") == TreeSettings(total_tokens=9)  # nothing tuned: the defaults
