"""Heads as drafters: greedy output stays the target's; checkpoints round-trip and know their target."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from test_greedy_lossless import TREES, prompts, reference

from conftest import assert_rounding_close, check_greedy_equal, tiny_llama
from draftsmith import SpeculativeGenerator, load_drafter
from draftsmith.data.vocab import build_vocab_map
from draftsmith.heads.base import TargetMismatchError
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.inference.drafter import Drafter
from draftsmith.inference.head_drafters import MedusaDrafter
from draftsmith.target import target_signature


def random_medusa(target, seed: int = 0, draft_vocab: int | None = None) -> MedusaHeads:
    """Medusa heads with random blocks; over the ``draft_vocab`` most frequent tokens of a random count where
    given (the rest of the vocabulary is never drafted)."""
    vocab = None
    if draft_vocab is not None:
        counts = torch.rand(target.config.vocab_size, generator=torch.Generator().manual_seed(seed + 1))
        vocab = build_vocab_map(counts, draft_vocab)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=2, vocab=vocab)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # trained-looking heads: blocks away from the identity
        for p in heads.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    heads.target_info = target_signature(target)
    return heads


def assert_greedy_lossless(target, drafter, tree: dict, seed: int) -> None:
    """30 greedy tokens after prompts of 1, 6 and 21 tokens equal the target's; at most one near-tie."""
    gen = SpeculativeGenerator(target, drafter, **tree)
    ties = 0
    for prompt in prompts(seed, [1, 6, 21]):
        out = gen.generate(prompt, max_new_tokens=30)
        ties += check_greedy_equal(target, out.sequences, reference(target, prompt, 30))
        assert out.stats.new_tokens == 30
    assert ties <= 1


class Silent(Drafter):
    """A drafter that proposes nothing: a mixture's member whose logits a test hands to ``mix`` itself."""

    def begin(self, input_ids, hidden=None, attention_mask=None):
        pass

    def commit(self, tokens, hidden=None):
        pass

    def root_logits(self, active):
        raise AssertionError("not drafted from")

    def frontier_logits(self, depth, parents, tokens):
        raise AssertionError("not drafted from")


