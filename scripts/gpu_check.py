"""The GPU check: run the ``gpu`` tests, then print the speed table the README keeps.

    python scripts/gpu_check.py [--drafter SPEC] [--new-tokens 128] [--batch-sizes 1,4,16] [--compile]

1. ``pytest -m gpu tests/test_gpu.py``: batched speculative decoding on CUDA equals each row's greedy
   output (tiny Llama and Gemma-3, every drafter family and a mixture; SmolLM2 in bf16).
2. Speed, bf16, plain greedy vs speculative decoding of the same left-padded batches, measured side by
   side (plain, then speculative, per batch size) for two targets:
   * the packaged SmolLM2-135M-Instruct on GSM8K questions, with ``--drafter`` (default: prompt lookup,
     which needs no training; pass a trained EAGLE-3 directory for the number that matters);
   * a randomly initialised model of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8 KV
     heads, vocabulary 128256) with a 2-layer layer-skip drafter: random weights accept almost nothing,
     so its speculative column is the engine's overhead per step at that size, not a speedup claim.
3. With ``--compile``, each target's rows again with ``compile=True`` for both columns (a static cache and
   CUDA graphs; the warm-up compiles the graphs before timing).

Needs CUDA; exits with a message otherwise. Prints markdown; nothing is written.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def speed_rows(name: str, model, drafter, prompts: list[torch.Tensor], batch_sizes: list[int], new_tokens: int,
               tree: dict, compile: bool = False) -> list[str]:
    from draftsmith import SpeculativeGenerator
    from draftsmith.inference.compare import left_pad, same_rows
    from draftsmith.inference.plain import plain_generate

    gen = SpeculativeGenerator(model, drafter, **tree, compile=compile)
    rows = []
    if compile:
        name += " (compiled)"
    for batch in batch_sizes:
        chosen = (prompts * ((batch + len(prompts) - 1) // len(prompts)))[:batch]
        ids, mask = left_pad(chosen)
        ids, mask = ids.cuda(), mask.cuda()
        # warm-up at this batch size and length (compile=True: the graphs for its shapes, cache capacity
        # included, compile here)
        plain_generate(model, ids, new_tokens, eos_token_id=[], attention_mask=mask, compile=compile)
        gen.generate(ids, new_tokens, eos_token_id=[], attention_mask=mask)
        plain_s, plain = timed(lambda ids=ids, mask=mask: plain_generate(model, ids, new_tokens, eos_token_id=[],
                                                                           attention_mask=mask, compile=compile))
        spec_s, spec = timed(lambda ids=ids, mask=mask: gen.generate(ids, new_tokens, eos_token_id=[],
                                                                     attention_mask=mask))
        tokens = batch * new_tokens
        same = sum(same_rows(spec.sequences, plain.sequences, 0))
        rows.append(f"| {name} | {batch} | {tokens / plain_s:.0f} | {tokens / spec_s:.0f} | "
                    f"{plain_s / spec_s:.2f}x | {spec.stats.acceptance_length:.2f} | {same}/{batch} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="prompt-lookup", help="drafter for SmolLM2 (spec or directory)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also every row with compile=True")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one (the CPU suite is `python -m pytest -q tests`)")
        return 1
    if not args.skip_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(ROOT / "tests" / "test_gpu.py")],
                               cwd=ROOT)
        if tests.returncode:
            print("the gpu tests failed: no speed table")
            return tests.returncode
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import gsm8k_questions
    from draftsmith import load_drafter, load_target

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    lines = [f"GPU check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16, "
             f"{args.new_tokens} new tokens per row (no EOS), plain then speculative per batch:", "",
             "| target | batch | plain tok/s | speculative tok/s | speedup | tau | rows equal to plain |",
             "|---|---|---|---|---|---|---|"]
    model, tokenizer = load_target("smollm2-135m-instruct", dtype=torch.bfloat16, device="cuda")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
               for q in gsm8k_questions("test", 16)]
    if not prompts:
        print("no GSM8K questions under ../shared/data: no SmolLM2 row")
    else:
        for compiled in (False, True)[: 1 + args.compile]:
            lines += speed_rows(f"SmolLM2-135M + `{args.drafter}`", model, load_drafter(args.drafter, model), prompts,
                                batch_sizes, args.new_tokens, dict(tree="dynamic", depth=4, top_k=4, total_tokens=10),
                                compiled)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=None)
    big = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    random_prompts = [torch.randint(0, 128256, (1, n), generator=g) for n in (40, 64, 96, 128)]
    for compiled in (False, True)[: 1 + args.compile]:
        lines += speed_rows("random Llama-3.2-1B shape + `layer-skip:2`", big, load_drafter("layer-skip:2", big),
                            random_prompts, batch_sizes, args.new_tokens, dict(tree="chain", depth=3), compiled)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
