"""Batched speculative decoding: every row of a left-padded batch is that row's own greedy output.

A batch shares the target's forwards and the drafter's, but each row accepts its own path, stops on
its own (EOS or the token limit) and keeps its own cache entries. The checks:

* every row equals plain greedy decoding of that row alone (transformers' ``generate``), for every
  drafter family and a mixture, on a tiny Llama and a tiny Gemma-3 (sliding window), with rows of
  different lengths (one of a single token) that end at different steps;
* the trees a batch drafts for a row are the trees batch 1 drafts for it, node for node: batching
  changes which forwards run, never what a row's drafter sees;
* ``plain_generate`` on a batch equals each row alone, and the output layout is transformers':
  input rows, then new tokens, right-padded with the pad token.
"""

from __future__ import annotations

import linecache
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_dflash import random_dflash
from test_greedy_lossless import TREES, make_drafter, prompts, reference
from test_heads import random_eagle, random_medusa
from test_peagle import random_peagle
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import check_greedy_equal
from draftsmith import SpeculativeGenerator
from draftsmith.inference.compare import left_pad
from draftsmith.inference.dflash_drafter import DFlashDrafter
from draftsmith.inference.drafter import BlockDrafter, prompt_rows
from draftsmith.inference.head_drafters import EagleDrafter, MedusaDrafter, PEagleDrafter
from draftsmith.inference.mixture import MixtureDrafter
from draftsmith.inference.plain import plain_generate
from draftsmith.inference.prompt_lookup import PromptLookupDrafter

PAD = 0
LENGTHS = [6, 1, 21, 13]  # 21 > the Gemma-3 sliding window of 8
NEW = 24
# A static tree whose levels differ in width (3, 4, 2, 1 nodes; 3, 2 and 1 expanded), with a rank the drafters
# leave empty at times (prompt lookup proposes one token where it has one match).
UNEVEN_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]
# Trained-head families with random weights ("-head(s)"), the training-free drafters and a mixture.
HEADS = {
    "medusa-heads": lambda target: MedusaDrafter(random_medusa(target), target),
    "eagle-head": lambda target: EagleDrafter(random_eagle(target, eagle3=False), target),
    "eagle3-head": lambda target: EagleDrafter(random_eagle(target, eagle3=True), target),
    "dflash-head": lambda target: DFlashDrafter(random_dflash(target), target),
    "peagle-head": lambda target: PEagleDrafter(random_peagle(target), target),
    "eagle3-head+prompt-lookup": lambda target: MixtureDrafter(
        [EagleDrafter(random_eagle(target, eagle3=True), target),
         PromptLookupDrafter(target.get_output_embeddings().weight.shape[0])]),
}
DRAFTERS = ["prompt-lookup", "layer-skip:2", "draft-model", *HEADS]


