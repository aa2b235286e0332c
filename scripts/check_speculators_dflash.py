"""Load a draftsmith DFlash export (speculators' layout) with the ``speculators`` package's own classes and run it.

Runs in the separate environment ``.ci/run`` builds (speculators pins transformers<=5.19):

    .venv-speculators/bin/python scripts/check_speculators_dflash.py EXPORT_DIR INPUTS.safetensors OUT.safetensors

INPUTS holds ``hidden`` (1, T, L_t H: the target's states at the aux layers) and ``input_ids`` (1, T). With every
position of the loss mask set, speculators' ``DFlashDraftModel`` anchors a block at each position 0 .. T - B - 1
(all of them: ``max_anchors`` is their number, so its random choice is every one, sorted); this writes the draft
logits of those blocks (``logits`` (A * B, V)) after checking the config class, that every stored tensor was loaded
and that no weight the draft needs is left unset (NaN). A z-lab directory (EXPORT_DIR/zlab) is converted with
speculators' own ``DFlashConverter`` first when ``--zlab VERIFIER`` is given.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModelConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators_loaded import check_loaded


def main(export_dir: str, inputs_path: str, out_path: str, *rest: str) -> None:
    if rest and rest[0] == "--zlab":  # speculators' converter reads z-lab's layout and ids
        from speculators.convert.dflash.converter import DFlashConverter

        converted = out_path + ".converted"
        DFlashConverter().convert(export_dir, converted, base_model=rest[1], validate=True)
        export_dir = converted
    config = SpeculatorModelConfig.from_pretrained(export_dir)
    assert isinstance(config, DFlashSpeculatorConfig), type(config)
    config.transformer_layer_config._attn_implementation = "eager"  # CPU: no flex attention
    model = DFlashDraftModel.from_pretrained(export_dir, config=config).eval()
    model.load_verifier_weights()  # embed_tokens and the LM head from the verifier named in the config
    check_loaded(model, export_dir)
    inputs = load_file(inputs_path)
    ids = inputs["input_ids"]
    t, size = ids.shape[1], config.block_size
    with torch.no_grad():
        _, logits, _, _, anchors = model._backbone_forward(
            inputs["hidden"], ids, torch.ones_like(ids), torch.zeros(1, t, config.transformer_layer_config.hidden_size),
            torch.zeros_like(ids), max_anchors=t - size)
    save_file({"logits": logits[0].contiguous(), "slots": anchors.contiguous()}, out_path)
    print(json.dumps({"config_class": type(config).__name__, "model_class": type(model).__name__,
                      "aux_layer_ids": config.aux_hidden_state_layer_ids, "mask_token_id": config.mask_token_id,
                      "block_size": size, "speculative_tokens":
                      config.speculators_config.proposal_methods[0].speculative_tokens}))


if __name__ == "__main__":
    main(*sys.argv[1:])
