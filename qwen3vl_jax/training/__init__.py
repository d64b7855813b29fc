"""Supervised fine-tuning: labels, the loss, the optimizer and the data pipeline."""

from .labels import IGNORE_INDEX, assistant_labels

__all__ = ["IGNORE_INDEX", "assistant_labels"]
