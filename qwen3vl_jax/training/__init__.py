"""Supervised fine-tuning: labels, the loss, the optimizer and the data pipeline."""

from .labels import IGNORE_INDEX, assistant_labels
from .loss import causal_lm_loss, chunked_cross_entropy, shift_labels

__all__ = ["IGNORE_INDEX", "assistant_labels", "causal_lm_loss", "chunked_cross_entropy", "shift_labels"]
