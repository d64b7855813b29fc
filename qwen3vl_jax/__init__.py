"""qwen3vl-jax: Qwen3-VL in JAX, Flax NNX and Pallas.

    from qwen3vl_jax import Qwen3VL, Qwen3VLProcessor
    model = Qwen3VL.from_pretrained(path)
    processor = Qwen3VLProcessor.from_pretrained(path)
"""

from .buckets import EncoderRunner
from .config import PRESETS, Qwen3VLConfig, TextConfig, VisionConfig, preset
from .model import Qwen3VL, count_params
from .processing import Qwen3VLProcessor
from .testing import make_tiny_checkpoint
from .training import lora as _peft_adapters  # noqa: F401  registers `from_pretrained(adapter=...)`

__all__ = [
    # the model and its inputs
    "Qwen3VL",
    "Qwen3VLProcessor",
    "EncoderRunner",
    # configuration
    "Qwen3VLConfig",
    "VisionConfig",
    "TextConfig",
    "PRESETS",
    "preset",
    # utilities
    "count_params",
    "make_tiny_checkpoint",
]
