"""Supervised fine-tuning: labels, the loss, the optimizer and the data pipeline."""

from .labels import IGNORE_INDEX, assistant_labels
from .loss import causal_lm_loss, chunked_cross_entropy, shift_labels
from .optim import PARTS, OptimConfig, build_optimizer, learning_rate_schedule

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
]
