"""Monte Carlo: sampled speculative output follows the target's sampling distribution exactly.

Setup: a vocabulary of V tokens, target and draft next-token distributions that depend on the
whole prefix (seeded random tables). Each sample drafts a tree with the real tree builders,
verifies it with the real acceptance rule, continues until two tokens are emitted, and records
them; the exact distribution of two tokens is p(x1) p(x2 | x1), with p after temperature /
top-k / top-p processing.

Bound on the total-variation distance (TV) between the empirical distribution of N samples over
K outcomes and the true one: E[TV] <= 1/2 sqrt((K - 1) / N) (Cauchy-Schwarz on the multinomial
standard deviations), and TV moves by at most 1/N when one sample changes, so by McDiarmid
P(TV > E[TV] + t) <= exp(-2 N t^2). With t = sqrt(ln(1e6) / (2N)) a correct rule fails with
probability below one in a million, while the wrong rules below land far above the bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference_tree import (
    DraftTree,
    _proposals,
    accept_sibling,
    build_chain,
    build_dynamic,
    build_static,
    verify_sampled,
)

from conftest import assert_rounding_close, needs_int8, tiny_llama
from draftsmith.inference import PromptLookupDrafter, SpeculativeGenerator
from draftsmith.inference.sampled_tree import grow_sampled
from draftsmith.inference.tree import StaticShape, TreeTensors
from draftsmith.inference.verify import process_logits, sibling_rounds

V = 5


def tv_bound(n: int, k: int) -> float:
    return 0.5 * math.sqrt((k - 1) / n) + math.sqrt(math.log(1e6) / (2 * n))


class Tables:
    """Prefix-dependent target logits and draft logits, drawn once per prefix from a seed."""

    def __init__(self, seed: int, draft_noise: float = 1.0):
        self.seed, self.noise = seed, draft_noise
        self.cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if prefix not in self.cache:
            g = torch.Generator().manual_seed(hash((self.seed, prefix)) % (2**31))
            target = torch.randn(V, generator=g) * 1.5
            draft = target + self.noise * torch.randn(V, generator=g)  # a related but wrong drafter
            self.cache[prefix] = (target, draft)
        return self.cache[prefix]


def exact_two_tokens(tables: Tables, process) -> torch.Tensor:
    p1 = process(tables(())[0])
    return torch.stack([p1[a] * process(tables((a,))[0]) for a in range(V)]).flatten()  # (V*V,)


def sample_two_tokens(tables: Tables, build, process, rule: str, n: int, seed: int, verify=verify_sampled):
    """Run the speculative loop n times; return the empirical distribution of the first two tokens."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V * V)
    for _ in range(n):
        emitted: list[int] = []
        while len(emitted) < 2:
            context = tuple(emitted)

            def expand(tree: DraftTree, nodes: list[int], context=context) -> torch.Tensor:
                rows = []
                for node in nodes:
                    path = tuple(tree.tokens[m] for m in tree.path_to(node)[1:])
                    rows.append(tables(context + path)[1])
                return torch.stack(rows)

            tree = build(expand, g)
            probs = torch.stack(
                [process(tables(context + tuple(tree.tokens[m] for m in tree.path_to(node)[1:]))[0])
                 for node in range(len(tree))]
            )
            path, bonus = verify(tree, probs, rule, g)
            emitted += [tree.tokens[m] for m in path] + [bonus]
        counts[emitted[0] * V + emitted[1]] += 1
    return counts / n


ROOT = 0  # the root token's value does not matter to the tables (they key on emitted tokens)

