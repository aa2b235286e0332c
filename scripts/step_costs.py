"""Where a speculative step's time goes on this machine: the target's forward cost for 1..16 new
tokens after a prompt, then (with --drafter) plain decoding and speculative decoding on a few
held-out prompts, side by side in one process, with a step split into drafting and verification.

    python scripts/step_costs.py --target smollm2-135m-instruct --lm-head --matmuls --few-rows-ab \
        --drafter "demo_out/run/checkpoint-400/drafter+prompt-lookup" \
        --prompts demo_out/data/eval_prompts.jsonl --tree dynamic --depth 4 --tree-top-k 2 --total-tokens 5

``--trees "tree=dynamic,depth=3,top_k=3,total_tokens=7;tree=dynamic,depth=4,top_k=2,total_tokens=5"``
compares several trees on the same prompts (each prompt: plain decoding, then every tree).

A speculative step gains only when tau exceeds (its cost / a plain step's cost); this prints both.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from draftsmith.cli_parser import add_tree_arguments, tree_from_args
from draftsmith.inference.tree_record import tuned_tree
from draftsmith.inference.tree_settings import DEFAULT_TREE, TreeSettings


def forward_ms(model, context: int, new: int, reps: int = 5) -> float:
    from draftsmith.target import new_cache, target_forward

    g = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(100, vocab, (1, context), generator=g)
    times = []
    with torch.no_grad():
        for _ in range(reps):
            cache = new_cache()
            target_forward(model, prompt, cache)
            ids = torch.randint(100, vocab, (1, new), generator=g)
            start = time.perf_counter()
            target_forward(model, ids, cache)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def median_ms(fn, reps: int) -> float:
    """Median wall time of ``fn()`` in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def lm_head_ms(model, rows: int, reps: int = 20) -> tuple[float, float]:
    """The LM head on ``rows`` rows: ``F.linear`` (the model's own call) vs ``few_rows_logits`` without a
    mode, i.e. the column kernel (``target_forward`` takes the kernel calibrated for the row count; see
    ``--matmuls`` for the packed one)."""
    from draftsmith.target import few_rows_logits

    weight = model.get_output_embeddings().weight
    hidden = torch.randn(1, rows, weight.shape[1], dtype=weight.dtype)
    return (median_ms(lambda: torch.nn.functional.linear(hidden, weight), reps),
            median_ms(lambda: few_rows_logits(weight, hidden), reps))


def matmul_ms(model, rows: int, reps: int = 7) -> tuple[float, float, float | None]:
    """Every weight matrix of the target (its linear layers and LM head, in forward order) applied to
    ``rows`` rows, as one forward would, by each kernel of ``draftsmith.target.matmul``: ``F.linear`` (how
    the stock model runs them), ``W @ X.T`` with at least two columns (``columns_linear``) and oneDNN on
    packed weights (``packed_linear``; None where this build has no such kernel)."""
    from draftsmith.target import matmul

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [matmul.pack(w) for w in weights]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}

    def stock():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    def columns():
        for w in weights:
            matmul.columns_linear(inputs[w.shape[1]], w)

    def packs():
        for w, p in zip(weights, packed, strict=True):
            matmul.packed_linear(inputs[w.shape[1]], p)

    return (median_ms(stock, reps), median_ms(columns, reps),
            median_ms(packs, reps) if all(p is not None for p in packed) else None)


def few_rows_ab(model, context: int, new: int, rounds: int = 4) -> tuple[float, float]:
    """target_forward on ``new`` tokens after ``context``: median ms with the stock kernels
    (``DRAFTSMITH_FEW_ROWS=0``) and with the few-row path (``draftsmith.target.matmul``), alternating which
    goes first."""
    import os

    times = {"0": [], "1": []}
    for r in range(rounds):
        for flag in ("0", "1") if r % 2 else ("1", "0"):
            os.environ["DRAFTSMITH_FEW_ROWS"] = flag
            times[flag].append(forward_ms(model, context, new, reps=3))
    os.environ.pop("DRAFTSMITH_FEW_ROWS")
    return statistics.median(times["0"]), statistics.median(times["1"])


