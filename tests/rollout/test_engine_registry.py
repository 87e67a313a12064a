"""Adding a rollout engine as docs/architecture.md says: the config takes its name."""

from __future__ import annotations

from typing import Literal

import pytest

from gspo.config import ConfigError, RolloutConfig, load_config


def test_an_engine_added_to_the_literal_is_accepted_by_the_config(monkeypatch):
    """docs/architecture.md: register the class and add its name to ``RolloutConfig.engine``'s
    ``Literal``; ``rollout.engine=<name>`` then loads (``validate`` kept a list of its own of
    the three built-in names, which refused it as an unknown engine)."""
    monkeypatch.setitem(RolloutConfig.__annotations__, "engine",
                        Literal["hf", "vllm", "llamacpp", "mine"])
    assert load_config(None, ["rollout.engine=mine"]).rollout.engine == "mine"
    with pytest.raises(ConfigError, match=r"rollout\.engine"):
        load_config(None, ["rollout.engine=theirs"])