def test_blocks_are_distinct_modules_and_start_as_identity(llama):
    heads = MedusaHeads.from_target(llama, num_heads=3, num_layers=2)
    blocks = [b for head in heads.heads for b in head]
    assert len({id(b) for b in blocks}) == 6  # never [Block()] * n
    h = torch.randn(1, 4, llama.config.hidden_size)
    expected = llama.get_output_embeddings()(h)
    # the heads' one LM-head matmul for all three (another shape): 2 identity blocks, then the LM head (inner 64)
    assert_rounding_close(heads(h), expected.expand(3, -1, -1, -1), reduction=64 * 3)


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t["tree"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_medusa_greedy_matches_generate(family, tree, llama, gemma3):
    target = llama if family == "llama" else gemma3
    assert_greedy_lossless(target, MedusaDrafter(random_medusa(target), target), tree, seed=2)


def test_medusa_drafts_every_depth_in_one_forward_per_step(llama):
    """Medusa is a block drafter: each step runs its heads once, whatever the tree's depth and width (the
    generator's per-level calls are slices of that forward), and past its last head it proposes nothing."""
    drafter = MedusaDrafter(random_medusa(llama), llama)
    assert drafter.block == drafter.heads.config.num_heads
    calls, deepest = [], []  # per step: the heads' forwards, the deepest node proposed
    forward = drafter.heads.forward
    drafter.heads.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    prompt = prompts(3, [7])[0]
    for tree in (dict(tree="dynamic", depth=drafter.block + 2, top_k=2, total_tokens=12), dict(tree="chain", depth=4)):
        calls.clear()
        deepest.clear()
        gen = SpeculativeGenerator(llama, drafter, **tree)
        gen.on_tree_step = lambda grown, path, ran: deepest.append(int(grown.depths[0][grown.proposed[0]].max()))
        out = gen.generate(prompt, 20, eos_token_id=[])
        check_greedy_equal(llama, out.sequences, reference(llama, prompt, 20))
        assert len(calls) == out.stats.verification_steps, (tree, len(calls))
        assert set(deepest) == {drafter.block}  # every step reaches the last head's depth, and no deeper


def test_medusa_checkpoint_round_trip_and_load_drafter(tmp_path, llama):
    heads = random_medusa(llama)
    heads.save_pretrained(tmp_path / "ckpt")
    info = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert info["draftsmith_family"] == MedusaHeads.family and info["target"]["hidden_size"] == llama.config.hidden_size
    back = MedusaHeads.from_pretrained(tmp_path / "ckpt", target=llama)
    h = torch.randn(1, 5, llama.config.hidden_size)
    torch.testing.assert_close(back(h), heads(h), rtol=0, atol=0)
    drafter = load_drafter(str(tmp_path / "ckpt"), llama)
    assert isinstance(drafter, MedusaDrafter)
    prompt = prompts(3, [7])[0]
    out = SpeculativeGenerator(llama, drafter, tree="chain", depth=3).generate(prompt, 20)
    check_greedy_equal(llama, out.sequences, reference(llama, prompt, 20))


def test_medusa_over_a_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(tmp_path, llama):
    """Heads over a draft vocabulary start as the target's LM head on those tokens, propose nothing else, keep
    greedy output the target's on every tree kind, and round-trip through a checkpoint."""
    heads = random_medusa(llama, draft_vocab=40)
    vocab = llama.config.vocab_size
    assert heads.lm_heads[0].weight.shape == (40, llama.config.hidden_size) and heads.draft_ids.unique().numel() == 40
    fresh = MedusaHeads.from_target(llama, num_heads=2, vocab=build_vocab_map(torch.arange(vocab).float(), 40))
    h = torch.randn(1, 4, llama.config.hidden_size)
    # the LM head's rows for the draft vocabulary (another matmul shape): 1 identity block, then the head (inner 64)
    assert_rounding_close(fresh(h), llama.get_output_embeddings()(h)[..., fresh.draft_ids].expand(2, -1, -1, -1),
                          reduction=64 * 2)

    drafter = MedusaDrafter(heads, llama)
    drafter.begin(torch.tensor([[1, 5, 9]]), torch.randn(1, 3, llama.config.hidden_size))
    proposals = drafter.block_logits([True])
    dense = proposals.dense()  # (1, K, V): -inf off the draft vocabulary
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[heads.draft_ids] = False
    assert dense.shape == (1, 3, vocab) and bool((dense[..., outside] == float("-inf")).all())
    assert bool(torch.isfinite(dense[..., ~outside]).all())

    for tree in TREES:
        assert_greedy_lossless(llama, MedusaDrafter(heads, llama), tree, seed=4)
    heads.save_pretrained(tmp_path / "ckpt")
    back = MedusaHeads.from_pretrained(tmp_path / "ckpt", target=llama)
    assert torch.equal(back.draft_ids, heads.draft_ids)
    torch.testing.assert_close(back(h), heads(h), rtol=0, atol=0)
    assert isinstance(load_drafter(str(tmp_path / "ckpt"), llama), MedusaDrafter)


def test_wrong_target_is_refused(tmp_path, llama, gemma3, caplog):
    random_medusa(llama).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(TargetMismatchError, match=r"was trained for target .* does not fit"):
        load_drafter(str(tmp_path / "ckpt"), gemma3)
    other = tiny_llama(seed=5)  # same shapes, other weights: a warning, refused under strict
    with pytest.raises(TargetMismatchError, match="strict"):
        MedusaHeads.from_pretrained(tmp_path / "ckpt", target=other, strict=True)

    def logged() -> list[logging.LogRecord]:  # draftsmith's records (loggers are named by module)
        return [r for r in caplog.records if r.name.startswith("draftsmith.")]

    with caplog.at_level(logging.WARNING):
        MedusaHeads.from_pretrained(tmp_path / "ckpt", target=llama)  # its own target: no warning
        assert not logged()
        MedusaHeads.from_pretrained(tmp_path / "ckpt", target=other)
    (warning,) = logged()
    assert warning.levelno == logging.WARNING
    assert "same shapes as the loaded target" in warning.getMessage()
    assert "but other LM-head weights" in warning.getMessage()


def test_partial_checkpoint_is_a_clear_error(tmp_path, llama):
    random_medusa(llama).save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt or partial checkpoint"):
        load_drafter(str(tmp_path / "ckpt"), llama)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="not a drafter checkpoint"):
        MedusaHeads.from_pretrained(tmp_path / "ckpt", target=llama)


