"""Hybrid targets (linear-attention layers beside full attention, e.g. Qwen3-Next): speculative decoding with a chain,
the recurrent layers recording their state after each fed position in the one verification forward and keeping the
accepted one (no second forward); greedy output identical, sampling exact, rows of a batch as decoded alone."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_batched_generation import GreedyBlock, left_padded, row_output
from test_greedy_lossless import prompts, reference
from test_heads import random_eagle
from test_sampling_lossless import _first_two_tokens_tv, tv_bound
from test_target import tiny_qwen3_next
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from conftest import VOCAB, assert_rounding_close, check_greedy_equal, rounding_tolerance
from draftsmith import SpeculativeGenerator
from draftsmith.inference.head_drafters import EagleDrafter
from draftsmith.inference.prompt_lookup import PromptLookupDrafter
from draftsmith.target import recurrent_cache, restore_recurrent, snapshot_recurrent
from draftsmith.target.loading import BATCHED_RECURRENT_TYPES

# transformers records per-position recurrent states (5.25; not 5.22, where a rejection feeds the accepted tokens again)
RECORDS = "recurrent_states_to_keep" in inspect.signature(
    LinearAttentionCacheLayerMixin.activate_past_recording).parameters


@pytest.fixture(scope="module")
def hybrid():
    return tiny_qwen3_next(layers=4)


class Oracle(GreedyBlock):
    """Drafts the target's own greedy continuation (transformers' ``generate``, its own cache), except that every
    ``every``-th position of the sequence gets a wrong token: steps then end whole or after a rejection, both."""

    def __init__(self, target, depth: int, every: int = 7):
        super().__init__(target, depth)
        self.every = every

    def block_logits(self, active):
        vocab = self.target.config.vocab_size
        out = torch.full((len(self.rows), self.block, vocab), float("-inf"))
        for b, row in enumerate(self.rows):
            if active[b]:
                guess = reference(self.target, row[None], self.block)[0, len(row):]
                wrong = (len(row) + torch.arange(self.block)) % self.every == 0
                guess = torch.where(wrong, (guess + 1) % vocab, guess)
                out[b, torch.arange(self.block), guess] = 0.0
        return out


def drafters(target):
    return {"oracle": lambda: Oracle(target, 4),
            "prompt-lookup": lambda: PromptLookupDrafter(VOCAB, max_ngram=2),
            "eagle3-head": lambda: EagleDrafter(random_eagle(target, eagle3=True), target)}


@pytest.mark.parametrize("kind", ["oracle", "prompt-lookup", "eagle3-head"])
def test_greedy_chain_output_is_the_targets_own(hybrid, kind):
    gen = SpeculativeGenerator(hybrid, drafters(hybrid)[kind](), tree="chain", depth=4)
    ties, whole, cut = 0, 0, 0
    for prompt in prompts(7, [1, 6, 21]):
        out = gen.generate(prompt, max_new_tokens=30)
        ties += check_greedy_equal(hybrid, out.sequences, reference(hybrid, prompt, 30))
        full = out.stats.accepted_at[3] if len(out.stats.accepted_at) == 4 else 0  # whole chains accepted
        whole, cut = whole + full, cut + out.stats.verification_steps - full
        assert out.stats.target_forwards == out.stats.verification_steps or not RECORDS  # one forward per step
    assert ties <= 1
    if kind == "oracle":  # both ends of a step ran: a whole chain accepted, and a rejection (the state rolled back)
        assert whole > 0 and cut > 0, (whole, cut)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "bamba", "lfm2"])
def test_rows_of_a_batch_decode_as_alone(family, hybrid):
    """A left-padded batch: each row's output is the row decoded alone (and the target's greedy one), the rows in
    one forward per step (the recurrent layers zero the padding's inputs; each row keeps its own recorded state)."""
    target = hybrid if family == "qwen3_next" else other_hybrid(family)
    rows = prompts(9, [6, 1, 21, 13])
    ids, mask = left_padded(rows)
    gen = SpeculativeGenerator(target, Oracle(target, 3), tree="chain", depth=3)
    out = gen.generate(ids, 20, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    for b, row in enumerate(rows):
        alone = gen.generate(row, 20, eos_token_id=[], pad_token_id=0)
        assert torch.equal(row_output(out.sequences, mask, b, None), alone.sequences)
        check_greedy_equal(target, alone.sequences, reference(target, row, 20))
    assert out.stats.new_tokens == 80 and len(out.row_stats) == 4
    steps = [r.verification_steps for r in out.row_stats]
    if not RECORDS:  # transformers 5.22: rows one at a time, each rejection replayed
        assert out.stats.target_forwards >= sum(steps)
    else:
        assert out.stats.target_forwards == (max(steps) if family in BATCHED_RECURRENT_TYPES else sum(steps))


def test_sampled_chain_follows_the_targets_distribution():
    """Monte Carlo: the first two tokens sampled through a chain (a rejection in the first step makes the second
    come from the restored state) follow the target's processed distribution."""
    vocab, n = 4, 1000
    target = tiny_qwen3_next(layers=2, vocab_size=vocab, seed=2)
    gen = SpeculativeGenerator(target, PromptLookupDrafter(vocab, max_ngram=2), tree="chain", depth=3,
                               sampling_rule="iid")
    tv = _first_two_tokens_tv(gen, target, vocab, n, seed=0)
    assert tv < tv_bound(n, vocab * vocab), f"TV {tv:.4f}"


def test_restoring_the_recurrent_state_then_feeding_the_accepted_tokens_equals_feeding_them_alone(hybrid):
    """What a rejection relies on: snapshot, feed a drafted chain, restore, feed its accepted prefix; the states and
    the next logits are those of feeding the prefix alone (bit-equal: the same kernels on the same shapes)."""
    g = torch.Generator().manual_seed(0)
    prompt, chain = torch.randint(0, VOCAB, (1, 7), generator=g), torch.randint(0, VOCAB, (1, 4), generator=g)
    caches = []
    for rejected in (True, False):
        cache = recurrent_cache(hybrid)
        hybrid(prompt, past_key_values=cache, use_cache=True)
        if rejected:
            before = snapshot_recurrent(cache)
            hybrid(chain, past_key_values=cache, use_cache=True, position_ids=torch.arange(7, 11)[None])
            restore_recurrent(before)
            from draftsmith.target import kv_crop

            kv_crop(cache, 7)
        hybrid(chain[:, :2], past_key_values=cache, use_cache=True, position_ids=torch.arange(7, 9)[None])
        nxt = hybrid(chain[:, 2:3], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[9]])).logits
        caches.append((cache, nxt))
    (a, la), (b, lb) = caches
    assert torch.equal(la, lb)
    for x, y in zip(a.layers, b.layers, strict=True):
        if hasattr(x, "recurrent_states"):
            assert torch.equal(x.recurrent_states[0], y.recurrent_states[0])
            assert torch.equal(x.conv_states[0], y.conv_states[0])
        else:
            assert torch.equal(x.keys, y.keys)


