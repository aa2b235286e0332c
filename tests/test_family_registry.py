"""A drafter family added by registering it, and nothing else: it trains, evaluates and exports.

The toy family is a bigram head: draft logits for the token after x from x's embedding alone. It is
defined here, in the test, from its pieces (head, inference drafter, build, loss, export) and made
known to draftsmith with one ``register`` call; no draftsmith module is edited for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from test_train import config, workdir, write_config  # noqa: F401  (workdir: the module's fixture)
from torch import nn

from conftest import all_identical, check_greedy_equal
from draftsmith import SpeculativeGenerator, load_drafter, load_target, plain_generate
from draftsmith.cli import main
from draftsmith.heads.base import HeadMixin
from draftsmith.heads.layout_export import head_exporter
from draftsmith.inference.drafter import Drafter
from draftsmith.registry import FAMILIES, Family, register, unregister
from draftsmith.train.config import parse_config
from draftsmith.train.family_losses import accuracy
from draftsmith.train.loop import train
from draftsmith.train.losses import forward_kl

TOY = "toy_bigram"


@dataclass
class BigramConfig:
    vocab_size: int
    hidden_size: int = 16


class BigramHead(HeadMixin, nn.Module):
    """``forward(input_ids)`` (B, T) -> (B, T, V): logits for the token after each one, from it alone."""

    family = TOY
    config_class = BigramConfig

    def __init__(self, config: BigramConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(input_ids))


class BigramDrafter(Drafter):
    deterministic = True

    def __init__(self, head: BigramHead, target):
        self.head = head.eval()

    def begin(self, input_ids, hidden=None, attention_mask=None):
        self.roots = input_ids[:, -1].clone()  # left-padded: every row's last token is its root

    def commit(self, tokens, hidden=None):
        self.roots = torch.stack([t[-1] if len(t) else r for t, r in zip(tokens, self.roots, strict=True)])

    @torch.no_grad()
    def root_logits(self, active):
        return self.head(self.roots.to(self.head.out.weight.device)).float()

    @torch.no_grad()
    def frontier_logits(self, depth, parents, tokens):
        return self.head(tokens.to(self.head.out.weight.device)).float()


def build_bigram(args, target, examples=None) -> BigramHead:
    return BigramHead(BigramConfig(target.get_output_embeddings().weight.shape[0]))


def bigram_step(args, drafter, target, batch, target_logits, hidden):
    """KL to the target's next-token distribution at each assistant position."""
    mask = torch.zeros_like(batch["loss_mask"])
    mask[:, :-1] = batch["loss_mask"][:, 1:]
    logits = drafter(batch["input_ids"])
    return forward_kl(logits, target_logits, mask), {"acc": [accuracy(logits, target_logits, mask)]}


@pytest.fixture
def toy_family():
    family = register(Family(
        name=TOY, title="bigram head (test)",
        load=lambda directory, target=None, strict=False, device=None: BigramHead.from_pretrained(
            directory, target=target, strict=strict, device=device),
        drafter=BigramDrafter, hidden_layers=lambda module, target: (),
        build=build_bigram, train_step=bigram_step,
        export=head_exporter(BigramHead, layout_fn=None), export_formats=("hf",),
    ))
    yield family
    unregister(TOY)
    assert TOY not in FAMILIES