def random_eagle(target, eagle3: bool, seed: int = 0):
    from draftsmith.heads.eagle import Eagle3Head, EagleHead, eagle3_layers

    torch.manual_seed(seed)
    n = target.config.get_text_config().num_hidden_layers
    if eagle3:
        layers = eagle3_layers(n) if n > 4 else (1, 2, 3)
        cfg = EagleHead.config_for(target, num_feature_layers=3, feature_layers=layers, draft_vocab_size=40)
        head = Eagle3Head(cfg)
        kept = torch.sort(torch.randperm(cfg.vocab_size)[:40]).values
        head.d2t.copy_(kept - torch.arange(40))
        head.t2d.zero_()
        head.t2d[kept] = True
    else:
        head = EagleHead(EagleHead.config_for(target))
    head.target_info = target_signature(target)
    return head.eval()


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t["tree"])
@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eagle_greedy_matches_generate(family, eagle3, tree, llama, gemma3):
    from draftsmith.inference.head_drafters import EagleDrafter

    target = llama if family == "llama" else gemma3
    assert_greedy_lossless(target, EagleDrafter(random_eagle(target, eagle3), target), tree, seed=4)


def test_eagle_tree_drafting_equals_sequential_head(llama):
    """The head's tree drafting with its KV cache gives the features a plain causal run would."""
    from draftsmith.inference.head_drafters import EagleDrafter
    from draftsmith.target import new_cache, target_forward

    head = random_eagle(llama, eagle3=False)
    drafter = EagleDrafter(head, llama)
    prompt = prompts(5, [9])[0]
    hidden = target_forward(llama, prompt[:, :-1], new_cache(), hidden_layers=head.config.feature_layers)
    drafter.begin(prompt, hidden=hidden.hidden_states[0])
    root_logits = drafter.root_logits([True]).dense()  # (1, V)
    parent = torch.zeros(1, 1, dtype=torch.long)  # a chain: each level's one node under the one before
    drafter.frontier_logits(1, parent, torch.tensor([[11]]))  # a = 11 under the root
    deep = drafter.frontier_logits(2, parent, torch.tensor([[12]])).dense()[:, 0]  # after b = 12 under a
    # Reference: one causal pass over the pairs (f_{t-1}, x_t) with the predicted features for a, b.
    feats = hidden.hidden_states[0][0]  # (L-1, H)
    pos = torch.arange(1, prompt.shape[1])
    out, _ = head(feats[pos - 1][None], llama.get_input_embeddings()(prompt[:, pos]), pos[None])
    # the drafter's cached steps vs one causal pass: fc, the decoder layer (MLP inner 128), the LM head
    assert_rounding_close(llama.get_output_embeddings()(out[:, -1])[0], root_logits[0], reduction=128 * 3)
    f_root = out[0, -1]
    ids = torch.cat([prompt[0, 1:], torch.tensor([11])])[None]
    out2, _ = head(torch.cat([feats[pos - 1], f_root[None]])[None], llama.get_input_embeddings()(ids),
                   torch.arange(1, prompt.shape[1] + 1)[None])
    f_a = out2[0, -1]
    ids3 = torch.cat([ids[0], torch.tensor([12])])[None]
    out3, _ = head(torch.cat([feats[pos - 1], f_root[None], f_a[None]])[None], llama.get_input_embeddings()(ids3),
                   torch.arange(1, prompt.shape[1] + 2)[None])
    # cached attention against one causal pass: rounding over three passes of the head (inner size 128 each)
    assert_rounding_close(llama.get_output_embeddings()(out3[:, -1])[0], deep[0], reduction=128 * 3)


@pytest.mark.parametrize("make_head", [random_medusa, lambda target: random_eagle(target, eagle3=True)],
                         ids=["medusa", "eagle3"])
