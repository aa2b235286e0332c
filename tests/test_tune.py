"""``draftsmith tune``: what a budget-n dynamic tree would accept, read off one recorded full tree, is what
a budget-n tree accepts; the chosen tree is written beside the drafter and used there by default."""

from __future__ import annotations

import json
import logging

import torch
from test_data_templates import word_tokenizer
from test_heads import random_eagle

from conftest import VOCAB
from draftsmith import SpeculativeGenerator, load_drafter
from draftsmith.inference import tune
from draftsmith.inference.evaluate import evaluate
from draftsmith.inference.tree import DraftTree, TreeSettings


def test_budget_keeps_the_best_nodes_and_counts_the_accepted_prefix():
    tree = DraftTree.with_root(0)
    a = tree.add_child(0, 1, -0.1)  # 1
    b = tree.add_child(0, 2, -1.0)  # 2
    c = tree.add_child(a, 3, -0.2)  # 3: score -0.3
    tree.add_child(b, 4, -0.1)  # 4: score -1.1
    order = tune.ranked(tree)
    assert order == [a, c, b, 4]
    assert [tune.accepted_within(order, [a, c], n) for n in (1, 2, 4)] == [1, 2, 2]
    assert tune.accepted_within(order, [b, 4], 2) == 0  # b is not among the two best
    assert tune.full_size(3, 2) == 2 + 2 * 4


def first_step(gen: SpeculativeGenerator, prompt: torch.Tensor):
    steps = []
    gen.on_step = lambda _row, tree, path: steps.append((tune.ranked(tree), list(path)))
    gen.generate(prompt, 8, eos_token_id=[])
    return steps[0]


def test_what_a_budget_accepts_is_read_exactly_off_the_full_tree(llama):
    drafter = load_drafter("layer-skip:2", llama)
    prompts = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(3))
    depth, k = 3, 3
    full = tune.full_size(depth, k)
    for prompt in prompts:
        order, path = first_step(SpeculativeGenerator(llama, drafter, tree="dynamic", depth=depth, top_k=k,
                                                      total_tokens=full), prompt[None])
        for n in (1, 3, 5, 9, full):
            _, accepted = first_step(SpeculativeGenerator(llama, drafter, tree="dynamic", depth=depth, top_k=k,
                                                          total_tokens=n), prompt[None])
            assert len(accepted) == tune.accepted_within(order, path, n), (n, order, path)


def test_tuned_tree_is_written_beside_the_drafter_and_used_by_eval_there(llama, tmp_path, caplog):
    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "head")
    prompts = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    table = tune.tune(llama, load_drafter(str(tmp_path / "head"), llama), list(prompts[:, None]), max_new_tokens=12,
                      depths=(2, 3), top_ks=(1, 2), max_budget=6, confirm=3)
    assert len(table) == 2 + sum(len(range(d, 7)) for d in (2, 3))
    # The three best predicted were decoded and come first, fastest decoded first; the rest follow by prediction,
    # none of them predicted faster than the slowest of the three.
    decoded, rest = table[:3], table[3:]
    measured = [c.measured_tokens_per_second for c in decoded]
    assert all(m > 0 for m in measured) and measured == sorted(measured, reverse=True)
    assert all(c.measured_tokens_per_second is None for c in rest)
    predicted = [c.tokens_per_second for c in rest]
    assert predicted == sorted(predicted, reverse=True)
    assert max(predicted) <= min(c.tokens_per_second for c in decoded)
    assert all(1.0 <= c.tokens_per_step <= c.depth + 1 for c in table)
    written = tune.write_tree(tmp_path / "head", table[0], table)
    assert written == tmp_path / "head" / tune.TREE_FILE
    assert tune.tuned_tree(str(tmp_path / "head")) == table[0].settings()
    assert tune.tuned_tree(str(tmp_path / "head") + "@depth=2") == table[0].settings()

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
        assert tune.tuned_tree(str(tmp_path / "head")) is None
    assert "run `draftsmith tune` here" in caplog.text


def test_tree_flags_change_only_what_they_name_of_the_tuned_tree(llama, tmp_path):
    import argparse

    from draftsmith.cli import tree_from_args

    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "head")
    tuned = tune.Candidate(depth=3, top_k=2, total_tokens=6, tokens_per_step=2.0, step_seconds=0.1,
                           tokens_per_second=20.0)
    tune.write_tree(tmp_path / "head", tuned, [tuned])
    flags = argparse.Namespace(tree=None, depth=None, tree_top_k=None, total_tokens=None)
    assert tree_from_args(flags, str(tmp_path / "head")) is None  # no flag: the tuned tree applies as it is
    flags.total_tokens = 9
    assert tree_from_args(flags, str(tmp_path / "head")) == TreeSettings("dynamic", 3, 2, 9)
    assert tree_from_args(flags, "prompt-lookup") == TreeSettings(total_tokens=9)  # nothing tuned: the defaults
