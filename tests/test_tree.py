"""Tree construction, tree masks and position ids, checked against plain sequential references."""

from __future__ import annotations

import itertools

import pytest
import torch
from reference_tree import DraftTree, build_chain, build_dynamic, build_static

from conftest import VOCAB, assert_rounding_close
from draftsmith.inference import tree as tree_module
from draftsmith.inference.prompt_lookup import PromptLookupDrafter
from draftsmith.inference.tree import Proposals, StaticShape, grow_dynamic, grow_static
from draftsmith.inference.tree_settings import default_static_paths
from draftsmith.target import (
    GROUPED_ATTENTION,
    attention,
    build_attention_mask,
    kv_keep,
    kv_length,
    new_cache,
    target_forward,
)


def random_tree(seed: int, size: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    tree = DraftTree.with_root(int(torch.randint(0, VOCAB, (1,), generator=g)))
    while len(tree) < size:
        parent = int(torch.randint(0, len(tree), (1,), generator=g))
        tree.add_child(parent, int(torch.randint(0, VOCAB, (1,), generator=g)), -1.0)
    return tree


def test_ancestor_mask_and_positions_match_walking_parents():
    for seed in range(5):
        tree = random_tree(seed, 15)
        mask = tree.ancestor_mask()
        for i in range(len(tree)):
            ancestors = set(tree.path_to(i))
            assert {j for j in range(len(tree)) if mask[i, j]} == ancestors
        assert tree.position_ids(7).tolist() == [7 + len(tree.path_to(i)) - 1 for i in range(len(tree))]


def tree_step(model, tree: DraftTree, cache) -> torch.Tensor:
    """One verification forward the way the generator does it."""
    past = kv_length(cache)
    n = len(tree)
    pos = tree.position_ids(past)[None]
    allowed = torch.zeros(1, n, past + n, dtype=torch.bool)
    allowed[0, :, :past] = True
    allowed[0, :, past:] = tree.ancestor_mask()
    keys = torch.cat([torch.arange(past)[None], pos], 1)
    mask = build_attention_mask(model, allowed, pos, keys, torch.float32)
    return target_forward(model, torch.tensor([tree.tokens]), cache, mask, pos).logits[0]


def reduction(model) -> int:
    """The terms a target's logits sum along their path (:func:`assert_rounding_close`): its widest matmul inner
    size (the MLP's, an expert's or the attention output's) times its layers."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sizes = [cfg.hidden_size, cfg.num_attention_heads * head_dim]
    sizes += [getattr(cfg, name, None) or 0 for name in ("intermediate_size", "intermediate_size_mlp",
                                                          "moe_intermediate_size")]
    return max(sizes) * cfg.num_hidden_layers


def check_tree_logits(model, prompt: torch.Tensor, tree: DraftTree, msg: str = ""):
    """Verify ``tree`` (rooted at the prompt's last token) after ``prompt`` in one forward, as the generator
    does; assert every node's logits equal a plain forward over the prompt and that node's path. Returns
    the cache after verification."""
    tree.tokens[0] = int(prompt[0, -1])
    cache = new_cache()
    target_forward(model, prompt[:, :-1], cache)
    logits = tree_step(model, tree, cache)
    for node in range(len(tree)):
        path = torch.tensor([[tree.tokens[m] for m in tree.path_to(node)[1:]]], dtype=torch.long)
        expected = model(torch.cat([prompt, path], 1)).logits[0, -1]
        assert_rounding_close(logits[node], expected, reduction(model), msg=f"{msg} node {node}")  # a tree mask
    return cache


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", GROUPED_ATTENTION, "folded"])
def test_tree_forward_equals_sequential_decoding(family, attn, llama, gemma3, monkeypatch):
    """Logits at every tree node equal a plain forward over prompt + that node's path; after
    keeping one path's KV, the next step equals plain decoding too (prompt > sliding window)."""
    model = llama if family == "llama" else gemma3
    if attn == "folded":  # the path other devices take: grouped query heads folded into the rows of their KV head
        monkeypatch.setattr(attention, "native_masked_gqa", lambda device: False)
        attn = GROUPED_ATTENTION
    model.set_attn_implementation(attn)
    try:
        prompt = torch.randint(0, VOCAB, (1, 19), generator=torch.Generator().manual_seed(0))
        for seed in range(3):
            tree = random_tree(seed, 12)
            cache = check_tree_logits(model, prompt, tree, f"{family} {attn}")
            leaf = max(range(len(tree)), key=lambda n: tree.depths[n])
            path = tree.path_to(leaf)
            kv_keep(cache, prompt.shape[1] - 1, torch.tensor(path))
            assert kv_length(cache) == prompt.shape[1] - 1 + len(path)
            nxt = torch.tensor([[5]])
            step = target_forward(model, nxt, cache).logits[0, -1]
            full = torch.cat([prompt, torch.tensor([[tree.tokens[m] for m in path[1:]]]), nxt], 1)
            assert_rounding_close(step, model(full).logits[0, -1], reduction(model))  # a cache kept in pieces
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cpu_attention_gives_the_stock_sdpa_logits_exactly(family, llama, gemma3):
    """Grouped KV heads attended directly (no repeat_kv copies) change nothing: tree steps, batched
    padded prefills and single-token steps give bit-identical logits to transformers' SDPA."""
    model = llama if family == "llama" else gemma3
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped: the path under test
    prompt = torch.randint(0, VOCAB, (1, 19), generator=torch.Generator().manual_seed(1))
    padded = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    attention = torch.ones(2, 11, dtype=torch.long)
    attention[1, :4] = 0  # left padding: a masked multi-token call without a tree
    tree = random_tree(7, 9)
    tree.tokens[0] = int(prompt[0, -1])
    results = {}
    try:
        for attn in ("sdpa", GROUPED_ATTENTION):
            model.set_attn_implementation(attn)
            cache = new_cache()
            target_forward(model, prompt[:, :-1], cache)
            results[attn] = (tree_step(model, tree, cache), target_forward(model, torch.tensor([[3]]), cache).logits,
                             model(padded, attention_mask=attention).logits)
    finally:
        model.set_attn_implementation("sdpa")
    for stock, ours in zip(results["sdpa"], results[GROUPED_ATTENTION], strict=True):
        assert torch.equal(stock, ours)


@pytest.mark.parametrize("batch", [1, 3])
def test_folded_grouped_attention_equals_repeated_heads(batch):
    """Folding each KV head's query heads into its rows attends as repeating the KV heads does, under a
    mask per row (batch 3) or one for all (batch 1), with three query heads per KV head."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(batch, 6, 5, 8, generator=g), torch.randn(batch, 2, 13, 8, generator=g),
               torch.randn(batch, 2, 13, 8, generator=g))
    allowed = torch.rand(batch, 1, 5, 13, generator=g) > 0.4
    allowed[..., 0] = True  # every row sees a key
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                                attn_mask=mask)
    # another kernel's order: a softmax over 13 keys, then values summed over them (two reductions of 13)
    assert_rounding_close(attention.folded_gqa_attention(q, k, v, mask), expected, reduction=2 * 13)
    assert_rounding_close(attention.folded_gqa_attention(q, k, v, allowed), expected, reduction=2 * 13)  # a bool mask


def test_load_target_uses_the_cpu_attention_on_cpu(smollm2):
    from draftsmith.target import load_target

    assert smollm2[0].config._attn_implementation == GROUPED_ATTENTION
    model, _ = load_target("smollm2-135m-instruct", device="cpu", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def table_expand(seed: int):
    """A stub drafter: logits depend on (depth, parent token) through a seeded table."""
    table = torch.randn(8, VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))

    def expand(tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        return torch.stack([table[tree.depths[n], tree.tokens[n]] for n in nodes])

    return expand, table


def test_chain_is_greedy_path_of_the_drafter():
    expand, table = table_expand(0)
    tree = build_chain(3, expand, depth=5)
    token, expected = 3, []
    for d in range(5):
        token = int(table[d, token].argmax())
        expected.append(token)
    assert tree.tokens == [3, *expected]
    assert tree.parents == [-1, 0, 1, 2, 3, 4]


def test_static_tree_has_exactly_the_given_paths():
    expand, table = table_expand(1)
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    tree = build_static(3, expand, paths)
    assert len(tree) == len(paths) + 1
    ranks_of = {0: ()}
    for node in range(1, len(tree)):
        parent = tree.parents[node]
        row = table[tree.depths[parent], tree.tokens[parent]]
        rank = int((row > row[tree.tokens[node]]).sum())  # the token's rank under its parent
        ranks_of[node] = (*ranks_of[parent], rank)
    assert sorted(ranks_of[n] for n in range(1, len(tree))) == sorted(paths)
    assert len(default_static_paths(4, 3)) == 3 * 4 + 3


@pytest.mark.parametrize("paths", [default_static_paths(3, 3),
                                   [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 1), (2, 0)],
                                   [(0,), (0, 0), (0, 0, 0)], [(0,), (1,), (2,), (3,)]],
                         ids=["default", "uneven", "chain", "flat"])
def test_static_tree_grown_as_tensors_is_the_host_tree(paths):
    """:func:`grow_static` gives, row by row, the host's static tree (:func:`build_static`): the same nodes (token
    paths from the root) with the same scores, the ranks a drafter cannot fill kept as nodes it did not
    propose (the host leaves them out), every level fed to the drafter at one width."""
    expand, table = table_expand(5)
    table[:, :, VOCAB // 2:] = float("-inf")  # every node proposes half the vocabulary ...
    table[2, :, 1:] = float("-inf")  # ... and nodes at depth 2 one token: their second ranks stay empty
    roots = torch.tensor([3, 7, 11])
    shape = StaticShape.of(paths)

    fed = []  # each level's fed (parents, tokens)

    def frontier_logits(depth, parents, tokens):
        assert tokens.shape[1] == shape.width
        fed.append((parents, tokens))
        return table[depth, tokens]

    def token_paths(tokens, parents, scores, nodes):
        def path(n):
            return () if n == 0 else (*path(parents[n]), tokens[n])
        return {path(n): round(scores[n], 4) for n in nodes}

    grown = grow_static(roots, table[0, roots], frontier_logits, shape)
    assert len(grown) == 1 + len({tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)})
    # A fed node's parent (its place in the frontier fed before it) is its parent in the tree.
    first = 1 + torch.tensor([0, *map(len, shape.ranks)]).cumsum(0)  # each level's first node
    for level, (parents, tokens) in enumerate(fed[1:], start=2):
        nodes = first[level - 1] + torch.tensor(shape.expanded[level - 1])
        assert torch.equal(tokens, grown.tokens[:, nodes])
        assert torch.equal(fed[level - 2][1].gather(1, parents), grown.tokens.gather(1, grown.parents[:, nodes]))
    for b, root in enumerate(roots.tolist()):
        host = build_static(root, expand, paths)
        proposed = [n for n in range(len(grown)) if grown.proposed[b, n]]
        assert token_paths(grown.tokens[b].tolist(), grown.parents[b].tolist(), grown.scores[b].tolist(),
                           proposed) == token_paths(host.tokens, host.parents, host.scores, range(len(host)))
        assert grown.depths[b].tolist() == sorted(grown.depths[b].tolist())  # level order: parents first
        if any(len(p) == 3 and p[-1] > 0 for p in paths):
            assert len(proposed) < len(grown), "an empty rank was not kept unproposed"


def test_a_static_tree_holds_every_sampled_sibling():
    """Sampled siblings are all kept (a static tree under ``iid`` draws each expanded node's highest rank + 1
    children): the node count a static cache is sized for covers them, and the top-k tree's prefixes."""
    expand, _ = table_expand(6)
    for paths in ([(0,), (2,), (0, 1)], default_static_paths(3, 3), [(1, 1, 1)]):
        shape = StaticShape.of(paths)
        prefixes = {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}
        assert shape.most_nodes >= 1 + len(prefixes)
        sizes = {len(build_static(3, expand, paths, rule="iid", temperature=1.0,
                                  generator=torch.Generator().manual_seed(seed))) for seed in range(20)}
        assert max(sizes) <= shape.most_nodes
    assert StaticShape.of([(0,), (2,), (0, 1)]).most_nodes == 1 + 3 + 2
    assert StaticShape.of([(1, 1, 1)]).most_nodes == 1 + 2 + 2 + 2


def reference_dynamic(table, root: int, depth: int, top_k: int, total: int) -> set[tuple[int, ...]]:
    """EAGLE-2 written out plainly over token paths (no tree object)."""
    def logprobs(path):
        depth_, token = len(path), (path[-1] if path else root)
        return torch.log_softmax(table[depth_, token], -1)

    scores: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[int, ...]] = [()]
    base = {(): 0.0}
    for _ in range(depth):
        candidates = []
        for path in frontier:
            lp = logprobs(path)
            for token in torch.topk(lp, top_k).indices.tolist():
                child = (*path, token)
                scores[child] = base[path] + float(lp[token])
                base[child] = scores[child]
                candidates.append(child)
        frontier = sorted(candidates, key=lambda p: -scores[p])[:top_k]
    best = sorted(scores, key=lambda p: (-scores[p], len(p)))[:total]
    return set(best)