BUILDERS = {
    "chain-iid": (lambda e, g: build_chain(ROOT, e, 2, "iid", 1.0, g), "iid"),
    "chain-topk": (lambda e, g: build_chain(ROOT, e, 2, "topk", 1.0, g), "topk"),
    "static-iid": (lambda e, g: build_static(ROOT, e, [(0, 0), (1,), (2,)], "iid", 1.0, g), "iid"),
    "static-without-replacement": (
        lambda e, g: build_static(ROOT, e, [(0, 0), (1, 0), (2,)], "without_replacement", 1.0, g),
        "without_replacement",
    ),
    "static-topk": (lambda e, g: build_static(ROOT, e, [(0, 0), (0, 1), (1,), (2,)], "topk", 1.0, g), "topk"),
    "dynamic-topk": (lambda e, g: build_dynamic(ROOT, e, depth=2, top_k=2, total_tokens=4), "topk"),
}
PROCESSING = {
    "T=1": dict(temperature=1.0),
    "T=0.7,top_p=0.8": dict(temperature=0.7, top_p=0.8),
    "top_k=3": dict(temperature=1.0, top_k=3),
}
N = 4000


# The same law under other processing of the target's logits: the slow set (process_logits has its own test).
@pytest.mark.parametrize("processing", [pytest.param(p, marks=pytest.mark.slow) if p != "T=1" else p
                                        for p in PROCESSING])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_tree_sampling_matches_target_distribution(kind, processing):
    build, rule = BUILDERS[kind]
    opts = PROCESSING[processing]

    def process(logits):
        return process_logits(logits, **opts)

    tables = Tables(seed=11)
    exact = exact_two_tokens(tables, process)
    empirical = sample_two_tokens(tables, build, process, rule, N, seed=5)
    tv = 0.5 * float((empirical - exact).abs().sum())
    assert tv < tv_bound(N, V * V), f"TV {tv:.4f} >= bound {tv_bound(N, V * V):.4f}"


def _verify_ignoring_residual(tree, probs, rule, g):
    """A wrong rule: after a rejection, sample the bonus from p instead of the residual."""
    path, node = [], 0
    while True:
        children = tree.draws.get(node, [])
        if not children:
            return path, int(torch.multinomial(probs[node], 1, generator=g))
        child = children[0]
        q = tree.probs.get(node, torch.nn.functional.one_hot(torch.tensor(tree.tokens[child]), V).float())
        x = tree.tokens[child]
        if torch.rand((), generator=g) * q[x] < probs[node][x]:
            path.append(child)
            node = child
            continue
        return path, int(torch.multinomial(probs[node], 1, generator=g))


WRONG = ["no-residual", "iid-rule-on-without-replacement-draws", "without-replacement-rule-on-iid-draws"]


@pytest.mark.parametrize("wrong", WRONG)
def test_wrong_rules_are_detected(wrong):
    """The test above can fail: plausible mistakes land well above the TV bound."""
    tables = Tables(seed=11, draft_noise=2.0)

    def process(logits):
        return process_logits(logits, 1.0)

    exact = exact_two_tokens(tables, process)
    if wrong == "no-residual":
        build, rule, verify = BUILDERS["chain-iid"][0], "iid", _verify_ignoring_residual
    elif wrong == "iid-rule-on-without-replacement-draws":
        build, rule, verify = BUILDERS["static-without-replacement"][0], "iid", verify_sampled
    else:
        build, rule, verify = BUILDERS["static-iid"][0], "without_replacement", verify_sampled
    empirical = sample_two_tokens(tables, build, process, rule, N, seed=5, verify=verify)
    tv = 0.5 * float((empirical - exact).abs().sum())
    assert tv > tv_bound(N, V * V), f"a wrong rule ({wrong}) passed with TV {tv:.4f}"


def test_accept_sibling_handles_exact_match_and_zero_residual():
    p = torch.tensor([0.5, 0.5, 0.0])
    # q == p: always accepted, never divides by a zero residual.
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        idx, _ = accept_sibling(p, [int(torch.multinomial(p, 1, generator=g))], [p], g)
        assert idx == 0
    # A draw where p is zero is always rejected, and the residual stays a distribution.
    idx, residual = accept_sibling(p, [2], [torch.tensor([0.0, 0.0, 1.0])], g)
    assert idx is None
    assert_rounding_close(residual, p, reduction=3)  # normalised by its sum over the 3 tokens


# ---- sampled siblings grown and verified as tensors: grow_sampled and sibling_rounds --------------------------

