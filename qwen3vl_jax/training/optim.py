"""The optimizer: AdamW per model part, warmup + cosine schedule, clipping, accumulation, freezing.

The model has three parts that Qwen's own fine-tuning recipe trains at different rates (or not at
all), each named by parameter-path prefixes that hold whether layers are a list (`blocks.3.`) or a
stack (`blocks.` with a leading layer axis):

  vision    visual.patch_embed, visual.pos_embed, visual.blocks
  merger    visual.merger, visual.deepstack_merger_list
  language  language_model, lm_head

`build_optimizer(config)` chains, in the order HF's Trainer applies them:
  1. frozen parts' gradients set to zero (so they do not count in the clipping norm),
  2. `optax.clip_by_global_norm` (`torch.nn.utils.clip_grad_norm_`),
  3. `optax.multi_transform`: per trained part `optax.adamw` with its own peak learning rate on the
     shared warmup + cosine schedule; frozen parts get `optax.set_to_zero` (no optimizer state),
and wraps it in `optax.MultiSteps` for gradient accumulation (the mean of k micro-batch gradients,
then one update; the schedule counts updates, not micro-batches), for use as a plain optax /
`nnx.Optimizer` transformation. `trainer.Trainer` builds it with one step and accumulates itself:
HF's token-weighted accumulation, which the mean of micro-batch means is not.

Weight decay follows HF's Trainer (`Trainer.get_decay_parameter_names`): biases and norm scales are
not decayed; everything else, embeddings included, is.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from ..checks import non_negative_int, positive_int, positive_number

__all__ = ["PARTS", "OptimConfig", "build_optimizer", "learning_rate_schedule", "param_part", "is_frozen",
           "param_labels", "decays", "param_path"]

PARTS: dict[str, tuple[str, ...]] = {
    "vision": ("visual.patch_embed", "visual.pos_embed", "visual.blocks"),
    "merger": ("visual.merger", "visual.deepstack_merger_list"),
    "language": ("language_model", "lm_head"),
    "router": (),  # the MoE routers (`language_model.layers.N.mlp.gate`): a part of `language` of its own
}

FROZEN = "frozen"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer hyperparameters (HF `TrainingArguments` names where they exist).

    learning_rate: peak rate of every trained part without its own entry in `part_learning_rates`.
    part_learning_rates: e.g. `{"vision": 2e-6, "merger": 1e-5}` (keys from `PARTS`).
    freeze: parts that do not move, e.g. `("vision",)`.
    warmup_steps, total_steps: linear warmup from 0 to the peak over `warmup_steps` updates, then
      cosine decay to `end_learning_rate_ratio * peak` at `total_steps` (constant after).
    decay_steps: None (the default): the cosine spans every update after the warmup. A number: the
      rate stays at the peak after the warmup and the cosine spans only the last `decay_steps` updates
      before `total_steps` (warmup-stable-decay), so a curriculum's late phases train at the peak.
    max_grad_norm: global-norm clipping of the trained parts' gradients; None = off.
    grad_accum_steps: micro-batches per update.
    """

    learning_rate: float = 1e-5
    part_learning_rates: dict[str, float] = dataclasses.field(default_factory=dict)
    freeze: tuple[str, ...] = ()
    warmup_steps: int = 0
    total_steps: int = 1000
    end_learning_rate_ratio: float = 0.0
    decay_steps: int | None = None
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    grad_accum_steps: int = 1

    def __post_init__(self):
        object.__setattr__(self, "freeze", tuple(self.freeze))
        for name in (*self.freeze, *self.part_learning_rates):
            if name not in PARTS:
                raise ValueError(f"unknown model part {name!r}; the parts are {', '.join(PARTS)}")
        positive_number("learning_rate", self.learning_rate)  # nan / inf / <= 0 would train nothing or ascend
        for part, rate in self.part_learning_rates.items():
            positive_number(f"part_learning_rates[{part!r}]", rate)
        non_negative_int("warmup_steps", self.warmup_steps)
        positive_int("total_steps", self.total_steps)
        positive_int("grad_accum_steps", self.grad_accum_steps)
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"need 0 <= warmup_steps < total_steps, got warmup_steps={self.warmup_steps}, "
                             f"total_steps={self.total_steps}")
        if self.decay_steps is not None:
            positive_int("decay_steps", self.decay_steps)
            if self.warmup_steps + self.decay_steps > self.total_steps:
                raise ValueError(f"need warmup_steps + decay_steps <= total_steps, got {self.warmup_steps} + "
                                 f"{self.decay_steps} > {self.total_steps}")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if all(is_frozen(part, self.freeze) for part in PARTS):
            raise ValueError("every part is frozen: nothing would train")

    def peak(self, part: str) -> float:
        return float(self.part_learning_rates.get(part, self.learning_rate))


