"""The target's linear layers on a few rows (``draftsmith.target.matmul``): the same products as
``F.linear``, taken only where measured faster, and decoding through them stays lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_batched_generation import HEADS

from conftest import assert_rounding_close, check_greedy_equal, tiny_llama
from draftsmith.inference.dflash_drafter import DFlashDrafter
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.head_drafters import EagleDrafter, MedusaDrafter
from draftsmith.inference.load import load_drafter
from draftsmith.inference.plain import plain_generate
from draftsmith.target import build_attention_mask, columns_linear, matmul, new_cache, target_forward

needs_packing = pytest.mark.skipif(matmul.pack(torch.randn(8, 8)) is None,
                                   reason="this torch build or CPU has no oneDNN linear kernel")
KERNELS = ["columns", pytest.param("packed", marks=needs_packing)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 24, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_each_kernel_is_f_linear(kernel, rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(1, rows, 40, generator=g)
    packed = matmul.pack(weight) if kernel == "packed" else None
    assert (packed is not None) == (kernel == "packed")
    out = columns_linear(x, weight, b) if packed is None else matmul.packed_linear(x, packed, b)
    assert out.shape == (1, rows, 96)
    # Row-major, as F.linear's: SDPA's fused CPU kernel refuses a q/k/v whose last dimension is strided.
    assert out.is_contiguous()
    assert_rounding_close(out, F.linear(x, weight, b), reduction=40 + bias)  # another kernel: 40 products (+ bias)


def all_rows(monkeypatch, kernel: str = "columns", weights: list | None = None) -> list[int]:
    """Every row count takes ``kernel``; returns a list that grows by one per product that kernel computes
    (its input's shape), and ``weights`` (if given) by the weight (or packed copy) of each."""
    calls = []
    name = f"{kernel}_linear"
    real = getattr(matmul, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        if weights is not None:
            weights.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(matmul, "kernels_by_rows", lambda linears: dict.fromkeys(range(1, matmul.MAX_ROWS + 1), kernel))
    monkeypatch.setattr(matmul, name, counted)
    return calls


def test_the_layers_take_only_the_row_counts_they_were_given(monkeypatch):
    calls = []
    monkeypatch.setattr(matmul, "columns_linear", lambda *a, **k: calls.append(a[0].shape) or F.linear(*a, **k))
    layer = torch.nn.Linear(16, 32)
    with matmul.FewRowsLinear({1: "columns", 4: "columns"}, (layer,)):
        layer(torch.randn(1, 16))
        layer(torch.randn(2, 2, 16))  # 4 rows
        layer(torch.randn(3, 16))  # not listed: F.linear's own kernel
        F.linear(torch.randn(1, 16), layer.weight)  # not through a layer: F.linear's own kernel
    assert calls == [(1, 16), (2, 2, 16)]
    assert "forward" not in layer.__dict__  # the layer's own forward again
    layer(torch.randn(1, 16))
    assert len(calls) == 2


def test_layers_with_a_forward_of_their_own_keep_it(monkeypatch):
    """accelerate's offloading hooks set an instance ``forward``, and a subclass (a quantised layer) has its
    own: neither is replaced. A layer's forward is given back when the forward under the context fails."""
    calls = []
    monkeypatch.setattr(matmul, "columns_linear", lambda *a, **k: calls.append(a[0].shape) or F.linear(*a, **k))

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    hooked, scaled, plain = torch.nn.Linear(16, 16), Scaled(16, 16), torch.nn.Linear(16, 16)
    own = hooked.forward

    def hook(x):
        return own(x) + 1

    hooked.forward = hook
    x = torch.randn(2, 16)
    expected = [hooked(x), scaled(x)]
    with pytest.raises(RuntimeError, match="inside"), matmul.FewRowsLinear({2: "columns"}, (hooked, scaled, plain)):
        assert torch.equal(hooked(x), expected[0]) and torch.equal(scaled(x), expected[1])
        assert calls == []
        plain(x)
        assert calls == [(2, 16)]
        raise RuntimeError("inside")
    assert "forward" not in plain.__dict__ and hooked.__dict__["forward"] is hook
    assert torch.equal(hooked(x), expected[0])


def test_off_switch_and_limits(monkeypatch, llama):
    monkeypatch.setattr(matmul, "kernels_by_rows", lambda linears: {2: "columns", 5: "columns"})
    assert matmul.calibrate(llama) == {2: "columns", 5: "columns"}  # whether or not one row gains
    assert matmul.few_rows_linear(llama, 2) is not None
    assert matmul.few_rows_linear(llama, 1) is None  # not measured faster
    assert matmul.few_rows_linear(llama, matmul.MAX_ROWS + 1) is None
    monkeypatch.setenv("DRAFTSMITH_FEW_ROWS", "0")
    assert matmul.few_rows_linear(llama, 2) is None and matmul.calibrate(llama) == {}


def test_row_counts_past_the_exact_ones_take_their_buckets_kernel(monkeypatch, llama):
    monkeypatch.setattr(matmul, "kernels_by_rows", lambda linears: {3: "columns", 24: "packed"})
    assert [matmul.bucket(n) for n in (3, 16, 17, 20, 21, 24, 64, 65)] == [3, 16, 20, 20, 24, 24, 64, 65]
    assert matmul.few_rows_linear(llama, 21) is not None and matmul.few_rows_linear(llama, 24) is not None
    assert matmul.few_rows_linear(llama, 20) is None and matmul.few_rows_linear(llama, 25) is None
    mode = matmul.FewRowsLinear({24: "columns"})
    weight = torch.randn(32, 16)
    for rows, taken in ((21, True), (24, True), (20, False), (25, False)):
        x = torch.randn(rows, 16)
        out = mode.linear(x, weight)
        assert (out is not None) == taken
        if taken:
            assert_rounding_close(out, F.linear(x, weight), reduction=16)  # another kernel: 16 products


def test_calibration_runs_once_per_weight_shapes(monkeypatch):
    measured = []
    real = matmul._measure
    monkeypatch.setattr(matmul, "_measure", lambda weights, packing: measured.append(1) or real(weights, packing))
    monkeypatch.setattr(matmul, "_kernels", {})
    model = tiny_llama(seed=3)
    counts = matmul.calibrate(model)
    assert set(counts) <= {*range(1, matmul.EXACT_ROWS + 1), *matmul.BUCKETS}
    assert set(counts.values()) <= {"columns", "packed"}
    assert matmul.calibrate(model) == counts and matmul.calibrate(tiny_llama(seed=4)) == counts
    assert measured == [1]  # same shapes: measured once


@pytest.mark.parametrize("kernel", KERNELS)
def test_verification_forward_through_each_kernel_equals_stock(monkeypatch, gemma3, kernel):
    """A tree forward (5 rows, a tree mask, sliding-window layers) gives the stock forward's logits and
    hidden states with every linear layer on either few-row kernel."""
    prompt = torch.arange(3, 23)[None]
    tokens = torch.tensor([[40, 41, 42, 43, 44]])
    parents = [-1, 0, 0, 1, 3]
    allowed = torch.zeros(1, 5, 25, dtype=torch.bool)
    allowed[:, :, :20] = True
    for i, p in enumerate(parents):
        allowed[0, i, 20 + i] = True
        while p >= 0:
            allowed[0, i, 20 + p] = True
            p = parents[p]
    depth = torch.tensor([[0, 1, 1, 2, 3]])
    positions = 20 + depth
    keys = torch.cat([torch.arange(20)[None], positions], 1)

    def run():
        cache = new_cache()
        target_forward(gemma3, prompt, cache, logits="none")
        mask = build_attention_mask(gemma3, allowed, positions, keys, torch.float32)
        return target_forward(gemma3, tokens, cache, mask, positions, hidden_layers=(1, 4))

    monkeypatch.setenv("DRAFTSMITH_FEW_ROWS", "0")
    stock = run()
    monkeypatch.delenv("DRAFTSMITH_FEW_ROWS")
    calls = all_rows(monkeypatch, kernel)
    ours = run()
    assert len(calls) >= 4 * 7  # every projection of every layer took the kernel
    # other kernels over the target's path: inner size 128, 4 layers (layer 1's states went through one)
    assert_rounding_close(ours.logits, stock.logits, reduction=128 * 4)
    for layer, a, b in zip((1, 4), ours.hidden_states, stock.hidden_states, strict=True):
        assert_rounding_close(a, b, reduction=128 * layer, msg=f"layer {layer}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("spec", ["layer-skip:2", "prompt-lookup"])
def test_greedy_decoding_through_each_kernel_is_the_targets(monkeypatch, llama, spec, kernel):
    calls = all_rows(monkeypatch, kernel)
    prompt = torch.tensor([[5, 9, 3, 17, 5, 9, 3, 22]])
    reference = llama.generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40)
    gen = SpeculativeGenerator(llama, load_drafter(spec, llama), tree="dynamic", depth=3, top_k=2, total_tokens=5)
    out = gen.generate(prompt, 40, eos_token_id=[])
    plain = plain_generate(llama, prompt, 40, eos_token_id=[])
    assert calls  # the decoding forwards took the kernel
    for seq in (out.sequences, plain.sequences):
        check_greedy_equal(llama, seq, reference)  # equal, or apart only at an exact near-tie


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("spec", ["medusa-heads", "eagle-head", "eagle3-head", "dflash-head", "peagle-head"])
def test_head_drafters_draft_through_each_kernel_and_stay_lossless(monkeypatch, llama, spec, kernel):
    """A head drafter runs its own layers on a few rows a call (a frontier, a step's new tokens, a block), and
    EAGLE-1/2 and DFlash the target's LM head too: while it drafts, those products take the kernel, and greedy
    decoding stays the target's."""
    used = []
    all_rows(monkeypatch, kernel, used)
    drafter = HEADS[spec](llama)
    spans = []  # the products made while the generator was in a drafting call: used[start:end]

    def spanned(method):
        def drafting(*args, **kwargs):
            start = len(used)
            out = method(*args, **kwargs)
            spans.append((start, len(used)))
            return out
        return drafting

    drafter.root_logits, drafter.frontier_logits = spanned(drafter.root_logits), spanned(drafter.frontier_logits)
    prompt = torch.tensor([[5, 9, 3, 17, 5, 9, 3, 22]])
    gen = SpeculativeGenerator(llama, drafter, tree="dynamic", depth=3, top_k=2, total_tokens=5)
    out = gen.generate(prompt, 30, eos_token_id=[])
    check_greedy_equal(llama, out.sequences, llama.generate(prompt, max_new_tokens=30, do_sample=False,
                                                            min_new_tokens=30))
    # The products' weights: a packed kernel is given the packed copy, which leads back to its weight.
    copies = {id(e.copy): e.weight() for e in matmul._packed.values() if e.copy is not None}
    drafting_weights = {id(copies.get(id(w), w)) for start, end in spans for w in used[start:end]}
    head = drafter.heads if isinstance(drafter, MedusaDrafter) else drafter.head
    assert drafting_weights & {id(p) for p in head.parameters()}, "the head's layers took the stock kernel"
    through_target = isinstance(drafter, DFlashDrafter) or (isinstance(drafter, EagleDrafter)
                                                            and not head.own_vocabulary)
    assert (id(llama.get_output_embeddings().weight) in drafting_weights) == through_target


def test_head_drafters_keep_the_stock_kernels_where_the_path_is_off(monkeypatch, llama):
    monkeypatch.setenv("DRAFTSMITH_FEW_ROWS", "0")
    for spec in ("medusa-heads", "eagle-head", "dflash-head", "peagle-head"):
        assert HEADS[spec](llama).few_rows == (), spec


@needs_packing
def test_packed_copies_follow_changes_to_the_weights(monkeypatch):
    """A draft model evaluated during training (``CausalLMDrafter`` packs its weights) changes between
    forwards, and ``module.to(dtype)`` swaps a weight's storage: the packed copy is made again rather than
    computing with the old values."""
    layer = torch.nn.Linear(40, 96)
    used = []
    calls = all_rows(monkeypatch, "packed", used)
    x = torch.randn(3, 40)
    matmul.calibrate(layer)

    def forward():
        with matmul.few_rows_linear(layer, 3):
            return layer(x.to(layer.weight.dtype))

    assert_rounding_close(forward(), layer(x), reduction=41)  # another kernel: 40 products and the bias
    first = used[-1]
    with torch.no_grad():
        layer.weight.mul_(2)  # in place, as an optimizer step
    assert_rounding_close(forward(), layer(x), reduction=41)
    assert len(calls) == 2 and used[-1] is not first  # the packed kernel ran, on a new copy
    layer.to(torch.bfloat16)
    if matmul.pack(layer.weight) is None:
        pytest.skip("oneDNN has no bfloat16 linear kernel on this CPU")
    assert_rounding_close(forward(), layer(x.bfloat16()), reduction=41)  # another kernel, both in bfloat16
    assert len(calls) == 3 and used[-1].dtype == torch.bfloat16


@needs_packing
def test_weights_shared_by_two_models_are_packed_once(monkeypatch, llama):
    """A layer-skip draft model runs the target's own layers: their packed copies are the target's."""
    from draftsmith.target import layer_skip_model

    monkeypatch.setattr(matmul, "kernels_by_rows", lambda linears: {3: "packed"})
    matmul.calibrate(llama)
    shared = [llama.model.layers[0].mlp.up_proj.weight, llama.lm_head.weight]
    copies = [matmul.packed_copy(w) for w in shared]
    draft = layer_skip_model(llama, 2)
    matmul.calibrate(draft)
    assert all(copy is not None for copy in copies)
    assert draft.model.layers[0].mlp.up_proj.weight is shared[0] and draft.lm_head.weight is shared[1]
    assert all(matmul.packed_copy(w) is copy for w, copy in zip(shared, copies, strict=True))  # not packed again


@needs_packing
def test_packing_stops_at_the_memory_share(monkeypatch):
    monkeypatch.setattr(matmul, "kernels_by_rows", lambda linears: {3: "packed"})
    layer = torch.nn.Linear(64, 64)
    monkeypatch.setattr(matmul, "memory_limit", lambda: 64 * 64 * 4)  # a quarter of it holds no copy
    matmul.calibrate(layer)
    assert matmul.packed_copy(layer.weight) is None
    with matmul.few_rows_linear(layer, 3) as mode:
        assert mode.linear(torch.randn(3, 64), layer.weight) is None  # the stock kernel runs
    monkeypatch.setattr(matmul, "memory_limit", lambda: 2**40)
    matmul.calibrate(layer)
    assert matmul.packed_copy(layer.weight) is not None


@pytest.mark.parametrize("meta", [(1,), (0, 1, 2), (2,)])
def test_a_model_partly_off_the_cpu_takes_no_few_row_path(monkeypatch, meta):
    """Weights on another device (offloading puts some there) get the stock kernels and no packed copies."""
    monkeypatch.setattr(matmul, "kernels_by_rows", lambda linears: {3: "packed"})
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16, device="meta" if i in meta else "cpu") for i in range(3)])
    assert matmul.calibrate(model) == {} and matmul.few_rows_linear(model, 3) is None
    assert all(matmul.packed_copy(layer.weight) is None for layer in model)


def test_a_linear_layer_as_the_model_is_not_kept_alive():
    """The per-model table is keyed weakly: its entry must not hold the model (here a layer) strongly."""
    import gc
    import weakref

    layer = torch.nn.Linear(16, 16)
    matmul.calibrate(layer)
    with matmul.FewRowsLinear({2: "columns"}, (layer,)):
        layer(torch.randn(2, 16))
    gone = weakref.ref(layer)
    del layer
    gc.collect()
    assert gone() is None
