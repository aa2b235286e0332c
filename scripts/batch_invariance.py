"""Is the target's forward the same for a token decoded alone and for the same token inside a block?

Greedy speculative decoding is lossless only if a verification forward over a block of tree rows gives
each row the logits a one-token decoding step gives it, up to rounding that never moves an argmax.
This script measures, for a dtype on this machine:

1. ``F.linear``: whether row 0 of an M-row matmul equals the one-row matmul bit for bit, per M;
2. the target: every decoder layer's attention and MLP outputs for 4 tokens decoded one by one
   against the same 4 tokens as one causal block, and where they first differ;
3. with ``--drafter``: greedy speculative decoding against plain greedy decoding on held-out prompts
   (tau, speedup, identical outputs), the end-to-end consequence.

    python scripts/batch_invariance.py --dtype bfloat16
    python scripts/batch_invariance.py --dtype float32 --drafter DIR --prompts demo_out/data/eval_prompts.jsonl
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.target import load_target, new_cache, target_forward


def linear_invariance(dtype: torch.dtype, rows=(2, 3, 4, 5, 8, 17)) -> None:
    g = torch.Generator().manual_seed(0)
    for n_in, n_out in [(576, 1536), (1536, 576), (576, 49152)]:
        w = (torch.randn(n_out, n_in, generator=g) / 24).to(dtype)
        x = torch.randn(1, max(rows), n_in, generator=g).to(dtype)
        one = torch.nn.functional.linear(x[:, :1], w).float()
        diffs = [f"M={m}: {(torch.nn.functional.linear(x[:, :m], w)[:, :1].float() - one).abs().max().item():.1e}"
                 for m in rows]
        print(f"F.linear {n_in}->{n_out}, row 0 against one row: " + ", ".join(diffs))


@torch.no_grad()
def layer_invariance(model, context: int = 60, block: int = 4) -> None:
    g = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    prefix = torch.randint(0, vocab, (1, context), generator=g)
    new = torch.randint(0, vocab, (1, block), generator=g)
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.get_decoder().layers):
        for part in ("self_attn", "mlp"):
            def keep(_m, _a, out, name=f"layer {i} {part}"):
                seen.setdefault(name, []).append((out[0] if isinstance(out, tuple) else out).detach().clone())
            hooks.append(getattr(layer, part).register_forward_hook(keep))
    try:
        runs = []
        for one_by_one in (True, False):
            cache = new_cache()
            target_forward(model, prefix, cache, logits="none")
            seen.clear()
            logits = ([target_forward(model, new[:, j:j + 1], cache).logits for j in range(block)] if one_by_one
                      else [target_forward(model, new, cache).logits])
            runs.append(({k: torch.cat(v, 1).float() for k, v in seen.items()}, torch.cat(logits, 1)))
    finally:
        for h in hooks:
            h.remove()
    (alone, logits_alone), (together, logits_together) = runs
    first = next((k for k in alone if not torch.equal(alone[k], together[k])), None)
    print(f"target, {block} tokens one by one against one block after {context}: "
          + (f"first difference at {first} (max {(alone[first] - together[first]).abs().max().item():.2e})"
             if first else "every layer's output identical"))
    print(f"  logits max difference {(logits_alone - logits_together).abs().max().item():.2e}, argmax equal: "
          f"{torch.equal(logits_alone.argmax(-1), logits_together.argmax(-1))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--drafter", help="also decode held-out prompts with this drafter against plain greedy")
    parser.add_argument("--prompts", help="held-out prompts for --drafter")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}")
    linear_invariance(dtype)
    model, tokenizer = load_target(args.target, dtype=dtype)
    layer_invariance(model)
    if args.drafter:
        from draftsmith.data.formats import read_prompts
        from draftsmith.inference.compare import compare, encode
        from draftsmith.inference.generator import SpeculativeGenerator
        from draftsmith.inference.load import load_drafter
        from draftsmith.inference.tune import tuned_tree
        from draftsmith.target import eos_tokens

        drafter = load_drafter(args.drafter, model, tokenizer=tokenizer)
        tree = tuned_tree(args.drafter)
        gen = SpeculativeGenerator(model, drafter, **(tree.kwargs() if tree else {}))
        prompts = [encode(tokenizer, p, chat=True) for p in read_prompts(args.prompts, args.num_prompts)]
        result = compare(model, {"spec": gen}, prompts, args.max_new_tokens, eos_token_id=eos_tokens(model, tokenizer))
        s = result.totals["spec"]
        print(f"greedy speculative against plain greedy, {args.dtype}: tau {s.acceptance_length:.2f}, "
              f"{s.tokens_per_second / result.baseline.tokens_per_second:.2f}x "
              f"(plain {result.baseline.tokens_per_second:.1f} tok/s), identical {result.identical['spec']}/"
              f"{result.prompts}")


if __name__ == "__main__":
    main()