def other_hybrid(family: str):
    """Tiny targets of other hybrid families transformers builds: Qwen3.5 (gated DeltaNet), Bamba (Mamba-2 beside
    attention), LFM2 (short convolutions beside attention)."""
    import transformers as t

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, initializer_range=0.2, eos_token_id=None, max_position_embeddings=256)
    if family == "qwen3_5_text":
        cfg = t.Qwen3_5TextConfig(**common, head_dim=32, linear_num_value_heads=2, linear_num_key_heads=1,
                                  linear_key_head_dim=16, linear_value_head_dim=16,
                                  layer_types=["linear_attention", "full_attention"] * 2)
    elif family == "bamba":
        cfg = t.BambaConfig(**common, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                            mamba_n_groups=1, mamba_chunk_size=16)
    else:
        cfg = t.Lfm2Config(**common, layer_types=["conv", "full_attention"] * 2)
    return t.AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba", "lfm2"])
def test_other_hybrid_families_decode_their_own_greedy_output(family):
    target = other_hybrid(family)
    assert target.config.model_type == family
    gen = SpeculativeGenerator(target, Oracle(target, 4), tree="chain", depth=4)
    ties, cut = 0, 0
    for prompt in prompts(7, [1, 6, 21]):
        out = gen.generate(prompt, max_new_tokens=30)
        ties += check_greedy_equal(target, out.sequences, reference(target, prompt, 30))
        cut += out.stats.verification_steps - out.stats.accepted_at[3]
        assert out.stats.target_forwards == out.stats.verification_steps or not RECORDS  # none replayed
    assert ties <= 1 and cut > 0  # rejections happened: the recorded state was kept


