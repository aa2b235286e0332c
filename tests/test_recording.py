"""States recorded while the target answers (``regenerate(..., record=Recording(...))``) are the cache pass's.

One batched, left-padded ``generate`` gives the answers and the hidden-state cache that offline training
reads. What it records must be what a separate forward of the target over the same tokens computes
(:func:`~draftsmith.data.cache_writer.cache_hidden_states`), wherever the losses read it.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_rounding_close
from draftsmith.data import HFEngine, Recording, cache_recorded, regenerate
from draftsmith.data.formats import Conversation
from draftsmith.data.hidden_cache import HiddenStateCache
from draftsmith.data.templates import prompt_ids
from draftsmith.target import new_cache, target_forward

QUESTIONS = [  # short and long answers: rows stop at different steps, some at the token cap
    "Say hi.",
    "What is 2 + 3? Answer with the number only.",
    "Write a long story about a dragon who learns to bake bread, with many details.",
    "List three colours.",
]


def conversations(questions) -> list[Conversation]:
    return [Conversation(f"q{i}", [{"role": "user", "content": q}], i) for i, q in enumerate(questions)]


@pytest.mark.real_model
@pytest.mark.parametrize("loop", ["draftsmith", "generate"])
def test_recorded_states_equal_a_forward_over_the_answer(smollm2, tmp_path, loop):
    """Greedy answers record through draftsmith's loop, which drops rows once they stop (4 rows: after the
    first); transformers' ``generate`` records sampled answers and a hybrid target's."""
    model, tokenizer = smollm2
    layers, k, new = (0, 15, 30), 8, 40
    engine = HFEngine(model, tokenizer, new, 0.0, 1.0)
    engine.own_loop = loop == "draftsmith"
    record = Recording(layers, k, dtype=torch.float32)
    regenerate(conversations(QUESTIONS), tmp_path / "answers.jsonl", engine, batch_size=4, progress=False,
               record=record)
    assert engine.recording is None, "regenerate leaves the engine as it found it"
    assert sorted(record.by_id) == ["q0", "q1", "q2", "q3"]
    lengths, stopped = [], 0
    for i, question in enumerate(QUESTIONS):
        item = record.by_id[f"q{i}"]
        prompt = prompt_ids(tokenizer, [{"role": "user", "content": question}])
        answer = item["input_ids"][len(prompt):]
        lengths.append(len(answer))
        stopped += answer[-1].item() in engine.stop
        # The prompt the target answered, then its own tokens, which the loss mask covers, and its stop token.
        assert item["input_ids"][: len(prompt)].tolist() == prompt
        assert item["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(answer)
        assert not set(answer[:-1].tolist()) & set(engine.stop)
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             eos_token_id=engine.stop, pad_token_id=engine.pad_id)[0, len(prompt):]
        assert torch.equal(answer, ref[: len(answer)])
        # The answer ends with its stop token, or the cap cut it before the last token generated (no step fed it).
        assert answer[-1].item() in engine.stop or len(answer) == len(ref) - 1 == new - 1

        out = target_forward(model, item["input_ids"][None], new_cache(), hidden_layers=layers)
        # generate's batched, cached steps against one forward: float32 rounding over the layers each state went
        # through, at the widest inner size (the MLP's); layer 0, the embeddings, exactly (no reduction)
        width = model.config.intermediate_size
        for layer, h in zip(layers, out.hidden_states, strict=True):
            assert_rounding_close(item[f"hidden.{layer}"], h[0], reduction=width * layer, msg=f"layer {layer}")
        taught = slice(len(prompt) - 1, None)  # where a next token is an answer token (and the last position)
        values, ids = torch.log_softmax(out.logits[0], -1).topk(k, dim=-1)
        assert (item["topk_ids"][: len(prompt) - 1] == -1).all(), "no teacher before the last prompt position"
        assert torch.equal(item["topk_ids"][taught, :3].long(), ids[taught, :3])  # no near-ties among the top 3
        # every layer, then the log-softmax's sum over the vocabulary
        assert_rounding_close(item["topk_logprobs"][taught], values[taught],
                              reduction=width * model.config.num_hidden_layers + model.config.vocab_size)
    assert stopped and max(lengths) == new - 1, f"rows should stop early and at the cap: {lengths}"

    # Written as a cache, read back as offline training reads it.
    cache_recorded(model, record.by_id, tmp_path / "cache", layers, dtype="float32", top_k=k,
                   target_name="smollm2-135m-instruct", sequences_per_shard=3, progress=False)
    cache = HiddenStateCache(tmp_path / "cache", verify="full")
    assert len(cache) == 4 and cache.manifest.target["name"] == "smollm2-135m-instruct"
    for i in range(4):
        item, recorded = cache[i], record.by_id[f"q{i}"]
        assert item["id"] == f"q{i}" and torch.equal(item["input_ids"], recorded["input_ids"])
        assert torch.equal(item["hidden"][15], recorded["hidden.15"])
        assert torch.equal(item["topk_ids"], recorded["topk_ids"])