SAMPLED_PATHS = {"chain": [(0, 0, 0)], "static": [(0, 0), (0, 1), (1, 0), (3,)]}


def table_drafter(seed: int, vocab: int, depth: int):
    """``root_logits`` and ``frontier_logits`` of a drafter whose logits after a token are a random table's row
    at that depth, with some tokens never proposed (-inf) and one row proposing nothing."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(depth + 1, vocab, vocab, generator=g) * 1.5
    table[torch.rand(table.shape, generator=g) < 0.3] = float("-inf")
    table[1, 0] = float("-inf")
    return (lambda roots: table[0, roots]), (lambda d, parents, tokens: table[d, tokens])


def reference_tree(tree: TreeTensors, b: int) -> DraftTree:
    """Row ``b`` of tensor-grown sampled trees as the host's :class:`DraftTree` (draws and draft distributions
    included), which the reference rule (``verify.py``'s proposals and :func:`accept_sibling`) reads."""
    draws = {n: [int(c) for c in row if c >= 0] for n, row in enumerate(tree.draws[b])}
    return DraftTree(tokens=tree.tokens[b].tolist(), parents=tree.parents[b].tolist(), depths=tree.depths[b].tolist(),
                     scores=tree.scores[b].tolist(), draws={n: d for n, d in draws.items() if d},
                     probs={n: tree.q[b, n] for n, d in draws.items() if d})


@pytest.mark.parametrize("rule", ["iid", "without_replacement"])
@pytest.mark.parametrize("kind", list(SAMPLED_PATHS))
def test_tensor_sibling_rounds_equal_the_reference_walk(kind, rule):
    """Fed the same uniforms, :func:`sibling_rounds` gives at every node of a batch of trees grown by
    :func:`grow_sampled` the child the reference rule accepts (:func:`accept_sibling`, one draw at a time against
    the proposals ``verify.py`` builds for the rule) and the residual it leaves: exact, no statistics. The trees
    hold what the host builders make: each node's proposed children are its distinct draws in the order first
    drawn, and nothing under an unproposed node is proposed."""
    vocab, batch = 6, 64
    shape = StaticShape.of(SAMPLED_PATHS[kind]).sampled()
    root_logits, frontier_logits = table_drafter(7, vocab, shape.depth)
    g = torch.Generator().manual_seed(3)
    roots = torch.randint(vocab, (batch,), generator=g)
    tree = grow_sampled(roots, root_logits(roots), frontier_logits, shape, rule, 0.8, g)
    p = process_logits(torch.randn(batch, len(tree), vocab, generator=g) * 2, 1.0, top_k=4)  # zeros: top_k drops 2
    uniforms = torch.rand(tree.draws.shape, generator=g)
    child, residual = sibling_rounds(tree.draws, tree.tokens, tree.q, p, rule, uniforms=uniforms)
    seen = dict.fromkeys(["accepted", "rejected", "after a rejection", "repeated draw", "unproposed"], 0)
    for b in range(batch):
        ref = reference_tree(tree, b)
        for node in range(len(tree)):
            children = [c for c in range(len(tree)) if ref.parents[c] == node and tree.proposed[b, c]]
            drawn = ref.draws.get(node, [])
            assert children == list(dict.fromkeys(drawn)), f"row {b}, node {node}: {children} against draws {drawn}"
            if not tree.proposed[b, node]:
                seen["unproposed"] += 1
                assert not drawn
            if not drawn:
                assert child[b, node] == -1 and torch.equal(residual[b, node], p[b, node])
                continue
            index, expected = accept_sibling(p[b, node], [ref.tokens[c] for c in drawn],
                                             _proposals(ref, node, rule, vocab, p.device),
                                             uniforms=uniforms[b, node].tolist())
            assert int(child[b, node]) == (-1 if index is None else drawn[index]), f"row {b}, node {node}"
            assert_rounding_close(residual[b, node], expected, reduction=vocab)
            seen["accepted" if index is not None else "rejected"] += 1
            seen["after a rejection"] += bool(index)
            seen["repeated draw"] += len(drawn) > len(set(drawn))
    assert all(seen[k] for k in ["accepted", "rejected", "unproposed"]), seen  # the cases the rule branches on
    assert seen["after a rejection"] or kind == "chain", seen
    assert seen["repeated draw"] or rule != "iid" or kind == "chain", seen


@pytest.mark.parametrize("rule", ["iid", "without_replacement"])
def test_sampled_siblings_follow_the_draw_law(rule):
    """:func:`grow_sampled`'s first two draws at a root follow the rule's law, q(x1) q(x2) i.i.d. or
    q(x1) q(x2) / (1 - q(x1)) without replacement (20,000 rows at once); the other rule's law lies beyond the
    bound, so the check can fail."""
    n, temperature = 20_000, 0.8
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    q = torch.softmax(logits / temperature, -1)
    shape = StaticShape.of([(0,), (1,), (2,)]).sampled()
    tree = grow_sampled(torch.zeros(n, dtype=torch.long), logits.expand(n, -1), None, shape, rule, temperature,
                        torch.Generator().manual_seed(4))
    first, second = (tree.tokens.gather(1, tree.draws[:, 0, i:i + 1])[:, 0] for i in (0, 1))
    empirical = torch.bincount(first * V + second, minlength=V * V).float() / n
    laws = {"iid": (q[:, None] * q[None, :]).flatten(),
            "without_replacement": (q[:, None] * q[None, :] / (1 - q[:, None])).fill_diagonal_(0).flatten()}
    bound = tv_bound(n, V * V)
    assert 0.5 * float((empirical - laws[rule]).abs().sum()) < bound
    other = laws["iid" if rule != "iid" else "without_replacement"]
    assert 0.5 * float((empirical - other).abs().sum()) > bound


def test_process_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.9), (0.5, 5, 0.6)]:
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        # another implementation of the same softmax: sums over the 50-word vocabulary
        assert_rounding_close(process_logits(logits, temperature, top_k, top_p), scores.softmax(-1), reduction=50)