def param_path(key_path) -> str:
    """A pytree key path as a dotted parameter path (`language_model.layers.3.mlp.up_proj.kernel`).

    Works on pure dicts and on `nnx.State` trees (whose Variable leaves add attribute keys that are
    not part of the name).
    """
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
    return ".".join(parts)


def param_part(path: str) -> str:
    """The part (`vision`, `merger`, `language`, `router`) a dotted parameter path belongs to."""
    if path.startswith("language_model.") and ".mlp.gate." in path:
        return "router"
    for part, prefixes in PARTS.items():
        if any(path == p or path.startswith(p + ".") for p in prefixes):
            return part
    raise ValueError(f"parameter {path!r} belongs to no model part ({PARTS})")


def decays(path: str) -> bool:
    """Whether weight decay applies: not to biases nor to norm scales (HF Trainer's rule)."""
    names = path.split(".")
    return names[-1] != "bias" and not any("norm" in n for n in names[:-1])


def is_frozen(part: str, freeze: tuple[str, ...]) -> bool:
    """Whether `part` is frozen by `freeze` (freezing `language` freezes its routers too)."""
    return part in freeze or (part == "router" and "language" in freeze)


def param_labels(params, freeze: tuple[str, ...] = ()):
    """The tree of part names for `params` (`frozen` for the frozen parts)."""
    def label(key_path, _):
        part = param_part(param_path(key_path))
        return FROZEN if is_frozen(part, freeze) else part

    return jax.tree_util.tree_map_with_path(label, params)


def learning_rate_schedule(peak: float, config: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0, then cosine decay: HF's `get_cosine_schedule_with_warmup` up to
    `total_steps` (plus an optional end value); after it, the end value (HF's cosine rises again).
    With `config.decay_steps`, the peak holds until the cosine of the last `decay_steps` updates."""
    if config.decay_steps is None:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=peak, warmup_steps=config.warmup_steps, decay_steps=config.total_steps,
            end_value=peak * config.end_learning_rate_ratio)
    pieces, boundaries = [], []
    if config.warmup_steps:  # optax's linear schedule over 0 steps would be the constant 0
        pieces, boundaries = [optax.linear_schedule(0.0, peak, config.warmup_steps)], [config.warmup_steps]
    pieces += [optax.constant_schedule(peak),
               optax.cosine_decay_schedule(peak, config.decay_steps, alpha=config.end_learning_rate_ratio)]
    return optax.join_schedules(pieces, boundaries + [config.total_steps - config.decay_steps])


def build_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """The optax transformation for `config`; its `init` / `update` take the parameter tree."""
    trained = [p for p in PARTS if not is_frozen(p, config.freeze)]

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda kp, _: decays(param_path(kp)), params)

    def frozen_or_not(params):
        return jax.tree.map(lambda label: FROZEN if label == FROZEN else "trained",
                            param_labels(params, config.freeze))

    per_part = {
        part: optax.adamw(learning_rate_schedule(config.peak(part), config), b1=config.b1, b2=config.b2,
                          eps=config.eps, weight_decay=config.weight_decay, mask=decay_mask)
        for part in trained
    }
    per_part[FROZEN] = optax.set_to_zero()
    chain = optax.chain(
        optax.multi_transform({"trained": optax.identity(), FROZEN: optax.set_to_zero()}, frozen_or_not),
        optax.clip_by_global_norm(config.max_grad_norm) if config.max_grad_norm else optax.identity(),
        optax.multi_transform(per_part, lambda params: param_labels(params, config.freeze)),
    )
    if config.grad_accum_steps == 1:
        return chain
    return optax.MultiSteps(chain, every_k_schedule=config.grad_accum_steps).gradient_transformation()

