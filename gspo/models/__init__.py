"""Models: loading (local folder, bundled SmolLM2, tiny configs), fp32 log-probs, MoE hooks."""

from gspo.models.loading import DEFAULT_MODEL, ModelError, load_model, resolve_model
from gspo.models.logprobs import token_logprobs
from gspo.models.upcycle import UpcycleSpec, upcycle  # registers the upcycle: model source

__all__ = ["DEFAULT_MODEL", "ModelError", "UpcycleSpec", "load_model", "resolve_model",
           "token_logprobs", "upcycle"]