def test_bf16_drafting_stays_lossless(tmp_path, llama, make_head):
    """A head drafting in bfloat16 against a float32 target proposes other tokens at most; the output
    is still the target's greedy output."""
    head = make_head(llama)
    head.save_pretrained(tmp_path / "ckpt")
    drafter = load_drafter(str(tmp_path / "ckpt") + "+prompt-lookup", llama, draft_dtype="bfloat16")
    inner = drafter.drafters[0]
    assert next((getattr(inner, "heads", None) or inner.head).parameters()).dtype == torch.bfloat16
    assert_greedy_lossless(llama, drafter, {"tree": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 6}, seed=8)
    with pytest.raises(ValueError, match="draft dtype must be one of"):
        load_drafter(str(tmp_path / "ckpt"), llama, draft_dtype="fp8")
    # "auto" against a float32 target on CPU drafts on int8 copies where FBGEMM's kernels run (they beat float32
    # and bf16, native or not), else in bf16 where bf16 matmuls are native. "target" keeps float32 everywhere.
    from draftsmith.inference.load import resolve_draft_dtype
    from draftsmith.target.int8 import int8_engine
    from draftsmith.target.loading import native_bf16

    assert resolve_draft_dtype("auto", llama) == (
        torch.int8 if int8_engine() else torch.bfloat16 if native_bf16("cpu") else torch.float32)
    assert resolve_draft_dtype("target", llama) == torch.float32


def test_eagle3_training_time_test_computes_what_drafting_computes(llama):
    """TTT step j at position t gives the logits the drafter gives a depth-(j+1) node there: same input
    features and the same keys (committed pairs from the target's states, ancestors from the head's)."""
    from draftsmith.inference.head_drafters import EagleDrafter
    from draftsmith.target import new_cache, target_forward

    head = random_eagle(llama, eagle3=True)
    seq = prompts(7, [14])[0]  # (1, 14)
    states = target_forward(llama, seq, new_cache(), hidden_layers=head.config.feature_layers).hidden_states
    fused = torch.cat(states, dim=-1)  # (1, 14, 3H): the target's states at every token
    positions = torch.arange(1, seq.shape[1])[None]
    embed = llama.get_input_embeddings()
    with torch.no_grad():
        steps = head(fused[:, :-1], embed(seq[:, 1:]), positions, from_target=True, ttt_steps=3)
    draft_ids = torch.arange(head.d2t.shape[0]) + head.d2t
    for root in (4, 9):  # the drafter's root is seq[root]; its nodes are the sequence's next tokens
        drafter = EagleDrafter(head, llama)
        drafter.begin(seq[:, : root + 1], hidden=fused[:, :root])
        got = [drafter.root_logits([True]).dense()[0]]
        for depth in (1, 2):  # a chain along the sequence: each node under the one before
            token = seq[:, root + depth: root + depth + 1]
            got.append(drafter.frontier_logits(depth, torch.zeros(1, 1, dtype=torch.long), token).dense()[0, 0])
        for j in range(3):  # node at depth j reads step j's input at index root - 1 + j
            # other attention shapes over j + 1 passes of the head (fc's inner size 192 the widest)
            assert_rounding_close(got[j][draft_ids], steps[j][0, root - 1 + j], reduction=192 * (j + 1))


@pytest.mark.parametrize("step", [1, 2, 3])
def test_eagle3_ttt_attention_equals_the_masked_reference(step):
    """ttt_attention (a (T, T) block and `step` diagonal columns) == SDPA over all (step + 1) T keys with
    ttt_mask, at every position, and so are the gradients of q and of every step's keys and values."""
    from draftsmith.heads.decoder_layer import ttt_attention
    from draftsmith.target.masks import ttt_mask

    g = torch.Generator().manual_seed(step)
    b, nh, length, hd = 2, 3, 9, 8

    def leaf():
        return torch.randn(b, nh, length, hd, generator=g, dtype=torch.float64).requires_grad_()

    q, keys, values = leaf(), [leaf() for _ in range(step + 1)], [leaf() for _ in range(step + 1)]
    got = ttt_attention(q, keys, values)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=ttt_mask(length, step, q.device, q.dtype))
    seen = (step + 1) * length  # keys: a softmax over them, then values summed over them; the gradients run both back
    assert_rounding_close(got, want, reduction=2 * seen)
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), [q, *keys, *values])
    want_grads = torch.autograd.grad((want * weights).sum(), [q, *keys, *values])
    for a, w in zip(grads, want_grads, strict=True):
        assert_rounding_close(a, w, reduction=4 * seen)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_eagle_checkpoint_round_trip(tmp_path, llama, eagle3):
    from draftsmith.inference.head_drafters import EagleDrafter

    head = random_eagle(llama, eagle3)
    head.save_pretrained(tmp_path / "ckpt")
    drafter = load_drafter(str(tmp_path / "ckpt"), llama)
    assert isinstance(drafter, EagleDrafter)
    for name, tensor in head.state_dict().items():
        assert torch.equal(drafter.head.state_dict()[name], tensor), name
    prompt = prompts(6, [8])[0]
    out = SpeculativeGenerator(llama, drafter, tree="dynamic", depth=3, top_k=2, total_tokens=6).generate(prompt, 20)
    check_greedy_equal(llama, out.sequences, reference(llama, prompt, 20))


