"""Token ids a model and its tokenizer agree on: the ones that end a response."""

from __future__ import annotations

from typing import Any


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)  # models built from a bare config lack one
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids.update(extra if isinstance(extra, list) else [extra])
    return sorted(i for i in ids if i is not None)
