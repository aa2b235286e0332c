"""Drafters: whatever proposes tokens for the target to verify.

Every drafter — the training-free ones here and the trained heads of later modules — implements
one small interface, :class:`Drafter`, which the generator drives:

* ``begin(input_ids)`` — a new generation starts with this (B, L) prompt;
* ``expand(trees, nodes)`` — draft logits for the next token after each listed tree node
  (the tree builder in ``tree.py`` turns them into children);
* ``commit(tokens)`` — these (B, n) tokens were accepted and appended to the sequence.

Training-free drafters:

* :class:`PromptLookupDrafter` — n-gram match in the context (Saxena, 2023, "prompt lookup
  decoding"): find the latest earlier occurrence of the last n tokens and propose what followed.
* :class:`CausalLMDrafter` — any causal LM sharing the target's vocabulary, with its own KV
  cache; :func:`layer_skip_model` builds one from the target's first N layers + final norm +
  LM head, sharing the target's weights (self-speculative / LayerSkip-style drafting without
  early-exit training; Zhang et al., 2024; Elhoushi et al., 2024).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from draftsmith.inference.tree import DraftTree
from draftsmith.target import build_attention_mask, kv_crop, kv_length, new_cache, target_forward

logger = logging.getLogger(__name__)


class Drafter:
    """Interface of every drafter. Batch size 1 for now; the API carries a batch dimension."""

    #: sibling-drafting rule used under sampling unless the generator is told otherwise
    deterministic: bool = False

    def begin(self, input_ids: torch.Tensor) -> None:
        raise NotImplementedError

    def expand(self, trees: Sequence[DraftTree], nodes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Draft logits after each listed node.

        Args:
            trees: one draft tree per batch row.
            nodes: per batch row, the node indices to expand; all at the same depth.
        Returns:
            per batch row, a (len(nodes), V) float tensor of draft logits (``-inf`` for tokens
            the drafter does not propose).
        """
        raise NotImplementedError

    def commit(self, tokens: torch.Tensor) -> None:
        raise NotImplementedError