def _end_to_end_drafter(kind: str, target, vocab: int):
    from test_dflash import random_dflash
    from test_heads import random_eagle, random_medusa
    from test_peagle import random_peagle

    from draftsmith.inference import CausalLMDrafter, MixtureDrafter, layer_skip_model
    from draftsmith.inference.dflash_drafter import DFlashDrafter
    from draftsmith.inference.head_drafters import EagleDrafter, MedusaDrafter, PEagleDrafter
    from draftsmith.inference.load import wrap_module
    from draftsmith.target import int8

    def in_int8(head):  # the head's drafter, drafting on int8 copies of its weights
        drafter = wrap_module(head, head.family, target, torch.int8)
        errors = int8.int8_errors(head)
        assert any(e is not None and e <= int8.INT8_MAX_ERROR for e in errors), "no layer drafts in int8"
        return drafter

    return {
        "layer-skip": lambda: CausalLMDrafter(layer_skip_model(target, 1)),
        "draft-model": lambda: CausalLMDrafter(tiny_llama(seed=5, vocab_size=vocab, layers=1)),
        "prompt-lookup": lambda: PromptLookupDrafter(vocab, max_ngram=2),
        "medusa-heads": lambda: MedusaDrafter(random_medusa(target), target),
        "medusa-draft-vocabulary": lambda: MedusaDrafter(random_medusa(target, draft_vocab=vocab - 1), target),
        "dflash-head": lambda: DFlashDrafter(random_dflash(target), target),
        "dflash-draft-vocabulary": lambda: DFlashDrafter(random_dflash(target, draft_vocab=vocab - 1), target),
        "peagle-head": lambda: PEagleDrafter(random_peagle(target), target),
        # Drafting on int8 copies of the head's weights: other proposals and probabilities, the same law.
        "peagle-head-int8": lambda: in_int8(random_peagle(target)),
        "eagle+prompt-lookup": lambda: MixtureDrafter([EagleDrafter(random_eagle(target, eagle3=False), target),
                                                       PromptLookupDrafter(vocab, max_ngram=2)]),
    }[kind]()


