"""qwen3vl-jax: Qwen3-VL in JAX, Flax NNX and Pallas."""

from .config import PRESETS, Qwen3VLConfig, TextConfig, VisionConfig, preset
from .model import Qwen3VL, count_params

__all__ = ["Qwen3VL", "Qwen3VLConfig", "VisionConfig", "TextConfig", "PRESETS", "preset", "count_params"]