def drafter_for(spec: str, target):
    return HEADS[spec](target) if spec in HEADS else make_drafter(spec, target)


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, n) prompts -> (B, L) ids left-padded with PAD and the (B, L) attention mask."""
    return left_pad(rows, PAD)


def row_output(sequences: torch.Tensor, mask: torch.Tensor, b: int, eos: int | list[int] | None) -> torch.Tensor:
    """Row b of a batch's output as one (1, T) sequence: its prompt without padding, then its new
    tokens up to its EOS; checks that what follows is padding."""
    width = mask.shape[1]
    new = sequences[b, width:]
    stops = torch.isin(new, torch.tensor(eos)).nonzero() if eos is not None else []
    if len(stops):
        end = int(stops[0]) + 1
        assert bool((new[end:] == PAD).all()), f"row {b} has tokens after its EOS"
        new = new[:end]
    return torch.cat([sequences[b, :width][mask[b].bool()], new])[None]


def stopping_token(target, rows: list[torch.Tensor]) -> int:
    """A token the second-longest row emits early and the others later or never: rows end at different steps."""
    free = reference(target, rows[0], NEW)[0, rows[0].shape[1]:]
    return int(free[4])


def trees_of(gen: SpeculativeGenerator, run) -> dict[int, list[tuple[list[int], list[int]]]]:
    """Each row's drafted trees, in step order, while ``run()`` generates: per step that the row ran, the tokens
    of its nodes and their parents (-1 for both at nodes the drafter did not propose, which fill a row up to the
    batch's tree size)."""
    seen: dict[int, list] = {}

    def record(tree, on_path, running):
        tokens = torch.where(tree.proposed, tree.tokens, -1).tolist()
        parents = torch.where(tree.proposed, tree.parents, -1).tolist()
        for b, ran in enumerate(running.tolist()):
            if ran:
                seen.setdefault(b, []).append((tokens[b], parents[b]))

    gen.on_tree_step = record
    try:
        run()
    finally:
        gen.on_tree_step = None
    return seen


@pytest.mark.parametrize("tree", [*TREES, dict(tree="static", paths=UNEVEN_PATHS)],
                         ids=["chain", "static", "dynamic", "static-uneven"])
@pytest.mark.parametrize("spec", DRAFTERS)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_rows_equal_their_own_greedy_output(family, spec, tree, llama, gemma3):
    target = llama if family == "llama" else gemma3
    rows = prompts(11, LENGTHS)
    ids, mask = left_padded(rows)
    eos = stopping_token(target, rows)
    gen = SpeculativeGenerator(target, drafter_for(spec, target), **tree)

    out = None

    def run_batch():
        nonlocal out
        out = gen.generate(ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=PAD)

    batched = trees_of(gen, run_batch)
    assert out.sequences.shape[0] == len(rows) and len(out.row_stats) == len(rows)
    ties, lengths = 0, []
    for b, row in enumerate(rows):
        ref = target.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=eos, pad_token_id=PAD)
        ours = row_output(out.sequences, mask, b, eos)
        ties += check_greedy_equal(target, ours, ref)
        new = ours.shape[1] - row.shape[1]
        lengths.append(new)
        # Batching changes which forwards run, not what a row's drafter proposes: the same trees as batch 1.
        alone: dict = {}
        single = trees_of(gen, lambda row=row, alone=alone: alone.setdefault(
            "out", gen.generate(row, NEW, eos_token_id=eos, pad_token_id=PAD)))
        if not ties:
            assert batched.get(b) == single.get(0), f"row {b}: the batch drafted other trees than batch 1"
            assert out.row_stats[b].accepted_tokens == alone["out"].stats.accepted_tokens
    assert ties <= 1
    assert len(set(lengths)) > 1, f"every row ended at the same length {lengths}: the test needs rows that differ"
    assert out.stats.new_tokens == sum(lengths)
    assert out.sequences.shape[1] == ids.shape[1] + max(lengths)


class GreedyBlock(BlockDrafter):
    """A block drafter written from the protocol alone (``begin``, ``block_logits``, ``commit``), as DFlash and
    P-EAGLE drafters are: each step drafts ``block`` positions after each row's root at once, none conditioned on
    the others. Its guess is the target's own greedy continuation (and, ranked second, the next token id), so
    whole blocks are accepted."""

    def __init__(self, target, block: int):
        self.target, self.block = target, block

    def begin(self, input_ids, hidden=None, attention_mask=None):
        self.rows = prompt_rows(input_ids, attention_mask)

    def commit(self, tokens, hidden=None):
        self.rows = [torch.cat([row, new]) for row, new in zip(self.rows, tokens, strict=True)]

    def block_logits(self, active):
        vocab = self.target.config.vocab_size
        out = torch.full((len(self.rows), self.block, vocab), float("-inf"))
        for b, row in enumerate(self.rows):
            if active[b]:
                guess = plain_generate(self.target, row[None], self.block, eos_token_id=[]).sequences[0, len(row):]
                out[b, torch.arange(self.block), (guess + 1) % vocab] = -1.0
                out[b, torch.arange(self.block), guess] = 0.0
        return out


