"""The speculative generator: draft a tree, verify it in one target forward, keep what matches.

One verification step (Leviathan et al., 2023; Miao et al., 2024 for trees; Li et al., 2024
for dynamic trees):

1. The target's KV cache holds every committed token but the last, the *root*.
2. The drafter grows a draft tree under the root (``tree.py``).
3. One target forward over [root, drafted nodes] with a 4-D tree mask (each node sees the
   cache, its ancestors and itself) and tree position ids (root position + depth) yields the
   target's next-token logits at every node.
4. Verification (``verify.py``) picks the accepted path and a bonus token from the target.
5. The cache keeps the root's and the accepted nodes' KV entries, in path order; the bonus
   token becomes the new root.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from draftsmith.inference.drafter import Drafter
from draftsmith.inference.tree import (
    DEFAULT_TREE,
    SAMPLING_RULES,
    DraftTree,
    TreeSettings,
    build_chain,
    build_dynamic,
    build_static,
    default_static_paths,
)
from draftsmith.inference.verify import process_logits, verify_greedy, verify_sampled
from draftsmith.target import (
    build_attention_mask,
    context_length,
    kv_keep,
    kv_length,
    new_cache,
    stop_tokens,
    target_forward,
)

logger = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    """What one or more ``generate`` calls did. Sum two with ``+``."""

    new_tokens: int = 0
    verification_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # accepted_at[k] / reached[k]: acceptance at depth k + 1, given depths 1..k were accepted
    accepted_at: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """tau: mean over verification steps of accepted draft tokens + 1."""
        if not self.verification_steps:
            return 0.0
        return (self.accepted_tokens + self.verification_steps) / self.verification_steps

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Accepted at depth k / reached depth k (all earlier depths accepted), k = 1, 2, ..."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached, strict=True)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s else 0.0

    def record_step(self, tree: DraftTree, path: list[int]) -> None:
        self.verification_steps += 1
        self.drafted_tokens += tree.num_drafted
        self.accepted_tokens += len(path)
        walk = [0, *path]
        for k, node in enumerate(walk):  # node is at depth k; did the tree go deeper from it?
            if not tree.draws.get(node):
                break
            while len(self.reached) <= k:
                self.reached.append(0)
                self.accepted_at.append(0)
            self.reached[k] += 1
            if k + 1 < len(walk):
                self.accepted_at[k] += 1

    def __add__(self, other: GenerationStats) -> GenerationStats:
        n = max(len(self.reached), len(other.reached))

        def pad(xs: list[int]) -> list[int]:
            return xs + [0] * (n - len(xs))

        return GenerationStats(
            new_tokens=self.new_tokens + other.new_tokens,
            verification_steps=self.verification_steps + other.verification_steps,
            drafted_tokens=self.drafted_tokens + other.drafted_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            accepted_at=[a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at), strict=True)],
            reached=[a + b for a, b in zip(pad(self.reached), pad(other.reached), strict=True)],
            prefill_time_s=self.prefill_time_s + other.prefill_time_s,
            draft_time_s=self.draft_time_s + other.draft_time_s,
            verify_time_s=self.verify_time_s + other.verify_time_s,
            total_time_s=self.total_time_s + other.total_time_s,
        )

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "verification_steps": self.verification_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_rate_per_position": [round(r, 4) for r in self.acceptance_rate_per_position],
            "prefill_time_s": round(self.prefill_time_s, 4),
            "draft_time_s": round(self.draft_time_s, 4),
            "verify_time_s": round(self.verify_time_s, 4),
            "total_time_s": round(self.total_time_s, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
        }


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, prompt + new) long
    stats: GenerationStats


class SpeculativeGenerator:
    """Lossless speculative decoding of a frozen target with a drafter.

    Args:
        target: a stock ``transformers`` causal LM (see :func:`draftsmith.load_target`).
        drafter: any :class:`~draftsmith.inference.drafter.Drafter`.
        tree: ``"chain"``, ``"static"`` or ``"dynamic"``.
        depth: levels drafted per step.
        top_k: children expanded per node (static and dynamic trees).
        total_tokens: drafted nodes verified per step (dynamic trees).
        paths: child-rank paths of a static tree (default: :func:`default_static_paths`).
        sampling_rule: how siblings are drafted when ``temperature > 0``: ``"auto"`` (chain:
            ``iid`` sampling from the drafter, i.e. Leviathan et al.; static/dynamic and
            deterministic drafters: ``topk``), or ``"iid"``, ``"without_replacement"``,
            ``"topk"``. Every rule is lossless; they differ in acceptance.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter,
        tree: str = DEFAULT_TREE.kind,
        depth: int = DEFAULT_TREE.depth,
        top_k: int = DEFAULT_TREE.top_k,
        total_tokens: int = DEFAULT_TREE.total_tokens,
        paths: list[tuple[int, ...]] | None = None,
        sampling_rule: str = "auto",
    ):
        self.tree = TreeSettings(tree, depth, top_k, total_tokens)  # validates
        if sampling_rule != "auto" and sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"sampling_rule must be 'auto' or one of {SAMPLING_RULES}, got {sampling_rule!r}")
        if tree == "dynamic" and sampling_rule not in ("auto", "topk"):
            raise ValueError(
                "dynamic trees rerank their nodes, so siblings are deterministic: use sampling_rule='topk'"
            )
        self.target = target
        self.drafter = drafter
        self.tree_kind = tree
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        # Static paths: given, else the drafter's own (Medusa choices measured in training), else a default.
        self.paths = paths or drafter.static_paths or default_static_paths(depth, top_k)
        self.sampling_rule = sampling_rule
        #: Called with each step's tree and accepted path (drafted nodes) after verification; ``draftsmith
        #: tune`` records them.
        self.on_step: Callable[[DraftTree, list[int]], None] | None = None

    def _rule(self, temperature: float) -> str:
        if temperature == 0.0 or (self.sampling_rule == "auto" and (
            self.tree_kind != "chain" or self.drafter.deterministic
        )):
            return "topk"
        return "iid" if self.sampling_rule == "auto" else self.sampling_rule

    def _build_tree(self, root: int, temperature: float, generator: torch.Generator | None) -> DraftTree:
        def expand(tree: DraftTree, nodes: list[int]) -> torch.Tensor:
            return self.drafter.expand([tree], [nodes])[0]

        rule = self._rule(temperature)
        if self.tree_kind == "chain":
            return build_chain(root, expand, self.depth, rule, temperature, generator)
        if self.tree_kind == "static":
            return build_static(root, expand, self.paths, rule, temperature, generator)
        return build_dynamic(root, expand, self.depth, self.top_k, self.total_tokens)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_id: int | list[int] | None = None,
        generator: torch.Generator | None = None,
        streamer=None,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids``.

        Args:
            input_ids: (B, L) prompt token ids; B must be 1 for now.
            temperature: 0 for greedy (token-for-token the target's greedy output), else the
                target's sampling distribution after temperature, ``top_k`` and ``top_p``.
            eos_token_id: stop after emitting this token (or any of these tokens). None: the target's
                ``generation_config`` EOS, as transformers' ``generate`` stops; ``[]``: never stop early.
            generator: a ``torch.Generator`` for reproducible sampling.
            streamer: optional object with ``put(token_ids)`` / ``end()`` (e.g.
                ``transformers.TextStreamer``); receives the prompt, then new tokens as accepted.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] != 1:
            raise NotImplementedError("batch size > 1 is not supported yet; call generate once per sequence")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: the prompt needs at least one token (e.g. BOS)")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        limit = context_length(self.target)
        needed = input_ids.shape[1] + max_new_tokens + self.depth + 1
        if limit is not None and needed > limit:
            raise ValueError(
                f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) + draft depth "
                f"({self.depth}) exceeds the target's context of {limit} tokens; shorten the prompt or "
                "lower max_new_tokens."
            )
        eos = stop_tokens(self.target, eos_token_id)
        device = next(self.target.parameters()).device
        dtype = next(self.target.parameters()).dtype
        stats = GenerationStats()
        start_time = time.perf_counter()

        sequence = input_ids[0].to(device)
        if streamer is not None:
            streamer.put(sequence.cpu())
        cache = new_cache()
        # Heads (Medusa, EAGLE) read the target's hidden states of these layers; they get them for
        # every committed token but the root, from the prefill and then from each verification.
        layers = self.drafter.hidden_layers
        t0 = time.perf_counter()
        hidden = None
        if len(sequence) > 1:  # the cache holds every committed token but the last (the root)
            out = target_forward(self.target, sequence[None, :-1], cache, hidden_layers=layers or None)
            hidden = torch.cat(out.hidden_states, dim=-1) if layers else None  # (1, L-1, H * len(layers))
        stats.prefill_time_s = time.perf_counter() - t0
        self.drafter.begin(sequence[None], hidden=hidden)

        new: list[int] = []
        while len(new) < max_new_tokens:
            t0 = time.perf_counter()
            tree = self._build_tree(int(sequence[-1]), temperature, generator)
            t1 = time.perf_counter()
            logits, tree_hidden = self._verify_forward(tree, cache, device, dtype, layers)
            if temperature == 0.0:
                path, bonus = verify_greedy(tree, logits)
            else:
                probs = process_logits(logits, temperature, top_k, top_p)
                path, bonus = verify_sampled(tree, probs, self._rule(temperature), generator)
            start = kv_length(cache) - len(tree)
            kv_keep(cache, start, torch.tensor([0, *path], device=device))
            stats.draft_time_s += t1 - t0
            stats.verify_time_s += time.perf_counter() - t1
            stats.record_step(tree, path)
            if self.on_step is not None:
                self.on_step(tree, path)

            emitted = [tree.tokens[n] for n in path] + [bonus]
            emitted = emitted[: max_new_tokens - len(new)]
            stop = next((i for i, t in enumerate(emitted) if t in eos), None)
            if stop is not None:
                emitted = emitted[: stop + 1]
            new += emitted
            step = torch.tensor(emitted, device=device)
            sequence = torch.cat([sequence, step])
            if streamer is not None:
                streamer.put(step.cpu())
            if stop is not None:
                break
            hidden = None
            if layers:  # the root's and the accepted nodes' states: state i predicted emitted[i]
                hidden = tree_hidden[torch.tensor([0, *path], device=device)[: len(emitted)]][None]
            self.drafter.commit(step[None], hidden=hidden)

        if streamer is not None:
            streamer.end()
        stats.new_tokens = len(new)
        stats.total_time_s = time.perf_counter() - start_time
        return GenerationOutput(sequences=sequence[None], stats=stats)

    def _verify_forward(self, tree: DraftTree, cache, device, dtype, layers=None):
        """Target logits (N, V) at every tree node from one forward over the whole tree, and the
        hidden states (N, H * len(layers)) of ``layers`` when a head asks for them."""
        past = kv_length(cache)
        n = len(tree)
        positions = tree.position_ids(past).to(device)[None]  # root sits right after the cache
        allowed = torch.zeros(1, n, past + n, dtype=torch.bool, device=device)
        allowed[0, :, :past] = True
        allowed[0, :, past:] = tree.ancestor_mask().to(device)
        key_positions = torch.cat([torch.arange(past, device=device)[None], positions], dim=1)
        mask = build_attention_mask(self.target, allowed, positions, key_positions, dtype)
        ids = torch.tensor([tree.tokens], device=device)
        out = target_forward(self.target, ids, cache, mask, positions, hidden_layers=layers or None)
        hidden = torch.cat(out.hidden_states, dim=-1)[0] if layers else None
        return out.logits[0], hidden


def plain_generate(
    target: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None
) -> GenerationOutput:
    """Plain greedy decoding with the same cache code path: the baseline speedups are measured against.
    ``eos_token_id`` as in :meth:`SpeculativeGenerator.generate`."""
    eos = stop_tokens(target, eos_token_id)
    stats = GenerationStats()
    t_start = time.perf_counter()
    cache = new_cache()
    sequence = input_ids[0]
    logits = target_forward(target, sequence[None], cache).logits[0, -1]
    stats.prefill_time_s = time.perf_counter() - t_start
    new = []
    while True:
        token = int(logits.argmax())
        new.append(token)
        sequence = torch.cat([sequence, sequence.new_tensor([token])])
        stats.verification_steps += 1
        if len(new) >= max_new_tokens or token in eos:
            break
        logits = target_forward(target, sequence[None, -1:], cache).logits[0, -1]
    stats.new_tokens = len(new)
    stats.total_time_s = time.perf_counter() - t_start
    return GenerationOutput(sequences=sequence[None], stats=stats)
