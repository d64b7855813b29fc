"""The optimizer against `torch.optim.AdamW` + `clip_grad_norm_` + HF's cosine schedule, on the tiny
model's parameters with the same gradients; the schedule against its formula; freezing; accumulation."""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from qwen3vl_jax.training import PARTS, OptimConfig, build_optimizer, learning_rate_schedule
from qwen3vl_jax.training.optim import decays, param_part, param_path


@pytest.fixture(scope="module")
def params(jax_model):
    return nnx.to_pure_dict(nnx.state(jax_model, nnx.Param))


def gradients(params, seed: int, scale: float = 1.0):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_unflatten(
        treedef, [(scale * rng.standard_normal(np.shape(x))).astype(np.float32) for x in leaves])


def flat(tree) -> dict[str, np.ndarray]:
    return {param_path(kp): np.asarray(leaf) for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def cosine_with_warmup(step, peak, warmup, total, end=0.0):
    """The schedule written out by hand."""
    if step < warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def hf_rates(make_scheduler, peak: float, updates: int) -> list[float]:
    """The rate of each of `updates` updates under HF's scheduler `make_scheduler(optimizer)`."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    scheduler = make_scheduler(opt)
    rates = []
    for _ in range(updates):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


def test_schedule_formula_and_hf():
    from transformers import get_cosine_schedule_with_warmup

    config = OptimConfig(learning_rate=3e-4, warmup_steps=10, total_steps=100)
    schedule = learning_rate_schedule(3e-4, config)
    hf_values = hf_rates(lambda opt: get_cosine_schedule_with_warmup(opt, num_warmup_steps=10,
                                                                     num_training_steps=100), 3e-4, 120)
    for step in (0, 1, 5, 9, 10, 11, 37, 55, 99, 100, 119):
        expected = cosine_with_warmup(step, 3e-4, 10, 100)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=3e-10), step
        if step <= 100:  # past the end HF's cosine rises again; ours stays at the end value
            assert float(schedule(step)) == pytest.approx(hf_values[step], rel=1e-5, abs=3e-10), step
    ends = OptimConfig(warmup_steps=2, total_steps=12, end_learning_rate_ratio=0.1)
    with_end = learning_rate_schedule(1.0, ends)
    for step in (0, 1, 2, 7, 12, 20):
        expected = cosine_with_warmup(step, 1.0, 2, 12, 0.1)
        assert float(with_end(step)) == pytest.approx(expected, rel=1e-5), step


def test_warmup_stable_decay_schedule_equals_hf():
    """`decay_steps`: warmup, the peak held, a cosine over the last `decay_steps` updates, then the end
    value: HF's `get_wsd_schedule` (its warmup starts at the end ratio, ours at 0, as the cosine's)."""
    from transformers import get_wsd_schedule

    for ratio in (0.0, 0.05):
        config = OptimConfig(learning_rate=2e-3, warmup_steps=10, total_steps=100, decay_steps=30,
                             end_learning_rate_ratio=ratio)
        schedule = learning_rate_schedule(2e-3, config)
        hf_values = hf_rates(lambda opt, r=ratio: get_wsd_schedule(
            opt, num_warmup_steps=10, num_decay_steps=30, num_training_steps=100, min_lr_ratio=r), 2e-3, 110)
        for step in (0, 5, 10, 40, 69, 70, 71, 85, 99, 100, 109):
            if step >= 10 or ratio == 0.0:
                expected = hf_values[step]
                assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=3e-10), (ratio, step)
        assert float(schedule(5)) == pytest.approx(1e-3, rel=1e-6)
        assert float(schedule(70)) == pytest.approx(2e-3, rel=1e-6)
    no_warmup = learning_rate_schedule(2e-3, OptimConfig(learning_rate=2e-3, total_steps=100, decay_steps=30))
    hf_values = hf_rates(lambda opt: get_wsd_schedule(opt, num_warmup_steps=0, num_decay_steps=30,
                                                      num_training_steps=100), 2e-3, 110)
    for step in (0, 1, 69, 70, 85, 100, 109):
        assert float(no_warmup(step)) == pytest.approx(hf_values[step], rel=1e-5, abs=3e-10), step
    assert float(no_warmup(0)) == pytest.approx(2e-3, rel=1e-6)
    with pytest.raises(ValueError, match="warmup_steps \\+ decay_steps"):
        OptimConfig(warmup_steps=10, total_steps=100, decay_steps=91)
    with pytest.raises(ValueError, match="decay_steps"):
        OptimConfig(total_steps=100, decay_steps=0)


def test_adamw_steps_equal_torch(params):
    """Three updates (warmup then decay), vision frozen, separate merger / language rates, weight
    decay except on biases and norms, clipping active: the same parameters as torch."""
    config = OptimConfig(learning_rate=1e-3, part_learning_rates={"merger": 3e-3}, freeze=("vision",),
                         warmup_steps=1, total_steps=5, weight_decay=0.1, b1=0.8, b2=0.95, eps=1e-6,
                         max_grad_norm=1.0)
    tx = build_optimizer(config)
    state = tx.init(params)
    ours = params
    grads = [gradients(params, seed) for seed in range(3)]
    for g in grads:
        updates, state = jax.jit(tx.update)(g, state, ours)
        ours = optax.apply_updates(ours, updates)

    start = flat(params)
    tensors = {path: torch.tensor(value, requires_grad=True) for path, value in start.items()}
    trained = {path: t for path, t in tensors.items() if param_part(path) != "vision"}
    groups = {}
    for path, t in trained.items():
        part, decay = param_part(path), decays(path)
        groups.setdefault((part, decay), []).append(t)
    opt = torch.optim.AdamW(
        [{"params": ts, "lr": config.peak(part), "weight_decay": 0.1 if decay else 0.0}
         for (part, decay), ts in groups.items()],
        betas=(0.8, 0.95), eps=1e-6)
    from transformers import get_cosine_schedule_with_warmup

    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=5)
    norms = []
    for g in grads:
        for path, value in flat(g).items():
            tensors[path].grad = torch.from_numpy(value)
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(trained.values()), max_norm=1.0)))
        opt.step()
        sched.step()
    assert min(norms) > 10, "the clipping should be active"

    after = flat(ours)
    decayed = not_decayed = 0
    for path, value in after.items():
        if param_part(path) == "vision":
            np.testing.assert_array_equal(value, start[path], err_msg=f"frozen {path} moved")
            continue
        ref = tensors[path].detach().numpy()
        assert not np.array_equal(ref, start[path]), f"{path} did not move in torch"
        np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-7, err_msg=path)
        decayed += decays(path)
        not_decayed += not decays(path)
    assert decayed and not_decayed


def test_accumulation_is_one_step_on_the_mean_gradient(params):
    # eps near the clipped gradients' size: Adam's first update, lr * m / (sqrt(v) + eps), is then
    # well conditioned where the two micro-batch gradients cancel (with eps=1e-8 it is ~lr * sign).
    config = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10, weight_decay=0.01,
                         eps=1e-3, max_grad_norm=1.0)
    g1, g2 = gradients(params, 1), gradients(params, 2)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, g1, g2)
    tx = build_optimizer(config)
    updates, _ = jax.jit(tx.update)(mean, tx.init(params), params)
    expected = optax.apply_updates(params, updates)

    accum = build_optimizer(OptimConfig(**{**config.__dict__, "grad_accum_steps": 2}))
    state = accum.init(params)
    update = jax.jit(accum.update)
    updates, state = update(g1, state, params)
    middle = optax.apply_updates(params, updates)
    jax.tree.map(np.testing.assert_array_equal, middle, params)  # no update after the first micro-batch
    updates, state = update(g2, state, middle)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 optax.apply_updates(middle, updates), expected)


def test_parts_and_bad_names():
    with pytest.raises(ValueError, match="unknown model part 'visual'; the parts are vision, merger, "
                                         "language"):
        OptimConfig(freeze=("visual",))
    with pytest.raises(ValueError, match="unknown model part 'llm'"):
        OptimConfig(part_learning_rates={"llm": 1e-4})
    with pytest.raises(ValueError, match="every part is frozen"):
        OptimConfig(freeze=tuple(PARTS))
    # Both the per-layer list layout and the stacked one (a leading layer axis, no index).
    assert param_part("visual.blocks.3.attn.qkv.kernel") == "vision"
    assert param_part("visual.blocks.attn.qkv.kernel") == "vision"
    assert param_part("visual.deepstack_merger_list.norm.scale") == "merger"
    assert param_part("language_model.layers.self_attn.q_proj.kernel") == "language"
    assert param_part("lm_head.kernel") == "language"
    assert not decays("language_model.layers.self_attn.q_norm.weight")
    assert not decays("visual.blocks.0.norm1.scale") and not decays("visual.blocks.0.attn.qkv.bias")
    assert decays("language_model.embed_tokens.embedding") and decays("visual.merger.linear_fc1.kernel")


@pytest.mark.slow  # (the Trainer's tests use the same transformation on the model in the fast tier)
def test_works_as_an_nnx_optimizer(tiny_dir):
    """The same transformation drives `nnx.Optimizer` on the model's own state tree (Variables, not
    a pure dict): the frozen vision tower stays put, the merger and language model move."""
    from qwen3vl_jax import Qwen3VL

    model = Qwen3VL.from_pretrained(tiny_dir)  # a private copy: the update edits it in place
    optimizer = nnx.Optimizer(model, build_optimizer(OptimConfig(learning_rate=1e-2, freeze=("vision",))),
                              wrt=nnx.Param)
    before = flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    grads = jax.tree.map(np.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    optimizer.update(model, grads)  # a second update, from the carried Adam state
    after = flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    for path, value in after.items():
        moved = not np.array_equal(value, before[path])
        assert moved == (param_part(path) != "vision"), path
