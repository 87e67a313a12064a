"""gspo: RL post-training of language models with Group Sequence Policy Optimization."""

__version__ = "0.1.0"