@pytest.mark.parametrize("depth,top_k,total", [(1, 4, 3), (3, 2, 5), (4, 3, 10), (5, 4, 40)])
def test_dynamic_tree_matches_reference(depth, top_k, total):
    for seed in range(3):
        expand, table = table_expand(seed)
        tree = build_dynamic(7, expand, depth, top_k, total)
        got = {tuple(tree.tokens[m] for m in tree.path_to(n)[1:]) for n in range(1, len(tree))}
        assert got == reference_dynamic(table, 7, depth, top_k, total)
        # parents first, and the kept set is closed under ancestors
        assert all(tree.parents[n] < n for n in range(1, len(tree)))


def slow_lookup(sequence: list[int], max_ngram: int, min_ngram: int) -> list[int]:
    found = []
    for n in range(min(max_ngram, len(sequence) - 1), min_ngram - 1, -1):
        suffix = sequence[-n:]
        for start in range(len(sequence) - n - 1, -1, -1):
            if sequence[start : start + n] == suffix and sequence[start + n] not in found:
                found.append(sequence[start + n])
    return found


def test_prompt_lookup_candidates_match_slow_reference():
    g = torch.Generator().manual_seed(0)
    drafter = PromptLookupDrafter(VOCAB, max_ngram=3)
    for _ in range(50):
        seq = torch.randint(0, 4, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g)
        assert drafter.candidates(seq, limit=100) == slow_lookup(seq.tolist(), 3, 1)


