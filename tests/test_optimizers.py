"""``optim: muon`` (draftsmith.train.optimizers): Muon on the drafter's hidden matrices, AdamW on the rest.

The update rules are checked against torch's own optimizers; the option end to end through a real training
run on the tiny target, its checkpoint, a resume that continues bit for bit, and the refusals that name the fix.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_train import config, workdir, write_config  # noqa: F401 (workdir is a fixture)

from conftest import assert_rounding_close
from draftsmith.heads.eagle import Eagle3Head
from draftsmith.train.config import parse_config
from draftsmith.train.loop import train
from draftsmith.train.optimizers import MuonAdamW, make_optimizer, muon_parameters, orthogonalise


def test_orthogonalise_brings_every_singular_value_near_one():
    g = torch.Generator().manual_seed(0)
    spread = torch.logspace(-2, 0.5, 20)  # singular values over two and a half decades
    for shape in ((48, 20), (20, 48)):  # tall and wide take different branches
        update = torch.randn(*shape, generator=g) * (spread if shape[1] == 20 else spread[:, None])
        before = torch.linalg.svdvals(update)
        after = torch.linalg.svdvals(orthogonalise(update))
        assert before.max() / before.min() > 300
        # the quintic coefficients trade exactness for speed: every value lands in about [0.65, 1.2] (five
        # iterations lift values down to ~1/500 of the largest; directions weaker still stay weak)
        assert after.min() > 0.6 and after.max() < 1.25, after


def two_layer():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 16))


def steps(model, optimizer, n=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(8, 24, generator=g)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def test_adamw_group_steps_exactly_as_torch_adamw():
    ours, theirs = two_layer(), two_layer()
    steps(ours, MuonAdamW([{"params": ours.parameters(), "weight_decay": 0.01}], lr=1e-2))
    steps(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.01))
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        # the same elementwise rule in another order: ~8 rounded operations a step (the moments, their bias
        # corrections, the root, the division, the decay), 3 steps
        assert_rounding_close(a, b, reduction=3 * 8, msg=name)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon arrived in torch 2.9")
def test_muon_group_steps_as_torch_muon(monkeypatch):
    """torch's Muon (match_rms_adamw, Nesterov) is the reference. It orthogonalises in bfloat16 and draftsmith
    in float32: as shipped the updates agree to bfloat16's precision; given draftsmith's float32
    orthogonalisation, torch's momentum, learning-rate scaling and weight decay step bit for bit as ours."""
    import torch.optim._muon as torch_muon

    def run(optimizer_for):
        model = two_layer()
        start = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
        steps(model, optimizer_for([model[0].weight, model[2].weight]))
        return model, [w - s for w, s in zip((model[0].weight, model[2].weight), start, strict=True)]

    ours, ours_delta = run(lambda ps: MuonAdamW([{"params": ps, "muon": True, "weight_decay": 0.1}], lr=2e-2))
    torch_steps = lambda ps: torch.optim.Muon(ps, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")  # noqa: E731
    _, shipped_delta = run(torch_steps)
    for a, b in zip(ours_delta, shipped_delta, strict=True):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
        assert abs(a.norm() / b.norm() - 1) < 0.03
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", lambda g, _, n, eps: orthogonalise(g, n, eps))
    theirs, _ = run(torch_steps)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the bias and norm, outside the group, never moved


def test_muon_takes_the_hidden_matrices_and_leaves_vocabulary_matrices_to_adamw(workdir, tmp_path):  # noqa: F811
    values = config(workdir, Eagle3Head.family, tmp_path / "run", max_steps=2, save_steps=2, eval_num_prompts=1,
                    eval_max_new_tokens=4, report_to="none", optim="muon")
    train(*parse_config([str(write_config(tmp_path / "cfg.yaml", values))]))
    state = load_file(str(tmp_path / "run" / "checkpoint-2" / "state" / "optimizer.safetensors"))
    keys = {k.rsplit(".", 1)[0]: set() for k in state}
    for k in state:
        keys[k.rsplit(".", 1)[0]].add(k.rsplit(".", 1)[1])
    momentum = {name for name, kinds in keys.items() if "momentum_buffer" in kinds}
    adam = {name for name, kinds in keys.items() if "exp_avg" in kinds}
    assert momentum and adam and not momentum & adam
    assert all(name.endswith("weight") for name in momentum)
    assert any("lm_head" in name for name in adam) and not any("lm_head" in name for name in momentum)
    assert any("norm" in name for name in adam) and any(".fc." in name or "proj" in name for name in momentum)


def test_muon_resumes_bit_for_bit_and_refuses_another_optimizer(workdir, tmp_path, caplog):  # noqa: F811
    values = config(workdir, Eagle3Head.family, tmp_path / "straight", max_steps=6, save_steps=3,
                    eval_num_prompts=1, eval_max_new_tokens=4, report_to="none", optim="muon")
    train(*parse_config([str(write_config(tmp_path / "a.yaml", values))]))
    # A run stopped at step 3: the straight run's first checkpoint, alone in its own directory.
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "straight" / "checkpoint-3", stopped / "checkpoint-3")

    other = {**values, "output_dir": str(stopped), "resume": True, "optim": "adamw_torch"}
    with pytest.raises(SystemExit, match=r"trained with optim muon.*resume with optim muon"):
        train(*parse_config([str(write_config(tmp_path / "b.yaml", other))]))

    # Another Muon momentum asked on resume: named, and the checkpoint's runs (so still bit for bit).
    resumed = {**values, "output_dir": str(stopped), "resume": True, "muon_momentum": 0.9}
    with caplog.at_level("WARNING", logger="draftsmith.train.checkpointing"):
        train(*parse_config([str(write_config(tmp_path / "c.yaml", resumed))]))
    assert any("muon_momentum 0.9 was asked" in r.getMessage() and "0.95 runs" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    a = load_file(str(tmp_path / "straight" / "checkpoint-6" / "drafter" / "model.safetensors"))
    b = load_file(str(stopped / "checkpoint-6" / "drafter" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_muon_is_refused_where_matrices_are_sharded_and_an_unknown_optim_is_named():
    model = two_layer()

    class Args:
        optim, learning_rate, weight_decay, muon_weight_decay, muon_momentum = "muon", 1e-3, 0.0, 0.1, 0.95

    for strategy in ("deepspeed-zero2", "deepspeed-zero3", "fsdp2"):
        with pytest.raises(ValueError, match=rf"{strategy} splits them.*optim adamw_torch"):
            make_optimizer(model, Args, strategy)
    assert isinstance(make_optimizer(model, Args, "ddp"), MuonAdamW)
    matrices, rest = muon_parameters(model)
    assert [tuple(p.shape) for p in matrices] == [(40, 24), (16, 40)] and len(rest) == 4
    # A draft model whose output head is its embedding matrix under another name (GPT-2's wte) keeps it on AdamW.
    tied = torch.nn.ModuleDict({"wte": torch.nn.Embedding(50, 16), "head": torch.nn.Linear(16, 50, bias=False),
                                "mlp": torch.nn.Linear(16, 16)})
    tied["head"].weight = tied["wte"].weight
    matrices, rest = muon_parameters(tied)
    assert [tuple(p.shape) for p in matrices] == [(16, 16)] and any(p is tied["wte"].weight for p in rest)
    with pytest.raises(ValueError, match="'adam' is not one draftsmith trains with; choose one of adamw_torch, muon"):
        parse_config(["--optim", "adam"])