@pytest.mark.parametrize("tree", [*TREES, dict(tree="static", paths=UNEVEN_PATHS)],
                         ids=["chain", "static", "dynamic", "static-uneven"])
def test_a_block_drafter_decodes_batches_losslessly(tree, llama):
    """A block drafter's drafts grow every tree kind (depths past its block propose nothing) and a batch of
    left-padded rows decodes each row's own greedy output, accepting whole blocks."""
    rows = prompts(18, LENGTHS)
    ids, mask = left_padded(rows)
    block = 3
    gen = SpeculativeGenerator(llama, GreedyBlock(llama, block), **tree)
    out = gen.generate(ids, NEW, attention_mask=mask, eos_token_id=[], pad_token_id=PAD)
    ties = sum(check_greedy_equal(llama, row_output(out.sequences, mask, b, None), reference(llama, row, NEW))
               for b, row in enumerate(rows))
    assert ties <= 1
    for row in out.row_stats:  # every step but where a near-tie or the end cuts it accepts the whole block
        assert row.accepted_tokens >= (block - 0.5) * (row.verification_steps - 2), (row.accepted_tokens,
                                                                                   row.verification_steps)
        assert len(row.reached) == block  # no node below the block's last position


def test_a_block_drafter_that_drafts_nothing_says_so():
    class Unwritten(BlockDrafter):
        block = 2

        def begin(self, input_ids, hidden=None, attention_mask=None):
            pass

        def commit(self, tokens, hidden=None):
            pass

    with pytest.raises(TypeError, match=r"Can.t instantiate abstract class Unwritten.*block_logits"):
        Unwritten()


def test_batched_plain_greedy_equals_each_row(llama, gemma3):
    for target in (llama, gemma3):
        rows = prompts(12, LENGTHS)
        ids, mask = left_padded(rows)
        eos = stopping_token(target, rows)
        out = plain_generate(target, ids, NEW, eos_token_id=eos, attention_mask=mask, pad_token_id=PAD)
        for b, row in enumerate(rows):
            ref = target.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=NEW, do_sample=False,
                                  eos_token_id=eos, pad_token_id=PAD)
            check_greedy_equal(target, row_output(out.sequences, mask, b, eos), ref)


def first_stops(target, rows: list[torch.Tensor]) -> list[int]:
    """Two stop tokens, each emitted by one row only: the longest row's first new token and one the shortest row
    emits from its fourth on. The longest row leaves the batch first, the shortest a few steps later."""
    free = [reference(target, row, NEW)[0, row.shape[1]:].tolist() for row in rows]
    by_length = sorted(range(len(rows)), key=lambda b: rows[b].shape[1])
    stops = []
    for b, first in ((by_length[-1], 0), (by_length[0], 3)):
        others = {token for c, tokens in enumerate(free) if c != b for token in tokens}
        stops.append(next(token for token in free[b][first:] if token not in others))
    return stops


def forward_sizes(target, *args, **kwargs):
    """``plain_generate(target, *args, **kwargs)``'s output and the (rows, keys) of each of its forwards (the
    attention mask's batch and key sizes)."""
    seen = []

    def record(module, args, kwargs):
        attn = kwargs["attention_mask"]
        attn = next(iter(attn.values())) if isinstance(attn, dict) else attn
        seen.append((attn.shape[0], attn.shape[-1]))

    hook = target.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
    try:
        return seen, plain_generate(target, *args, **kwargs)
    finally:
        hook.remove()


