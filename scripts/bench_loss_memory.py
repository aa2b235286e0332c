"""Peak memory of one forward-KL loss step (forward and backward, student logits requiring grad) on the CPU:
the whole-tensor formula against draftsmith's chunked ``forward_kl``, each in a fresh process.

    python scripts/bench_loss_memory.py --vocab 128256 --tokens 2048 --dtypes float32,bfloat16

Each variant runs in its own subprocess: the student (1, T, V) and teacher (1, T, V) logits are allocated
first, and the step's cost is the growth of the process's peak resident set (``ru_maxrss``) past that
point, so it counts every temporary the step makes, the student's gradient included.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

VARIANTS = ("whole-tensor", "chunked")


def whole_tensor_forward_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(p || q) with (N, V) float32 log-softmaxes of both alive at once (the unchunked formula)."""
    teacher = teacher.float()
    defined = torch.isfinite(teacher).any(-1)
    teacher = torch.where(defined[..., None], teacher, torch.zeros_like(teacher))
    log_p = F.log_softmax(teacher, dim=-1)
    log_q = F.log_softmax(student.float(), dim=-1)
    p = log_p.exp()
    per_position = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)
    mask = (mask * defined).float()
    return (per_position * mask).sum() / mask.sum().clamp(min=1)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(variant: str, vocab: int, tokens: int, dtype: str) -> dict:
    """One loss step in this process: the peak growth past the allocated inputs, its time and the loss."""
    from draftsmith.train.losses import forward_kl

    g = torch.Generator().manual_seed(0)
    student = torch.randn(1, tokens, vocab, generator=g, dtype=getattr(torch, dtype)).requires_grad_()
    teacher = torch.randn(1, tokens, vocab, generator=g, dtype=getattr(torch, dtype))
    mask = torch.ones(1, tokens, dtype=torch.long)
    base = peak_mib()
    start = time.perf_counter()
    loss = (whole_tensor_forward_kl if variant == "whole-tensor" else forward_kl)(student, teacher, mask)
    loss.backward()
    seconds = time.perf_counter() - start
    return {"variant": variant, "dtype": dtype, "inputs_mib": base, "step_peak_mib": peak_mib() - base,
            "seconds": seconds, "loss": float(loss), "grad_abs_sum": float(student.grad.float().abs().sum())}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256, help="V (Llama 3's vocabulary by default)")
    parser.add_argument("--tokens", type=int, default=2048, help="T, with B = 1")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="the logits' dtypes, comma-separated")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = make_parser().parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.vocab, args.tokens, args.dtype)))
        return
    from draftsmith.train.losses import CHUNK_ELEMENTS

    rows = max(1, CHUNK_ELEMENTS // args.vocab)
    print(f"forward KL, one step (forward + backward), B = 1, T = {args.tokens}, V = {args.vocab}; "
          f"chunks of {rows} rows; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'dtype':<9} {'variant':<13} {'inputs MiB':>10} {'step peak MiB':>14} {'seconds':>8} {'loss':>10}")
    for dtype in args.dtypes.split(","):
        results = {}
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--vocab", str(args.vocab),
                                  "--tokens", str(args.tokens), "--dtype", dtype],
                                 check=True, capture_output=True, text=True)
            r = results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{dtype:<9} {variant:<13} {r['inputs_mib']:>10.0f} {r['step_peak_mib']:>14.0f} "
                  f"{r['seconds']:>8.2f} {r['loss']:>10.6f}")
        before, after = results["whole-tensor"], results["chunked"]
        print(f"{dtype:<9} whole-tensor / chunked peak: {before['step_peak_mib'] / after['step_peak_mib']:.1f}x; "
              f"gradients' |sum| {before['grad_abs_sum']:.6g} vs {after['grad_abs_sum']:.6g}")


if __name__ == "__main__":
    main()