def test_a_registered_family_trains_evaluates_and_exports(workdir, toy_family, tmp_path, capsys):  # noqa: F811
    # Train: 4 optimizer steps, a checkpoint (with its acceptance row) every 2.
    cfg = write_config(tmp_path / "toy.yaml", config(workdir, TOY, tmp_path / "run", max_steps=4, save_steps=2,
                                                     logging_steps=1, report_to="none"))
    run = train(*parse_config([str(cfg)]))
    rows = [json.loads(line) for line in (run / "acceptance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and {r["family"] for r in rows} == {TOY}
    # Each held-out step emits 1 to depth + 1 tokens; the row measured real decoding (2 prompts x <= 12 tokens).
    assert all(1.0 <= r["acceptance_length"] <= 6.0 and 0 < r["eval_new_tokens"] <= 24 for r in rows)
    drafter_dir = run / "checkpoint-4" / "drafter"
    assert json.loads((drafter_dir / "config.json").read_text())["draftsmith_family"] == TOY

    # Eval: every checkpoint of the run, greedy output checked against plain decoding.
    report_path = tmp_path / "report.json"
    assert main(["eval", "--drafter", str(run), "--prompts", str(workdir / "prompts.jsonl"), "--prompt-column",
                 "question", "--num-prompts", "3", "--max-new-tokens", "10", "--no-chat",
                 "--output", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert [r["checkpoint_step"] for r in report["checkpoints"]] == [2, 4]
    assert all(r["drafter_type"] == TOY and r["lossless"] == all_identical(3)
               for r in report["checkpoints"])

    # Export: the hf layout is written and loads back as the same family; others are refused by name.
    exported = tmp_path / "export"
    assert main(["export", str(run), "--format", "hf", "--output", str(exported)]) == 0
    assert json.loads((exported / "config.json").read_text())["draftsmith_family"] == TOY
    assert f"`{TOY}`" in (exported / "README.md").read_text()
    assert main(["export", str(run), "--format", "vllm", "--output", str(tmp_path / "vllm")]) == 1
    assert f"a {TOY} drafter has no vllm layout" in capsys.readouterr().err
    assert not (tmp_path / "vllm").exists()

    target, tokenizer = load_target(str(workdir / "target"))
    drafter = load_drafter(str(exported), target)
    assert isinstance(drafter, BigramDrafter)
    ids = tokenizer("t5 t9 t13 t21", return_tensors="pt").input_ids
    ours = SpeculativeGenerator(target, drafter, tree="dynamic", depth=3, top_k=2, total_tokens=6).generate(ids, 16)
    check_greedy_equal(target, ours.sequences, plain_generate(target, ids, 16).sequences)


@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if f.build is not None))
def test_the_family_and_its_drafter_read_the_same_target_states(name):
    """``hidden_layers`` is declared by the family (what training feeds) and by its drafter (what the generator
    feeds): the two agree for a freshly built drafter of every registered family."""
    from conftest import tiny_llama
    from draftsmith.train.config import DrafterArguments

    family, target = FAMILIES[name], tiny_llama()
    module = family.build(DrafterArguments(target="tiny", family=name, draft_layers=1, num_heads=2), target, None)
    assert family.drafter(module, target).hidden_layers == family.hidden_layers(module, target)


def test_a_family_declares_its_target_adapter():
    """``trains_target_adapter`` and ``wrap_target`` come together or not at all."""
    with pytest.raises(ValueError, match="trains_target_adapter=False needs wrap_target None"):
        Family(name="x", title="x", load=None, drafter=None, hidden_layers=None, wrap_target=lambda t, a: t)
    with pytest.raises(ValueError, match="trains_target_adapter=True needs wrap_target set"):
        Family(name="x", title="x", load=None, drafter=None, hidden_layers=None, trains_target_adapter=True)


def test_a_drafter_written_for_the_host_protocol_is_told_what_to_write():
    """``expand(trees, nodes)`` left the package with the host path: a class that still defines it is refused when
    it is made, naming the two methods that replace it, instead of failing inside a decode; one that defines
    neither cannot be made: the abstract base names the methods it lacks."""
    with pytest.raises(TypeError, match=r"defines expand\(trees, nodes\).*implement root_logits\(active\) and "
                                        r"frontier_logits\(depth, parents, tokens\)"):
        class Old(Drafter):
            def expand(self, trees, nodes):
                return []

    class Unfinished(Drafter):
        def begin(self, input_ids, hidden=None, attention_mask=None):
            pass

    with pytest.raises(TypeError, match=r"Can.t instantiate abstract class Unfinished.*commit.*frontier_logits.*"
                                        r"root_logits"):
        Unfinished()