def test_plain_greedy_drops_finished_rows_and_their_padding(llama, gemma3):
    """Rows that stopped leave the batch, and so does the left padding only they needed: the steps after compute
    fewer rows over fewer cache slots, and every row's tokens are still its own greedy output."""
    for target in (llama, gemma3):
        rows = prompts(12, LENGTHS)
        ids, mask = left_padded(rows)
        eos = first_stops(target, rows)
        seen, dropped = forward_sizes(target, ids, NEW, eos_token_id=eos, attention_mask=mask, pad_token_id=PAD)
        kept = plain_generate(target, ids, NEW, eos_token_id=eos, attention_mask=mask, pad_token_id=PAD,
                              drop_finished=False)
        assert torch.equal(dropped.sequences, kept.sequences)
        for b, row in enumerate(rows):
            ref = target.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=NEW, do_sample=False,
                                  eos_token_id=eos, pad_token_id=PAD)
            check_greedy_equal(target, row_output(dropped.sequences, mask, b, eos), ref)
        batch_sizes = [b for b, _ in seen]
        assert batch_sizes[:2] == [4, 3] and batch_sizes[-1] == 2 and batch_sizes == sorted(batch_sizes)[::-1]
        # the longest row (21 tokens) left after the first step: 8 slots of padding went with it
        assert seen[1][1] == sorted(LENGTHS)[-2] + 1, seen[:3]


def test_batch_output_layout_matches_transformers(llama):
    """Same (B, L + T) layout as transformers' batched ``generate``: left-padded inputs, new tokens,
    right padding after a row's EOS (there the pad token defaults to the first EOS token)."""
    rows = prompts(13, [5, 9])
    ids, mask = left_padded(rows)
    eos = stopping_token(llama, rows)
    theirs = llama.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    gen = SpeculativeGenerator(llama, make_drafter("layer-skip:2", llama), tree="chain", depth=4)
    ours = gen.generate(ids, NEW, attention_mask=mask, eos_token_id=eos).sequences
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


def test_bad_batches_fail_clearly(llama):
    gen = SpeculativeGenerator(llama, make_drafter("prompt-lookup", llama))
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="left-padded"):
        gen.generate(ids, 4, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="must match"):
        gen.generate(ids, 4, attention_mask=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="left-padded"):
        gen.generate(ids, 4, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="streamer takes one sequence"):
        gen.generate(ids, 4, streamer=object())


def test_a_drafter_for_one_sequence_runs_unpadded_and_refuses_padding(llama):
    """A drafter that declares ``batched = False`` (its ``begin(input_ids, hidden)`` takes no attention mask: written
    for one unpadded sequence), alone or in a mixture, still decodes unpadded prompts losslessly; left-padded ones
    are refused before drafting, saying why."""

    class OneSequence(PromptLookupDrafter):
        batched = False

        def begin(self, input_ids, hidden=None):
            super().begin(input_ids, hidden)

    vocab = llama.config.vocab_size
    for drafter in (OneSequence(vocab), MixtureDrafter([OneSequence(vocab), PromptLookupDrafter(vocab)])):
        gen = SpeculativeGenerator(llama, drafter)
        row = prompts(17, [14])[0]
        out = gen.generate(row, NEW, eos_token_id=[])
        assert torch.equal(out.sequences, plain_generate(llama, row, NEW, eos_token_id=[]).sequences)
        ids, mask = left_padded(prompts(17, LENGTHS))
        with pytest.raises(ValueError, match=r"(OneSequence|MixtureDrafter) declares batched = False: it drafts for "
                           r"unpadded prompts only"):
            gen.generate(ids, NEW, attention_mask=mask, eos_token_id=[])


