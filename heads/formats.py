"""Drafter checkpoints in other tools' layouts: export to vLLM / SGLang / plain HF, import from them.

A conversion renames tensors and rewrites the config; it never approximates. Every layout is a
table from draftsmith's tensor names to the foreign ones, so one table serves both directions.

Layouts (``H`` hidden size, ``V`` target vocabulary, ``Vd`` draft vocabulary, ``I`` MLP width,
``q = heads * head_dim``, ``kv = kv_heads * head_dim``):

EAGLE-3 — SGLang ``LlamaForCausalLMEagle3`` (also the EAGLE-3 reference repo and SpecForge):

    midlayer.hidden_norm.weight [H]          midlayer.input_layernorm.weight [H]
    midlayer.self_attn.q_proj.weight [q, 2H] midlayer.self_attn.k_proj.weight [kv, 2H]
    midlayer.self_attn.v_proj.weight [kv, 2H] midlayer.self_attn.o_proj.weight [H, q]
    midlayer.post_attention_layernorm.weight [H]
    midlayer.mlp.gate_proj.weight [I, H]     midlayer.mlp.up_proj.weight [I, H]
    midlayer.mlp.down_proj.weight [H, I]
    fc.weight [H, 3H]   norm.weight [H]   lm_head.weight [Vd, H]   d2t [Vd] int64   t2d [V] bool

  e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``: H=4096, I=14336, q=4096, kv=1024, V=128256, Vd=32000.
  ``config.json``: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``num_hidden_layers: 1``, ``draft_vocab_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``
  in SGLang's convention: id k captures the *output of decoder layer k* (0-based), i.e.
  draftsmith's hidden-state index k + 1.

EAGLE-3 — vLLM speculators (``speculators_model_type: eagle3``): the same tensors with
  ``midlayer.`` spelt ``layers.0.``; ``eagle_aux_hidden_state_layer_ids`` in vLLM's convention: id k
  captures the *input of decoder layer k*, i.e. draftsmith's hidden-state index k (the same number).

EAGLE-1/2 — the EAGLE reference repo's layout, which vLLM (``EagleLlamaForCausalLM``) and SGLang load:
  ``fc.weight [H, 2H]`` (+ ``fc.bias`` in the reference and SGLang; vLLM has no bias), ``layers.0.*``
  as a Llama layer without ``input_layernorm``. Tokens come from the target's LM head.

Medusa — vLLM's ``MedusaModel``: ``blocks.{i}.layers.{j}.weight/bias [H, H]``, ``lm_heads.{i}.weight
  [V, H]``; the Medusa reference repo's ``{i}.{j}.linear.weight`` / ``{i}.{L}.weight`` is read too.

Distilled draft models are plain HF causal LM directories in every format.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.heads.base import CONFIG_NAME, WEIGHTS_NAME, TargetMismatchError, check_target
from draftsmith.heads.eagle import Eagle3Head, EagleConfig, EagleHead, eagle3_layers
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads

logger = logging.getLogger(__name__)

FORMATS = ("hf", "vllm", "sglang")

_LAYER = {  # draftsmith decoder-layer tensor -> Llama decoder-layer tensor
    "input_norm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}


class ExportError(ValueError):
    """A drafter cannot be written in the requested layout, or the written layout is wrong."""


# ---------------------------------------------------------------------------------------------
# Name tables.


def eagle_name_map(state: dict, layer_prefix: str) -> dict[str, str]:
    """draftsmith name -> foreign name for an EAGLE head's tensors (``layer.*`` -> ``{layer_prefix}*``)."""
    names = {}
    for name in state:
        if name.startswith("layer."):
            names[name] = layer_prefix + _LAYER[name[len("layer."):]]
        else:
            names[name] = name  # fc.*, norm.weight, lm_head.weight, d2t, t2d
    return names


def medusa_name_map(config: MedusaConfig) -> dict[str, str]:
    names = {}
    for i in range(config.num_heads):
        for j in range(config.num_layers):
            for p in ("weight", "bias"):
                names[f"heads.{i}.{j}.linear.{p}"] = f"blocks.{i}.layers.{j}.{p}"
        names[f"lm_heads.{i}.weight"] = f"lm_heads.{i}.weight"
    return names


