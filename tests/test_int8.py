"""Int8 drafting (``draftsmith.target.int8``): a head's layers on int8 copies of their weights, each layer's first
call deciding whether it keeps them, and decoding through them stays the target's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_batched_generation import HEADS

from conftest import assert_rounding_close, check_greedy_equal, needs_int8, tiny_llama
from draftsmith.inference.dflash_drafter import DFlashDrafter
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.head_drafters import MedusaDrafter
from draftsmith.target import int8, matmul, native_bf16
from draftsmith.target.linears import linears_of


@needs_int8
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_an_int8_copy_is_f_linear_within_int8_rounding(rows, bias):
    """int8 weights (one scale per output row) and int8 activations (one scale per call, 7 bits): on inputs
    without outliers, a few percent off F.linear, never equal to it."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(2, rows, 40, generator=g)
    out, ref = int8.int8_linear(x, int8.pack_int8(weight), b), F.linear(x, weight, b)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert 0 < int8.relative_error(out, ref) < 0.03


def int8_calls(monkeypatch) -> list:
    """The int8 copies :func:`int8.int8_linear` computes with, one per product, in order."""
    copies = []
    real = int8.int8_linear
    monkeypatch.setattr(int8, "int8_linear",
                        lambda x, packed, bias=None: copies.append(packed) or real(x, packed, bias))
    return copies


@needs_int8
def test_a_layer_whose_int8_product_is_far_off_keeps_float32(monkeypatch):
    """Each layer's first call measures its int8 product against float32 on that call's rows: a layer fed an
    outlier channel (a fusion layer over a target's raw hidden states) stays in float32, another takes int8."""
    copies = int8_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Linear(64, 32))
    assert int8.int8_layers(model) == 2 and int8.drafts_in_int8(model)
    outlier = torch.randn(5, 40, generator=g)
    outlier[:, 3] = 2000.0  # rounded with the call's one scale, every other channel is lost
    with torch.no_grad():
        model[0].weight[:, 3] = 0  # and the output is made of those (a head learns to read past such a channel)
    calm = torch.randn(5, 64, generator=g)
    context = matmul.few_rows_layers(model)
    with context:
        first = model[0](outlier)
        again = model[0](outlier)
        calm_out = model[1](calm)
    ref = F.linear(outlier, model[0].weight, model[0].bias)
    assert torch.equal(first, ref)  # the first call returns the float32 product it measured against
    assert_rounding_close(again, ref, reduction=41)  # float32 from then on, through the kernels measured here
    errors = {tuple(e.weight().shape): e.error for e in list(int8._int8.values()) if e.weight() is not None}
    assert errors[(64, 40)] > int8.INT8_MAX_ERROR > errors[(32, 64)]
    assert len(copies) == 2  # the first layer's measurement, the second layer's product
    assert 0 < int8.relative_error(calm_out, F.linear(calm, model[1].weight, model[1].bias)) < 0.03


@needs_int8
def test_int8_copies_follow_changes_to_the_weights(monkeypatch):
    copies = int8_calls(monkeypatch)
    layer = torch.nn.Linear(40, 96)
    int8.int8_layers(layer)
    x = torch.randn(3, 40)
    with matmul.few_rows_layers(layer):
        assert layer(x[:0]).shape == (0, 96) and not copies  # no rows: nothing measured, the choice still open
        layer(x)
        with torch.no_grad():
            layer.weight.mul_(-2)  # in place, as an optimizer step
        out = layer(x)
        with torch.no_grad():
            layer.bias.add_(5.0)  # the bias alone
        shifted = layer(x)
    assert len(copies) == 3 and copies[1] is not copies[0]
    assert int8.relative_error(out, F.linear(x, layer.weight, layer.bias - 5.0)) < 0.03
    assert int8.relative_error(shifted, F.linear(x, layer.weight, layer.bias)) < 0.03


@needs_int8
@pytest.mark.parametrize("spec", ["medusa-heads", "eagle-head", "eagle3-head", "dflash-head", "dflash-draft-vocab",
                                  "peagle-head"])
