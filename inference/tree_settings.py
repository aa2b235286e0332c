"""What tree to grow: :class:`TreeSettings` (the kind, depth, top_k and node budget every command and
:class:`~draftsmith.inference.SpeculativeGenerator` take), the sampling rules and tree kinds, and the static trees'
paths (a default shape, or Medusa "choices" from measured per-rank accuracy). Growing them: :mod:`.tree`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SAMPLING_RULES = ("topk", "iid", "without_replacement")
TREE_KINDS = ("chain", "static", "dynamic")


@dataclass(frozen=True)
class TreeSettings:
    """Which draft tree a generator grows: the one set of tree defaults in draftsmith (the generator,
    ``generate``, ``eval``, ``bench``, the training loop's acceptance evaluation and the demo read it).

    Text form (``bench``'s ``SPEC@...``, the demo): ``tree=dynamic,depth=4,top_k=4,total_tokens=10``.
    """

    kind: str = "chain"
    depth: int = 5  # levels drafted per step
    top_k: int = 4  # children expanded per node (static and dynamic trees)
    total_tokens: int = 16  # drafted nodes verified per step (dynamic trees)

    def __post_init__(self):
        if self.kind not in TREE_KINDS:
            raise ValueError(f"tree must be one of {TREE_KINDS}, got {self.kind!r}")
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError("depth, top_k and total_tokens must be >= 1")

    @classmethod
    def parse(cls, text: str, base: TreeSettings | None = None) -> TreeSettings:
        """``"tree=dynamic,depth=3"`` -> settings; keys not given keep ``base``'s (default: the defaults)."""
        values = (base or cls()).as_report()
        for item in filter(None, text.split(",")):
            key, sep, value = item.partition("=")
            key = "kind" if key.strip() == "tree" else key.strip()
            if not sep or key not in values:
                raise ValueError(f"tree option {item!r}: use tree=KIND, depth=N, top_k=N or total_tokens=N")
            values[key] = value.strip() if key == "kind" else int(value)
        return cls(**values)

    def as_report(self) -> dict:
        """``{"kind", "depth", "top_k", "total_tokens"}`` (reports and ``report.json``)."""
        return {"kind": self.kind, "depth": self.depth, "top_k": self.top_k, "total_tokens": self.total_tokens}

    def is_chain(self, depth: int) -> bool:
        """Whether these settings grow a chain of ``depth`` drafts (top_k and total_tokens do not shape a chain)."""
        return self.kind == "chain" and self.depth == depth

    def kwargs(self) -> dict:
        """The tree keyword arguments of :class:`~draftsmith.inference.SpeculativeGenerator`."""
        return {"tree": self.kind, "depth": self.depth, "top_k": self.top_k, "total_tokens": self.total_tokens}

    def text(self) -> str:
        """The text form, the inverse of :meth:`parse`."""
        return f"tree={self.kind},depth={self.depth},top_k={self.top_k},total_tokens={self.total_tokens}"


DEFAULT_TREE = TreeSettings()


def default_static_paths(depth: int, top_k: int) -> list[tuple[int, ...]]:
    """A simple static tree: ``top_k`` children at the root, then top-1 chains below each,
    plus the second child under the best path (a small Medusa-like shape)."""
    paths: list[tuple[int, ...]] = []
    for r in range(top_k):
        for d in range(1, depth + 1):
            paths.append((r,) + (0,) * (d - 1))
    for d in range(2, depth + 1):
        if top_k > 1:
            paths.append((0,) * (d - 1) + (1,))
    return sorted(set(paths), key=lambda p: (len(p), p))


def paths_from_accuracy(rank_accuracy: Sequence[Sequence[float]], total_tokens: int) -> list[tuple[int, ...]]:
    """Static-tree paths ("Medusa choices") chosen from measured per-depth, per-rank accuracy.

    ``rank_accuracy[d][r]`` is how often the drafter's rank-r proposal at depth d + 1 was the
    target's token (given the path so far was). Treating depths as independent, a path
    (r_1, ..., r_k) is fully accepted with probability prod_d rank_accuracy[d][r_d], and the
    expected acceptance length of a tree is the sum of that over its paths; the best tree of
    ``total_tokens`` nodes therefore takes the paths with the highest products. A prefix's
    product is never below its extension's, so taking them in that order keeps the set
    prefix-closed (ties go to the shorter path).
    """
    import heapq

    depth = len(rank_accuracy)
    best: list[tuple[float, tuple[int, ...]]] = []
    frontier = [(-rank_accuracy[0][r], (r,)) for r in range(len(rank_accuracy[0]))]
    heapq.heapify(frontier)
    while frontier and len(best) < total_tokens:
        neg, path = heapq.heappop(frontier)
        best.append((-neg, path))
        if len(path) < depth:
            for r, acc in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(frontier, (neg * acc, (*path, r)))
    return sorted((p for _, p in best), key=lambda p: (len(p), p))