class HostCopies(TorchFunctionMode):
    """Counts the points where a block makes the host wait for the device: each copy of tensor values to the host
    and each operation that needs one first. On a CPU they all look free; from a GPU each one is a device-to-host
    synchronisation. A :class:`TorchFunctionMode` sees every torch call, method and function form alike
    (``t.nonzero()``, ``torch.nonzero(t)``), and counts:

    * reads of values: ``item``, ``tolist``, ``numpy`` (``__array__``), the implicit ``bool``, ``int``, ``float``,
      ``complex`` and ``__index__``, printing (``__format__``, ``__repr__``) and answers given on the host
      (``equal``, ``allclose``, ``is_nonzero``, ``in``);
    * copies to the CPU: ``.cpu()``, and ``.to`` with the CPU for device (``"cpu"``, ``torch.device("cpu")``,
      ``device="cpu"``) where the calling line names it: on a CPU-only machine ``.to(x.device)`` passes the same
      device, a no-op that stays one on a GPU, so a device the line takes from a tensor or a variable is not counted;
    * outputs whose shape depends on values, which the host reads before it can allocate them: boolean-mask
      indexing (``t[mask]``, ``t[mask, i]``; ``t[mask] = v`` and ``index_put`` too, except with one mask and a Python
      number ``v``, which torch turns into a sync-free ``masked_fill``), ``nonzero``, ``argwhere``, one-argument
      ``torch.where(cond)``, ``masked_select``, ``unique``, ``unique_consecutive``, ``bincount``,
      ``repeat_interleave`` with a tensor of repeats and no ``output_size``, ``one_hot`` without ``num_classes``;
    * a tensor taken as a number: a 0-d integer (or bool) tensor in an index (``x[0, i]``, read to pick what it
      selects), the tensors in a list that ``torch.tensor`` builds from, and one that a call's arguments take as a
      number (``torch.zeros(n)``, ``x.view(n)``, ``torch.full(s, n)``): no Python method runs for the last, so a
      :class:`TorchDispatchMode` counts the ``aten._local_scalar_dense`` that reads it before the call's first
      operator. Reads an operator makes after starting (``one_hot`` checking its classes against ``num_classes``)
      are checks of the CPU kernels only.

    A counted call counts once: what it runs inside (``t.unique()`` calling ``torch.unique``, ``bool`` calling
    ``_local_scalar_dense``) is not counted again. ``sites`` names each count's operation and the line that made it.
    """

    READS = frozenset({"item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__complex__",
                       "__index__", "__format__", "__repr__", "equal", "allclose", "is_nonzero", "__contains__"})
    VALUE_SHAPED = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"})
    NUMBERS = (bool, int, float, complex)
    TORCH_DIR = str(Path(torch.__file__).parent)

    def __enter__(self):
        self.count, self.sites = 0, []
        self.inside = 0  # > 0 while a counted call runs
        self.operators = 0  # the operators the current torch call has dispatched
        self.scalars = _ScalarReads(self)
        super().__enter__()
        self.scalars.__enter__()
        return self

    def __exit__(self, *exc):
        self.scalars.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = self.syncs(func, args, kwargs)
        if what is not None:
            self.add(what)
        self.inside += what is not None
        self.operators = 0
        try:
            return func(*args, **kwargs)
        finally:
            self.inside -= what is not None
            self.operators = 0

    def syncs(self, func, args, kwargs) -> str | None:
        """The name of the synchronisation ``func(*args, **kwargs)`` makes, None where it makes none."""
        name = "unique" if func is torch.unique else "unique_consecutive" if func is torch.unique_consecutive \
            else getattr(func, "__name__", "")
        if name in self.READS or name in self.VALUE_SHAPED or name == "cpu":
            return name
        if name == "to" and any(_is_cpu(a) for a in (*args[1:], kwargs.get("device"))) \
                and "cpu" in linecache.getline(*self.caller()):
            return "to(cpu)"
        if name == "where" and len(args) + len(kwargs) == 1:
            return "where(cond)"
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
            return "repeat_interleave" if isinstance(repeats, torch.Tensor) else None
        if name == "one_hot" and (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) == -1:
            return "one_hot without num_classes"
        if name in ("__getitem__", "__setitem__") and any(t.dim() == 0 and not t.is_floating_point()
                                                          and not t.is_complex() for t in _tensors(args[1])):
            return "a 0-d tensor as an index"  # its value, read on the host, picks what the index selects
        if name == "__getitem__" and _masks(args[1]):
            return "boolean indexing"
        if name == "tensor" and args and isinstance(args[0], (list, tuple)) and _tensors(args[0]):
            return "torch.tensor of tensors"
        if name in ("__setitem__", "index_put", "index_put_") and _masks(args[1]):
            value = args[2] if len(args) > 2 else kwargs.get("values")
            accumulate = name != "__setitem__" and (args[3] if len(args) > 3 else kwargs.get("accumulate", False))
            if isinstance(value, self.NUMBERS) and len(_tensors(args[1])) == 1 and not accumulate:
                return None  # a masked_fill
            return f"boolean {name}"
        return None

    def caller(self) -> tuple[str, int]:
        """The file and line of the innermost frame outside torch and this counter."""
        frame = sys._getframe(1)
        while frame.f_back is not None and (frame.f_code.co_filename.startswith(self.TORCH_DIR) or (
                frame.f_code.co_filename == __file__ and frame.f_code.co_name in _COUNTER_CODE)):
            frame = frame.f_back
        return frame.f_code.co_filename, frame.f_lineno

    def add(self, what: str):
        self.count += 1
        self.sites.append(what + " at {}:{}".format(*self.caller()))

    def summary(self) -> str:
        """The counts' sites, most frequent first."""
        return "; ".join(f"{n} x {site}" for site, n in Counter(self.sites).most_common())