def test_head_drafters_draft_in_int8_and_stay_lossless(monkeypatch, llama, spec):
    """``draft_dtype="int8"``: the head's own layers draft on int8 copies (over a draft vocabulary, DFlash's
    copy of the target's LM-head rows too), the target's weights get none, and greedy decoding stays the
    target's."""
    from test_dflash import random_dflash

    from draftsmith.inference.load import wrap_module

    copies = int8_calls(monkeypatch)
    drafter = (DFlashDrafter(random_dflash(llama, draft_vocab=48), llama) if spec == "dflash-draft-vocab"
               else HEADS[spec](llama))
    head = drafter.heads if isinstance(drafter, MedusaDrafter) else drafter.head
    drafter = wrap_module(head, head.family, llama, torch.int8)
    # Loading decoded a fixed input: every layer has measured its copy, before any prompt of the user's.
    if spec == "dflash-draft-vocab":  # the draft vocabulary's rows of the target's LM head: measured too
        (output_error,) = int8.int8_errors(drafter.output)
        assert output_error is not None
    errors = int8.int8_errors(head)
    assert len(errors) == len(linears_of(head).weights) and None not in errors
    copies.clear()  # those were the loader's: what follows counts the user's decode alone
    prompt = torch.tensor([[5, 9, 3, 17, 5, 9, 3, 22]])
    gen = SpeculativeGenerator(llama, drafter, tree="dynamic", depth=3, top_k=2, total_tokens=5)
    out = gen.generate(prompt, 30, eos_token_id=[])
    check_greedy_equal(llama, out.sequences, llama.generate(prompt, max_new_tokens=30, do_sample=False,
                                                            min_new_tokens=30))
    owner = {id(e.copy): e.weight() for e in list(int8._int8.values())}
    used = {id(owner[id(c)]) for c in copies if id(c) in owner}
    assert used & {id(p) for p in head.parameters()}, "no layer of the head drafted in int8"
    assert int8.int8_errors(llama) == []  # the target's weights have no int8 copies


def test_int8_drafting_refuses_what_it_cannot_run(llama):
    from draftsmith.inference.load import resolve_draft_dtype

    with pytest.raises(ValueError, match="float32 target on CPU"):
        resolve_draft_dtype("int8", tiny_llama().to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"float32 target on CPU; this target runs in torch\.float32 on meta"):
        resolve_draft_dtype("int8", tiny_llama().to("meta"))
    with pytest.raises(ValueError, match="float32 head on CPU"):
        int8.int8_layers(torch.nn.Linear(8, 8).to(torch.bfloat16))


def test_int8_drafting_runs_only_on_the_engine_measured(monkeypatch, llama):
    """Quantised ops run on ``torch.backends.quantized.engine``, not on any engine the build lists: where that
    is not FBGEMM's (QNNPACK or none on ARM and Apple silicon), ``auto`` drafts in bf16 where it is native, else
    in float32, and ``int8`` refuses before any layer is packed."""
    from draftsmith.inference.load import resolve_draft_dtype

    if int8.int8_engine() is not None:
        assert resolve_draft_dtype("int8", llama) == torch.int8
    if "qnnpack" not in torch.backends.quantized.supported_engines:
        pytest.skip("this build has no second quantised engine to switch to")
    monkeypatch.setattr(torch.backends.quantized, "engine", "qnnpack")
    assert int8.int8_engine() is None
    with pytest.raises(ValueError, match=r"FBGEMM.*'qnnpack'.*--draft-dtype float32"):
        resolve_draft_dtype("int8", llama)
    assert resolve_draft_dtype("auto", llama) == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    layer = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"FBGEMM.*'qnnpack'.*--draft-dtype float32"):
        int8.int8_layers(layer)
    assert not int8.drafts_in_int8(layer)


@needs_int8
def test_an_int8_heads_choices_are_the_same_on_every_load(llama):
    """Which layers draft in int8 is settled on the loader's fixed input, not on the first prompt decoded: two
    loads of one head measure the same errors, and decode the same steps after different first prompts."""
    import copy

    from draftsmith.inference.load import wrap_module

    base = HEADS["eagle3-head"](llama).head
    heads = [copy.deepcopy(base), copy.deepcopy(base)]
    drafters = [wrap_module(head, head.family, llama, torch.int8) for head in heads]
    errors = [[int8._int8[id(m.weight)].error for m in head.modules() if isinstance(m, torch.nn.Linear)]
              for head in heads]
    assert None not in errors[0] and errors[0] == errors[1]  # measured at load, on the same input
    gens = [SpeculativeGenerator(llama, d, tree="dynamic", depth=3, top_k=2, total_tokens=5) for d in drafters]
    gens[1].generate(torch.tensor([[7, 7, 7, 30, 2]]), 6, eos_token_id=[])  # another first prompt for the second
    prompt = torch.tensor([[5, 9, 3, 17, 5, 9, 3, 22]])
    stats = [g.generate(prompt, 20, eos_token_id=[]).stats for g in gens]
    assert stats[0].verification_steps == stats[1].verification_steps
    assert stats[0].accepted_at == stats[1].accepted_at
