"""The training recipe and its helpers (checkpoints, metrics, evaluation)."""

from gspo.trainer.trainer import Trainer

__all__ = ["Trainer"]
