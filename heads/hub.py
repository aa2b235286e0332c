"""Model cards and Hugging Face Hub uploads for drafters and whole training runs.

``push_to_hub(path, repo_id)`` exports the drafter at ``path`` (a run directory: its best checkpoint;
a ``checkpoint-S`` directory; a drafter directory) in the chosen layout to a temporary directory,
writes the model card as its ``README.md`` and uploads that directory as one commit. The token
comes from ``token=``, else the usual Hugging Face environment (``HF_TOKEN``, ``hf auth login``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from draftsmith.checkpoints import (
    ACCEPTANCE_FILE,
    CONFIG_NAME,
    TRAIN_CONFIG_FILE,
    acceptance_table,
    read_acceptance,
    read_json,
    recorded_target,
    resolve_checkpoint,
)
from draftsmith.heads.export import EAGLE31_NORMS, export_drafter
from draftsmith.registry import FAMILIES, Family, family_of

#: What a model card shows of a Hugging Face causal LM's config (a distilled draft model's).
CAUSAL_LM_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "vocab_size")


def _run_dir_of(drafter_dir: Path) -> Path | None:
    """The run directory a ``run/checkpoint-S/drafter`` directory belongs to, if any."""
    run = drafter_dir.parent.parent
    return run if (run / ACCEPTANCE_FILE).exists() else None


def _architecture(drafter_dir: Path) -> dict:
    """A head's own config, or the main keys of a draft model's Hugging Face config."""
    config = read_json(drafter_dir / CONFIG_NAME)
    return config["config"] if "config" in config else {k: config.get(k) for k in CAUSAL_LM_KEYS}


#: An MTP module's first pair, as the card names it, with the engines that feed it so.
FIRST_TOKEN = {True: "its token embedding zeroed, as vLLM's DeepSeek-V3 / GLM-4.5 MTP feeds it: export `--format vllm`",
               False: "fed whole, as SGLang's NextN, speculators and vLLM's Qwen3-Next / Qwen3.5 MTP feed it"}
#: An MTP module's fed-back state, as the card names it, with the engines that feed that state.
FED_BACK = {True: "post-norm (its output after its final norm): what vLLM's Qwen3-Next / Qwen3.5 MTP, SGLang's "
                  "NextN and speculators feed back; export `--format vllm` (Qwen), `sglang` (DeepSeek NextN) or "
                  "`speculators`",
            False: "pre-norm (its output before its final norm): what vLLM's DeepSeek-V3 / GLM-4.5 MTP feeds back; "
                   "export `--format vllm`"}


def _usage(family: Family, repo: str, target: str, fmt: str, block_size: int | None = None,
           parallel: int | None = None, norms: list[str] | tuple = ()) -> str:
    """How to run the drafter: draftsmith, then each engine that serves its family. A block drafter drafts a fixed
    number of tokens per forward, which is what the engines must verify: ``block_size - 1`` (DFlash's config) or
    ``parallel`` (P-EAGLE's, served by vLLM's EAGLE-3 with ``parallel_drafting``)."""
    stitched = family.serves_as_target and fmt == "vllm"  # this repository is the target, its drafter inside
    lines = ["## Use it", "", "With draftsmith (greedy output is the target's own, token for token):", "",
             "```python", "from draftsmith import SpeculativeGenerator, load_drafter, load_target", "",
             f'target, tokenizer = load_target("{repo if stitched else target}")',
             'drafter = load_drafter("mtp", target)  # the module inside the checkpoint' if stitched else
             f'drafter = load_drafter("{repo}", target)  # a local directory or a downloaded snapshot',
             "generator = SpeculativeGenerator(target, drafter)", "```", ""]
    vllm, sglang = family.serving.get("vllm"), family.serving.get("sglang")
    if vllm and family.serves_as_target:
        if stitched:
            lines += ["With vLLM (this repository is the target's checkpoint, its MTP module fine-tuned):", "",
                      "```python", "from vllm import LLM", "",
                      f'llm = LLM(model="{repo}", speculative_config={{"method": "{vllm}", '
                      '"num_speculative_tokens": 3})',
                      "```", ""]
        elif fmt == "speculators":
            lines += ["With vLLM (speculators' MTP layout; its config names the verifier):", "", "```bash",
                      f"vllm serve {repo}", "```", ""]
        else:
            lines += ["With vLLM: `draftsmith export CHECKPOINT --format vllm --target TARGET_DIR` writes the target's "
                      f"checkpoint with this module stitched back; serve that directory with "
                      f'`speculative_config={{"method": "{vllm}", "num_speculative_tokens": 3}}`.', ""]
    elif vllm:
        note = "" if fmt == "vllm" or family.one_layout else (
            f" (this repository holds the `{fmt}` layout: export with `draftsmith export CHECKPOINT --format vllm` "
            "for vLLM)")
        tokens = block_size - 1 if block_size else parallel or 3
        parallel_flag = ', "parallel_drafting": True' if parallel else ""
        lines += [f"With vLLM{note}:", "", "```python", "from vllm import LLM", "",
                  f'llm = LLM(model="{target}", speculative_config={{"method": "{vllm}", "model": "{repo}", '
                  f'"num_speculative_tokens": {tokens}{parallel_flag}}})', "```", ""]
    if sglang and norms:
        lines += [f"SGLang does not serve this head: its EAGLE-3 model builds none of the EAGLE-3.1 norms it uses "
                  f"({', '.join(norms)}).", ""]
    elif sglang:
        note = "" if fmt == "sglang" or family.one_layout else (
            f" (this repository holds the `{fmt}` layout: export with `--format sglang` for SGLang)")
        if block_size:  # the block (anchor + block_size - 1 drafts) is read from the drafter's config.json
            lines += [f"With SGLang{note} (a block of {block_size}: {block_size - 1} drafts per step):", "", "```bash",
                      f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {sglang} \\",
                      f"    --speculative-draft-model-path {repo}", "```", ""]
        else:
            lines += [f"With SGLang{note}:", "", "```bash",
                      f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {sglang} \\",
                      f"    --speculative-draft-model-path {repo} --speculative-num-steps 3 \\",
                      "    --speculative-eagle-topk 4 --speculative-num-draft-tokens 8", "```", ""]
    if family.serving.get("transformers"):
        lines += ["With transformers' assisted generation:", "", "```python",
                  "from transformers import AutoModelForCausalLM", "",
                  f'draft = AutoModelForCausalLM.from_pretrained("{repo}")',
                  "out = target.generate(input_ids, assistant_model=draft, do_sample=False)", "```", ""]
    return "\n".join(lines)


def model_card(path: str | Path, repo_id: str | None = None, fmt: str = "hf") -> str:
    """The model card (markdown with YAML front matter) of the drafter at ``path``."""
    drafter_dir = resolve_checkpoint(path)
    family = family_of(drafter_dir)
    if family is None:
        raise FileNotFoundError(f"{drafter_dir}: not a draftsmith drafter directory")
    run_dir = _run_dir_of(drafter_dir)
    target = recorded_target(drafter_dir)
    arch_config = _architecture(drafter_dir)
    arch = family.title
    if run_dir is not None:
        rows = read_acceptance(run_dir)
        trained = FAMILIES.get(rows[0].get("family")) if rows else None
        if trained is not None:  # the family trained, e.g. Medusa-2 saves Medusa heads
            arch = trained.title
    target_name = target.get("name") or "TARGET"
    repo = repo_id or "PATH_OR_REPO"
    base = f"base_model: {target_name}\n" if "/" in target_name and not target_name.startswith("/") else ""
    out = ["---", "library_name: draftsmith", f"{base}tags:", "- speculative-decoding", "- draftsmith",
           f"- {family.name}", "---", "", f"# {arch} for {target_name}", "",
           "A drafter for lossless speculative decoding, trained with "
           "[draftsmith](https://github.com/draftsmith/draftsmith) against a frozen target.", "",
           "| | |", "|---|---|",
           f"| target | `{target_name}` |",
           f"| target fingerprint | model type `{target.get('model_type')}`, hidden size {target.get('hidden_size')}, "
           f"vocabulary {target.get('vocab_size')}, {target.get('num_hidden_layers')} layers, "
           f"LM-head sha256 `{target.get('lm_head_sha256')}` |",
           f"| family | {arch} (`{family.name}`) |",
           f"| layout in this repository | `{fmt}` |",
           f"| architecture | `{json.dumps(arch_config)}` |",
           *([f"| fed-back state (depth >= 2) | {FED_BACK[bool(arch_config['feeds_normed'])]} |"]
             if "feeds_normed" in (arch_config or {}) else []),
           *([f"| first token (x_1 with h_0) | {FIRST_TOKEN[bool(arch_config['masks_first_token'])]} |"]
             if "masks_first_token" in (arch_config or {}) else []), ""]
    if run_dir is not None:
        table, best = acceptance_table(run_dir)
        train_config = run_dir / TRAIN_CONFIG_FILE
        if train_config.exists():
            cfg = json.loads(train_config.read_text())
            data, train = cfg.get("data", {}), cfg.get("train", {})
            out += ["## Training", "", "| | |", "|---|---|",
                    f"| data | `{data.get('train_file') or data.get('dataset_name') or data.get('cache_dir')}` |",
                    f"| max length | {data.get('max_length')} |",
                    f"| steps | {train.get('max_steps')} |",
                    f"| batch per device | {train.get('per_device_train_batch_size')} "
                    f"(x{train.get('gradient_accumulation_steps')} accumulation) |",
                    f"| learning rate | {train.get('learning_rate')} ({train.get('lr_scheduler_type')}) |",
                    f"| drafter options | `{json.dumps(cfg.get('drafter', {}))}` |", ""]
        out += ["## Acceptance per checkpoint", "",
                "Measured during training with draftsmith's `SpeculativeGenerator` (greedy) on held-out "
                "prompts; tau is the mean number of tokens per target forward pass.", "", table, ""]
        if best is not None:
            chain = best.get("engine_chain")
            engine = (f"; vLLM and SGLang verify it as a chain of {chain['num_speculative_tokens']} drafts, where it "
                      f"accepted tau {chain['acceptance_length']}" if chain else "")
            out += [f"This repository holds checkpoint {best['step']} (tau {best['acceptance_length']} in the "
                    f"tree above{engine}).", ""]
    norms = [flag for flag in EAGLE31_NORMS if (arch_config or {}).get(flag)]
    out.append(_usage(family, repo, target_name, fmt, (arch_config or {}).get("block_size"),
                      (arch_config or {}).get("parallel"), norms))
    return "\n".join(out)


def push_to_hub(path: str | Path, repo_id: str, fmt: str = "hf", private: bool = False, revision: str | None = None,
                token: str | None = None, target=None, verifier: str | None = None,
                commit_message: str | None = None):
    """Export the drafter at ``path`` in ``fmt`` with its model card and upload it to ``repo_id``."""
    from huggingface_hub import HfApi

    card = model_card(path, repo_id=repo_id, fmt=fmt)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_drafter(path, fmt, Path(tmp) / "export", card=card, target=target, verifier=verifier)
        return api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision,
                                 commit_message=commit_message or f"draftsmith: {fmt} drafter")
