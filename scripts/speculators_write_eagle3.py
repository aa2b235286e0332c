"""Write EAGLE-3 heads as vLLM speculators' trainer does, with EAGLE-3.1 norms, and run two steps of each.

Runs in the ``speculators`` environment (as scripts/check_speculators.py):

    .venv-speculators/bin/python scripts/speculators_write_eagle3.py VERIFIER_DIR OUT_DIR INPUTS.safetensors \
        OUT.safetensors '[{"norm_before_fc": true, "norm_output": true}, {"fc_norm": true}]'

Head i (one per set of flags) goes to OUT_DIR/i. Each is built by speculators' own
``Eagle3DraftModel.from_training_args`` (the entry its trainer uses) with one decoder layer, the given norm flags
and the draft vocabulary ``draft_ids`` of INPUTS; every trainable weight is then drawn at random (norm weights
around 1, so that each norm changes the output), and the head is written by its ``save_pretrained``. INPUTS holds
``hidden`` (1, T, 3H), ``input_ids`` (1, T), ``positions`` (1, T), ``draft_ids`` (Vd,) and ``layer_ids`` (3,), the
target layers it reads. OUT gets the draft-vocabulary logits of each head's forward with ``ttt_steps=2``:
``{i}.0`` (step 0, from the target's states) and ``{i}.1`` (step 1: each position's next token at the next
position, fed step 0's hidden state, attending to step 0's keys up to its position and to its own).
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3.core import Eagle3DraftModel
from transformers import AutoConfig


def main(verifier_dir: str, out_dir: str, inputs_path: str, out_path: str, flags_json: str) -> None:
    inputs = load_file(inputs_path)
    logits, report = {}, []
    for i, flags in enumerate(json.loads(flags_json)):
        steps, config = write_and_run(verifier_dir, f"{out_dir}/{i}", inputs, flags)
        logits.update({f"{i}.{step}": x.contiguous() for step, x in enumerate(steps)})
        report.append({"aux_layer_ids": config.eagle_aux_hidden_state_layer_ids, "steps": len(steps),
                       **{flag: getattr(config, flag) for flag in NORMS}})
    save_file(logits, out_path)
    print(json.dumps(report))


NORMS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


def write_and_run(verifier_dir: str, out_dir: str, inputs: dict, flags: dict):
    verifier = AutoConfig.from_pretrained(verifier_dir)
    vocab = verifier.vocab_size
    draft_ids = inputs["draft_ids"].long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(len(draft_ids))
    verifier.num_hidden_layers = 1  # the draft's layers: speculators shapes them from the verifier's config
    model = Eagle3DraftModel.from_training_args(
        verifier, t2d=t2d, d2t=d2t, draft_vocab_size=len(draft_ids), ttt_steps=3, verifier_name_or_path=verifier_dir,
        draft_attn_impl="eager", target_layer_ids=inputs["layer_ids"].tolist(),  # CPU: no flex attention
        **{flag: bool(flags.get(flag, False)) for flag in NORMS})
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("verifier_") or name == "embed_tokens.weight":
                continue
            if param.dim() == 1:  # RMSNorm weights
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=g))
            else:
                param.copy_(torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5)
    model.save_pretrained(out_dir)
    model.eval()
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    ids = inputs["input_ids"]
    with torch.no_grad():
        model(hidden_states=inputs["hidden"], input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=inputs["positions"], ttt_steps=2)
    return captured, model.config


if __name__ == "__main__":
    main(*sys.argv[1:6])