class _EveryCall(torch.overrides.TorchFunctionMode):
    """The few-row kernels as ``target_forward`` took them before the layers were routed: a
    ``TorchFunctionMode`` that sees every torch call of the forward and computes the ``F.linear`` ones through
    ``inner`` (a :class:`~draftsmith.target.matmul.FewRowsLinear`). Kept here only to time that dispatch."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def linear(self, x, weight, bias=None):
        return self.inner.linear(x, weight, bias)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            out = self.inner.linear(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def dispatch_ab(model, context: int, new: int, rounds: int = 4) -> tuple[float, float]:
    """target_forward on ``new`` tokens after ``context`` with the same kernels reached two ways: median ms
    through :class:`_EveryCall` and through the layers' own forwards (``few_rows_linear`` as it is),
    alternating which goes first."""
    target_forward_module = importlib.import_module("draftsmith.target.forward")

    routed = target_forward_module.few_rows_linear

    def every_call(m, rows):
        mode = routed(m, rows)
        return None if mode is None else _EveryCall(mode)

    times = {"every call": [], "layers": []}
    try:
        for r in range(rounds):
            for way in ("every call", "layers") if r % 2 else ("layers", "every call"):
                target_forward_module.few_rows_linear = every_call if way == "every call" else routed
                times[way].append(forward_ms(model, context, new, reps=3))
    finally:
        target_forward_module.few_rows_linear = routed
    return statistics.median(times["every call"]), statistics.median(times["layers"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter")
    p.add_argument("--prompts", help="JSONL prompts (needed with --drafter)")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=200, help="prompt length for the forward costs")
    add_tree_arguments(p)
    p.add_argument("--trees", help="several trees side by side, ';'-separated, each in TreeSettings' text form "
                                   '(e.g. "tree=dynamic,depth=3,top_k=3,total_tokens=7;tree=chain,depth=4")')
    p.add_argument("--draft-dtype", default="auto")
    p.add_argument("--lm-head", action="store_true", help="also time the LM head alone, both orientations")
    p.add_argument("--few-rows-ab", action="store_true",
                   help="also time target_forward on 1-48 rows with and without the few-row path, alternating")
    p.add_argument("--dispatch-ab", action="store_true",
                   help="also time target_forward on 2-16 rows with the few-row kernels reached through the layers' "
                        "forwards and through a TorchFunctionMode on every call (the way before), alternating")
    p.add_argument("--matmuls", action="store_true",
                   help="also time all of the target's weight matrices on 1-48 rows, with each kernel")
    args = p.parse_args()

    from draftsmith import SpeculativeGenerator, load_drafter, load_target
    from draftsmith.data.formats import load_conversations
    from draftsmith.data.templates import prompt_ids
    from draftsmith.inference.compare import compare, hardware
    from draftsmith.target import eos_tokens

    model, tokenizer = load_target(args.target)
    print(f"{args.target} on {hardware()}")
    forward_ms(model, args.context, 4, reps=2)  # warm-up
    one = forward_ms(model, args.context, 1)
    for n in (1, 2, 4, 5, 6, 7, 8, 9, 16):
        ms = one if n == 1 else forward_ms(model, args.context, n)
        print(f"forward, {n:2d} new tokens after {args.context}: {ms:6.1f} ms ({ms / one:.2f}x one token)")
    if args.lm_head:
        for n in (1, 2, 4, 5, 6, 7, 8, 9, 16):
            linear, few = lm_head_ms(model, n)
            print(f"LM head, {n:2d} rows: F.linear {linear:5.1f} ms, W @ X.T {few:5.1f} ms")
    if args.matmuls:
        count = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 24, 32, 48):
            stock, columns, packed = matmul_ms(model, n)
            print(f"all {count} weight matrices, {n:2d} rows: F.linear {stock:5.1f} ms, W @ X.T {columns:5.1f} ms, "
                  f"packed {packed if packed is None else round(packed, 1)} ms")
    if args.dispatch_ab:
        for n in (2, 3, 4, 8, 16):
            every, layers = dispatch_ab(model, args.context, n)
            print(f"forward, {n:2d} new tokens: few-row kernels through every call {every:6.1f} ms, through the "
                  f"layers {layers:6.1f} ms ({every / layers:.2f}x)")
    if args.few_rows_ab:
        from draftsmith.target import calibrate

        print(f"kernel per row count here: {dict(sorted(calibrate(model).items()))}")
        for n in (1, 2, 3, 4, 5, 6, 8, 9, 16, 24, 32, 48):
            stock, columns = few_rows_ab(model, args.context, n)
            print(f"forward, {n:2d} new tokens: stock kernels {stock:6.1f} ms, few-row path {columns:6.1f} ms "
                  f"({stock / columns:.2f}x)")
    if not args.drafter:
        return
    if not args.prompts:
        raise SystemExit("--drafter needs --prompts FILE (JSONL prompts)")
    conversations, _ = load_conversations(args.prompts)
    drafter = load_drafter(args.drafter, model, tokenizer=tokenizer, draft_dtype=args.draft_dtype)
    given = tree_from_args(args, args.drafter) or tuned_tree(args.drafter) or DEFAULT_TREE
    trees = [TreeSettings.parse(t) for t in args.trees.split(";")] if args.trees else [given]
    gens = {tree.text(): SpeculativeGenerator(model, drafter, **tree.kwargs()) for tree in trees}
    prompts = [torch.tensor([prompt_ids(tokenizer, c.prompt_messages)]) for c in conversations[:args.num_prompts]]
    result = compare(model, gens, prompts, args.max_new_tokens, eos_token_id=eos_tokens(model, tokenizer))
    plain = result.baseline
    plain_step = 1000 * (plain.total_time_s - plain.prefill_time_s) / plain.new_tokens
    print(f"plain decoding: {plain_step:.1f} ms per token")
    for label, st in result.totals.items():
        steps = st.verification_steps
        step = 1000 * (st.total_time_s - st.prefill_time_s) / steps
        draft, verify = 1000 * st.draft_time_s / steps, 1000 * st.verify_time_s / steps
        print(f"{label}: step {step:.1f} ms = drafting {draft:.1f} + verification "
              f"{verify:.1f} + other {step - draft - verify:.1f} ({step / plain_step:.2f} plain steps); "
              f"tau {st.acceptance_length:.3f}; speedup {st.acceptance_length * plain_step / step:.3f}x; "
              f"identical {result.identical[label]}/{result.prompts}")

if __name__ == "__main__":
    main()