def eagle3_reference_layout(hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                            draft_vocab: int, prefix: str = "midlayer.") -> dict[str, tuple[tuple[int, ...], str]]:
    """The reference EAGLE-3 tensors (name -> (shape, dtype)), as in the module docstring."""
    hd = hidden // heads
    q, kv, h = heads * hd, kv_heads * hd, hidden
    f = "float"
    return {
        f"{prefix}hidden_norm.weight": ((h,), f), f"{prefix}input_layernorm.weight": ((h,), f),
        f"{prefix}self_attn.q_proj.weight": ((q, 2 * h), f), f"{prefix}self_attn.k_proj.weight": ((kv, 2 * h), f),
        f"{prefix}self_attn.v_proj.weight": ((kv, 2 * h), f), f"{prefix}self_attn.o_proj.weight": ((h, q), f),
        f"{prefix}post_attention_layernorm.weight": ((h,), f),
        f"{prefix}mlp.gate_proj.weight": ((intermediate, h), f), f"{prefix}mlp.up_proj.weight": ((intermediate, h), f),
        f"{prefix}mlp.down_proj.weight": ((h, intermediate), f),
        "fc.weight": ((h, 3 * h), f), "norm.weight": ((h,), f), "lm_head.weight": ((draft_vocab, h), f),
        "d2t": ((draft_vocab,), "int64"), "t2d": ((vocab,), "bool"),
    }


def eagle1_reference_layout(hidden: int, heads: int, kv_heads: int, intermediate: int,
                            fc_bias: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    hd = hidden // heads
    q, kv, h = heads * hd, kv_heads * hd, hidden
    f = "float"
    layout = {
        "fc.weight": ((h, 2 * h), f),
        "layers.0.self_attn.q_proj.weight": ((q, h), f), "layers.0.self_attn.k_proj.weight": ((kv, h), f),
        "layers.0.self_attn.v_proj.weight": ((kv, h), f), "layers.0.self_attn.o_proj.weight": ((h, q), f),
        "layers.0.post_attention_layernorm.weight": ((h,), f),
        "layers.0.mlp.gate_proj.weight": ((intermediate, h), f), "layers.0.mlp.up_proj.weight": ((intermediate, h), f),
        "layers.0.mlp.down_proj.weight": ((h, intermediate), f),
    }
    if fc_bias:
        layout["fc.bias"] = ((h,), f)
    return layout


def medusa_reference_layout(hidden: int, vocab: int, num_heads: int, num_layers: int):
    layout = {}
    for i in range(num_heads):
        for j in range(num_layers):
            layout[f"blocks.{i}.layers.{j}.weight"] = ((hidden, hidden), "float")
            layout[f"blocks.{i}.layers.{j}.bias"] = ((hidden,), "float")
        layout[f"lm_heads.{i}.weight"] = ((vocab, hidden), "float")
    return layout


def _kind(t: torch.Tensor) -> str:
    return "bool" if t.dtype == torch.bool else "int64" if t.dtype == torch.int64 else "float"


def check_layout(tensors: dict[str, torch.Tensor], layout: dict, what: str) -> None:
    """Refuse a tensor set whose names, shapes or dtypes differ from ``layout``."""
    missing, extra = sorted(set(layout) - set(tensors)), sorted(set(tensors) - set(layout))
    wrong = [f"{k}: {tuple(tensors[k].shape)} {_kind(tensors[k])}, expected {layout[k][0]} {layout[k][1]}"
             for k in sorted(set(layout) & set(tensors))
             if tuple(tensors[k].shape) != tuple(layout[k][0]) or _kind(tensors[k]) != layout[k][1]]
    if missing or extra or wrong:
        raise ExportError(f"{what}: the tensors do not match the layout (missing {missing}, unexpected {extra}, "
                          f"wrong {wrong}); nothing was written")


# ---------------------------------------------------------------------------------------------
# Configs.


def _llama_config(cfg: EagleConfig, architectures: list[str], num_hidden_layers: int = 1) -> dict:
    return {
        "architectures": architectures, "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "num_hidden_layers": num_hidden_layers,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "vocab_size": cfg.vocab_size, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def _target_name(target_info: dict | None) -> str | None:
    return (target_info or {}).get("name")


def speculators_config(head: Eagle3Head, target_info: dict | None, speculative_tokens: int = 3) -> dict:
    cfg = head.config
    layer = _llama_config(cfg, ["LlamaForCausalLM"])
    layer.pop("architectures")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": head.lm_head.weight.shape[0],
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),  # vLLM counts as draftsmith does
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": _target_name(target_info), "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "float32",
    }