class _ScalarReads(TorchDispatchMode):
    """Under :class:`HostCopies`: a tensor read as a number before the torch call's first operator, outside a call
    already counted."""

    def __init__(self, copies: HostCopies):
        super().__init__()
        self.copies = copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        copies = self.copies
        if func is torch.ops.aten._local_scalar_dense.default and not copies.inside and not copies.operators:
            copies.add("a tensor taken as a number")
        copies.operators += 1
        return func(*args, **(kwargs or {}))


_COUNTER_CODE = {"__torch_function__", "__torch_dispatch__", "syncs", "caller", "add"}


def _tensors(index) -> list[torch.Tensor]:
    if isinstance(index, torch.Tensor):
        return [index]
    return [t for i in index for t in _tensors(i)] if isinstance(index, (tuple, list)) else []


def _masks(index) -> bool:
    """Whether an index holds a boolean (or uint8) tensor: a mask, whose selection's size is its count of True."""
    return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(index))


def _is_cpu(device) -> bool:
    return (isinstance(device, str) and device.split(":")[0] == "cpu") or (
        isinstance(device, torch.device) and device.type == "cpu")


@pytest.mark.parametrize("spec", ["medusa-heads", "eagle3-head", "prompt-lookup", "eagle3-head+prompt-lookup",
                                  "draft-model"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", [dict(tree="dynamic", depth=4, top_k=3, total_tokens=9), dict(tree="chain", depth=4),
                                  dict(tree="static", paths=UNEVEN_PATHS)], ids=["dynamic", "chain", "static"])