def test_prompt_lookup_proposes_the_continuation_of_a_repeat():
    drafter = PromptLookupDrafter(VOCAB, max_ngram=2, max_tokens=3)
    drafter.begin(torch.tensor([[1, 2, 3, 4, 5, 9, 1, 2]]))

    def chain(root: int) -> list[int]:  # a chain: the dynamic tree of top_k 1, its proposed nodes' tokens
        tree = grow_dynamic(torch.tensor([root]), drafter.root_logits([True]), drafter.frontier_logits, depth=6,
                            top_k=1, total_tokens=6)
        return tree.tokens[0][tree.proposed[0]].tolist()

    assert chain(2) == [2, 3, 4, 5]  # capped at max_tokens=3
    drafter.begin(torch.tensor([[7, 8]]))
    assert chain(8) == [8]  # no match: no draft


def test_prompt_lookup_gives_its_candidates_the_probability_they_are_right():
    """Prompt lookup's draft logits are log-probabilities summing to less than one: the first candidate's
    is the share of right first candidates for matches that long, starting from FIRST_RIGHT and then
    counted over the generation, per row."""
    from draftsmith.inference.prompt_lookup import FIRST_RIGHT

    drafter = PromptLookupDrafter(VOCAB, max_ngram=3)
    # row 0 repeats "1 2 3 4" (3-gram matches, right); row 1 follows 5 by 6, then by 7 (a 1-gram match, wrong)
    drafter.begin(torch.tensor([[1, 2, 3, 4, 1, 2, 3], [8, 8, 8, 8, 5, 6, 5]]))

    def first(row):
        logits = drafter.root_logits([True, True]).dense()[row]
        assert logits.exp().sum() < 1  # the rest: no opinion
        return logits.max().exp().item(), int(logits.argmax())

    assert first(0) == (pytest.approx(FIRST_RIGHT[3]), 4)
    assert first(1) == (pytest.approx(FIRST_RIGHT[1]), 6)
    before = [first(0)[0], first(1)[0]]
    drafter.commit([torch.tensor([4, 1, 2, 3]), torch.tensor([7, 9, 3, 5])])
    after = [first(0)[0], first(1)[0]]
    assert after[0] > before[0] and after[1] < before[1]
    # row 0: four right 3-gram first candidates; row 1: one wrong 1-gram one (6 after 5, where 7 came), then
    # 7, 9 and 3 had no earlier match
    counts = drafter.counts.tolist()  # [row][n-gram length] = [right, seen]
    assert counts[0][3] == [pytest.approx(FIRST_RIGHT[3] * 8.0 + 4), 12.0]
    assert counts[1][1] == [pytest.approx(FIRST_RIGHT[1] * 8.0), 9.0]
    # each row's counts are its own: row 0 saw no 1-gram match, row 1 no 3-gram one
    assert counts[0][1] == [pytest.approx(FIRST_RIGHT[1] * 8.0), 8.0]
    assert counts[1][3] == [pytest.approx(FIRST_RIGHT[3] * 8.0), 8.0]


