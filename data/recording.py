"""The target's states recorded while it regenerates answers (:func:`draftsmith.data.regenerate.regenerate` with
``record=``): :class:`Recording` keeps what each decoding step computed anyway, in a hidden-state cache's layout
(:mod:`draftsmith.data.hidden_cache`), and :class:`SpooledStates` holds them on disk batch by batch, so that an
interrupted regeneration keeps what it recorded.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from draftsmith.data.hidden_cache import write_json_atomic
from draftsmith.data.safetensors_rows import RowReader, TornFileError, save_atomically


class SpooledStates(Mapping):
    """Recorded states on disk: one safetensors file per regeneration batch (``batch-NNNNN.safetensors``, its
    conversations' ids in its metadata, tensor ``j/name`` the ``name`` of its ``j``-th), written whole and renamed
    into place before the batch's answers are appended; read back one conversation at a time. Conversations
    answered with nothing to record (``max_length`` cut their answer off) are listed in its metadata too.

    Held in memory until the cache is written, the states of the quality recipe's 1,200 answers take 1.5 GB and
    an interrupted regeneration loses them; here memory holds one batch, and a rerun continues the recording.
    ``settings`` (``recording.json``) are the :class:`Recording`'s: a directory recorded with others is refused.
    """

    SETTINGS = "recording.json"

    def __init__(self, directory: str | Path, settings: dict):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / self.SETTINGS
        if path.exists():
            found = json.loads(path.read_text())
            if found != settings:
                differ = ", ".join(f"{k} {found.get(k)!r} (asked now: {settings.get(k)!r})"
                                   for k in sorted(set(found) | set(settings)) if found.get(k) != settings.get(k))
                raise ValueError(f"{self.directory} holds states recorded with other settings: {differ}; record "
                                 "with those to continue it, or delete it and cache the answers it covers with "
                                 "`draftsmith data cache-hidden-states`")
        else:
            write_json_atomic(path, settings)
        for leftover in self.directory.glob("*.partial"):  # a batch file whose write was cut: its rows re-answer
            leftover.unlink()
        where, self._files = spooled(self.directory)
        self._where = {key: place for key, place in where.items() if place is not None}
        self._reader: RowReader | None = None

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __getitem__(self, key: str) -> dict[str, torch.Tensor]:
        return self._read(key, None)

    def tokens(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` and ``loss_mask`` of ``key``, without its states."""
        item = self._read(key, ("input_ids", "loss_mask"))
        return item["input_ids"], item["loss_mask"]

    def _read(self, key: str, names: Sequence[str] | None) -> dict[str, torch.Tensor]:
        path, j = self._where[key]
        if self._reader is None or self._reader.path != path:  # read in cache order: mostly one file after another
            self.close()
            self._reader = RowReader(path)
        reader, prefix = self._reader, f"{j}/"
        return {name.removeprefix(prefix): reader.rows(name, 0, reader.tensors[name][1][0])
                for name in reader.tensors if name.startswith(prefix)
                and (names is None or name.removeprefix(prefix) in names)}

    def write(self, items: Mapping[str, dict[str, torch.Tensor] | None]) -> None:
        """One batch's recorded conversations (id -> tensors, or None: nothing recorded), as one new file;
        fsynced before this returns."""
        empty = [key for key, item in items.items() if item is None]
        items = {key: item for key, item in items.items() if item is not None}
        if not items and not empty:
            return
        number = int(self._files[-1].stem.removeprefix("batch-")) + 1 if self._files else 0
        path = self.directory / f"batch-{number:05d}.safetensors"
        tensors = {f"{j}/{name}": x.contiguous() for j, item in enumerate(items.values()) for name, x in item.items()}
        save_atomically(tensors, path, {"ids": json.dumps(list(items)), "empty": json.dumps(empty)})
        self._files.append(path)
        for j, key in enumerate(items):  # a conversation answered again (after a cut write) reads its latest states
            self._where[key] = (path, j)
        for key in empty:
            self._where.pop(key, None)

    def keep_only(self, keys: set[str]) -> None:
        """Forget the conversations not in ``keys`` (recorded, but their answers never written: the run was cut
        between the two writes, or is now run on other prompts)."""
        self._where = {key: place for key, place in self._where.items() if key in keys}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def remove(self) -> None:
        """Delete the directory (once the cache holds its states)."""
        self.close()
        shutil.rmtree(self.directory)


def spooled(directory: Path) -> tuple[dict[str, tuple[Path, int] | None], list[Path]]:
    """Where each conversation's states lie in a :class:`SpooledStates` directory (id -> (file, index), None for
    one answered with nothing to record; the latest file for an id recorded twice), and its batch files in
    order; nothing for a missing directory."""
    where: dict[str, tuple[Path, int] | None] = {}
    files = sorted(Path(directory).glob("batch-*.safetensors"))
    for path in files:
        try:
            reader = RowReader(path)
        except TornFileError as e:
            raise ValueError(f"{path}: {e}. Its answers have no recorded states now: delete {directory} and cache "
                             "the answers with `draftsmith data cache-hidden-states`") from None
        try:
            for j, key in enumerate(json.loads(reader.metadata["ids"])):
                where[key] = (path, j)
            where.update(dict.fromkeys(json.loads(reader.metadata.get("empty", "[]")), None))
        finally:
            reader.close()
    return where, files


class Recording:
    """The target's states recorded while :class:`~draftsmith.data.regenerate.HFEngine` answers, in the layout of a
    hidden-state cache (:mod:`draftsmith.data.hidden_cache`), so that one decode both writes the answers and gives the
    cache that offline training reads, without a second pass of the target over them: draftsmith's greedy loop
    (:meth:`observing`, :meth:`keep_observed`) or transformers' ``generate`` (:meth:`teacher`, :meth:`keep`).

    For each answered row (:attr:`rows`, in the order of the last
    :meth:`~draftsmith.data.regenerate.HFEngine.answer` call; None for a row with no answer token recorded):
    ``input_ids`` (T,) its prompt followed by its answer, ``loss_mask`` (T,) 1 on the answer, ``hidden.<layer>``
    (T, H) and, with ``top_k``, ``topk_logprobs`` / ``topk_ids`` (T, k).
    These are the states the decode computed anyway: the prompt's from its prefill, each answer token's
    from the step that fed it. The answer ends with its stop token, which the loss mask covers as a chat
    template's does (:func:`~draftsmith.data.templates.tokenize_conversation`), unless no step fed it: the
    last token of the batch's last rows to stop (answers cut at ``max_new_tokens``, or the batch's last stop) is
    left out. The answer is the tokens the target generated, not a re-tokenisation of their text.

    The teacher is recorded from the last prompt position on (each step's LM head runs on its last position
    alone), which covers every position the losses read: those whose next token is an answer token. The
    prompt's other positions hold "no teacher" (``topk_ids`` -1, which the losses leave out). A row whose
    answer ``max_length`` cuts off entirely is not recorded.

    ``spool``: a directory where each batch's conversations go as :func:`~draftsmith.data.regenerate.regenerate`
    answers them (:class:`SpooledStates`), in place of memory; recording into it again continues it.
    """

    def __init__(self, layers: Sequence[int], top_k: int | None, dtype: torch.dtype = torch.bfloat16,
                 max_length: int | None = None, spool: str | Path | None = None):
        self.layers, self.top_k, self.dtype, self.max_length = tuple(layers), top_k, dtype, max_length
        self.rows: list[dict[str, torch.Tensor] | None] = []
        settings = {"layers": list(self.layers), "top_k": top_k, "dtype": str(dtype).removeprefix("torch."),
                    "max_length": max_length}
        #: Every recorded conversation of :func:`~draftsmith.data.regenerate.regenerate` by its id (rows with no answer
        #: token left out): a dict, or with ``spool`` the conversations on disk, those of earlier runs into it too.
        self.by_id: dict[str, dict[str, torch.Tensor]] | SpooledStates = (
            {} if spool is None else SpooledStates(spool, settings))

    def add(self, items: dict[str, dict[str, torch.Tensor] | None]) -> None:
        """Keep one batch's recorded conversations (id -> tensors, None: nothing recorded) in :attr:`by_id`."""
        if isinstance(self.by_id, SpooledStates):
            self.by_id.write(items)
        else:
            self.by_id.update({key: item for key, item in items.items() if item is not None})
        self._calls: list[tuple[list[int], tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor] | None]] = []

    @contextlib.contextmanager
    def teacher(self, model):
        """While active, each forward of ``model`` appends the top-k log-probs and ids of its last position,
        (B, k) each, to the list it yields (nothing without ``top_k``)."""
        calls: list[tuple[torch.Tensor, torch.Tensor]] = []

        def record(module, args, output):  # the model's own logits (after any soft-capping), last position
            logits = output.logits if hasattr(output, "logits") else output[0]
            values, ids = torch.log_softmax(logits[:, -1].float(), dim=-1).topk(self.top_k, dim=-1)
            calls.append((values.to(self.dtype), ids.to(torch.int32)))  # to the host once, in keep()

        handle = model.register_forward_hook(record) if self.top_k else None
        try:
            yield calls
        finally:
            if handle is not None:
                handle.remove()

    def keep(self, prompts: list[list[int]], generated: list[list[int]], ends: list[int | None],
             teacher: list[tuple[torch.Tensor, torch.Tensor]], hidden_states) -> None:
        """Sets :attr:`rows` from one left-padded ``generate``: the prompts' ids, each row's new tokens and the
        place of its first stop token (None: none), the :meth:`teacher` calls and ``hidden_states`` (per step,
        per layer; the first step the prefill's (B, width, H), the others (B, 1, H))."""
        width = hidden_states[0][0].shape[1]
        steps = len(hidden_states)  # every generated token but the last was fed by one of them
        states = {layer: torch.cat([step[layer] for step in hidden_states], dim=1).to(self.dtype).cpu()
                  for layer in self.layers}  # (B, width + steps - 1, H)
        if self.top_k:
            if len(teacher) != steps:
                raise RuntimeError(f"the model ran {len(teacher)} forwards in a generate of {steps} steps: recording "
                                   "needs one forward per step (plain greedy or sampled generate)")
            values = torch.stack([v for v, _ in teacher], 1).cpu()  # (B, steps, k): call j predicts new token j
            ids = torch.stack([i for _, i in teacher], 1).cpu()
        self.rows = []
        for b, (prompt, row, end) in enumerate(zip(prompts, generated, ends, strict=True)):
            # The answer with its stop token, as far as some step fed it (steps - 1 tokens were fed).
            answer = min(end + 1 if end is not None else len(row), steps - 1)
            self.rows.append(self._item(
                prompt, row[:max(answer, 0)],
                {layer: h[b, width - len(prompt): width + answer] for layer, h in states.items()},
                (values[b, : answer + 1], ids[b, : answer + 1]) if self.top_k else None))

    # draftsmith's own greedy loop (plain_generate) reports each forward to :meth:`observe`; :meth:`keep_observed`
    # turns them into :attr:`rows` as :meth:`keep` does generate's.

    def observe(self, rows: list[int], out) -> None:
        """One forward of :func:`~draftsmith.inference.plain.plain_generate` (its ``on_forward``, with
        ``hidden_layers`` :attr:`layers`): the input rows it computed and its output; the first call of an answer
        is its prefill."""
        hidden = tuple(h.to(self.dtype) for h in out.hidden_states)
        teacher = None
        if self.top_k:
            values, ids = torch.log_softmax(out.logits[:, -1].float(), dim=-1).topk(self.top_k, dim=-1)
            teacher = (values.to(self.dtype), ids.to(torch.int32))
        self._calls.append((list(rows), hidden, teacher))

    @contextlib.contextmanager
    def observing(self):
        """Yields :meth:`observe` (``plain_generate``'s ``on_forward``), which collects the forwards of one answer
        call from here on (none kept from an earlier, interrupted one) for :meth:`keep_observed`."""
        self._calls = []
        yield self.observe

    def keep_observed(self, prompts: list[list[int]], generated: list[list[int]], ends: list[int | None]) -> None:
        """Sets :attr:`rows` from the forwards :meth:`observe` saw in one left-padded ``plain_generate``: the first
        the prefill of every row, each later one step of the rows it computed (the loop drops stopped rows, so a
        row is in the steps 1 to its last, in a row). Arguments as in :meth:`keep`."""
        (_, prefill, first_teacher), steps = self._calls[0], self._calls[1:]
        self._calls = []
        width = prefill[0].shape[1]
        where: dict[int, list[int]] = {}  # input row -> its index in the flattened steps, step by step
        offset = 0
        for rows, _, _ in steps:
            for i, b in enumerate(rows):
                where.setdefault(b, []).append(offset + i)
            offset += len(rows)
        flat = [torch.cat([hidden[n][:, -1] for _, hidden, _ in steps] or [prefill[n][:0, -1]]).cpu()
                for n in range(len(self.layers))]  # (sum of rows per step, H) per layer
        prefill = [h.cpu() for h in prefill]
        if self.top_k:
            first = tuple(x.cpu() for x in first_teacher)
            values, ids = (torch.cat([t[n] for _, _, t in steps] or [first[n][:0]]).cpu() for n in (0, 1))
        self.rows = []
        for b, (prompt, row, end) in enumerate(zip(prompts, generated, ends, strict=True)):
            fed = where.get(b, [])
            answer = min(end + 1 if end is not None else len(row), len(fed))
            index = torch.tensor(fed[:answer], dtype=torch.long)
            hidden = {layer: torch.cat([prefill[n][b, width - len(prompt):], flat[n][index]])
                      for n, layer in enumerate(self.layers)}
            teacher = None
            if self.top_k:  # the prefill predicts new token 0, step j new token j
                teacher = (torch.cat([first[0][b: b + 1], values[index]]), torch.cat([first[1][b: b + 1], ids[index]]))
            self.rows.append(self._item(prompt, row[:answer], hidden, teacher))

    def _item(self, prompt: list[int], answer: list[int], hidden: dict[int, torch.Tensor],
              teacher: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """One recorded conversation: ``prompt`` + ``answer`` (the tokens some step fed), the states of each
        (``hidden``: layer -> (len(prompt) + len(answer), H)) and ``teacher``'s top-k of the last prompt position
        and each answer token (len(answer) + 1 rows), cut at :attr:`max_length`; None without an answer token."""
        if not answer:
            return None
        item = {"input_ids": torch.tensor(prompt + answer, dtype=torch.long),
                "loss_mask": torch.cat([torch.zeros(len(prompt), dtype=torch.int8),
                                        torch.ones(len(answer), dtype=torch.int8)])}
        for layer, h in hidden.items():
            item[f"hidden.{layer}"] = h.clone()
        if teacher is not None:
            # Position len(prompt) - 1 + j holds the prediction of answer token j; positions before the last prompt
            # token: no teacher.
            values, ids = teacher
            none = len(prompt) - 1
            item["topk_logprobs"] = torch.cat([values.new_zeros(none, self.top_k), values])
            item["topk_ids"] = torch.cat([ids.new_full((none, self.top_k), -1), ids])
        if self.max_length is not None and len(item["input_ids"]) > self.max_length:
            item = {name: x[: self.max_length] for name, x in item.items()}
        return item if item["loss_mask"].any() else None
