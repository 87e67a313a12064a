"""Turn a user message into prompt token ids, with or without the tokenizer's chat template."""

from __future__ import annotations

from typing import Any


def format_prompt(tokenizer: Any, prompt: str, *, chat_template: bool = True,
                  system_prompt: str = "") -> list[int]:
    """Token ids of the prompt, ending where the assistant's response starts."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]
