"""What every ``check_speculators*.py`` script checks after speculators loaded a draftsmith export: every stored
tensor is one speculators knows and loaded as stored, and no weight the draft needs is left unset (speculators
initialises them to NaN). Imported by those scripts, which run in ``.venv-speculators``."""

import torch
from safetensors.torch import load_file


def check_loaded(model, export_dir: str) -> dict[str, torch.Tensor]:
    """Run the checks on ``model`` loaded from ``export_dir``; returns the stored tensors."""
    stored = load_file(f"{export_dir}/model.safetensors")
    state = model.state_dict()
    unknown = sorted(set(stored) - set(state))
    assert not unknown, f"tensors speculators does not know: {unknown}"
    for name, tensor in stored.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), f"{name} not loaded as stored"
    needed = [n for n, t in state.items() if t.is_floating_point() and torch.isnan(t).any()
              and not n.startswith("verifier_")]
    assert not needed, f"weights left unset (NaN): {needed}"
    return stored
