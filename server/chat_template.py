"""Messages -> prompt text: the tokenizer's own chat template when it has one; the fixtures
(plain BPE tokenizers without one) get a simple, visible one."""

from __future__ import annotations

SIMPLE = "<|{role}|>\n{content}\n"
ASSISTANT = "<|assistant|>\n"


def render(tokenizer, messages: list[dict[str, str]]) -> str:
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    return "".join(SIMPLE.format(**m) for m in messages) + ASSISTANT
