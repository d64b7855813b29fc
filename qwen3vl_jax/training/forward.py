"""The forward pass up to the final norm, for the loss (a stand-in until the model exposes it).

`Qwen3VL.__call__` returns logits `[B, L, V]`; the loss wants the final hidden states `[B, L, E]` so
it can project them through the LM head a chunk of tokens at a time. This is
`qwen3vl_jax/model.py::_run_language_model` without its last line (`model.logits(...)`). When the
model's forward takes an option to stop before the LM head, this module goes away and the loss
calls that instead.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["final_hidden_states"]


def final_hidden_states(model, inputs) -> jnp.ndarray:
    """`[B, L, E]` hidden states after the final norm, for `inputs` from `model.prepare_inputs`."""
    embeds, deepstack = model.embed(inputs)
    length = inputs.input_ids.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    mask = causal[None] & inputs.attention_mask[:, None, :]
    return model.language_model(embeds, inputs.positions, mask, deepstack,
                                implementation=model.attention_implementation)
