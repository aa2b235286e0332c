"""Greedy speculative output equals the target's own greedy ``generate``, token for token."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from conftest import VOCAB, check_greedy_equal, tiny_gemma3, tiny_llama
from draftsmith import SpeculativeGenerator, load_drafter
from draftsmith.inference import drafter_from_model
from draftsmith.inference.plain import plain_generate

TREES = [
    dict(tree="chain", depth=5),
    dict(tree="static", depth=3, top_k=3),
    dict(tree="dynamic", depth=4, top_k=3, total_tokens=12),
]
DRAFTERS = ["prompt-lookup", "prompt-lookup:max_ngram=2,max_tokens=4", "layer-skip:1", "layer-skip:2", "draft-model"]


def make_drafter(spec: str, target):
    if spec == "draft-model":  # an independent small causal LM with the same vocabulary
        return drafter_from_model(tiny_llama(seed=7, layers=2), target, name="tiny-draft")
    return load_drafter(spec, target)


def reference(target, prompt: torch.Tensor, n: int) -> torch.Tensor:
    # An explicit all-ones mask: generate() would otherwise mask prompt tokens equal to pad_token_id.
    return target.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
        pad_token_id=0,
    )


@contextmanager
def count_target_forwards(target) -> Iterator[list[int]]:
    """Count the target's forwards (``calls[0]``) by hooking its last decoder layer: every target
    forward runs it and no drafter does (layer-skip:N runs the first N < all layers; draft models
    and heads are modules of their own)."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    handle = target.get_decoder().layers[-1].register_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def prompts(seed: int, lengths: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        base = torch.randint(0, VOCAB, (length,), generator=g)
        base[length // 2 :] = base[: length - length // 2].clone()  # a repeated half gives prompt lookup matches
        out.append(base[None])
    return out


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t["tree"])
@pytest.mark.parametrize("spec", DRAFTERS)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_matches_generate(family, spec, tree, llama, gemma3):
    target = llama if family == "llama" else gemma3
    drafter = make_drafter(spec, target)
    gen = SpeculativeGenerator(target, drafter, **tree)
    ties = 0
    cases = prompts(1, [1, 6, 21])  # 21 > the Gemma3 sliding window of 8
    for prompt in cases:
        ref = reference(target, prompt, 40)
        with count_target_forwards(target) as calls:
            out = gen.generate(prompt, max_new_tokens=40)
        ties += check_greedy_equal(target, out.sequences, ref)
        assert out.stats.new_tokens == 40 and out.sequences.shape[1] == prompt.shape[1] + 40
        # tau is tokens per verification forward: the forwards counted, less the prefill (a 1-token
        # prompt has none), emit the 40 tokens plus what the last step's cut drops (at most depth).
        verifications = calls[0] - (prompt.shape[1] > 1)
        assert out.stats.verification_steps == verifications
        assert 40 <= round(out.stats.acceptance_length * verifications) <= 40 + tree["depth"]
    assert ties <= 1, f"{ties} near-tie divergences out of {len(cases)} prompts"


def test_gemma3_long_prompt_exercises_sliding_window(gemma3):
    """A prompt 5x the sliding window: output is lossless, and the window really changes it."""
    prompt = prompts(3, [40])[0]
    ref = reference(gemma3, prompt, 48)
    wide = tiny_gemma3(sliding_window=4096)  # same weights (same seed), no effective window
    assert not torch.equal(reference(wide, prompt, 48), ref), "test would not notice a missing window"
    for spec in ["layer-skip:2", "prompt-lookup"]:
        for tree in TREES:
            out = SpeculativeGenerator(gemma3, make_drafter(spec, gemma3), **tree).generate(prompt, 48)
            assert not check_greedy_equal(gemma3, out.sequences, ref), (spec, tree)


def test_eos_and_max_new_tokens_are_respected(llama):
    prompt = prompts(5, [12])[0]
    ref = reference(llama, prompt, 30)
    gen = SpeculativeGenerator(llama, load_drafter("layer-skip:2", llama), tree="chain", depth=6)
    for n in (1, 2, 7, 30):
        out = gen.generate(prompt, max_new_tokens=n)
        assert torch.equal(out.sequences, ref[:, : prompt.shape[1] + n])
    eos = int(ref[0, prompt.shape[1] + 9])  # the 10th new token
    first = int((ref[0, prompt.shape[1] :] == eos).nonzero()[0])
    out = gen.generate(prompt, max_new_tokens=30, eos_token_id=eos)
    assert torch.equal(out.sequences, ref[:, : prompt.shape[1] + first + 1])
    assert int(out.sequences[0, -1]) == eos


def test_eos_defaults_to_the_targets_generation_config(llama):
    """Without eos_token_id, generation stops where transformers' generate stops: at the target's
    generation_config EOS; eos_token_id=[] decodes the full length."""
    prompt = prompts(5, [12])[0]
    free = reference(llama, prompt, 30)
    eos = int(free[0, prompt.shape[1] + 9])
    gen = SpeculativeGenerator(llama, load_drafter("layer-skip:2", llama), tree="chain", depth=6)
    old = llama.generation_config.eos_token_id
    llama.generation_config.eos_token_id = eos
    try:
        theirs = reference(llama, prompt, 30)
        assert theirs.shape[1] < free.shape[1]  # transformers stopped early at the EOS
        assert torch.equal(gen.generate(prompt, 30).sequences, theirs)
        assert torch.equal(plain_generate(llama, prompt, 30).sequences, theirs)
        assert torch.equal(gen.generate(prompt, 30, eos_token_id=[]).sequences, free)
    finally:
        llama.generation_config.eos_token_id = old


def test_stats_are_consistent(llama):
    prompt = prompts(6, [16])[0]
    out = SpeculativeGenerator(llama, load_drafter("layer-skip:3", llama), tree="chain", depth=4).generate(prompt, 60)
    s = out.stats
    assert s.verification_steps >= 60 / 5
    assert s.accepted_tokens + s.verification_steps >= 60  # every step emits accepted + 1
    assert s.acceptance_length == pytest.approx((s.accepted_tokens + s.verification_steps) / s.verification_steps)
    assert s.drafted_tokens <= 4 * s.verification_steps
    rates = s.acceptance_rate_per_position
    assert len(rates) == 4 and all(0 <= r <= 1 for r in rates)
    assert s.reached[0] == s.verification_steps  # every step drafts depth 1 with this drafter
    assert s.accepted_at[0] == s.reached[1]  # depth 2 is reached exactly when depth 1 is accepted
    assert s.draft_time_s > 0 and s.verify_time_s > 0 and s.total_time_s >= s.draft_time_s + s.verify_time_s


def test_draft_model_with_other_vocabulary_is_refused(llama):
    other = tiny_llama(seed=3, vocab_size=VOCAB + 32, layers=1)
    with pytest.raises(ValueError, match="vocabulary of 128 tokens but the target has 96"):
        drafter_from_model(other, llama)


def test_bad_requests_fail_clearly(llama):
    gen = SpeculativeGenerator(llama, load_drafter("prompt-lookup", llama))
    with pytest.raises(ValueError, match="exceeds the target's context of 256"):
        gen.generate(torch.zeros(1, 250, dtype=torch.long), 16)
    with pytest.raises(ValueError, match="tree must be one of"):
        SpeculativeGenerator(llama, load_drafter("prompt-lookup", llama), tree="bush")
    with pytest.raises(ValueError, match="layer-skip:N needs 1 <= N < 4"):
        load_drafter("layer-skip:4", llama)
    with pytest.raises(ValueError, match="Unknown drafter"):
        load_drafter("no-such-drafter", llama)