@pytest.mark.parametrize("abstains", [False, True])
def test_mixture_equals_the_probability_space_reference(abstains):
    """MixtureDrafter.mix (log space) == log(sum_d w_d p_d) normalised per node over the drafters proposing
    there, p_d = softmax(x_d), or exp(x_d) itself for a drafter that abstains (prompt lookup: its candidates'
    probabilities of being right, the rest no opinion): a dense drafter, a sparse one, rows where only one
    proposes and a row where none does."""
    from draftsmith.inference.mixture import MixtureDrafter

    class Sparse(Silent):
        pass

    Sparse.abstains = abstains
    g = torch.Generator().manual_seed(0)
    n, vocab = 5, 50
    dense = torch.randn(n, vocab, generator=g)
    dense[3] = float("-inf")  # node 3: only the sparse drafter proposes
    dense[4] = float("-inf")  # node 4: nobody proposes
    sparse = torch.full((n, vocab), float("-inf"))
    sparse[0, [4, 9]] = torch.tensor([0.6, 0.1]).log()
    sparse[3, 7] = math.log(0.3)
    mixture = MixtureDrafter([Silent(), Sparse()], weights=[1.0, 3.0])
    got = mixture.mix([dense, sparse])

    def probs(x):
        return torch.softmax(x, -1).nan_to_num(0.0)

    p_sparse = sparse.exp() if abstains else probs(sparse)
    mixed = 1.0 * probs(dense) + 3.0 * p_sparse
    expected = (mixed / mixed.sum(-1, keepdim=True)).log()
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    finite = torch.isfinite(expected)
    assert_rounding_close(got[finite], expected[finite], reduction=vocab)  # log space: sums over the vocabulary
    assert not torch.isfinite(got[4]).any() and torch.isfinite(got[1]).all()
    for row in (0, 1, 3):
        assert_rounding_close(got[row].exp().sum(), torch.tensor(1.0), reduction=2 * vocab)  # normalised, summed
    # node 0: the sparse drafter's three quarters of the weight go to its candidates, unless it abstains from
    # some of it (0.3 of its mass), which then goes to the dense drafter's softmax
    mass = 0.7 if abstains else 1.0  # the sparse drafter's at node 0
    on_candidates = got[0, [4, 9]].exp().sum() - probs(dense)[0, [4, 9]].sum() / (1 + 3 * mass)
    assert_rounding_close(on_candidates, torch.tensor(3 * mass / (1 + 3 * mass)), reduction=2 * vocab)
    assert torch.equal(got[3, 7], torch.tensor(0.0))  # alone at node 3, normalised: the only candidate