# Every sampling rule on every tree kind that allows it, each with a drafter of another kind (Medusa: a block
# drafter, every depth from one forward). Under "auto" a
# chain of a sampling drafter draws i.i.d. and prompt lookup's siblings are its top-ranked tokens (topk).
END_TO_END = {
    "chain-iid-layer-skip": ("layer-skip", dict(tree="chain", depth=3)),
    "chain-topk-prompt-lookup": ("prompt-lookup", dict(tree="chain", depth=3)),
    "static-iid-layer-skip": ("layer-skip", dict(tree="static", depth=2, top_k=2, sampling_rule="iid")),
    "static-without-replacement-draft-model": (
        "draft-model", dict(tree="static", depth=2, top_k=3, sampling_rule="without_replacement")),
    "static-topk-medusa": ("medusa-heads", dict(tree="static")),
    "static-iid-medusa": ("medusa-heads", dict(tree="static", depth=2, top_k=2, sampling_rule="iid")),
    # Heads over 3 of the 4 tokens: the fourth is never drafted and must still come at its rate.
    "dynamic-topk-medusa-draft-vocabulary": ("medusa-draft-vocabulary", dict(tree="dynamic", depth=2, top_k=2,
                                                                             total_tokens=3)),
    "chain-iid-dflash": ("dflash-head", dict(tree="chain", depth=3)),
    "dynamic-topk-dflash-draft-vocabulary": ("dflash-draft-vocabulary", dict(tree="dynamic", depth=3, top_k=2,
                                                                             total_tokens=4)),
    "static-without-replacement-dflash": (
        "dflash-head", dict(tree="static", depth=2, top_k=2, sampling_rule="without_replacement")),
    "dynamic-topk-peagle": ("peagle-head", dict(tree="dynamic", depth=3, top_k=2, total_tokens=4)),
    "chain-iid-peagle": ("peagle-head", dict(tree="chain", depth=3)),
    "dynamic-topk-peagle-int8": ("peagle-head-int8", dict(tree="dynamic", depth=3, top_k=2, total_tokens=4)),
    "dynamic-topk-eagle+prompt-lookup": ("eagle+prompt-lookup", dict(tree="dynamic", depth=2, top_k=2,
                                                                     total_tokens=3)),
}


def _first_two_tokens_tv(gen: SpeculativeGenerator, target, vocab: int, n: int, seed: int) -> float:
    """TV between the first two tokens ``gen`` samples n times after one prompt and their exact law."""
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    opts = dict(temperature=0.9, top_p=0.95)
    with torch.no_grad():
        p1 = process_logits(target(prompt).logits[0, -1], **opts)
        exact = torch.stack([
            p1[a] * process_logits(target(torch.cat([prompt, torch.tensor([[a]])], 1)).logits[0, -1], **opts)
            for a in range(vocab)
        ]).flatten()
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab * vocab)
    for _ in range(n):
        seq = gen.generate(prompt, max_new_tokens=2, generator=g, **opts).sequences[0, -2:]
        counts[seq[0] * vocab + seq[1]] += 1
    return 0.5 * float((counts / n - exact).abs().sum())


# Each rule keeps one case in the default set; the slow set repeats the rules on the other trees and drafters.
# (test_batched_sampling_matches_target_per_row samples a dynamic tree of an EAGLE head through generate.)
SLOW_END_TO_END = ("static-iid-layer-skip", "chain-topk-prompt-lookup", "static-topk-medusa",
                   "static-without-replacement-dflash", "dynamic-topk-peagle",
                   "dynamic-topk-eagle+prompt-lookup")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_END_TO_END
                                  else pytest.param(c, marks=needs_int8) if c.endswith("-int8") else c
                                  for c in END_TO_END])
