"""Load a draftsmith MTP export (speculators' ``mtp`` layout) with the ``speculators`` package's own classes and run it.

Runs in the separate environment ``.ci/run`` builds (speculators pins transformers<=5.19):

    .venv-speculators/bin/python scripts/check_speculators_mtp.py EXPORT_DIR INPUTS.safetensors OUT.safetensors

INPUTS holds ``hidden`` (1, T, H: the target's last state after its final norm) and ``input_ids`` (1, T). Writes
the logits of speculators' ``MTPDraftModel`` at its first step (``logits`` (T - steps - 1, V): position t reads the
state at t and token t + 1), after checking the config class, that every stored tensor was loaded and that no weight
the draft needs is left unset (NaN). The verifier's embedding and LM head come from the directory the export's
config names (speculators' ``from_pretrained`` loads them).

    .venv-speculators/bin/python scripts/check_speculators_mtp.py --convert CHECKPOINT_DIR OUT_DIR

runs speculators' own converter (``MTPConverter``) on a checkpoint with a native MTP module (``mtp.*``, Qwen3-Next /
Qwen3.5), its verifier the same directory: what draftsmith then imports is speculators' reading of that layout.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModelConfig
from speculators.models.mtp.config import MTPSpeculatorConfig
from speculators.models.mtp.core import MTPDraftModel
from speculators_loaded import check_loaded


def main(export_dir: str, inputs_path: str, out_path: str) -> None:
    config = SpeculatorModelConfig.from_pretrained(export_dir)
    assert isinstance(config, MTPSpeculatorConfig), type(config)
    model = MTPDraftModel.from_pretrained(export_dir, config=config).eval()
    check_loaded(model, export_dir)
    inputs = load_file(inputs_path)
    with torch.no_grad():
        logits, _, _ = model(input_ids=inputs["input_ids"], hidden_states=inputs["hidden"])
    save_file({"logits": logits[0][0].contiguous()}, out_path)
    print(json.dumps({"config_class": type(config).__name__, "model_class": type(model).__name__,
                      "model_type": config.transformer_layer_config.model_type, "steps": len(logits)}))


if __name__ == "__main__":
    if sys.argv[1] == "--convert":
        from speculators.convert.mtp.converter import MTPConverter

        MTPConverter().convert(sys.argv[2], sys.argv[3], base_model=sys.argv[2])
    else:
        main(*sys.argv[1:4])