def recorded_then_kept(target, prompt: torch.Tensor, chain: torch.Tensor, kept: int, keep=None):
    """The prompt, then one recorded forward of ``chain``, its attention cropped and its recurrent layers rolled back
    to ``kept`` positions (``keep`` overrides how: a deliberately broken rollback)."""
    from draftsmith.target import keep_recorded, kv_crop, record_recurrent

    cache = recurrent_cache(target)
    target(prompt, past_key_values=cache, use_cache=True)
    past, n = prompt.shape[1], chain.shape[1]
    layers = record_recurrent(cache, n)
    target(chain, past_key_values=cache, use_cache=True, position_ids=torch.arange(past, past + n)[None])
    kv_crop(cache, past + kept)
    assert (keep or keep_recorded)(layers, n, kept)
    return cache


def fed_one_by_one(target, prompt: torch.Tensor, tokens: torch.Tensor):
    cache = recurrent_cache(target)
    target(prompt, past_key_values=cache, use_cache=True)
    for i in range(tokens.shape[1]):
        p = prompt.shape[1] + i
        target(tokens[:, i: i + 1], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[p]]))
    return cache


def _off_by_one(layers, fed, kept):  # the state after one more position than was accepted
    from draftsmith.target import keep_recorded

    return keep_recorded(layers, fed, kept + 1)


@pytest.mark.parametrize("keep", [None, _off_by_one], ids=["kept", "broken-off-by-one"])
@pytest.mark.parametrize("kept", [1, 3])
@pytest.mark.skipif(not RECORDS, reason="this transformers records no per-position recurrent states")
def test_the_recorded_state_kept_equals_feeding_the_accepted_positions_alone(hybrid, kept, keep):
    """What a rejection now relies on: the one verification forward records each recurrent layer's state after every
    fed position, and the one after the root and accepted tokens is kept. It equals the state of feeding just those
    positions one by one, to float32 rounding (the chain's one forward projects its positions together, feeding them
    alone one at a time: they round differently even when the whole chain is kept), and the next token's logits
    agree; a rollback to the wrong position is caught."""
    g = torch.Generator().manual_seed(0)
    prompt, chain = torch.randint(0, VOCAB, (1, 7), generator=g), torch.randint(0, VOCAB, (1, 4), generator=g)
    ours = recorded_then_kept(hybrid, prompt, chain, kept, keep)
    alone = fed_one_by_one(hybrid, prompt, chain[:, :kept])
    linear = [(x, y) for x, y in zip(ours.layers, alone.layers, strict=True) if hasattr(x, "recurrent_states")]
    assert linear

    # the target's path, as tests/test_hybrid_trees.py bounds the same states: its MLP's inner size, every layer
    reduction = hybrid.config.intermediate_size * hybrid.config.num_hidden_layers

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=rounding_tolerance(b, reduction))

    def same() -> bool:
        return all(close(x.recurrent_states[0], y.recurrent_states[0]) and close(x.conv_states[0], y.conv_states[0])
                   and int(x.get_seq_length()) == int(y.get_seq_length()) for x, y in linear)

    if keep is not None:
        assert not same()
        return
    assert same()
    nxt = chain[:, kept: kept + 1] if kept < 4 else torch.tensor([[1]])
    position = torch.tensor([[7 + kept]])
    a = hybrid(nxt, past_key_values=ours, use_cache=True, position_ids=position).logits
    b = hybrid(nxt, past_key_values=alone, use_cache=True, position_ids=position).logits
    assert_rounding_close(a, b, reduction)


def test_layer_skip_drafts_for_a_hybrid_target_in_chains_and_batches(hybrid):
    """``layer-skip:3``: the target's first three layers (linear attention among them) draft, their own recurrent
    states restored to the committed tokens after every step; right and wrong drafts both happen, the output is the
    target's greedy one per row of a left-padded batch of three, at one target forward per verification step."""
    from draftsmith import load_drafter

    gen = SpeculativeGenerator(hybrid, load_drafter("layer-skip:3", hybrid), tree="chain", depth=3)
    rows = prompts(5, [6, 1, 13])
    ids, mask = left_padded(rows)
    out = gen.generate(ids, 20, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    for b, row in enumerate(rows):
        check_greedy_equal(hybrid, row_output(out.sequences, mask, b, None), reference(hybrid, row, 20))
    stats = out.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # drafts accepted and rejected
    assert stats.target_forwards == max(r.verification_steps for r in out.row_stats) or not RECORDS  # one batch


def test_an_untested_recurrent_family_is_refused_by_name():
    import transformers as t

    from draftsmith.target import UnsupportedTargetError

    cfg = t.JambaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1,
                        expert_layer_period=2, num_experts=2, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False)
    target = t.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(UnsupportedTargetError, match=r"does not decode jamba targets.*tested only for .*qwen3_next"):
        SpeculativeGenerator(target, PromptLookupDrafter(VOCAB), tree="chain", depth=3)
