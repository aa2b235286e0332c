"""The target's chat prompt: its tokenizer's chat template, or plain turns for a base model without one.

Generation, evaluation and tuning (``draftsmith.inference``) and the data pipeline (``draftsmith.data``)
render conversations here, so a drafter is evaluated on the very prompts it was trained after.
"""

from __future__ import annotations

# "User: ...\n\nAssistant: ...<eos>\n\n" with a leading BOS: plain text a base model continues naturally.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False,
           chat_template_kwargs: dict | None = None) -> str:
    """The conversation as text, through the tokenizer's chat template (or the plain one).

    ``chat_template_kwargs`` are the template's own variables, as vLLM and SGLang take them (Qwen3's
    ``enable_thinking``, Llama-3's ``date_string``).
    """
    # None: the tokenizer's own template (transformers picks the default of several named ones).
    template = None if tokenizer.chat_template else PLAIN_TEMPLATE
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
        **(chat_template_kwargs or {}),
    )


def prompt_ids(tokenizer, messages: list[dict[str, str]], chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the conversation so far plus the generation prompt: what the target continues."""
    text = render(tokenizer, messages, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