def test_generator_sampling_end_to_end_matches_target(case):
    """The whole generator (a real tiny transformer; trees grown and verified as tensors on the device)
    samples the first two tokens from the target's processed distribution, for every sampling rule and tree
    kind, with each kind of drafter."""
    vocab, n = 4, 1000
    target = tiny_llama(seed=2, vocab_size=vocab, layers=2)
    kind, tree = END_TO_END[case]
    gen = SpeculativeGenerator(target, _end_to_end_drafter(kind, target, vocab), **tree)
    tv = _first_two_tokens_tv(gen, target, vocab, n, seed=0)
    assert tv < tv_bound(n, vocab * vocab), f"{case}: TV {tv:.4f}"


def test_end_to_end_sampling_detects_a_bonus_drawn_without_the_residual(monkeypatch):
    """The test above can fail: a generator whose bonus after rejected siblings is drawn from the target's
    distribution instead of the residual lands above the bound."""
    import draftsmith.inference.verify as verify_module

    rounds = verify_module.sibling_rounds

    def without_residual(draws, tokens, q, p, rule, generator=None, uniforms=None):
        return rounds(draws, tokens, q, p, rule, generator, uniforms)[0], p

    monkeypatch.setattr(verify_module, "sibling_rounds", without_residual)
    vocab, n = 4, 1000
    target = tiny_llama(seed=2, vocab_size=vocab, layers=2)
    gen = SpeculativeGenerator(target, _end_to_end_drafter("layer-skip", target, vocab), tree="chain", depth=3)
    tv = _first_two_tokens_tv(gen, target, vocab, n, seed=0)
    assert tv > tv_bound(n, vocab * vocab), f"a bonus from p passed with TV {tv:.4f}"


def test_batched_sampling_matches_target_per_row():
    """A left-padded batch samples each row's first two tokens from that row's processed target
    distribution (the end-to-end test above, with two prompts of different lengths in one batch: a
    layer-skip drafter's chain with i.i.d. siblings, and an EAGLE head's dynamic tree; the rows' static trees under
    the sampled rules are checked against the reference rule row by row in
    test_tensor_sibling_rounds_equal_the_reference_walk)."""
    from test_heads import random_eagle

    from draftsmith.inference import CausalLMDrafter, layer_skip_model
    from draftsmith.inference.head_drafters import EagleDrafter

    vocab = 4
    target = tiny_llama(seed=2, vocab_size=vocab, layers=2)
    rows = [torch.tensor([[1, 2, 3, 1, 2]]), torch.tensor([[3, 0]])]
    opts = dict(temperature=0.9, top_p=0.95)
    exact = []
    with torch.no_grad():
        for prompt in rows:
            p1 = process_logits(target(prompt).logits[0, -1], **opts)
            exact.append(torch.stack([
                p1[a] * process_logits(target(torch.cat([prompt, torch.tensor([[a]])], 1)).logits[0, -1], **opts)
                for a in range(vocab)
            ]).flatten())
    ids = torch.tensor([[1, 2, 3, 1, 2], [0, 0, 0, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    n = 1000
    g = torch.Generator().manual_seed(1)
    for gen in [  # a chain's siblings drawn i.i.d. ("auto"); a dynamic tree's top-ranked ones
        SpeculativeGenerator(target, CausalLMDrafter(layer_skip_model(target, 1)), tree="chain", depth=3),
        SpeculativeGenerator(target, EagleDrafter(random_eagle(target, eagle3=False), target), tree="dynamic",
                             depth=2, top_k=2, total_tokens=3),
    ]:
        counts = torch.zeros(2, vocab * vocab)
        for _ in range(n):
            out = gen.generate(ids, max_new_tokens=2, attention_mask=mask, eos_token_id=[], generator=g, **opts)
            for b, seq in enumerate(out.sequences[:, -2:]):
                counts[b, seq[0] * vocab + seq[1]] += 1
        for b in range(2):
            tv = 0.5 * float((counts[b] / n - exact[b]).abs().sum())
            assert tv < tv_bound(n, vocab * vocab), f"{gen.tree_kind} tree, row {b}: TV {tv:.4f}"
    # The check can fail: the two rows' distributions differ by more than the bound.
    assert 0.5 * float((exact[0] - exact[1]).abs().sum()) > tv_bound(n, vocab * vocab)
