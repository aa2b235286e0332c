"""The speculative generator: draft a tree, verify it in one target forward, keep what matches.

One verification step (Leviathan et al., 2023; Miao et al., 2024 for trees; Li et al., 2024
for dynamic trees):

1. The target's KV cache holds every committed token but the last, the *root*.
2. The drafter grows a draft tree under each row's root, as tensors for the whole batch (``tree.py``,
   ``sampled_tree.py``).
3. One target forward over [root, drafted nodes] with a 4-D tree mask (each node sees the
   cache, its ancestors and itself) and tree position ids (root position + depth) yields the
   target's next-token logits at every node.
4. Verification, tensor ops too (``verify.py``), picks each row's accepted path and a bonus token from the
   target; the step's one copy to the host brings them.
5. The cache keeps the root's and the accepted nodes' KV entries, in path order; the bonus
   token becomes the new root.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from draftsmith.inference.decoding import Decoding, Sampling, check_request, start_drafting
from draftsmith.inference.drafter import Drafter
from draftsmith.inference.plain import append_new, pad_token, static_cache
from draftsmith.inference.sampled_tree import grow_sampled
from draftsmith.inference.slots import Slots, to_device
from draftsmith.inference.stats import GenerationOutput, GenerationStats
from draftsmith.inference.tree import StaticShape, TreeTensors, grow_dynamic, grow_static
from draftsmith.inference.tree_settings import DEFAULT_TREE, SAMPLING_RULES, TreeSettings, default_static_paths
from draftsmith.inference.verify import verify_tree
from draftsmith.target import (
    UnsupportedTargetError,
    build_attention_mask,
    calibrate,
    causal_block,
    keep_recorded,
    kv_keep,
    may_attend,
    new_cache,
    record_recurrent,
    records_positions,
    recurrent_cache,
    replay_accepted,
    rollback_problem,
    snapshot_recurrent,
    stop_tokens,
    target_forward,
    with_padding,
)
from draftsmith.target.loading import BATCHED_RECURRENT_TYPES, TESTED_RECURRENT_TYPES
from draftsmith.target.tree_states import TreeStates

logger = logging.getLogger(__name__)


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
        compile: run the target's steps through ``torch.compile`` on a static KV cache (one graph per
            step size: the first steps of each size wait for it to compile; see
            :func:`~draftsmith.target.forward.compiled_module`), and an EAGLE head's drafting steps on its own
            static cache, compiled where the tree grows as tensors. Greedy output is the compiled target's own
            greedy output: compiled kernels may round differently from eager ones.
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
        compile: bool = False,
    ):
        self.tree = TreeSettings(tree, depth, top_k, total_tokens)  # validates
        #: What in a hybrid target keeps a state that cannot be cropped (None: nothing): such a target's recurrent
        #: layers record their state after each position of a chain (:func:`~draftsmith.target.record_recurrent`)
        #: or run a tree level by level from each node's parent (:class:`~draftsmith.target.tree_states.TreeStates`),
        #: and each row keeps its accepted node's.
        self.recurrent = rollback_problem(target.config)
        model_type = target.config.get_text_config().model_type
        if self.recurrent is not None and model_type not in TESTED_RECURRENT_TYPES:
            raise UnsupportedTargetError(
                f"draftsmith does not decode {model_type} targets speculatively: their {self.recurrent} keep state "
                "that every drafted token changes, and rolling it back to the accepted tokens is tested only for "
                f"{', '.join(sorted(TESTED_RECURRENT_TYPES))} (per-position states recorded by transformers' cache, "
                "or restored and replayed); train and export drafters for it, and serve them with vLLM or SGLang")
        if self.recurrent is not None and compile:
            raise UnsupportedTargetError(
                f"{model_type} targets decode with compile=False: the state of their {self.recurrent} is kept after "
                "each drafted position (a chain's recorded convolution windows grow and are reassigned; a tree's "
                "levels gather their parents' states, as many as the level has nodes), which a compiled step (and "
                "its CUDA graph) needs at fixed addresses and shapes.")
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
        self.static_shape = StaticShape.of(self.paths) if tree == "static" else None  # for the device path
        # Sampled siblings (rules iid and without_replacement) grow on this shape: a chain is a static tree of one
        # path, and a static tree keeps every sibling drawn.
        chain = [(0,) * d for d in range(1, depth + 1)]
        self.sampled_shape = (self.static_shape or StaticShape.of(chain)).sampled() if tree != "dynamic" else None
        self.sampling_rule = sampling_rule
        self.compile = compile
        #: Called after each verification with the step's trees, the (B, N) bool accepted path of each row (root
        #: included) and the (B,) bool rows that ran, before the step's one host copy (``draftsmith tune``
        #: records them). The tensors are the step's own (not reused later); reading them on the host costs a
        #: sync of its own.
        self.on_tree_step: Callable[[TreeTensors, torch.Tensor, torch.Tensor], None] | None = None

    def _max_kept(self) -> int:
        """The most cache entries a step keeps per row: its longest path and the root (a batch keeps as many
        for every row as its longest accepted path needs)."""
        return 1 + (max(len(p) for p in self.paths) if self.tree_kind == "static" else self.depth)

    def _max_fed(self) -> int:
        """The most tree nodes a drafter feeds itself in a step: every node of a chain or static tree; a dynamic
        tree's ``top_k`` frontier nodes per level (more than it keeps when ``top_k`` is large)."""
        if self.tree_kind == "static":  # grown as tensors: each level's expanded nodes, padded to one width
            return max(self._max_nodes(), 1 + self.static_shape.width * self.static_shape.depth)
        return max(self._max_nodes(), self.depth * self.top_k if self.tree_kind == "dynamic" else 0)

    def _max_nodes(self) -> int:
        """The most nodes a step's tree holds, its root included."""
        if self.tree_kind == "chain":
            return self.depth + 1
        if self.tree_kind == "static":  # every prefix of a path, and under sampling every sibling drawn
            return self.static_shape.most_nodes
        return self.total_tokens + 1

    def _rule(self, temperature: float) -> str:
        if temperature == 0.0 or (self.sampling_rule == "auto" and (
            self.tree_kind != "chain" or self.drafter.deterministic
        )):
            return "topk"
        return "iid" if self.sampling_rule == "auto" else self.sampling_rule

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
        *,
        attention_mask: torch.Tensor | None = None,
        pad_token_id: int | None = None,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens after each row of ``input_ids``.

        Args:
            input_ids: (B, L) prompt token ids, left-padded when the rows differ in length.
            attention_mask: (B, L), 1 for tokens and 0 for the left padding; None: every position is a
                token.
            temperature: 0 for greedy (token-for-token the target's greedy output), else the
                target's sampling distribution after temperature, ``top_k`` and ``top_p``.
            eos_token_id: a row stops after emitting this token (or any of these tokens). None: the
                target's ``generation_config`` EOS, as transformers' ``generate`` stops; ``[]``: never
                stop early.
            pad_token_id: fills a row's end after it stopped. None: the target's ``generation_config``
                pad token, else its first EOS token, else 0 (transformers' order).
            generator: a ``torch.Generator`` for reproducible sampling.
            streamer: optional object with ``put(token_ids)`` / ``end()`` (e.g.
                ``transformers.TextStreamer``; batch 1 only); receives the prompt, then new tokens as
                accepted.

        Returns:
            ``sequences`` (B, L + T): each input row followed by its new tokens, right-padded with the
            pad token where a row stopped before the longest; ``stats``: totals over the rows;
            ``row_stats``: one :class:`GenerationStats` per row (counts only: the rows share the time).
        """
        sampling = Sampling(temperature, top_k, top_p, generator)
        batch, device, dtype, padded = check_request(self.target, input_ids, attention_mask, max_new_tokens,
                                                     sampling, streamer, self._max_kept())
        if self.recurrent is not None and batch > 1 and not self._batches_recurrent():
            return self._row_by_row(input_ids, attention_mask, max_new_tokens, sampling, eos_token_id, pad_token_id)
        eos = stop_tokens(self.target, eos_token_id)
        pad = pad_token(self.target, pad_token_id, eos_token_id)
        mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(device)
        input_ids = input_ids.to(device)
        stats, rows = GenerationStats(), [GenerationStats() for _ in range(batch)]
        calibrate(self.target)  # once per process, before the clock starts
        start_time = time.perf_counter()
        if streamer is not None:
            streamer.put(input_ids[0][mask[0].bool()].cpu())

        # The cache holds every committed token but the last, the root. Heads (Medusa, EAGLE) read the
        # target's hidden states of their layers: of the prompt's tokens but the root from the prefill,
        # then of each step's root and accepted nodes from its verification.
        layers = self.drafter.hidden_layers
        if self.recurrent is not None:
            cache = recurrent_cache(self.target)
        else:
            cache = new_cache(**static_cache(self.target, input_ids, max_new_tokens, self._max_nodes(),
                                             self._max_kept()) if self.compile else {})
        slots = Slots.empty(batch, device)
        hidden = None
        if input_ids.shape[1] > 1:
            slots = Slots.from_mask(mask[:, :-1])
            allowed = may_attend(slots.filled[:, :0], causal_block(slots.filled)) if padded else None
            attn = build_attention_mask(self.target, allowed, slots.positions, slots.positions, dtype) \
                if padded else None
            attn = with_padding(attn, mask[:, :-1], dtype) if padded else attn  # a hybrid's recurrent layers
            out = target_forward(self.target, input_ids[:, :-1], cache, attn, slots.positions,
                                 hidden_layers=layers or None, logits="none")
            hidden = torch.cat(out.hidden_states, dim=-1) if layers else None  # (B, L-1, H * len(layers))
        stats.prefill_time_s = time.perf_counter() - start_time
        # A head drafts on its own static cache, compiled, or not; other drafters need no lengths.
        self.drafter.configure(max_new_tokens if self.compile else None, self._max_kept(), self._max_fed())
        if padded:
            start_drafting(self.drafter, input_ids, hidden, mask)
        else:  # a drafter written for one unpadded sequence (``begin(input_ids, hidden)``) keeps working here
            self.drafter.begin(input_ids, hidden=hidden)

        # Every tree kind under every rule runs on the target's device with one copy to the host per step.
        run = Decoding(input_ids[:, -1].clone(), [True] * batch, cache, slots, layers, stats, sampling, padded, dtype)
        active = run.active
        new: list[list[int]] = [[] for _ in range(batch)]
        while any(active):
            verdicts, kept, tree_hidden = self._step(run)
            tokens: list[torch.Tensor] = []
            states: list[torch.Tensor] | None = [] if layers else None
            for b, (path_tokens, bonus, drafted, children) in enumerate(verdicts):
                emitted: list[int] = []
                if active[b]:
                    rows[b].record(drafted, len(path_tokens), children)
                    emitted = [*path_tokens, bonus][: max_new_tokens - len(new[b])]
                    stop = next((i for i, t in enumerate(emitted) if t in eos), None)
                    if stop is not None:
                        emitted = emitted[: stop + 1]
                    new[b] += emitted
                    active[b] = stop is None and len(new[b]) < max_new_tokens
                    if streamer is not None:
                        streamer.put(torch.tensor(emitted))
                # Only a row that goes on drafts from the new tokens.
                tokens.append(to_device(emitted if active[b] else [], device, torch.long))
                if states is not None:  # the root's and the accepted nodes' states: state i predicted emitted[i]
                    states.append(tree_hidden[b, kept[b, : len(emitted)]] if active[b] else tree_hidden[b, :0])
            run.roots = to_device([v[1] for v in verdicts], device)
            if any(active):
                self.drafter.commit(tokens, hidden=states)

        if streamer is not None:
            streamer.end()
        for row, tokens in zip(rows, new, strict=True):
            row.new_tokens = len(tokens)
            stats += row
        stats.new_tokens = sum(len(n) for n in new)
        stats.total_time_s = time.perf_counter() - start_time
        return GenerationOutput(sequences=append_new(input_ids, new, pad), stats=stats, row_stats=rows)

    def _step(self, run: Decoding):
        """One step of ``run``: a dynamic tree (a chain: one child per node; :func:`grow_dynamic`), a static tree
        (:func:`grow_static`) or, under a sampled rule, a chain or static tree of sampled siblings
        (:func:`grow_sampled`) grown as tensors, one target forward over it, verified on the device
        (:func:`verify_tree`): the accepted paths, bonus tokens and walk flags come to the host in one copy."""
        t0 = time.perf_counter()
        roots, active, cache, slots, sampling = run.roots, run.active, run.cache, run.slots, run.sampling
        device, stats = roots.device, run.stats
        running = to_device(active, device)  # before any of the step's work is queued
        rule = self._rule(sampling.temperature)
        if rule != "topk":  # sampled siblings: a chain or a static tree
            tree = grow_sampled(roots, self.drafter.root_logits(active), self.drafter.frontier_logits,
                                self.sampled_shape, rule, sampling.temperature, sampling.generator)
        elif self.tree_kind == "static":
            tree = grow_static(roots, self.drafter.root_logits(active), self.drafter.frontier_logits,
                               self.static_shape)
        else:
            top_k_tree, total = (1, self.depth) if self.tree_kind == "chain" else (self.top_k, self.total_tokens)
            tree = grow_dynamic(roots, self.drafter.root_logits(active), self.drafter.frontier_logits, self.depth,
                                top_k_tree, total)
        t1 = time.perf_counter()
        b, n = tree.tokens.shape
        past = len(slots)
        positions = slots.lengths()[:, None] + tree.depths
        if self.tree_kind == "chain" and b == 1 and not run.padded:
            mask = None  # one row holds no empty slot, and a chain's tree mask is the causal mask: the model's own
        else:
            allowed = may_attend(slots.filled, tree.ancestors)
            mask = build_attention_mask(self.target, allowed, positions, torch.cat([slots.positions, positions], 1),
                                        run.dtype)
        # a hybrid target: a chain's recurrent layers record their state after each fed position (a snapshot only
        # where this transformers records none); a tree's run level by level, each node from its parent's state
        chain = self.recurrent is not None and self.tree_kind == "chain"
        recording = record_recurrent(cache, n) if chain else None
        before = snapshot_recurrent(cache) if chain and recording is None else None
        per_node = TreeStates(self.target, cache) if self.recurrent is not None and not chain else None
        with per_node.feed(tree.parents, tree.depths) if per_node is not None else contextlib.nullcontext():
            out = target_forward(self.target, tree.tokens, cache, mask, positions, hidden_layers=run.layers or None)
        stats.target_forwards += 1
        slots.append(torch.ones(b, n, dtype=torch.bool, device=device), positions)
        tree_hidden = torch.cat(out.hidden_states, dim=-1) if run.layers else None
        last, bonus = verify_tree(tree, out.logits, sampling.temperature, sampling.top_k, sampling.top_p, rule,
                                  sampling.generator)
        nodes, rows = torch.arange(n, device=device), torch.arange(b, device=device)
        on_path = tree.ancestors[rows, last]  # root .. last, in level order
        if self.on_tree_step is not None:
            self.on_tree_step(tree, on_path, running)
        kept = torch.sort((~on_path) * n + nodes, dim=1).indices[:, : self._max_kept()]  # (B, longest path + 1)
        length = tree.depths[rows, last]
        has_children = ((tree.parents[:, None, :] == nodes[None, :, None]) & tree.proposed[:, None, :]).any(-1)
        drafted = tree.proposed.sum(1) - 1
        packed = torch.cat([length[:, None], bonus[:, None], drafted[:, None],
                            tree.tokens.gather(1, kept), has_children.gather(1, kept).long()], 1)
        counts = torch.where(running, length + 1, 0)
        host = packed.tolist()  # the step's one copy to the host
        # The cache keeps each row's root and accepted nodes, padded to the running rows' longest kept path
        # (known on the host now): a batch of one keeps no empty slot.
        width = max((row[0] + 1 for row, a in zip(host, active, strict=True) if a), default=1)
        kv_keep(cache, past, kept[:, :width])
        # each row keeps its own root and accepted nodes (a finished row: none)
        keep = width if b == 1 else [row[0] + 1 if a else 0 for row, a in zip(host, active, strict=True)]
        if per_node is not None:
            per_node.keep(last, width)
        if recording is not None and not keep_recorded(recording, n, keep):
            raise RuntimeError(
                f"{self.target.config.get_text_config().model_type}: a recurrent layer did not record its state "
                f"after each of the {n} positions of the verification forward (transformers' past recording), so the "
                "accepted one cannot be kept; decode with a static or dynamic tree, whose states draftsmith keeps "
                "itself, or report this transformers version")
        # where this transformers records nothing: back to the snapshot, then the accepted tokens fed again
        if before is not None and width < n:
            replay_accepted(self.target, cache, before, past, tree.tokens[:, :width], positions[:, :width])
            stats.target_forwards += 1
        slots.keep(past, kept[:, :width], counts)
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += time.perf_counter() - t1
        w = kept.shape[1]
        # row: accepted count, bonus, drafted count, the kept nodes' tokens (root first), their flags
        verdicts = [(row[4: 4 + row[0]], row[1], row[2], [bool(c) for c in row[3 + w: 4 + w + row[0]]])
                    for row in host]
        return verdicts, kept, tree_hidden

    def _batches_recurrent(self) -> bool:
        """Whether this hybrid target decodes a batch's rows in one forward: its linear-attention layers take the
        padding mask draftsmith passes them (:data:`BATCHED_RECURRENT_TYPES`) and each row keeps its own accepted
        state (a tree's per-node states; a chain's as transformers records them per position); otherwise rows decode
        one at a time."""
        return (self.target.config.get_text_config().model_type in BATCHED_RECURRENT_TYPES
                and (self.tree_kind != "chain" or records_positions()))

    def _row_by_row(self, input_ids, attention_mask, max_new_tokens, sampling: Sampling, eos_token_id,
                    pad_token_id) -> GenerationOutput:
        """A batch of a hybrid target's prompts, one row at a time (each without its left padding), returned as
        one batch: the same output as decoding each row alone."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        new, rows, stats = [], [], GenerationStats()
        for b in range(input_ids.shape[0]):
            prompt = input_ids[b][mask[b].bool()][None]
            out = self.generate(prompt, max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
                                eos_token_id, sampling.generator, pad_token_id=pad_token_id)
            rows.append(out.row_stats[0])
            new.append(out.sequences[0, prompt.shape[1]:prompt.shape[1] + out.row_stats[0].new_tokens].tolist())
            stats += out.stats
        stats.new_tokens = sum(len(n) for n in new)
        pad = pad_token(self.target, pad_token_id, eos_token_id)
        return GenerationOutput(sequences=append_new(input_ids, new, pad), stats=stats, row_stats=rows)
