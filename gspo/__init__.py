"""gspo: RL post-training of language models with Group Sequence Policy Optimization.

    from gspo import Trainer, TrainConfig
    Trainer(TrainConfig(model="tiny:llama", steps=2), reward_fns=[my_reward],
            train_dataset=[{"prompt": "2+2=?", "answer": "4"}, ...]).setup().train()

``Trainer`` (and ``export_merged``) load lazily, so ``import gspo`` stays light.
"""

from typing import Any

from gspo.config import TrainConfig, load_config

__version__ = "0.1.0"
__all__ = ["TrainConfig", "Trainer", "export_merged", "load_config"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from gspo.trainer import Trainer

        return Trainer
    if name == "export_merged":
        from gspo.cli.export import export_merged

        return export_merged
    raise AttributeError(f"module 'gspo' has no attribute {name!r}")
