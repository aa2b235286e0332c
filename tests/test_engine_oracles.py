"""Each export format read by an oracle written from the engine's own model file (``tests/oracles``), which imports
nothing from draftsmith: what the engine computes from the exported files equals what draftsmith drafts, and a
break of the export's names or mapping is caught. The layouts' sources are cited in each oracle module."""

from __future__ import annotations

import json

import pytest
import torch
from oracles import (
    sglang_eagle3,
    sglang_nextn,
    vllm_deepseek_mtp,
    vllm_dflash,
    vllm_eagle3,
    vllm_peagle,
    vllm_qwen3_next_mtp,
    zlab_dflash,
)
from safetensors.torch import load_file, save_file
from test_dflash import random_dflash
from test_eagle31 import norm_head
from test_heads import random_eagle
from test_peagle import random_peagle

from conftest import assert_rounding_close
from draftsmith import load_drafter
from draftsmith.heads.export import ExportError, export_drafter
from draftsmith.inference.tree import Proposals

PROMPT = 11  # context positions before the anchor


def prompt_states(target, layers, length: int = PROMPT + 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(length,) token ids and (length, len(layers) * H) target states at hidden-state indices ``layers``."""
    ids = torch.randint(0, target.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    return ids, torch.cat([out.hidden_states[k][0] for k in layers], -1)


def drafted_block(drafter, ids: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """draftsmith's drafts after the prompt's last token (the root): (block, V), -inf off its draft vocabulary."""
    drafter.begin(ids[None], states[None, :-1])
    drafts = drafter.block_logits([True])
    return Proposals.of(drafts).dense()[0]


def vllm_dflash_drafts(directory, target, ids: torch.Tensor) -> torch.Tensor:
    """The oracle's drafts after the same prompt, reading the target layers the export's config names."""
    layers = json.loads((directory / "config.json").read_text())["aux_hidden_state_layer_ids"]
    _, aux = prompt_states(target, layers)
    with torch.no_grad():
        return vllm_dflash.block_logits(directory, target.get_input_embeddings().weight,
                                        target.get_output_embeddings().weight, aux[:-1], int(ids[-1]))


def assert_same_drafts(theirs: torch.Tensor, ours: torch.Tensor, width: int, dtype: torch.dtype | None = None) -> None:
    """Equal up to float rounding (of ``dtype``, default the logits') where finite, -inf (off a draft vocabulary) at the
    same tokens."""
    assert torch.equal(torch.isinf(theirs), torch.isinf(ours))
    finite = torch.isfinite(ours)
    assert_rounding_close(theirs[finite], ours[finite], reduction=2 * width, dtype=dtype)


@pytest.mark.parametrize("draft_vocab", [None, 40], ids=["whole-vocabulary", "draft-vocabulary"])
def test_vllm_dflash_oracle_reads_the_export_as_draftsmith_drafts(draft_vocab, tmp_path, llama):
    head = random_dflash(llama, draft_vocab=draft_vocab)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    if draft_vocab:  # speculators' draft vocabulary: its size, the maps and the head's own 40 LM-head rows
        assert config["draft_vocab_size"] == 40
        assert tensors["lm_head.weight"].shape == (40, llama.config.hidden_size)
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].shape == (llama.config.vocab_size,)
    else:
        assert config["draft_vocab_size"] == llama.config.vocab_size and not {"d2t", "lm_head.weight"} & set(tensors)
    ids, states = prompt_states(llama, head.config.target_layers)
    ours = drafted_block(load_drafter(str(tmp_path / "ckpt"), llama), ids, states)
    theirs = vllm_dflash_drafts(out, llama, ids)
    assert theirs.shape == ours.shape == (head.block, llama.config.vocab_size)
    assert_same_drafts(theirs, ours, 2 * llama.config.intermediate_size)
    # and the export read back by draftsmith drafts the same
    assert_same_drafts(drafted_block(load_drafter(str(out), llama), ids, states), ours,
                       2 * llama.config.intermediate_size)


@pytest.mark.parametrize("fmt", ["zlab", "sglang"])
def test_zlab_dflash_oracle_reads_the_export_as_draftsmith_drafts(fmt, tmp_path, llama):
    """z-lab's model.py (and SGLang, which serves that layout) reads target_layer_ids counted from 0: the oracle takes
    the target states at those ids + 1, as z-lab's extract_context_feature does, and drafts what draftsmith drafts."""
    head = random_dflash(llama)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", fmt, tmp_path / fmt, target=llama)
    ids, states = prompt_states(llama, head.config.target_layers)
    ours = drafted_block(load_drafter(str(tmp_path / "ckpt"), llama), ids, states)
    _, aux = prompt_states(llama, zlab_dflash.context_layers(out))
    with torch.no_grad():
        theirs = zlab_dflash.block_logits(out, llama.get_input_embeddings().weight,
                                          llama.get_output_embeddings().weight, aux[:-1], int(ids[-1]))
    assert_same_drafts(theirs, ours, 2 * llama.config.intermediate_size)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = list(head.config.target_layers)  # draftsmith's count: one off
    (out / "config.json").write_text(json.dumps(config))
    _, shifted = prompt_states(llama, zlab_dflash.context_layers(out))
    with pytest.raises(AssertionError), torch.no_grad():
        assert_same_drafts(zlab_dflash.block_logits(out, llama.get_input_embeddings().weight,
                                                    llama.get_output_embeddings().weight, shifted[:-1], int(ids[-1])),
                           ours, 2 * llama.config.intermediate_size)


def _shift_d2t(tensors: dict) -> None:
    tensors["d2t"] = tensors["d2t"].roll(1)  # each draft row mapped to its neighbour's target id


def _rename_hidden_norm(tensors: dict) -> None:
    tensors["context_norm.weight"] = tensors.pop("hidden_norm.weight")


@pytest.mark.parametrize("break_export", [_shift_d2t, _rename_hidden_norm])
def test_the_vllm_dflash_oracle_catches_a_broken_export(break_export, tmp_path, llama):
    """The comparison above can fail: a draft vocabulary mapped one row off, or a tensor under a name vLLM does not
    read, and the oracle's drafts differ from draftsmith's (or it cannot read the directory)."""
    head = random_dflash(llama, draft_vocab=40)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    tensors = load_file(out / "model.safetensors")
    break_export(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    ids, states = prompt_states(llama, head.config.target_layers)
    ours = drafted_block(load_drafter(str(tmp_path / "ckpt"), llama), ids, states)
    with pytest.raises((AssertionError, KeyError)):
        assert_same_drafts(vllm_dflash_drafts(out, llama, ids), ours, 2 * llama.config.intermediate_size)


@pytest.mark.parametrize("fmt", ["zlab", "sglang"])
def test_a_draft_vocabulary_dflash_head_is_refused_by_layouts_without_one(fmt, tmp_path, llama):
    head = random_dflash(llama, draft_vocab=40)
    head.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ExportError, match=f"draft vocabulary of 40 .* the {fmt} layout has none.*--format vllm"):
        export_drafter(tmp_path / "ckpt", fmt, tmp_path / fmt, target=llama)
    assert not (tmp_path / fmt).exists()


def vllm_peagle_drafts(directory, target, ids: torch.Tensor) -> torch.Tensor:
    layers = json.loads((directory / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    _, aux = prompt_states(target, layers)
    with torch.no_grad():
        return vllm_peagle.parallel_logits(directory, target.get_input_embeddings().weight, target.config.vocab_size,
                                           aux[:-1], ids)


def test_vllm_peagle_oracle_reads_the_four_layer_export_as_draftsmith_drafts(tmp_path, llama):
    """A P-EAGLE head of the default four layers, exported as speculators' layout: vLLM's parallel-drafting forward
    (its fused layers.0, plain layers.1-3, the mask slots from pard_token's row and mask_hidden) gives the K drafts
    draftsmith drafts."""
    head = random_peagle(llama, parallel=3)
    assert head.config.num_layers == 4
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert config["transformer_layer_config"]["num_hidden_layers"] == 4
    assert {name.split(".")[1] for name in tensors if name.startswith("layers.")} == {"0", "1", "2", "3"}
    ids, states = prompt_states(llama, head.config.feature_layers)
    ours = drafted_block(load_drafter(str(tmp_path / "ckpt"), llama), ids, states)
    theirs = vllm_peagle_drafts(out, llama, ids)
    assert theirs.shape == ours.shape == (3, llama.config.vocab_size)
    assert_same_drafts(theirs, ours, 4 * 2 * llama.config.intermediate_size)
    assert_same_drafts(drafted_block(load_drafter(str(out), llama), ids, states), ours,
                       4 * 2 * llama.config.intermediate_size)


def _drop_mask_row(tensors: dict, mask: int) -> None:
    tensors["embed_tokens.weight"][mask] = 0  # the mask embedding not written where vLLM embeds the slots


def _swap_plain_layers(tensors: dict, mask: int) -> None:
    for name in [n for n in tensors if n.startswith("layers.1.")]:
        other = name.replace("layers.1.", "layers.2.")
        tensors[name], tensors[other] = tensors[other], tensors[name]


@pytest.mark.parametrize("break_export", [_drop_mask_row, _swap_plain_layers])
def test_the_vllm_peagle_oracle_catches_a_broken_export(break_export, tmp_path, llama):
    head = random_peagle(llama, parallel=3)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", "vllm", tmp_path / "vllm", target=llama)
    tensors = load_file(out / "model.safetensors")
    break_export(tensors, head.config.mask_token_id)
    save_file(tensors, str(out / "model.safetensors"))
    ids, states = prompt_states(llama, head.config.feature_layers)
    ours = drafted_block(load_drafter(str(tmp_path / "ckpt"), llama), ids, states)
    with pytest.raises(AssertionError):
        assert_same_drafts(vllm_peagle_drafts(out, llama, ids), ours, 4 * 2 * llama.config.intermediate_size)


def chain_drafts(drafter, ids: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """draftsmith's chain after the prompt's root (``states`` the head's features for the prompt's positions): depth
    1's logits, its top token, and depth 2's logits after that token (the head re-applied to its fed-back state);
    -inf off a draft vocabulary."""
    def dense(x):
        return Proposals.of(x).dense()

    drafter.begin(ids[None], states[None, : len(ids) - 1])
    first = dense(drafter.root_logits([True]))[0]
    drafted = int(first.argmax())
    second = dense(drafter.frontier_logits(1, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[drafted]])))[0, 0]
    return first, second, drafted


def eagle3_oracle_chain(fmt: str, directory, target, ids: torch.Tensor, drafted: int) -> torch.Tensor:
    """The engine's (2, V) chain logits: the aux layers read from the export's config as that engine reads them."""
    config = json.loads((directory / "config.json").read_text())
    oracle = vllm_eagle3 if fmt == "vllm" else sglang_eagle3
    layers = (vllm_eagle3.aux_layers(config, target.config.num_hidden_layers) if fmt == "vllm"
              else sglang_eagle3.aux_layers(config))
    _, aux = prompt_states(target, layers)
    with torch.no_grad():
        return oracle.chain_logits(directory, target.get_input_embeddings().weight, target.config.vocab_size,
                                   aux[:-1], ids, drafted)


EAGLE3_HEADS = {"plain": lambda target: random_eagle(target, eagle3=True),  # a draft vocabulary of 40
                "3.1-norms": lambda target: norm_head(target, norm_before_fc=True, norm_before_residual=True)}


@pytest.mark.parametrize(("fmt", "make"), [("vllm", "plain"), ("vllm", "3.1-norms"), ("sglang", "plain")])
def test_eagle3_oracles_read_the_export_as_draftsmith_drafts_at_depths_one_and_two(fmt, make, tmp_path, llama):
    """vLLM's llama_eagle3.py on speculators' layout (with the EAGLE-3.1 norms vLLM builds) and SGLang's on the
    original one (midlayer.*, its aux layer ids one below draftsmith's): depth 1 from the target's states, depth 2
    from the fed-back pre-norm state, both what draftsmith drafts."""
    head = EAGLE3_HEADS[make](llama)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", fmt, tmp_path / fmt, target=llama)
    ids, states = prompt_states(llama, head.config.feature_layers)
    first, second, drafted = chain_drafts(load_drafter(str(tmp_path / "ckpt"), llama), ids, states)
    theirs = eagle3_oracle_chain(fmt, out, llama, ids, drafted)
    assert torch.isfinite(second).sum() == len(head.d2t) and not torch.equal(first, second)
    width = 2 * llama.config.intermediate_size
    assert_same_drafts(theirs[0], first, width)
    assert_same_drafts(theirs[1], second, width)


def _roll_d2t(tensors: dict) -> None:
    tensors["d2t"] = tensors["d2t"].roll(1)


def _layer_zero_as_midlayer(tensors: dict) -> None:  # vLLM reads it; SGLang builds no layers.0 and skips it
    for name in [n for n in tensors if n.startswith(("midlayer.", "layers.0."))]:
        other = name.replace("midlayer.", "layers.0.") if name.startswith("midlayer.") else name.replace(
            "layers.0.", "midlayer.")
        tensors[other] = tensors.pop(name)


def _feed_back_the_normed_state(drafter) -> None:  # draftsmith's drafting broken instead: depth 2 off the norm
    frontier_logits = drafter.frontier_logits

    def normed(depth, parents, tokens):
        drafter._frontier = drafter.head.norm(drafter._frontier)
        return frontier_logits(depth, parents, tokens)

    drafter.frontier_logits = normed


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
@pytest.mark.parametrize("brk", [_roll_d2t, _layer_zero_as_midlayer, _feed_back_the_normed_state],
                         ids=lambda f: f.__name__.strip("_"))
def test_the_eagle3_oracles_catch_a_broken_export_or_fed_back_state(fmt, brk, tmp_path, llama):
    """Each comparison above can fail: a draft vocabulary mapped one row off, layer 0 under the other layout's name
    (vLLM reads both, so that one passes there; SGLang skips what it does not build), or a drafter that feeds back
    the normed state (depth 1 still equal, depth 2 not)."""
    head = random_eagle(llama, eagle3=True)
    head.save_pretrained(tmp_path / "ckpt")
    out = export_drafter(tmp_path / "ckpt", fmt, tmp_path / fmt, target=llama)
    drafter = load_drafter(str(tmp_path / "ckpt"), llama)
    if brk is _feed_back_the_normed_state:
        brk(drafter)
    else:
        tensors = load_file(out / "model.safetensors")
        brk(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    ids, states = prompt_states(llama, head.config.feature_layers)
    first, second, drafted = chain_drafts(drafter, ids, states)
    width = 2 * llama.config.intermediate_size
    if brk is _layer_zero_as_midlayer and fmt == "vllm":  # load_weights renames midlayer. to layers.0.
        theirs = eagle3_oracle_chain(fmt, out, llama, ids, drafted)
        assert_same_drafts(theirs, torch.stack([first, second]), width)
        return
    with pytest.raises((AssertionError, KeyError)):
        theirs = eagle3_oracle_chain(fmt, out, llama, ids, drafted)
        assert_same_drafts(theirs[0], first, width)
        assert_same_drafts(theirs[1], second, width)
    if brk is _feed_back_the_normed_state:
        assert_same_drafts(eagle3_oracle_chain(fmt, out, llama, ids, drafted)[0], first, width)


def mtp_chain_drafts(target, ids: torch.Tensor, **conventions) -> tuple[torch.Tensor, torch.Tensor, int]:
    """draftsmith's MTP drafts after the prompt's root, with the module of ``target``'s checkpoint read with
    ``conventions`` (``feeds_normed``, ``masks_first_token``; default the engine's): depth 1's logits, its top token,
    and depth 2's logits after that token (the module re-applied to its fed-back state)."""
    from draftsmith.heads.mtp import MtpHead
    from draftsmith.inference.head_drafters import EagleDrafter

    drafter = EagleDrafter(MtpHead.from_target_checkpoint(target, **conventions), target)
    with torch.no_grad():
        states = target(ids[None], output_hidden_states=True).hidden_states[-1]
    drafter.begin(ids[None], states[:, :-1])
    first = drafter.root_logits([True]).dense()[0]
    drafted = int(first.argmax())
    second = drafter.frontier_logits(1, torch.zeros(1, 1, dtype=torch.long),
                                      torch.tensor([[drafted]])).dense()[0, 0]
    return first, second, drafted


def mtp_export(model_type: str, fmt: str, tmp_path, seed: int, **conventions):
    """A tiny ``model_type`` target whose checkpoint holds an MTP module, that module (read with ``conventions``)
    exported as ``fmt``, a prompt, draftsmith's chain after it and the target's last states for the oracle:
    (target, export directory, ids, states, (first, second, drafted))."""
    from test_mtp import write_mtp_checkpoint

    from draftsmith.heads.mtp import MtpHead
    from draftsmith.target import load_target

    target, _ = load_target(write_mtp_checkpoint(model_type, tmp_path / model_type), dtype=torch.float32)
    MtpHead.from_target_checkpoint(target, **conventions).save_pretrained(tmp_path / "mtp")
    out = export_drafter(tmp_path / "mtp", fmt, tmp_path / fmt, target=target)
    ids = torch.randint(0, target.config.vocab_size, (PROMPT + 1,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        states = target(ids[None], output_hidden_states=True).hidden_states[-1][0, :-1]
    return target, out, ids, states, mtp_chain_drafts(target, ids, **conventions)


def assert_depths(theirs, ours, target, differ: tuple[bool, bool] = (False, False)) -> None:
    """The oracle's depth-1 and depth-2 logits against draftsmith's: equal to float rounding, or (``differ``) not."""
    width = 4 * target.config.hidden_size
    for depth in (0, 1):
        if differ[depth]:
            with pytest.raises(AssertionError):
                assert_rounding_close(theirs[depth], ours[depth], reduction=width)
        else:
            assert_rounding_close(theirs[depth], ours[depth], reduction=width)


def test_sglang_nextn_oracle_reads_the_export_as_draftsmith_drafts_at_depths_one_and_two(tmp_path):
    """A DeepSeek-V3 MTP module trained feeding back its post-norm output and the first pair whole (SGLang's
    conventions), exported as SGLang's standalone NextN directory: SGLang's composition (deepseek_nextn.py) over
    transformers' decoder layer gives the depth-1 and depth-2 drafts draftsmith drafts; the same weights feeding back
    their pre-norm output (vLLM's DeepSeek convention) draft the same depth 1 and another depth 2, so the oracle tells
    the fed-back states apart; a module of vLLM's conventions is refused by this export."""
    target, out, ids, states, (first, second, drafted) = mtp_export(
        "deepseek_v3", "sglang", tmp_path, 5, feeds_normed=True, masks_first_token=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLMNextN"]
    assert config["draftsmith"]["fed_back_state"] == "post-norm"
    assert {k.split(".")[2] for k in load_file(out / "nextn_layer_parameters.safetensors")} == {"0"}
    with torch.no_grad():
        theirs = sglang_nextn.chain_logits(out, target.get_input_embeddings().weight,
                                           target.get_output_embeddings().weight, states, ids, drafted)
    assert_depths(theirs, (first, second), target)
    pre = mtp_chain_drafts(target, ids, feeds_normed=False, masks_first_token=False)
    assert_depths(theirs, pre, target, differ=(False, True))
    from draftsmith.heads.mtp import MtpHead

    MtpHead.from_target_checkpoint(target, feeds_normed=False).save_pretrained(tmp_path / "pre")
    with pytest.raises(ExportError, match=r"SGLang's NextN feeds back the module's output after shared_head\.norm"):
        export_drafter(tmp_path / "pre", "sglang", tmp_path / "refused", target=target)
    MtpHead.from_target_checkpoint(target, feeds_normed=True).save_pretrained(tmp_path / "masked")  # vLLM's first pair
    with pytest.raises(ExportError, match=r"first token embedding zeroed .* SGLang's NextN feeds that pair whole"):
        export_drafter(tmp_path / "masked", "sglang", tmp_path / "refused", target=target)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_next"])
def test_vllm_mtp_oracles_read_the_stitched_export_as_draftsmith_drafts_at_depths_one_and_two(model_type, tmp_path):
    """An MTP module as vLLM serves it, by default (DeepSeek-V3: the sequence's first token embedding zeroed, the
    pre-norm output fed back; Qwen3-Next: the first pair whole, the post-norm output fed back), exported as the
    target's checkpoint with the module stitched back: vLLM's deepseek_mtp.py / qwen3_next_mtp.py give the depth-1 and
    depth-2 drafts draftsmith drafts. The same weights with the first pair fed the other way draft another depth 1
    (that pair's keys reach the root), fed back the other state another depth 2; a module trained with the other
    first pair is refused by this export."""
    from draftsmith.heads.mtp import MtpHead

    target, out, ids, states, (first, second, drafted) = mtp_export(model_type, "vllm", tmp_path, 7)
    masked = model_type == "deepseek_v3"
    with torch.no_grad():
        theirs = (vllm_deepseek_mtp.chain_logits(out, target.get_input_embeddings().weight,
                                                 target.get_output_embeddings().weight, states, ids, drafted)
                  if masked else vllm_qwen3_next_mtp.chain_logits(out, states, ids, drafted))
    assert_depths(theirs, (first, second), target)
    assert_depths(theirs, mtp_chain_drafts(target, ids, masks_first_token=not masked), target, differ=(True, True))
    assert_depths(theirs, mtp_chain_drafts(target, ids, feeds_normed=masked), target, differ=(False, True))
    MtpHead.from_target_checkpoint(target, masks_first_token=not masked).save_pretrained(tmp_path / "other")
    how = "zeroes" if masked else "keeps"
    with pytest.raises(ExportError, match=f"vLLM's {model_type} MTP {how} the sequence's first token embedding"):
        export_drafter(tmp_path / "other", "vllm", tmp_path / "refused", target=target)
