"""Supervised fine-tuning: labels, the loss, the optimizer and the data pipeline.

    from qwen3vl_jax.training import SFTDataset, causal_lm_loss, OptimConfig, build_optimizer
    data = SFTDataset("train.jsonl", processor, batch_size=4, max_length=2048)
    loss = causal_lm_loss(model, data.batch(0))
"""

from .data import SFTDataset, Skipped, read_jsonl
from .labels import IGNORE_INDEX, assistant_labels
from .loss import causal_lm_loss, chunked_cross_entropy, shift_labels
from .optim import PARTS, OptimConfig, build_optimizer, learning_rate_schedule
from .trainer import Trainer, trainable_filter

__all__ = [
    "IGNORE_INDEX",
    "assistant_labels",
    "causal_lm_loss",
    "chunked_cross_entropy",
    "shift_labels",
    "PARTS",
    "OptimConfig",
    "build_optimizer",
    "learning_rate_schedule",
    "SFTDataset",
    "Skipped",
    "read_jsonl",
    "Trainer",
    "trainable_filter",
]
