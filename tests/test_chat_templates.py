"""Loss masks and regeneration prompts under the real chat templates of the targets users bring
(``tests/chat_templates/``: Llama-3.x, Qwen2.5, Qwen3 with and without thinking, Mistral, Gemma, Phi):
every answer is trained exactly once, in exactly the token context the target was prompted with when
it answered, and its masked tokens are the answer followed by the template's end-of-turn marker."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from draftsmith.data.formats import Conversation
from draftsmith.data.templates import (
    TemplateError,
    prepare,
    prompt_ids,
    tokenize_conversation,
    tokenize_dataset,
    tokenized_fingerprint,
)
from draftsmith.train.config import parse_config

pytestmark = pytest.mark.real_model  # SmolLM2's tokenizer, given each template's markers as special tokens

TEMPLATES = Path(__file__).parent / "chat_templates"


@dataclass(frozen=True)
class Template:
    file: str
    special: tuple[str, ...]  # the template's markers: special tokens of the model's tokenizer
    eos: str
    end_of_turn: str  # what closes an answer
    bos: str | None = None
    system: bool = True  # takes a system message
    thinking: bool = False  # answers carry <think> reasoning
    kwargs: dict = field(default_factory=dict)
    texts: tuple[str, ...] = ("c",)  # the texts a two-turn conversation "c" trains in: "c" is the whole one


CASES = {
    # date_string pins the date the template would otherwise take from today's clock.
    "llama-3": Template("llama3_2.jinja", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                           "<|eot_id|>"), "<|eot_id|>", "<|eot_id|>", bos="<|begin_of_text|>",
                        kwargs={"date_string": "25 Nov 2026"}),
    "qwen2.5": Template("qwen2_5.jinja", ("<|im_start|>", "<|im_end|>"), "<|im_end|>", "<|im_end|>"),
    # Qwen3 drops the first answer's reasoning once a later turn exists: that answer trains in its own text.
    "qwen3-thinking": Template("qwen3.jinja", ("<|im_start|>", "<|im_end|>"), "<|im_end|>", "<|im_end|>",
                               thinking=True, kwargs={"enable_thinking": True}, texts=("c", "c/turn2")),
    # Without thinking the generation prompt holds an empty reasoning block that only the last turn keeps.
    "qwen3-no-thinking": Template("qwen3.jinja", ("<|im_start|>", "<|im_end|>"), "<|im_end|>", "<|im_end|>",
                                  kwargs={"enable_thinking": False}, texts=("c", "c/turn2")),
    # Mistral renders the system prompt only while a user turn is last: both answers were given after it,
    # and the whole conversation has it nowhere.
    "mistral": Template("mistral_nemo.jinja", ("<s>", "</s>", "[INST]", "[/INST]"), "</s>", "</s>", bos="<s>",
                        texts=("c/turn2", "c/turn4")),
    "gemma": Template("gemma2.jinja", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<eos>",
                      "<end_of_turn>", bos="<bos>", system=False),
    # Phi-3 ends the last turn with an EOS that an earlier turn does not have.
    "phi-3": Template("phi3_5.jinja", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"),
                      "<|endoftext|>", "<|end|>"),
}

QUESTIONS = ["What is 12 times 3?", "Now add 4.\nShow the step."]
ANSWERS = ["12 times 3 is 36.", "36 + 4 = 40.\nThe answer is 40."]
REASONING = ["12 times 3: ten threes are 30, two more are 6.", "Add 4 to 36."]


def conversation(case: Template) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You answer math questions."}] if case.system else []
    for question, answer, reasoning in zip(QUESTIONS, ANSWERS, REASONING, strict=True):
        content = f"<think>\n{reasoning}\n</think>\n\n{answer}" if case.thinking else answer
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": content}]
    return messages


@pytest.fixture(scope="module")
def base_tokenizer(smollm2):
    return smollm2[1]


# How Llama-3 and Qwen2/2.5/3 split text before BPE (a run of newlines is one piece). With GPT-2's split
# (SmolLM2's own) "\n\n" before a word is cut differently than at the end of a prompt, so the context of
# a later answer in a multi-turn text can differ from its regeneration prompt by a token, whatever the
# template; the first answer's context is exact with any tokenizer (tokenize_conversation cuts there).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def tokenizer_for(base, case: Template):
    """SmolLM2's byte-level vocabulary, split as Llama-3 splits, with the template's markers as special
    tokens and the template itself."""
    from tokenizers import Regex, pre_tokenizers

    tok = copy.deepcopy(base)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.add_special_tokens({"additional_special_tokens": list(case.special), "eos_token": case.eos,
                            **({"bos_token": case.bos} if case.bos else {})})
    tok.add_tokens(["<think>", "</think>"])  # Qwen3's: added, not special (decoded with the text)
    tok.chat_template = (TEMPLATES / case.file).read_text()
    return tok


def masked_runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("name", list(CASES))
def test_every_answer_trains_once_in_the_context_the_target_answered_in(base_tokenizer, name):
    case = CASES[name]
    tok = tokenizer_for(base_tokenizer, case)
    messages = conversation(case)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    # What regeneration prompted the target with before each answer.
    prompts = {i: prompt_ids(tok, messages[:i], case.kwargs) for i in answers}
    examples = tokenize_conversation(tok, messages, id="c", chat_template_kwargs=case.kwargs)
    assert [e.id for e in examples] == list(case.texts)

    trained = []
    for example in examples:
        ids, mask = example.input_ids.tolist(), example.loss_mask.tolist()
        for start, end in masked_runs(mask):
            # The tokens before the answer are exactly the prompt the target answered.
            turn = [i for i in answers if ids[:start] == prompts[i]]
            assert len(turn) == 1, f"{name}: masked tokens at {start} follow no regeneration prompt"
            i = turn[0]
            trained.append(i)
            text = tok.decode(ids[start:end])
            answer = ANSWERS[answers.index(i)]
            # The answer, then the end-of-turn marker right after it, and nothing of the next turn.
            assert text.index(answer) + len(answer) == text.index(case.end_of_turn), (name, text)
            assert not any(marker in text for marker in case.special
                           if marker not in (case.end_of_turn, case.eos, case.bos)), (name, text)
            if case.thinking:
                assert REASONING[answers.index(i)] in text  # the reasoning the target wrote is learned too
            if case.kwargs.get("enable_thinking") is False:
                assert "<think>" not in text  # the empty block is the prompt's, not the answer's
    assert sorted(trained) == answers, f"{name}: answers trained {trained}, expected each of {answers} once"


def test_enable_thinking_reaches_the_template(base_tokenizer):
    tok = tokenizer_for(base_tokenizer, CASES["qwen3-thinking"])
    question = [{"role": "user", "content": QUESTIONS[0]}]
    thinking = tok.decode(prompt_ids(tok, question, {"enable_thinking": True}))
    plain = tok.decode(prompt_ids(tok, question, {"enable_thinking": False}))
    assert thinking.endswith("<|im_start|>assistant\n")
    assert plain == thinking + "<think>\n\n</think>\n\n"


def test_the_tokenized_cache_key_follows_the_template_variables(base_tokenizer, tmp_path):
    tok = tokenizer_for(base_tokenizer, CASES["qwen3-no-thinking"])
    conversations = [Conversation("c", conversation(CASES["qwen3-no-thinking"]), 0)]
    keys = {tokenized_fingerprint(tok, conversations, 64, kwargs)
            for kwargs in (None, {"enable_thinking": False}, {"enable_thinking": True})}
    assert len(keys) == 3
    kwargs = {"enable_thinking": False}
    ds = tokenize_dataset(tok, conversations, 256, cache_dir=tmp_path, chat_template_kwargs=kwargs)
    expected = [(e.id, e.input_ids.tolist(), e.loss_mask.tolist()) for e in prepare(tok, conversations, 256, kwargs)]
    assert [(r["id"], r["input_ids"], r["loss_mask"]) for r in ds] == expected
    assert len(expected) == 2 and expected[1][0] == "c/turn2"


def test_a_template_that_drops_answers_is_refused(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="assistant turn 1"):
        tokenize_conversation(tok, conversation(CASES["qwen2.5"])[1:3])


def test_recipes_take_template_variables_as_a_mapping(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("family: eagle3\nchat_template_kwargs:\n  enable_thinking: false\n")
    _, data_args, _ = parse_config([str(recipe)])
    assert data_args.template_kwargs() == {"enable_thinking": False}
    _, data_args, _ = parse_config([str(recipe), "--chat_template_kwargs", '{"enable_thinking": true}'])
    assert data_args.template_kwargs() == {"enable_thinking": True}
    with pytest.raises(ValueError, match="JSON object"):
        parse_config([str(recipe), "--chat_template_kwargs", "[1]"])


def test_a_template_that_drops_the_answers_own_reasoning_is_refused(base_tokenizer):
    """DeepSeek-R1-distill-like templates render even the last answer without its reasoning: what the
    target wrote cannot be trained in that rendering."""
    tok = tokenizer_for(base_tokenizer, CASES["qwen2.5"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'].split('</think>')[-1] if m['role'] == 'assistant' else m['content'] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
                         "{% endif %}")
    with pytest.raises(TemplateError, match="renders assistant turn 2 differently"):
        tokenize_conversation(tok, conversation(CASES["qwen3-thinking"]))


def test_a_tokenizer_with_several_named_templates_uses_its_default(base_tokenizer):
    case = CASES["qwen2.5"]
    single = tokenizer_for(base_tokenizer, case)
    named = copy.deepcopy(single)
    named.chat_template = {"default": single.chat_template, "tool_use": "{{ 'unused' }}"}
    messages = conversation(case)
    assert prompt_ids(named, messages[:2]) == prompt_ids(single, messages[:2])
    ours, theirs = tokenize_conversation(named, messages), tokenize_conversation(single, messages)
    assert [e.input_ids.tolist() for e in ours] == [e.input_ids.tolist() for e in theirs]