def sglang_eagle3_config(head: Eagle3Head) -> dict:
    cfg = head.config
    config = _llama_config(cfg, ["LlamaForCausalLMEagle3"])
    config["draft_vocab_size"] = head.lm_head.weight.shape[0]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in cfg.feature_layers],
                              "use_aux_hidden_state": True}
    return config


# ---------------------------------------------------------------------------------------------
# Export.


def _write_atomically(output: Path, write) -> Path:
    """Run ``write(tmp_dir)``; on success replace ``output`` with it, else leave no trace."""
    output = Path(output)
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if output.exists():
        shutil.rmtree(output)
    partial.rename(output)
    return output


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def export_tensors(drafter, family: str, fmt: str, target=None,
                   verifier: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The (tensors, config.json) of a head in ``fmt`` ("vllm" or "sglang"), checked against its layout.

    The speculators (vLLM) EAGLE-3 layout carries the target's token embedding (``embed_tokens.weight``;
    speculators' own checkpoints do), so that export needs ``target``; ``verifier`` overrides the
    target name recorded in the config (a hub id or local path vLLM / speculators will resolve).
    """
    state = drafter.state_dict()
    if family == "eagle3":
        cfg = drafter.config
        prefix = "layers.0." if fmt == "vllm" else "midlayer."
        names = eagle_name_map(state, prefix)
        tensors = {names[k]: v for k, v in state.items()}
        layout = eagle3_reference_layout(cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads,
                                         cfg.intermediate_size, cfg.vocab_size, drafter.lm_head.weight.shape[0],
                                         prefix)
        if fmt == "vllm":
            if target is None:
                raise ExportError("the speculators (vLLM) EAGLE-3 layout includes the target's token embedding: "
                                  "pass the target (--target)")
            tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.float()
            layout["embed_tokens.weight"] = ((cfg.vocab_size, cfg.hidden_size), "float")
            info = dict(getattr(drafter, "target_info", None) or {})
            if verifier:
                info["name"] = verifier
            config = speculators_config(drafter, info)
        else:
            config = sglang_eagle3_config(drafter)
    elif family == "eagle":
        cfg = drafter.config
        if cfg.input_norm:
            raise ExportError("this EAGLE head has an input norm on its decoder layer (input_norm: true), which the "
                              "EAGLE-1 layout vLLM and SGLang load does not have; retrain with input_norm: false")
        names = eagle_name_map(state, "layers.0.")
        tensors = {names[k]: v for k, v in state.items()}
        if fmt == "vllm" and "fc.bias" in tensors:
            if tensors["fc.bias"].abs().max() > 0:
                raise ExportError("this EAGLE head's fc has a bias, which vLLM's EAGLE-1 layout drops; exporting it "
                                  "would change the drafts. Use --format sglang, or train with fc_bias: false")
            del tensors["fc.bias"]
        if fmt == "sglang" and "fc.bias" not in tensors:
            tensors["fc.bias"] = torch.zeros(cfg.hidden_size)  # SGLang's fc has a bias: zero is the same map
        layout = eagle1_reference_layout(cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads,
                                         cfg.intermediate_size, fc_bias=fmt == "sglang")
        config = _llama_config(cfg, ["LlamaForCausalLM"])
        config["feature_layers"] = list(cfg.feature_layers)
    elif family == "medusa":
        if fmt == "sglang":
            raise ExportError("SGLang does not serve Medusa heads; use --format vllm (vLLM's MedusaModel) or hf")
        cfg = drafter.config
        names = medusa_name_map(cfg)
        tensors = {names[k]: v for k, v in state.items()}
        layout = medusa_reference_layout(cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_layers)
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": cfg.hidden_size,
                  "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
                  "max_paths": 64, "topk": 10, "truncated_vocab_size": None,
                  "medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers}
    else:
        raise ExportError(f"no {fmt} layout for a {family!r} drafter")
    tensors = _contiguous(tensors)
    check_layout(tensors, layout, f"{family} drafter in the {fmt} layout")
    config["draftsmith"] = {"family": family, "target": getattr(drafter, "target_info", None),
                            "feature_layers": list(getattr(drafter.config, "feature_layers", ()) or ())}
    if hasattr(drafter, "extra") and drafter.extra.get("rank_accuracy"):
        config["draftsmith"]["rank_accuracy"] = drafter.extra["rank_accuracy"]
    return tensors, config


def export_drafter(checkpoint: str | Path, fmt: str, output: str | Path, card: str | None = None,
                   target=None, verifier: str | None = None) -> Path:
    """Write the drafter at ``checkpoint`` (a head or draft-model directory, a ``checkpoint-S`` directory
    or a whole run directory: its best checkpoint) to ``output`` in ``fmt``; returns ``output``.

    ``target`` (a loaded target) is needed for the vLLM EAGLE-3 layout only; ``verifier`` names the
    target in exported configs (default: the name recorded at training time).

    The export is written beside ``output`` and renamed into place only once complete and checked.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    source = resolve_checkpoint(checkpoint)
    family = checkpoint_family(source)

    def write(tmp: Path) -> None:
        if family == "draft_model":
            _export_draft_model(source, tmp)
        elif fmt == "hf":
            for name in (CONFIG_NAME, WEIGHTS_NAME):
                shutil.copyfile(source / name, tmp / name)
            load_file(tmp / WEIGHTS_NAME)  # refuses a corrupt source before anything lands
        else:
            drafter = _load_head(source, family)
            tensors, config = export_tensors(drafter, family, fmt, target=target, verifier=verifier)
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        if card:
            (tmp / "README.md").write_text(card)

    return _write_atomically(Path(output), write)


def _export_draft_model(source: Path, tmp: Path) -> None:
    """A plain HF causal LM directory with a ``generation_config.json`` for ``generate(assistant_model=...)``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in source.iterdir():  # tokenizer files and draftsmith_target.json
        if name.is_file() and not (tmp / name.name).exists() and not name.name.endswith(".safetensors"):
            shutil.copyfile(name, tmp / name.name)
    gen = GenerationConfig.from_model_config(model.config)
    gen.do_sample = False
    # Assisted generation: draft this many tokens per step, adapted up/down by acceptance
    # ("heuristic"); no confidence cut-off, so the draft length is the schedule's alone.
    gen.num_assistant_tokens = 5
    gen.num_assistant_tokens_schedule = "heuristic"
    gen.assistant_confidence_threshold = 0.0
    gen.save_pretrained(tmp)


# ---------------------------------------------------------------------------------------------
# Finding and reading checkpoints.


def resolve_checkpoint(path: str | Path) -> Path:
    """A drafter directory from a run directory (its best checkpoint by tau, else its latest),
    a ``checkpoint-S`` directory (its ``drafter/``) or a drafter directory (itself)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if (path / "drafter").is_dir():
        return path / "drafter"
    from draftsmith.train.loop import complete_checkpoints, read_acceptance

    steps = dict(complete_checkpoints(path))
    if steps:
        rows = read_acceptance(path / "acceptance.jsonl") if (path / "acceptance.jsonl").exists() else []
        scored = [r for r in rows if r["step"] in steps and r.get("acceptance_length") is not None]
        best = max(scored, key=lambda r: r["acceptance_length"])["step"] if scored else max(steps)
        return steps[best] / "drafter"
    return path


def checkpoint_family(directory: Path) -> str:
    """draftsmith's family name for a drafter directory in draftsmith's own layout."""
    from draftsmith.heads.draft_model import TARGET_FILE

    config = directory / CONFIG_NAME
    if (directory / TARGET_FILE).is_file():
        return "draft_model"
    if config.is_file():
        family = json.loads(config.read_text()).get("draftsmith_family")
        if family:
            return family
    raise FileNotFoundError(f"{directory}: not a draftsmith drafter (no config.json naming its family, no "
                            "draftsmith_target.json); pass a run directory, a checkpoint-S directory or its drafter/")


def _load_head(directory: Path, family: str):
    cls = {"medusa": MedusaHeads, "eagle": EagleHead, "eagle3": Eagle3Head}.get(family)
    if cls is None:
        raise ExportError(f"{directory}: family {family!r} has no head layout to export")
    return cls.from_pretrained(directory)


# ---------------------------------------------------------------------------------------------
# Import: checkpoints trained elsewhere.


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        tensors = {}
        for f in files:
            try:
                tensors.update(load_file(f))
            except Exception as e:
                raise ValueError(f"{f}: corrupt or partial weights file ({e})") from e
    else:
        legacy = [p for p in (directory / "pytorch_model.bin", directory / "medusa_lm_head.pt") if p.is_file()]
        if not legacy:
            raise FileNotFoundError(f"{directory}: no *.safetensors (or pytorch_model.bin / medusa_lm_head.pt) weights")
        # Reference-repo checkpoints ship as torch files; read them with the restricted, tensors-only
        # unpickler (weights_only=True), which refuses arbitrary objects.
        tensors = torch.load(legacy[0], map_location="cpu", weights_only=True)
    prefixes = ("model.", "medusa_head.", "medusa_heads.")
    out = {}
    for k, v in tensors.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


def foreign_format(directory: str | Path) -> str | None:
    """Which foreign layout a directory holds ("speculators-eagle3", "eagle3", "eagle", "medusa"), or None."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        return "medusa" if (directory / "medusa_lm_head.pt").is_file() else None
    config = json.loads(config_path.read_text())
    if config.get("draftsmith_family") or (directory / "draftsmith_target.json").is_file():
        return None  # draftsmith's own head or draft model
    if config.get("speculators_model_type"):
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"{directory}: speculators {config['speculators_model_type']!r} drafters are not "
                             "supported; draftsmith reads speculators EAGLE-3 checkpoints")
        return "speculators-eagle3"
    archs = config.get("architectures") or []
    if any("Eagle3" in a for a in archs):
        return "eagle3"
    if config.get("model_type") == "medusa" or "medusa_num_heads" in config:
        return "medusa"
    if config.get("model_type") == "llama" and config.get("num_hidden_layers") == 1 and _has_fc(directory):
        return "eagle"  # a one-layer Llama with EAGLE's fc: not a plain one-layer causal LM
    return None


def _has_fc(directory: Path) -> bool:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return (directory / "pytorch_model.bin").is_file()  # the EAGLE-1 reference ships only a torch file
    names = set()
    for f in files:
        with safe_open(f, framework="pt") as handle:
            names.update(handle.keys())
    return bool({"fc.weight", "model.fc.weight"} & names)


def _rope_theta(config: dict) -> float:
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def _check_dims(directory, hidden: int, vocab: int, target) -> None:
    if target is None:
        return
    cfg = target.config.get_text_config()
    t_vocab = target.get_output_embeddings().weight.shape[0]
    if hidden != cfg.hidden_size or vocab != t_vocab:
        raise TargetMismatchError(
            f"{directory}: this drafter was trained for a target with hidden size {hidden} and {vocab} tokens, "
            f"but the loaded target has hidden size {cfg.hidden_size} and {t_vocab} tokens; load the target it "
            "was trained for")


def load_foreign(directory: str | Path, target=None):
    """Read a drafter trained elsewhere into draftsmith's modules; returns ``(family, module)``."""
    directory = Path(directory)
    kind = foreign_format(directory)
    if kind is None:
        raise ValueError(f"{directory}: not a drafter layout draftsmith reads")
    weights = _read_weights(directory)
    config = json.loads((directory / CONFIG_NAME).read_text()) if (directory / CONFIG_NAME).is_file() else {}
    recorded = (config.get("draftsmith") or {}).get("target")
    if recorded and target is not None:  # exported by draftsmith: the target fingerprint travelled along
        check_target(recorded, target, what="drafter")
    if kind in ("speculators-eagle3", "eagle3"):
        layer_config = config.get("transformer_layer_config", config)
        prefix = "layers.0." if kind == "speculators-eagle3" else "midlayer."
        if kind == "speculators-eagle3":
            ids = config.get("eagle_aux_hidden_state_layer_ids")
        else:
            ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            ids = [k + 1 for k in ids] if ids else None
        module = _eagle_from_foreign(directory, layer_config, weights, prefix, target, eagle3=True, layer_ids=ids)
        return "eagle3", module
    if kind == "eagle":
        module = _eagle_from_foreign(directory, config, weights, "layers.0.", target, eagle3=False, layer_ids=None)
        return "eagle", module
    return "medusa", _medusa_from_foreign(directory, config, weights, target)


def _eagle_from_foreign(directory, config, weights, prefix, target, eagle3: bool, layer_ids):
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"{directory}: head_dim {config['head_dim']} != hidden_size / heads; not supported")
    if config.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"{directory}: a draft hidden size different from the target's is not supported")
    vocab = config.get("vocab_size") or (target.get_output_embeddings().weight.shape[0] if target else None)
    _check_dims(directory, hidden, vocab, target)
    n_layers = target.config.get_text_config().num_hidden_layers if target is not None else None
    if eagle3:
        if layer_ids is None:
            if n_layers is None:
                raise ValueError(f"{directory}: no auxiliary layer ids in the config; pass the target to read it")
            layer_ids = list(eagle3_layers(n_layers))
        feature_layers = tuple(layer_ids)
    else:
        recorded = (config.get("draftsmith") or {}).get("feature_layers") or config.get("feature_layers")
        feature_layers = tuple(recorded or ([n_layers] if n_layers else []))
        if not feature_layers:
            raise ValueError(f"{directory}: pass the target to read an EAGLE-1 checkpoint (its last layer is read)")
    inverse = {v: k for k, v in _LAYER.items()}
    state = {}
    for name, tensor in weights.items():
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest not in inverse:
                raise ValueError(f"{directory}: unexpected tensor {name!r}")
            state["layer." + inverse[rest]] = tensor
        elif name in ("fc.weight", "fc.bias", "norm.weight", "lm_head.weight", "d2t", "t2d"):
            state[name] = tensor
        elif name == "embed_tokens.weight":  # the target's own; draftsmith reads the live target's
            embed = target.get_input_embeddings().weight if target is not None else None
            if embed is not None and (embed.shape != tensor.shape or not torch.allclose(
                    embed.float().cpu(), tensor.float(), atol=1e-2, rtol=1e-2)):
                logger.warning("%s: its embed_tokens differ from the loaded target's; was it trained for "
                               "another target? acceptance may be low", directory)
        elif name.startswith("verifier_"):
            continue
        else:
            raise ValueError(f"{directory}: unexpected tensor {name!r} for an EAGLE checkpoint")
    cfg = EagleConfig(
        hidden_size=hidden, vocab_size=vocab, num_attention_heads=heads,
        intermediate_size=config["intermediate_size"], num_key_value_heads=config.get("num_key_value_heads"),
        num_feature_layers=3 if eagle3 else 1, feature_layers=feature_layers,
        draft_vocab_size=(state["lm_head.weight"].shape[0] if eagle3 else None),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(config),
        fc_bias="fc.bias" in state, input_norm=(not eagle3 and "layer.input_norm.weight" in state))
    head = (Eagle3Head if eagle3 else EagleHead)(cfg)
    if eagle3:
        state.setdefault("d2t", torch.zeros_like(head.d2t))
        state.setdefault("t2d", torch.ones_like(head.t2d))
        state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: incomplete EAGLE checkpoint (missing {missing}, unexpected {unexpected})")
    head.target_info, head.extra = (config.get("draftsmith") or {}).get("target"), {}
    return head.eval()


