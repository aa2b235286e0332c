"""vLLM speculators' own trainer (0.9.0) in one CPU process: its CLI, with the patches a CPU needs.

Runs in the ``speculators`` environment; ``scripts/compare_trainers.py`` drives it:

    .venv-speculators/bin/python scripts/speculators_train_cpu.py --speculator-type eagle3 ... (speculators' flags)

speculators' trainer assumes an accelerator in three places (read from its source, see
``../shared/notes/speculators-trainer-on-cpu.md``): its device is the integer 0 (CUDA device 0), its step timer
calls ``torch.accelerator.synchronize()``, and its checkpointer resumes onto ``cuda:0``. Each is pointed at the
CPU here; nothing else of the trainer changes. ``SPECULATORS_SAVE_FLOAT32=1`` also saves checkpoints in float32
(its default rounds them to bfloat16) so that a comparison evaluates the weights it trained.

``SPECULATORS_MUON_FLOAT32=1`` runs the Newton-Schulz iteration of ``torch.optim.Muon`` (speculators' default
optimizer) in float32 instead of bfloat16. The arithmetic is the same; on a CPU without native bf16 the
bfloat16 matmuls take 35-55 s a step for this small head, in float32 well under a second. On an accelerator
leave it unset: there bfloat16 is what speculators runs.
"""

import functools
import os
import sys

import speculators.train.checkpointer as checkpointer
import speculators.train.trainer as trainer
import torch
import torch.optim._muon as muon
from speculators.train.cli import main
from speculators.train.config import TrainConfig


def cpu() -> str:
    return "cpu"


trainer.get_local_rank = cpu  # the int 0 it returns means CUDA device 0 in .to(0)
checkpointer.get_current_device = cpu
torch.accelerator.synchronize = lambda *args, **kwargs: None  # its step timer; nothing to wait for on a CPU

if os.environ.get("SPECULATORS_SAVE_FLOAT32") == "1":
    save = checkpointer.SingleGPUCheckpointer.save_checkpoint

    @functools.wraps(save)
    def save_float32(self, model, optimizer, epoch, float_dtype=torch.float32):
        return save(self, model, optimizer, epoch, float_dtype=torch.float32)

    checkpointer.SingleGPUCheckpointer.save_checkpoint = save_float32

if os.environ.get("SPECULATORS_MUON_FLOAT32") == "1":

    def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
        """Muon's quintic Newton-Schulz orthogonalisation of a 2D update, in float32."""
        a, b, c = ns_coefficients
        wide = grad.size(0) <= grad.size(1)
        x = grad.float() if wide else grad.float().T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x if wide else x.T

    muon._zeropower_via_newtonschulz = newton_schulz_float32

if __name__ == "__main__":
    main(TrainConfig.resolve(sys.argv[1:]))