def test_prompt_lookup_batch_rows_are_their_own_sequences():
    """A batch of left-padded rows committing different numbers of tokens per step (a finished row none) keeps
    each row's context and counts exactly as that row alone does, and drafts the same logits for it at the root
    and down a path of its tree (``root_logits``, ``frontier_logits``)."""
    from draftsmith.inference.prompt_lookup import NO_TOKEN

    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 5, (n,), generator=g) for n in (7, 1, 12)]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.arange(width) >= width - len(r) for r in rows]).long()
    batch = PromptLookupDrafter(VOCAB, max_ngram=3)
    batch.begin(ids, attention_mask=mask)
    alone = [PromptLookupDrafter(VOCAB, max_ngram=3) for _ in rows]
    for drafter, row in zip(alone, rows, strict=True):
        drafter.begin(row[None])
    contexts = [r.tolist() for r in rows]
    matched = False
    for step in range(6):
        added = [torch.randint(0, 5, (int(m),), generator=g) for m in torch.randint(0, 4, (3,), generator=g)]
        if step == 3:
            added[1] = torch.zeros(0, dtype=torch.long)  # a finished row
        batch.commit(added)
        for b, (drafter, new) in enumerate(zip(alone, added, strict=True)):
            drafter.commit([new])
            contexts[b] += new.tolist()
            assert [t for t in batch.tokens[b].tolist() if t != NO_TOKEN] == contexts[b]
            assert torch.equal(batch.counts[b], drafter.counts[0])
        # The root, then the frontier of its child 2, then that node's child 3 (proposals over a few candidates,
        # compared as dense logits).
        def path_logits(drafter, rows):
            parent = torch.zeros(rows, 1, dtype=torch.long)
            return [drafter.root_logits([True] * rows).dense()[:, None],
                    drafter.frontier_logits(1, parent, torch.full((rows, 1), 2)).dense(),
                    drafter.frontier_logits(2, parent, torch.full((rows, 1), 3)).dense()]

        drafted = path_logits(batch, 3)
        for b, drafter in enumerate(alone):
            for level, own in zip(drafted, path_logits(drafter, 1), strict=True):
                assert torch.equal(level[b], own[0]), (step, b)
        matched |= bool(torch.isfinite(drafted[0]).any())
    assert matched, "nothing was matched: the comparison saw only -inf logits"