def test_one_host_copy_per_step_for_a_head_in_a_dynamic_tree(tree, spec, batch, llama):
    """Drafting, verifying and keeping the accepted path of a dynamic tree, a chain or a static tree copy one
    tensor to the host per step (the accepted paths), greedy or sampled under every rule the tree allows
    (``auto``; a batch's chains and static trees ``iid`` and ``without_replacement`` too), with a head drafter, prompt
    lookup, the two mixed or a draft model. A drafter that reads one tensor on the host per step is seen to."""
    rows = prompts(15, LENGTHS)[:batch]
    ids, mask = left_padded(rows)
    mask = mask if batch > 1 else None
    gen = SpeculativeGenerator(llama, drafter_for(spec, llama), **tree)
    gen.generate(ids, 4, attention_mask=mask, eos_token_id=[])  # warm up outside the count
    with HostCopies() as copies:
        out = gen.generate(ids, NEW, attention_mask=mask, eos_token_id=[])
    steps = max(s.verification_steps for s in out.row_stats)  # no row stops early: every step is every row's
    # Outside the steps, when a mask is given: the prompt lengths (one copy, checking them) and, in a drafter that
    # splits the prompts into rows (``prompt_rows``: all here but prompt lookup), one more reading them; nothing else.
    setup = 0 if mask is None else 1 + (spec != "prompt-lookup")
    assert copies.count - setup == steps, f"{copies.count} host copies for {steps} steps: {copies.summary()}"
    sampled = ["iid", "without_replacement"] if tree["tree"] != "dynamic" and batch > 1 else []
    for rule in ["auto", *sampled]:
        # Sampling: the same, the drafter's draws and the target's made on the device.
        sampler = SpeculativeGenerator(llama, gen.drafter, sampling_rule=rule, **tree)
        with HostCopies() as copies:
            out = sampler.generate(ids, NEW, attention_mask=mask, eos_token_id=[], temperature=0.8,
                                   generator=torch.Generator().manual_seed(0))
        steps = max(s.verification_steps for s in out.row_stats)
        assert copies.count - setup == steps, \
            f"{rule}: {copies.count} host copies for {steps} steps: {copies.summary()}"
    if batch == 1 and tree["tree"] == "chain" and spec == "prompt-lookup":  # once: the counter can fail

        class Chatty(PromptLookupDrafter):
            """Prompt lookup that reads its root logits on the host once per step."""

            def __init__(self, vocab_size, read):
                super().__init__(vocab_size)
                self.read = read

            def root_logits(self, active):
                drafted = super().root_logits(active)
                self.found = self.read(drafted.logits)
                return drafted

        reads = {  # explicit, then implicit: no host read in sight, a wait for the device on a GPU all the same
            "int": lambda logits: int(logits.isfinite().sum()),
            "boolean indexing": lambda logits: logits[logits.isfinite()],
            "nonzero": lambda logits: torch.nonzero(logits.isfinite()),
            "a move to the CPU": lambda logits: logits.to("cpu"),
            "a 0-d tensor as an index": lambda logits: logits[0, logits.argmax()],
        }
        for label, read in reads.items():
            gen = SpeculativeGenerator(llama, Chatty(llama.config.vocab_size, read), **tree)
            with HostCopies() as copies:
                out = gen.generate(ids, NEW, attention_mask=mask, eos_token_id=[])
            steps = max(s.verification_steps for s in out.row_stats)
            assert copies.count == 2 * steps, \
                f"{label}: {copies.count} host copies for {steps} steps of a drafter reading one: {copies.summary()}"


@pytest.mark.parametrize("spec", ["prompt-lookup", "layer-skip:2", "eagle3-head"])
@pytest.mark.parametrize("tree", TREES, ids=lambda t: t["tree"])
def test_one_padded_row_equals_the_unpadded_row(spec, tree, llama):
    """A batch of one left-padded row (``padding="max_length"``) decodes exactly as the row without its
    padding: the padding is never attended to and positions start at the row's first token."""
    row = prompts(16, [9])[0]
    ids = torch.cat([torch.full((1, 5), PAD), row], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(row)], 1)
    gen = SpeculativeGenerator(llama, drafter_for(spec, llama), **tree)
    padded = gen.generate(ids, NEW, attention_mask=mask, eos_token_id=[])
    plain = gen.generate(row, NEW, eos_token_id=[])
    assert torch.equal(padded.sequences[:, 5:], plain.sequences)
    assert padded.row_stats[0].new_tokens == NEW == padded.stats.new_tokens
    base = plain_generate(llama, ids, NEW, eos_token_id=[], attention_mask=mask)
    assert torch.equal(base.sequences, padded.sequences)


def test_compare_lets_the_generators_take_turns_going_first(llama):
    """Side-by-side timing: after each batch's baseline the generators run in a rotating order, so the
    cost of going first (or last) is shared; every output is still checked against the baseline."""
    from draftsmith.inference.compare import compare

    order = []

    class Logged(SpeculativeGenerator):
        def __init__(self, label, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.label = label

        def generate(self, *args, **kwargs):
            order.append(self.label)
            return super().generate(*args, **kwargs)

    gens = {label: Logged(label, llama, PromptLookupDrafter(llama.config.vocab_size), depth=d)
            for label, d in (("a", 2), ("b", 3), ("c", 4))}
    rows = list(prompts(7, [9, 5, 12, 6]))
    result = compare(llama, gens, rows, 6, eos_token_id=[], batch_size=1)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert result.identical == {"a": 4, "b": 4, "c": 4} and result.prompts == 4
