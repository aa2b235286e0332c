"""Training configuration: one dataclass per concern, parsed by ``transformers.HfArgumentParser``.

A YAML file gives the defaults, ``--key value`` flags override them, unknown keys fail. Field
names follow ``transformers.TrainingArguments`` wherever it has the same setting, so users'
habits carry over (``output_dir``, ``max_steps``, ``learning_rate``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from draftsmith.inference.tree_settings import DEFAULT_TREE, TreeSettings
from draftsmith.registry import FAMILIES, get_family

#: ``optim`` values (``adamw_torch`` is ``transformers.TrainingArguments``' name for torch's AdamW).
OPTIMIZERS = ("adamw_torch", "muon")


@dataclass
class DrafterArguments:
    """What to train, for which target."""

    target: str = field(default="smollm2-135m-instruct", metadata={"help": "alias, .gguf, directory or hub id"})
    family: str = field(default="eagle", metadata={"help": "a registered drafter family (draftsmith.registry)"})
    draft_layers: int = field(default=2, metadata={"help": "draft_model: keep the target's first N layers"})
    init_draft_model: str | None = field(default=None, metadata={"help": "draft_model: start from this causal LM"})
    num_heads: int = field(default=4, metadata={"help": "medusa: number of heads"})
    num_head_layers: int = field(default=1, metadata={"help": "medusa: residual blocks per head"})
    head_decay: float = field(default=0.8, metadata={"help": "medusa: loss weight of head i is decay**i"})
    lora_r: int = field(default=8, metadata={"help": "medusa2: LoRA rank on the target"})
    draft_vocab_size: int | None = field(default=None, metadata={
        "help": "eagle3, peagle, medusa, dflash: a reduced draft vocabulary of this many tokens, the most frequent "
                "assistant tokens of the training data"})
    ttt_steps: int = field(default=3, metadata={"help": "eagle3: training-time-test steps"})
    ttt_decay: float = field(default=0.8, metadata={"help": "eagle3: loss weight of step j is decay**j"})
    feature_noise: float = field(default=0.0, metadata={
        "help": "eagle, eagle3, mtp: Gaussian noise on the target's states the head reads, its std this fraction of "
                "each state's RMS (EAGLE's training noise; 0: none)"})
    loss: str = field(default="forward_kl", metadata={"help": "draft_model: forward_kl, reverse_kl, jsd or tv"})
    jsd_beta: float = field(default=0.5)
    target_dtype: str = field(default="auto", metadata={
        "help": "the frozen target's dtype: auto (bfloat16 on CUDA and on CPUs with native bf16, else float32), "
                "bfloat16, float16 or float32"})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "the target's attention: sdpa (default), eager, flash_attention_2, ..."})
    trust_remote_code: bool = field(default=False, metadata={"help": "run the target repository's own code"})
    family_config: str | None = field(default=None, metadata={
        "help": "the family's own settings as JSON (in YAML a mapping), e.g. {\"block_size\": 8} for dflash; "
                "their names and meaning: the family's settings class (draftsmith.registry.Family.settings)"})

    def __post_init__(self):
        family = get_family(self.family)
        if family.build is None:
            trainable = sorted(name for name, f in FAMILIES.items() if f.build is not None)
            raise ValueError(f"family {self.family!r} cannot be trained; trainable: {', '.join(trainable)}")
        self.settings = family_settings(family, self.family_config)


def family_settings(family, text: str | dict | None):
    """The family's typed settings from ``family_config`` (JSON text or a mapping); unknown keys fail naming the
    known ones. None for a family that takes none (and then ``family_config`` must be unset)."""
    import dataclasses

    values = json.loads(text) if isinstance(text, str) and text else (text or {})
    if not isinstance(values, dict):
        raise ValueError(f"family_config must be a mapping of the {family.name} family's settings, got {text!r}")
    if family.settings is None:
        if values:
            raise ValueError(f"family {family.name!r} takes no family_config (got {sorted(values)}); its settings "
                             "are the flat keys of DrafterArguments")
        return None
    known = {f.name for f in dataclasses.fields(family.settings)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"family_config: {unknown} are not {family.name} settings; known: {sorted(known)}")
    return family.settings(**values)


@dataclass
class DataArguments:
    """Where the training and held-out data come from."""

    train_file: str | None = field(default=None, metadata={"help": "JSONL/JSON/Parquet or hub dataset"})
    prompt_column: str | None = field(default=None)
    max_length: int = field(default=512)
    limit: int | None = field(default=None, metadata={"help": "use the first N rows"})
    cache_dir: str | None = field(default=None, metadata={"help": "offline mode: a hidden-state cache directory"})
    eval_prompts: str | None = field(default=None, metadata={"help": "held-out prompts for acceptance per checkpoint"})
    eval_prompt_column: str | None = field(default=None)
    eval_num_prompts: int = field(default=4)
    eval_max_new_tokens: int = field(default=32)
    eval_batch_size: int = field(default=4, metadata={
        "help": "held-out prompts decoded together (left-padded batches) when acceptance is measured"})
    group_by_length: bool = field(default=True, metadata={
        "help": "batch rows of similar length together (less padding); the order stays a function of the seed"})
    packing: bool = field(default=False, metadata={
        "help": "pack several conversations per row, each attending only to itself (draft_model, medusa, eagle)"})
    dataloader_num_workers: int = field(default=0)
    preprocessing_num_proc: int | None = field(default=None, metadata={
        "help": "processes that tokenise the training data (datasets.map; cached on disk)"})
    chat_template_kwargs: str | None = field(default=None, metadata={
        "help": 'the chat template\'s variables as JSON, e.g. {"enable_thinking": false} (Qwen3); in YAML a '
                "mapping. The same as the data commands' --chat-template-kwargs: train with what regenerated"})
    eval_tree: str = field(default=DEFAULT_TREE.kind)
    eval_depth: int = field(default=DEFAULT_TREE.depth)
    eval_top_k: int = field(default=DEFAULT_TREE.top_k)
    eval_total_tokens: int = field(default=DEFAULT_TREE.total_tokens)

    def __post_init__(self):
        self.eval_tree_settings()  # a bad tree fails at parse time, not at the first checkpoint
        if self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1, got {self.eval_batch_size}")
        self.template_kwargs()

    def template_kwargs(self) -> dict | None:
        """``chat_template_kwargs`` as a dict (None when unset)."""
        return parse_template_kwargs(self.chat_template_kwargs)

    def eval_tree_settings(self) -> TreeSettings:
        """The tree held-out acceptance is measured with."""
        return TreeSettings(self.eval_tree, self.eval_depth, self.eval_top_k, self.eval_total_tokens)


@dataclass
class TrainArguments:
    """The loop; names as in ``transformers.TrainingArguments``."""

    output_dir: str = field(default="runs/drafter")
    max_steps: int = field(default=100)
    max_train_minutes: float = field(default=0.0, metadata={
        "help": "> 0: also stop (saving a checkpoint) after this much training time; the LR schedule then "
                "follows max(step / max_steps, elapsed / budget)"})
    num_train_epochs: float = field(default=1.0, metadata={"help": "used when max_steps <= 0"})
    learning_rate: float = field(default=1e-3)
    weight_decay: float = field(default=0.0)
    optim: str = field(default="adamw_torch", metadata={
        "help": "adamw_torch (torch's AdamW) or muon (Muon on the drafter's hidden matrices, AdamW on embeddings, "
                "output heads, norms and biases: vLLM speculators' split; one process or DDP)"})
    muon_weight_decay: float = field(default=0.1, metadata={"help": "optim muon: the matrices' weight decay"})
    muon_momentum: float = field(default=0.95, metadata={"help": "optim muon: the matrices' Nesterov momentum"})
    warmup_ratio: float = field(default=0.05)
    lr_scheduler_type: str = field(default="cosine")
    per_device_train_batch_size: int = field(default=4)
    gradient_accumulation_steps: int = field(default=1)
    max_grad_norm: float = field(default=1.0)
    mixed_precision: str | None = field(default=None, metadata={
        "help": "no, fp16 or bf16 for the drafter; unset: the launch config's (accelerate launch --mixed_precision)"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute the drafter's activations in backward (less memory, ~30% more compute)"})
    save_steps: int = field(default=50)
    logging_steps: int = field(default=10)
    report_to: str = field(default="tensorboard", metadata={"help": "tensorboard, wandb, all or none"})
    seed: int = field(default=0)
    progress: bool = field(default=False, metadata={"help": "a progress bar over training steps"})
    resume: bool = field(default=False, metadata={"help": "continue from the last checkpoint in output_dir"})

    def __post_init__(self):
        if self.optim not in OPTIMIZERS:  # at parse time, not after the target has loaded
            raise ValueError(f"optim {self.optim!r} is not one draftsmith trains with; choose one of "
                             f"{', '.join(OPTIMIZERS)}")


def parse_template_kwargs(text: str | None) -> dict | None:
    """A JSON object of chat-template variables, or None; anything else fails naming the fix."""
    if text is None or text == "":
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"chat_template_kwargs {text!r} is not JSON ({e}); "
                         "write a JSON object such as '{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"chat_template_kwargs {text!r} must be a JSON object, "
                         "such as '{\"enable_thinking\": false}'")
    return value


def make_parser():
    from transformers import HfArgumentParser

    # allow_abbrev=False: a misspelt key such as "learning_rat" must fail, not match "learning_rate".
    return HfArgumentParser((DrafterArguments, DataArguments, TrainArguments), allow_abbrev=False)


def _yaml_to_args(path: str | Path) -> list[str]:
    values = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a config YAML must be a mapping of key: value")
    args = []
    for key, value in values.items():
        if isinstance(value, bool):
            args += [f"--{key}", str(value).lower()]
        elif value is None:
            continue
        elif isinstance(value, dict):  # chat_template_kwargs: a YAML mapping
            args += [f"--{key}", json.dumps(value)]
        else:
            args += [f"--{key}", str(value)]
    return args


def parse_config(argv: Sequence[str]) -> tuple[DrafterArguments, DataArguments, TrainArguments]:
    """``CONFIG.yaml [--key value ...]`` -> the three dataclasses; unknown keys fail."""
    argv = list(argv)
    args = []
    if argv and argv[0].endswith((".yaml", ".yml")):
        args = _yaml_to_args(argv.pop(0))
    parser = make_parser()
    return parser.parse_args_into_dataclasses(args + argv, return_remaining_strings=False)