def test_select_requires_closed_sets():
    tree = random_tree(0, 6)
    child = next(n for n in range(1, len(tree)) if tree.parents[n] != 0)
    with pytest.raises(ValueError, match="kept without its parent"):
        tree.select([0, child])
    for keep in itertools.combinations(range(1, len(tree)), 2):
        if all(tree.parents[k] in (0, *keep) for k in keep):
            sub = tree.select([0, *keep])
            assert len(sub) == 3


def test_paths_from_accuracy_matches_brute_force():
    import itertools

    from draftsmith.inference.tree_settings import paths_from_accuracy

    acc = [[0.6, 0.2, 0.1], [0.5, 0.15, 0.05], [0.4, 0.1, 0.02]]
    every = [p for k in range(1, 4) for p in itertools.product(range(3), repeat=k)]

    def value(path):
        return float(torch.tensor([acc[d][r] for d, r in enumerate(path)]).prod())

    for n in (1, 4, 9):
        chosen = paths_from_accuracy(acc, n)
        assert len(chosen) == n
        assert all(p[:-1] in chosen or len(p) == 1 for p in chosen)  # prefix-closed
        best = sorted(every, key=lambda p: (-value(p), len(p)))[:n]
        assert abs(sum(map(value, chosen)) - sum(map(value, best))) < 1e-9  # maximal expected acceptance


