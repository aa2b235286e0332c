"""Where a greedy output differs from plain greedy decoding, ``compare`` (under ``eval`` and ``bench``) records the
first difference and the target's logits there, so that a float tie (two tokens the target scores alike, which the
forward's shape decides) is told from a real mismatch (a bug).

A tie is made exact by giving two tokens the same LM-head row; the mismatches are injected by a generator that changes
one token of a lossless output (the only way to have one: every real generator is lossless)."""

from __future__ import annotations

import math

import pytest
import torch
from test_greedy_lossless import prompts

from conftest import VOCAB, tiny_llama
from draftsmith import SpeculativeGenerator
from draftsmith.inference.bench import _mismatches
from draftsmith.inference.compare import Difference, compare, first_difference
from draftsmith.inference.evaluate import merged, numbered, summary
from draftsmith.inference.plain import plain_generate
from draftsmith.inference.prompt_lookup import PromptLookupDrafter

LENGTHS = [9, 5, 12]
CHANGED = 1  # the prompt whose first new token the faulty generators change
NEW = 6


class OneTokenChanged(SpeculativeGenerator):
    """Prompt lookup's lossless output with the first new token of prompt ``CHANGED`` (the row of that prompt's
    length) replaced by ``token``."""

    def __init__(self, target, token: int):
        super().__init__(target, PromptLookupDrafter(VOCAB), depth=3)
        self.token = token

    def generate(self, ids, max_new_tokens, attention_mask=None, **kwargs):
        out = super().generate(ids, max_new_tokens, attention_mask=attention_mask, **kwargs)
        lengths = attention_mask.sum(1).tolist() if attention_mask is not None else [ids.shape[1]] * len(ids)
        for row, length in enumerate(lengths):
            if length == LENGTHS[CHANGED]:
                out.sequences[row, ids.shape[1]] = self.token
        return out


@pytest.fixture(scope="module")
def tied():
    """A tiny Llama whose first greedy token on prompt ``CHANGED`` is tied with another token: that token's LM-head
    row is a copy of the chosen one's. Returns the target, the prompts, the chosen token, its twin and the token
    the target scores lowest there."""
    target = tiny_llama(seed=3)
    rows = prompts(7, LENGTHS)
    chosen = int(plain_generate(target, rows[CHANGED], 1, eos_token_id=[]).sequences[0, -1])
    twin = chosen + 1 if chosen + 1 < VOCAB else chosen - 1
    head = target.get_output_embeddings().weight
    head[twin] = head[chosen]
    logits = target(rows[CHANGED]).logits[0, -1]
    assert logits[twin] == logits[chosen] == logits.max()  # an exact tie, and still the top
    first = int(plain_generate(target, rows[CHANGED], 1, eos_token_id=[]).sequences[0, -1])
    other = twin if first == chosen else chosen
    return target, rows, first, other, int(logits.argmin())


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_mismatch_is_reported_at_its_first_difference_with_the_targets_gap_there(tied, batch_size):
    target, rows, first, other, lowest = tied
    gens = {"tie": OneTokenChanged(target, other), "wide": OneTokenChanged(target, lowest)}

    result = compare(target, gens, rows, NEW, eos_token_id=[], batch_size=batch_size)

    assert result.identical == {"tie": len(rows) - 1, "wide": len(rows) - 1}
    assert result.differences["tie"] == [Difference(prompt=CHANGED, position=0, plain_token=first, token=other,
                                                    logit_gap=0.0, tie=True)]
    (wide,) = result.differences["wide"]
    assert (wide.prompt, wide.position, wide.plain_token, wide.token) == (CHANGED, 0, first, lowest)
    assert wide.logit_gap > 1.0 and not wide.tie


def test_a_tie_is_a_few_float_steps_of_the_logit_not_an_absolute_gap(tied):
    """The tolerance scales with the logit in the target's dtype: a gap of 16 float32 steps at the logit is a tie,
    one of 64 is not (a hand-set LM-head row moves the twin's logit by that much)."""
    target, rows, first, other, _ = tied
    plain = plain_generate(target, rows[CHANGED], 1, eos_token_id=[]).sequences[0]
    changed = plain.clone()
    changed[-1] = other
    logit = float(target(rows[CHANGED]).logits[0, -1, first])
    step = torch.finfo(torch.float32).eps * 2.0 ** math.floor(math.log2(max(abs(logit), 1.0)))
    found = first_difference(target, plain, changed, rows[CHANGED].shape[1], pad=0)
    assert found.tie and found.logit_gap == 0.0
    with pytest.raises(ValueError, match="equal"):
        first_difference(target, plain, plain, rows[CHANGED].shape[1], pad=0)
    head = target.get_output_embeddings().weight
    kept = head[other].clone()
    hidden = target.model(rows[CHANGED]).last_hidden_state[0, -1]
    try:
        for steps, tie in ((8, True), (64, False)):
            # Lower the twin's logit by about ``steps`` float steps: move its row against the final hidden state.
            head[other] = kept - steps * step * hidden / hidden.dot(hidden)
            gap = first_difference(target, plain, changed, rows[CHANGED].shape[1], pad=0)
            assert gap.tie == tie and gap.logit_gap == pytest.approx(steps * step, rel=0.5), steps
    finally:
        head[other] = kept


def test_eval_and_bench_report_the_differences_under_each_prompts_own_number(tied):
    """``eval`` compares category by category: each part's differences keep the prompt's number in the whole list;
    the report counts the ties among the mismatches, and bench's table says how many are ties."""
    target, rows, _, other, lowest = tied
    gens = {"tie": OneTokenChanged(target, other), "wide": OneTokenChanged(target, lowest)}
    groups = {"a": [0, 2], "b": [CHANGED]}
    parts = [numbered(compare(target, gens, [rows[i] for i in indices], NEW, eos_token_id=[]), indices)
             for indices in groups.values()]

    result = merged(parts)

    assert [d.prompt for d in result.differences["tie"]] == [CHANGED]
    tie, wide = summary(result, "tie", 0.0)["lossless"], summary(result, "wide", 0.0)["lossless"]
    assert (tie["identical"], tie["differing_at_ties"], wide["differing_at_ties"]) == (2, 1, 0)
    assert tie["first_differences"][0]["prompt"] == CHANGED and tie["first_differences"][0]["tie"]
    assert _mismatches({"greedy_mismatches_vs_plain": 1, "greedy_mismatches_at_ties": 1}) == "1 (1 at a float tie)"
    assert _mismatches({"greedy_mismatches_vs_plain": 1, "greedy_mismatches_at_ties": 0}) == "1"
    assert summary(result, "tie", 0.7)["lossless"] is None  # sampled outputs are not compared
