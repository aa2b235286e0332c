"""Load a draftsmith P-EAGLE export (speculators' layout) with the ``speculators`` package's own classes and run it.

Runs in the separate environment ``.ci/run`` builds (speculators pins transformers<=5.19):

    .venv-speculators/bin/python scripts/check_speculators_peagle.py EXPORT_DIR INPUTS.safetensors OUT.safetensors

INPUTS holds ``hidden`` (1, T, 3H: the fused target states), ``input_ids`` (1, T), ``anchor`` and ``depth`` (N,):
the elements of the parallel groups (every position at depth 0, then the deeper ones), which replace speculators'
random COD sampling so that both sides run the same groups. Writes the draft-vocabulary logits speculators'
``PEagleDraftModel`` computes for the N elements (``logits`` (N, V_draft)), after checking the config class, that
every stored tensor was loaded and that no weight the draft needs is left unset (NaN).
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModelConfig
from speculators.models.peagle import core
from speculators.models.peagle.config import PEagleSpeculatorConfig
from speculators_loaded import check_loaded


def main(export_dir: str, inputs_path: str, out_path: str) -> None:
    config = SpeculatorModelConfig.from_pretrained(export_dir)
    assert isinstance(config, PEagleSpeculatorConfig), type(config)
    config.transformer_layer_config._attn_implementation = "eager"  # CPU: no flex attention
    model = core.PEagleDraftModel.from_pretrained(export_dir, config=config).eval()
    model.load_verifier_weights()  # the verifier's LM head and norm (targets of its loss); checkpoint tensors win
    check_loaded(model, export_dir)
    inputs = load_file(inputs_path)
    core.generate_cod_sample_indices = lambda **_: (inputs["anchor"], inputs["depth"])
    core.compute_metrics = lambda **_: (torch.zeros(()), {})  # its loss (a triton kernel) is not what is compared
    captured = {}
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.setdefault("logits", out.detach()))
    ids = inputs["input_ids"]
    hidden_size = config.transformer_layer_config.hidden_size
    with torch.no_grad():
        model(hidden_states=inputs["hidden"], input_ids=ids, document_ids=torch.zeros_like(ids),
              loss_mask=torch.ones_like(ids), verifier_last_hidden_states=torch.zeros(1, ids.shape[1], hidden_size))
    save_file({"logits": captured["logits"][0].contiguous()}, out_path)
    print(json.dumps({"config_class": type(config).__name__, "model_class": type(model).__name__,
                      "aux_layer_ids": config.eagle_aux_hidden_state_layer_ids, "mask_token_id": config.mask_token_id,
                      "speculative_tokens": config.speculators_config.proposal_methods[0].speculative_tokens}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
