"""Turn a user message into prompt token ids, with or without the tokenizer's chat template."""

from __future__ import annotations

from typing import Any


def format_prompt(tokenizer: Any, prompt: str, *, chat_template: bool = True,
                  system_prompt: str = "") -> list[int]:
    """Token ids of the prompt, ending where the assistant's response starts.

    A chat template that refuses a system message (Gemma's "System role not supported",
    templates whose roles must alternate user/assistant) gets ``system_prompt`` at the start of
    the user message instead, separated by a blank line, as Gemma 3's template places it.
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        user = {"role": "user", "content": prompt}
        if not system_prompt:
            return _chat_ids(tokenizer, [user])
        from jinja2.exceptions import TemplateError

        try:
            return _chat_ids(tokenizer, [{"role": "system", "content": system_prompt}, user])
        except TemplateError as refused:
            try:
                return _chat_ids(tokenizer, [{"role": "user",
                                              "content": f"{system_prompt}\n\n{prompt}"}])
            except TemplateError:
                raise refused from None
    return tokenizer(prompt)["input_ids"]


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