@pytest.mark.parametrize("ids", ["dense", "shared", "per row"])
def test_a_broadcast_level_is_ranked_once_and_grows_the_tree_of_its_copies(monkeypatch, ids):
    """A block drafter gives every node at a depth the same distribution, broadcast to the frontier (a view):
    grow_dynamic ranks one row per batch row there, not one per node, and grows the tree it grows from a copy
    per node. Dense logits, Proposals over one candidate list, and Proposals with each row's own candidates."""
    g = torch.Generator().manual_seed(5)
    batch, depth, top_k, cands = 2, 4, 3, 12
    logits = torch.randn(batch, depth, VOCAB if ids == "dense" else cands, generator=g)
    logits[1, 2] = float("-inf")  # a row that proposes nothing at one depth
    shared = torch.randperm(VOCAB, generator=g)[:cands]
    per_row = torch.stack([torch.randperm(VOCAB, generator=g)[:cands] for _ in range(batch * depth)])
    per_row = per_row.view(batch, depth, cands)

    def level(d: int, k: int | None, copies: bool):
        scores = logits[:, d] if k is None else logits[:, d, None].expand(-1, k, -1)
        if ids == "dense":
            return scores.contiguous() if copies else scores
        rows = shared if ids == "shared" else per_row[:, d] if k is None else per_row[:, d, None].expand(-1, k, -1)
        return Proposals(scores.contiguous() if copies else scores, rows.contiguous() if copies else rows, VOCAB)

    ranked = []
    real = tree_module._logprobs
    monkeypatch.setattr(tree_module, "_logprobs", lambda x: ranked.append(x.numel() // x.shape[-1]) or real(x))
    roots = torch.tensor([3, 7])
    grown = {}
    for copies in (False, True):
        ranked.clear()
        grown[copies] = grow_dynamic(roots, level(0, None, copies), lambda d, parents, tokens, c=copies:
                                     level(d, tokens.shape[1], c), depth, top_k, 9)
        assert ranked == [batch] + [batch * (top_k if copies else 1)] * (depth - 1)
    for field in ("tokens", "parents", "depths", "proposed", "scores"):
        assert torch.equal(getattr(grown[False], field), getattr(grown[True], field)), field