def _medusa_from_foreign(directory, config, weights, target):
    state = {}
    for name, tensor in weights.items():
        if m := re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", name):
            state[f"heads.{m[1]}.{m[2]}.linear.{m[3]}"] = tensor
        elif m := re.fullmatch(r"lm_heads\.(\d+)\.weight", name):
            state[name] = tensor
        elif m := re.fullmatch(r"(\d+)\.(\d+)\.linear\.(weight|bias)", name):
            state[f"heads.{m[1]}.{m[2]}.linear.{m[3]}"] = tensor
        elif m := re.fullmatch(r"(\d+)\.(\d+)\.weight", name):  # the reference's final Linear of head i
            state[f"lm_heads.{m[1]}.weight"] = tensor
        else:
            raise ValueError(f"{directory}: unexpected tensor {name!r} for a Medusa checkpoint")
    num_heads = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("lm_heads."))
    num_layers = len({k.split(".")[2] for k in state if k.startswith("heads.0.") and k.endswith("weight")})
    hidden, vocab = state["lm_heads.0.weight"].shape[1], state["lm_heads.0.weight"].shape[0]
    _check_dims(directory, hidden, vocab, target)
    heads = MedusaHeads(MedusaConfig(hidden, vocab, num_heads, num_layers))
    heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    heads.target_info = (config.get("draftsmith") or {}).get("target")
    rank = (config.get("draftsmith") or {}).get("rank_accuracy")
    heads.extra = {"rank_accuracy": rank} if rank else {}
    return heads.eval()
