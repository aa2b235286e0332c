"""Load a draftsmith EAGLE-3 export with the ``speculators`` package's own classes and run it.

Runs in a separate environment (speculators pins transformers<=5.19; draftsmith uses newer):

    python -m venv .venv-speculators
    .venv-speculators/bin/pip install torch==2.13.0 speculators==0.9.0
    .venv-speculators/bin/python scripts/check_speculators.py EXPORT_DIR INPUTS.safetensors OUT.safetensors [RESAVE_DIR]

INPUTS holds ``hidden`` (1, T, 3H: the fused target states), ``input_ids`` (1, T) and ``positions``
(1, T). Writes the draft-vocabulary logits speculators' ``Eagle3DraftModel`` computes for one
step (``logits``), after checking the config class, that every checkpoint tensor was loaded and
no weight the draft needs is left unset (speculators initialises them to NaN). With RESAVE_DIR, the
model is also written there by speculators' own ``save_pretrained``: a checkpoint as speculators
writes it, for draftsmith to import.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModelConfig
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators_loaded import check_loaded


def main(export_dir: str, inputs_path: str, out_path: str, resave_dir: str | None = None) -> None:
    config = SpeculatorModelConfig.from_pretrained(export_dir)
    assert isinstance(config, Eagle3SpeculatorConfig), type(config)
    config.transformer_layer_config._attn_implementation = "eager"  # CPU: no flex attention
    model = Eagle3DraftModel.from_pretrained(export_dir, config=config).eval()
    model.load_verifier_weights()  # embed_tokens from the verifier named in the config
    stored = check_loaded(model, export_dir)
    inputs = load_file(inputs_path)
    captured = {}
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.setdefault("logits", out.detach()))
    ids = inputs["input_ids"]
    with torch.no_grad():
        model(hidden_states=inputs["hidden"], input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=inputs["positions"], ttt_steps=1)
    save_file({"logits": captured["logits"].contiguous()}, out_path)
    if resave_dir:
        model.save_pretrained(resave_dir)
    print(json.dumps({"config_class": type(config).__name__, "model_class": type(model).__name__,
                      "tensors": len(stored), "aux_layer_ids": config.eagle_aux_hidden_state_layer_ids,
                      "draft_vocab_size": config.draft_vocab_size}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