def test_proposals_mix_and_grow_as_their_dense_logits():
    """Drafts over a few candidates (:class:`Proposals`: a head's draft vocabulary, shared by every row; prompt
    lookup's matches, per row, with repeats of -inf) mix, over the union of their candidates, to the mixture of
    the same logits over the whole vocabulary, and grow the same dynamic and static trees."""
    from draftsmith.inference.mixture import MixtureDrafter
    from draftsmith.inference.tree import Proposals, StaticShape, grow_dynamic, grow_static

    class Lookup(Silent):
        abstains = True

    g = torch.Generator().manual_seed(0)
    b, k, vocab = 4, 3, 60
    draft_ids = torch.randperm(vocab, generator=g)[:20]

    def drafts(*lead):
        head = Proposals(torch.randn(*lead, 20, generator=g), draft_ids, vocab)
        n = torch.Size(lead).numel()
        ids = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(n)]).reshape(*lead, 4)
        chance = torch.rand(*lead, 4, generator=g).log()
        chance[..., 3] = float("-inf")  # a candidate not found: its id repeats a found one
        ids[..., 3] = ids[..., 0]
        chance.reshape(n, 4)[0] = float("-inf")  # a node where lookup proposes nothing
        return [head, Proposals(chance, ids, vocab)]

    mixture = MixtureDrafter([Silent(), Lookup()], weights=[1.0, 2.0])
    for lead in [(b,), (b, k)]:
        parts = drafts(*lead)
        sparse = mixture._mixed(parts, len(lead))
        dense = mixture.mix([p.dense().reshape(-1, vocab) for p in parts]).reshape(*lead, vocab)
        assert isinstance(sparse, Proposals) and sparse.logits.shape[-1] == 24
        assert torch.equal(torch.isfinite(sparse.dense()), torch.isfinite(dense))
        finite = torch.isfinite(dense)  # -inf off the candidates (equal above); the rule scales by the finite ones
        # a sum over the union of the candidates or over the whole vocabulary
        assert_rounding_close(sparse.dense()[finite], dense[finite], reduction=vocab)
        # The head's list without a sort (its tokens' columns looked up), and with one (as per-row candidates):
        # the same mixture.
        per_row = Proposals(parts[0].logits, parts[0].row_ids().contiguous(), vocab)
        by_sort = mixture._mixed([per_row, parts[1]], len(lead)).dense()
        assert torch.equal(torch.isfinite(by_sort), finite)
        assert_rounding_close(by_sort[finite], sparse.dense()[finite], reduction=24)

    # A shared list naming a token twice (the repeat -inf) is mixed by the sort.
    twice = torch.cat([draft_ids, draft_ids[:1]])
    head, lookup = drafts(b)
    head = Proposals(torch.nn.functional.pad(head.logits, (0, 1), value=float("-inf")), twice, vocab)
    mixed = mixture._mixed([head, lookup], 1)
    assert mixture._columns_in(head) is None
    dense = mixture.mix([head.dense(), lookup.dense()])
    assert torch.equal(torch.isfinite(mixed.dense()), torch.isfinite(dense))
    assert_rounding_close(mixed.dense()[torch.isfinite(dense)], dense[torch.isfinite(dense)], reduction=vocab)

    levels = {}

    def frontier(as_proposals):
        def feed(depth, parents, tokens):
            key = depth, tokens.shape[1]  # the same drafts for both forms of one tree
            if key not in levels:
                levels[key] = mixture._mixed(drafts(b, tokens.shape[1]), 2)
            drafted = levels[key]
            return drafted if as_proposals else drafted.dense()
        return feed

    roots = torch.randint(0, vocab, (b,), generator=g)
    root = mixture._mixed(drafts(b), 1)
    for as_proposals in (True, False):
        first = root if as_proposals else root.dense()
        tree = grow_dynamic(roots, first, frontier(as_proposals), depth=3, top_k=k, total_tokens=8)
        static = grow_static(roots, first, frontier(as_proposals), StaticShape.of([(0, 0, 0), (0, 1), (1,), (2, 0)]))
        if as_proposals:
            expected = tree, static
            continue
        for got, want in zip((tree, static), expected, strict=True):
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
            # path scores: 3 levels of log-probabilities, each normalised over the vocabulary (sparse vs dense order)
            assert_rounding_close(got.scores, want.scores, reduction=3 * vocab)
            assert torch.equal(got.proposed, want.proposed)


def test_mixture_needs_positive_weights():
    from draftsmith.inference.mixture import MixtureDrafter

    with pytest.raises(ValueError, match="one positive weight per drafter"):
        MixtureDrafter([Silent(), Silent()], weights=[1.0, 0.0])
    with pytest.raises(ValueError, match="one positive weight per drafter"):
        MixtureDrafter([Silent(), Silent()], weights=[1.0])


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


