"""The training recipe and its helpers (checkpoints, metrics, evaluation)."""

from gspo.trainer import sft  # noqa: F401 (registers the model source sft:<tiny name>)
from gspo.trainer.trainer import Trainer

__all__ = ["Trainer"]