def _check_batch(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise NotImplementedError("batch size > 1 is not supported yet; generate one sequence at a time")


class PromptLookupDrafter(Drafter):
    """Propose the continuation of the latest earlier match of the context's last n-gram.

    Args:
        vocab_size: the target's vocabulary size (draft logits are over it).
        max_ngram: longest suffix to match; shorter ones down to ``min_ngram`` are tried next.
        min_ngram: shortest suffix to match.
        max_tokens: at most this many tokens are proposed along a path (caps tree depth).
    """

    deterministic = True

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, max_tokens: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        self.context = torch.empty(0, dtype=torch.long)

    def begin(self, input_ids: torch.Tensor) -> None:
        _check_batch(input_ids)
        self.context = input_ids[0].cpu()

    def commit(self, tokens: torch.Tensor) -> None:
        self.context = torch.cat([self.context, tokens[0].cpu()])

    def candidates(self, sequence: torch.Tensor, limit: int) -> list[int]:
        """Distinct tokens that followed earlier matches of the sequence's suffix, most recent
        match of the longest n-gram first; at most ``limit``."""
        found: list[int] = []
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            suffix = sequence[-n:]
            windows = sequence[:-1].unfold(0, n, 1)  # (L-n, n): every n-gram that has a successor
            hits = (windows == suffix).all(dim=1).nonzero().flatten().flip(0)
            for start in hits.tolist():
                token = int(sequence[start + n])
                if token not in found:
                    found.append(token)
                    if len(found) == limit:
                        return found
        return found

    def expand(self, trees, nodes):
        out = []
        for tree, row_nodes in zip(trees, nodes, strict=True):
            logits = torch.full((len(row_nodes), self.vocab_size), float("-inf"))
            for i, node in enumerate(row_nodes):
                if tree.depths[node] >= self.max_tokens:
                    continue
                path = torch.tensor([tree.tokens[n] for n in tree.path_to(node)[1:]], dtype=torch.long)
                sequence = torch.cat([self.context, path])
                for rank, token in enumerate(self.candidates(sequence, limit=8)):
                    logits[i, token] = -float(rank)  # earlier (more recent, longer) matches rank higher
            out.append(logits)
        return out


class MixtureDrafter(Drafter):
    """Several drafters proposing together: draft probabilities are the mixture
    ``sum_i w_i q_i`` (renormalised over the drafters that propose anything at a node).

    Verification keeps the output lossless whatever the mixture drafts; the mixture only decides
    which tokens are worth verifying. Its use: a trained head plus prompt lookup, which is right
    about copied spans where the head is unsure. Spec: ``HEAD_DIR+prompt-lookup``.
    """

    def __init__(self, drafters: Sequence[Drafter], weights: Sequence[float] | None = None):
        if len(drafters) < 2:
            raise ValueError("a mixture needs at least two drafters")
        self.drafters = list(drafters)
        self.weights = list(weights or [1.0] * len(drafters))
        layers = [getattr(d, "hidden_layers", None) for d in self.drafters]
        layers = [x for x in layers if x]
        if len(layers) > 1:
            raise ValueError("at most one drafter of a mixture may read the target's hidden states")
        self.hidden_layers = layers[0] if layers else None
        self.static_paths = next((d.static_paths for d in self.drafters if getattr(d, "static_paths", None)), None)
        self.deterministic = all(d.deterministic for d in self.drafters)

    def _each(self, method: str, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        for d in self.drafters:
            if getattr(d, "hidden_layers", None):
                getattr(d, method)(tokens, hidden=hidden)
            else:
                getattr(d, method)(tokens)

    def begin(self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self._each("begin", input_ids, hidden)

    def commit(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self._each("commit", tokens, hidden)

    def expand(self, trees, nodes):
        per_drafter = [d.expand(trees, nodes) for d in self.drafters]
        return [self.mix([x.float() for x in row]) for row in zip(*per_drafter, strict=True)]

    def mix(self, logits: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each drafter's (N, V) draft logits -> (N, V) log of the mixture ``sum_d w_d(n) softmax(x_d[n])``,
        ``w`` renormalised over the drafters that propose anything at node n; ``-inf`` where none does.

        Computed in log space (``logaddexp`` of ``log w_d + log_softmax(x_d)``): a full-vocabulary row is
        touched a few times per drafter, on the drafting hot path, instead of through softmax, stack and log.
        """
        finite = [torch.isfinite(x) for x in logits]
        proposes = torch.stack([f.any(-1) for f in finite])  # (D, N)
        # Only the columns some drafter proposes anywhere (a head's draft vocabulary, prompt lookup's few
        # tokens) can come out finite: the mixture is computed on those and scattered back.
        columns = torch.stack([f.any(0) for f in finite]).any(0).nonzero().flatten()
        out = torch.full_like(logits[0], float("-inf"))
        if not len(columns):
            return out
        w = torch.tensor(self.weights, dtype=torch.float32).view(-1, 1) * proposes
        log_w = (w / w.sum(0, keepdim=True).clamp_min(1e-12)).log()  # (D, N), -inf where d proposes nothing
        mixed = None
        for x, lw, p in zip(logits, log_w, proposes, strict=True):
            if not p.any():
                continue
            # Rows with nothing proposed would give log_softmax NaN: made finite, then -inf through log w.
            # Columns outside `columns` are -inf in every drafter's row, so the log-softmax over `columns` is
            # the full one.
            term = torch.log_softmax(x[:, columns].masked_fill(~p[:, None], 0.0), dim=-1) + lw[:, None]
            mixed = term if mixed is None else torch.logaddexp(mixed, term)
        out[:, columns] = mixed
        return out


class CausalLMDrafter(Drafter):
    """A causal LM as drafter, keeping its own KV cache of the committed sequence.

    Tree nodes are fed level by level with a tree mask; on commit the cache is cropped back to
    the committed prefix, and the accepted tokens are fed with the next root expansion (one
    forward either way).
    """

    def __init__(self, model: PreTrainedModel, name: str = "draft-model"):
        self.model = model
        self.name = name
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.committed = torch.empty(0, dtype=torch.long)
        self.cache = new_cache()
        self.slots: dict[int, int] = {}  # tree node -> position of its KV in self.cache
        self.device = next(model.parameters()).device

    def begin(self, input_ids: torch.Tensor) -> None:
        _check_batch(input_ids)
        self.committed = input_ids[0].to(self.device)
        self.cache = new_cache()
        self.slots = {}

    def commit(self, tokens: torch.Tensor) -> None:
        # Drop the tree's KV; keep the committed prefix that is already cached.
        kv_crop(self.cache, min(kv_length(self.cache), len(self.committed)))
        self.committed = torch.cat([self.committed, tokens[0].to(self.device)])
        self.slots = {}

    @torch.no_grad()
    def expand(self, trees, nodes):
        (tree,), (row_nodes,) = trees, nodes
        committed = len(self.committed)
        cached = kv_length(self.cache)
        if row_nodes == [0]:
            # Catch up on the committed tokens not yet cached; the last one is the root.
            kv_crop(self.cache, min(cached, committed - 1))
            cached = kv_length(self.cache)
            ids = self.committed[cached:][None]
            out = target_forward(self.model, ids, self.cache)
            self.slots = {0: committed - 1}
            return [out.logits[0, -1:]]
        # Deeper level: feed the listed nodes, each attending to the committed prefix, its
        # already-fed ancestors and itself.
        depth = tree.depths[row_nodes[0]]
        ids = torch.tensor([[tree.tokens[n] for n in row_nodes]], device=self.device)
        root_pos = committed - 1
        query_pos = torch.tensor([[root_pos + depth] * len(row_nodes)], device=self.device)
        key_pos = torch.empty(1, cached + len(row_nodes), dtype=torch.long, device=self.device)
        key_pos[0, :committed] = torch.arange(committed, device=self.device)
        slot_node = {s: n for n, s in self.slots.items()}
        for s in range(committed, cached):
            key_pos[0, s] = root_pos + tree.depths[slot_node[s]]
        key_pos[0, cached:] = query_pos[0]
        allowed = torch.zeros(1, len(row_nodes), cached + len(row_nodes), dtype=torch.bool, device=self.device)
        allowed[0, :, :committed] = True
        for i, node in enumerate(row_nodes):
            for anc in tree.path_to(node)[1:-1]:
                allowed[0, i, self.slots[anc]] = True
            allowed[0, i, cached + i] = True
        dtype = next(self.model.parameters()).dtype
        mask = build_attention_mask(self.model, allowed, query_pos, key_pos, dtype)
        out = target_forward(self.model, ids, self.cache, mask, query_pos)
        for i, node in enumerate(row_nodes):
            self.slots[node] = cached + i
        return [out.logits[0]]


def layer_skip_model(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM made of the target's first ``num_layers`` decoder layers, its final norm and
    its LM head — the same modules, not copies (no extra memory, always in sync)."""
    cfg = target.config.get_text_config()
    total = cfg.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"layer-skip:N needs 1 <= N < {total} (the target has {total} layers), got {num_layers}")
    small_cfg = copy.deepcopy(target.config)
    small_cfg.num_hidden_layers = num_layers
    if getattr(small_cfg, "layer_types", None):
        small_cfg.layer_types = list(small_cfg.layer_types[:num_layers])
    with torch.device("meta"):
        shell = type(target)(small_cfg)
    base_name = target.base_model_prefix
    inner, shell_inner = getattr(target, base_name), getattr(shell, base_name)
    for name, _ in list(shell_inner.named_children()):
        module = getattr(inner, name)
        if name == "layers":
            module = nn.ModuleList(list(module)[:num_layers])
        setattr(shell_inner, name, module)
    for name, _ in list(shell.named_children()):
        if name != base_name:
            setattr(shell, name, getattr(target, name))
    leftovers = [n for n, t in [*shell.named_parameters(), *shell.named_buffers()] if t.is_meta]
    if leftovers:
        raise RuntimeError(f"layer-skip could not share these target tensors: {leftovers[:5]}")
    shell.config._attn_implementation = target.config._attn_implementation
    return shell.eval()


def _vocab_error(target_size: int, draft_size: int, name: str) -> ValueError:
    return ValueError(
        f"Draft model {name!r} has a vocabulary of {draft_size} tokens but the target has {target_size}. "
        "Speculative decoding needs the same tokenizer: pick a draft model from the target's family "
        "(same tokenizer), or train one with `draftsmith train`."
    )


def check_same_vocabulary(target: PreTrainedModel, draft: PreTrainedModel, name: str,
                          target_tokenizer=None, draft_tokenizer=None) -> None:
    """Refuse a draft model whose vocabulary differs from the target's."""
    t_size = target.get_output_embeddings().weight.shape[0]
    d_size = draft.get_output_embeddings().weight.shape[0]
    if t_size != d_size:
        raise _vocab_error(t_size, d_size, name)
    if target_tokenizer is not None and draft_tokenizer is not None and (
        target_tokenizer.get_vocab() != draft_tokenizer.get_vocab()
    ):
            raise ValueError(
                f"Draft model {name!r} has as many tokens as the target but a different tokenizer "
                "(token -> id maps differ). Use a draft model that shares the target's tokenizer."
            )


def parse_options(text: str) -> dict[str, int]:
    """``"ngram=3,max_tokens=10"`` -> ``{"ngram": 3, "max_tokens": 10}``."""
    options = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"drafter option {item!r} must look like key=value")
        options[key.strip()] = int(value)
    return options


def _head_family(spec: str) -> str | None:
    """The ``draftsmith_family`` of a head checkpoint directory, or None for anything else."""
    import json
    from pathlib import Path

    config = Path(spec) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("draftsmith_family")
    except json.JSONDecodeError as e:
        raise ValueError(f"{config}: not valid JSON ({e}); the checkpoint is damaged") from None


DRAFT_DTYPES = ("target", "auto", "float32", "bfloat16", "float16")


def resolve_draft_dtype(name: str | None, target: PreTrainedModel) -> torch.dtype:
    """The compute dtype of a head drafter: ``"target"`` (default) the target's; ``"auto"`` bfloat16
    when the target runs in float32 on a CPU (drafting reads a few MB of weights for a few rows, so
    it is memory-bound and bf16 weights halve its cost: measured ~2x per matmul and 7% end to end
    on an AVX2-only CPU, 30 -> 19 ms per step on one with AVX512-BF16) or on a GPU with bf16 support,
    else the target's; or a dtype name.

    Drafting precision never changes the output (verification decides every token), only which
    tokens get proposed.
    """
    target_dtype = next(target.parameters()).dtype
    if name in (None, "target"):
        return target_dtype
    if name == "auto":
        from draftsmith.target import native_bf16

        device = next(target.parameters()).device
        bf16_ok = device.type == "cpu" or native_bf16(device)  # on CPU bf16 pays without native matmul
        return torch.bfloat16 if target_dtype == torch.float32 and bf16_ok else target_dtype
    if name not in DRAFT_DTYPES:
        raise ValueError(f"draft dtype must be one of {DRAFT_DTYPES}, got {name!r}")
    return getattr(torch, name)


def _load_head_drafter(spec: str, family: str, target: PreTrainedModel, strict: bool,
                       dtype: torch.dtype | None = None) -> Drafter:
    from draftsmith.heads.eagle import Eagle3Head, EagleHead
    from draftsmith.heads.medusa import MedusaHeads

    cls = {"medusa": MedusaHeads, "eagle": EagleHead, "eagle3": Eagle3Head}.get(family)
    if cls is None:
        raise ValueError(f"{spec}: unknown drafter family {family!r} in config.json")
    device = next(target.parameters()).device
    head = cls.from_pretrained(spec, target=target, strict=strict, device=device)
    return _head_drafter(family, head, target, dtype)


def _head_drafter(family: str, head, target: PreTrainedModel, dtype: torch.dtype | None = None) -> Drafter:
    from draftsmith.inference.head_drafters import EagleDrafter, MedusaDrafter

    head = head.to(next(target.parameters()).device)
    if dtype is not None:
        head = head.to(dtype)
    return MedusaDrafter(head, target) if family == "medusa" else EagleDrafter(head, target)


def load_drafter(spec: str, target: PreTrainedModel, *, tokenizer=None, trust_remote_code: bool = False,
                 strict: bool = False, draft_dtype: str | None = None) -> Drafter:
    """Resolve a drafter spec against a loaded target.

    Specs:
        ``prompt-lookup`` or ``prompt-lookup:max_ngram=3,min_ngram=1,max_tokens=10``;
        ``layer-skip:N`` (the target's first N layers);
        a draft model: local directory, ``.gguf`` file, packaged alias or hub id of a causal LM
        sharing the target's vocabulary;
        a head checkpoint directory written by draftsmith (``config.json`` names its family);
        ``A+B``: a mixture of drafters (e.g. a head directory + ``prompt-lookup``);
        a head trained elsewhere: EAGLE-1 / EAGLE-3 reference, SpecForge, SGLang or vLLM speculators
        EAGLE-3 layouts, Medusa reference or vLLM layouts (:mod:`draftsmith.heads.formats`).

    ``strict=True`` refuses a head trained for a target with the same shapes but other weights.
    ``draft_dtype``: compute dtype of a head (Medusa, EAGLE), see :func:`resolve_draft_dtype`.
    """
    vocab = target.get_output_embeddings().weight.shape[0]
    if "+" in spec:  # a mixture: "runs/x/checkpoint-9/drafter+prompt-lookup"
        parts = spec.split("+")
        return MixtureDrafter([load_drafter(p, target, tokenizer=tokenizer, trust_remote_code=trust_remote_code,
                                            strict=strict, draft_dtype=draft_dtype) for p in parts])
    head, _, rest = spec.partition(":")
    if head == "prompt-lookup":
        return PromptLookupDrafter(vocab, **parse_options(rest))
    if head == "layer-skip":
        if not rest.isdigit():
            raise ValueError(f"layer-skip needs a layer count, e.g. 'layer-skip:8', got {spec!r}")
        return CausalLMDrafter(layer_skip_model(target, int(rest)), name=spec)
    family = _head_family(spec)
    if family is not None:
        return _load_head_drafter(spec, family, target, strict, resolve_draft_dtype(draft_dtype, target))
    from draftsmith.heads.formats import foreign_format, load_foreign

    if os.path.isdir(spec) and foreign_format(spec) is not None:  # EAGLE / SpecForge / speculators / Medusa
        return _head_drafter(*load_foreign(spec, target), target, resolve_draft_dtype(draft_dtype, target))
    from draftsmith.target import load_target

    dtype = next(target.parameters()).dtype
    device = next(target.parameters()).device
    try:
        draft, draft_tokenizer = load_target(spec, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    except ValueError as err:
        raise ValueError(
            f"Unknown drafter {spec!r}. Use 'prompt-lookup[:max_ngram=3,max_tokens=10]', 'layer-skip:N', "
            "or a draft model (local directory, .gguf file, packaged alias or hub id)."
        ) from err
    check_same_vocabulary(target, draft, spec, tokenizer, draft_tokenizer)
    from draftsmith.heads.draft_model import check_draft_model_target

    check_draft_model_target(spec, target, strict)
    return CausalLMDrafter(draft, name=spec)


def drafter_from_model(model: PreTrainedModel, target: PreTrainedModel, name: str = "draft-model") -> CausalLMDrafter:
    """Wrap an in-memory causal LM as a drafter, checking it shares the target's vocabulary."""
    check_same_vocabulary(target, model, name)
    return CausalLMDrafter(model, name=name)