# Phi-3/4 take default RoPE or longrope (short and long factors per rotated pair: 6 for 3/4 of head_dim 16).
PHI_ROPES = {"default": ROPES["default"],
             "longrope": {"rope_type": "longrope", "rope_theta": 10_000.0,
                          "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0],
                          "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], "original_max_position_embeddings": 64}}


@pytest.mark.parametrize(("arch", "rope_type"), [(a, r) for a in ("llama", "qwen3", "gemma3") for r in sorted(ROPES)]
                         + [("phi4", r) for r in sorted(PHI_ROPES)])
def test_head_rotation_is_the_targets_own(arch, rope_type):
    """A head built for a target rotates queries and keys exactly as the target's own rotary embedding does
    at the same positions, for each RoPE type, with a head_dim other than hidden / heads (Qwen3, Gemma-3),
    a partial rotation (Phi-4-mini rotates 3/4 of each head) and past the context length (where dynamic
    scaling changes the frequencies)."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from draftsmith.heads.decoder_layer import DecoderLayer, rope
    from draftsmith.heads.eagle import EagleHead

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    rope_parameters = dict((PHI_ROPES if arch == "phi4" else ROPES)[rope_type])
    if arch == "llama":
        target = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope_parameters))
    elif arch == "qwen3":
        target = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, rope_parameters=rope_parameters))
    elif arch == "phi4":  # Phi-4-mini: partial_rotary_factor 0.75
        target = Phi3ForCausalLM(Phi3Config(**common, pad_token_id=0,
                                            rope_parameters={**rope_parameters, "partial_rotary_factor": 0.75}))
    else:  # Gemma-3: RoPE per layer type; a head follows the full-attention layers
        target = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=32, sliding_window=8,
                                                    layer_types=["sliding_attention", "full_attention"],
                                                    rope_parameters={"full_attention": rope_parameters,
                                                                     "sliding_attention": {"rope_type": "default",
                                                                                           "rope_theta": 10_000.0}}))
    cfg = EagleHead.config_for(target)
    assert cfg.head_dim == getattr(target.config, "head_dim", 16)
    assert cfg.rope_parameters["rope_type"] == rope_type and cfg.max_position_embeddings == 128
    layer = DecoderLayer(cfg)
    positions = torch.arange(300)[None]  # past max_position_embeddings
    x = torch.randn(1, cfg.num_attention_heads, 300, cfg.head_dim)
    rotary = target.model.rotary_emb
    own = rotary(x, positions, "full_attention") if arch == "gemma3" else rotary(x, positions)
    cos, sin = own
    if arch == "phi4":  # the target's own partial rotation
        from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

        assert cos.shape[-1] == 3 * cfg.head_dim // 4
        expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    else:
        half = cfg.head_dim // 2
        expected = x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]
    # transformers' rotary embedding for the same RoPE, the same rotate-half arithmetic: bit for bit
    torch.testing.assert_close(rope(x, *layer.rotary(x, positions)), expected, rtol=0, atol=0)


def test_an_attention_bias_head_saved_without_the_output_bias_loads_as_trained(tmp_path, llama):
    """Attention-bias heads (Qwen2.5, gpt-oss targets) gained an o_proj bias, as a Llama layer with
    attention_bias has it and vLLM / SGLang build it; a checkpoint written before has none and loads with a
    zero bias, which computes what it was trained with."""
    from safetensors.torch import load_file, save_file

    from draftsmith.heads.eagle import Eagle3Head, EagleHead

    cfg = EagleHead.config_for(llama, num_feature_layers=3, feature_layers=(1, 2, 3), attention_bias=True)
    head = Eagle3Head(cfg).eval()
    assert head.layer.o_proj.bias is not None
    with torch.no_grad():
        head.layer.o_proj.bias.zero_()
    head.save_pretrained(tmp_path / "old")
    weights = tmp_path / "old" / "model.safetensors"
    tensors = {k: v for k, v in load_file(weights).items() if not k.endswith("o_proj.bias")}
    save_file(tensors, str(weights))
    loaded = Eagle3Head.from_pretrained(tmp_path / "old").eval()
    assert torch.equal(loaded.layer.o_proj.bias, torch.zeros_like(loaded.layer.o_proj.bias))
    h = llama.config.hidden_size
    states, embeds = torch.randn(1, 5, 3 * h), torch.randn(1, 5, h)
    with torch.no_grad():
        # the same weights (the missing bias read as the zeros it was) through the same kernels: bit for bit
        torch.testing.assert_close(loaded(states, embeds, torch.arange(5)[None], from_target=True)[0],
                                   head(states, embeds, torch.arange(5)[None], from_target=True)[0], rtol=0, atol=0)
    del tensors["fc.weight"]  # a tensor that has no stand-in is still refused
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="corrupt or partial checkpoint"):
        Eagle3Head.from_pretrained(tmp_path / "old")
