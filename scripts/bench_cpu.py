"""CPU benchmark: our jitted JAX model against HF torch eager, same weights, same run.

    .venv/bin/python scripts/bench_cpu.py [--repeats 5] [--llm-layers 4] [--parts vision generate]
        [--prompt-tokens 512] [--new-tokens 32] [--moe]

The model has the 2B preset's widths with random weights (the real architecture) and
`--llm-layers` decoder layers. First the machine's limits are measured in the same run: XLA's FLOP
rate on one large f32 matmul and its memory bandwidth on one large f32 matrix-vector product.
Vision part: one 448x448 image (grid 1x28x28) and one 8-frame 448x448 video (grid 4x28x28) through
the vision tower, with its FLOP rate as a fraction of the matmul's. Generation part: greedy
`generate` on a text prompt of `--prompt-tokens` tokens and on a 448x448 image prompt; prefill is
the time to the first token, decode the tokens/s of the remaining `--new-tokens - 1`, also as the
weight bytes read per token over the time, a fraction of the matrix-vector bandwidth; decoding runs
in on-device chunks (`generate.DECODE_CHUNK` tokens per host synchronization) and, for comparison,
one token per device call (`decode_chunk=1`, the per-token host loop). Prints median wall times of
both sides and the ratio HF / ours (above 1 means we are faster). Writes nothing.

`--quantize int8 int4 fp8`: instead, weight-only quantized decoding (`qwen3vl_jax.quant`: the
language model's linears quantized, the embeddings / tied LM head, norms and vision tower in f32)
against the same model with f32 and with bf16 weights, in the same run: greedy decode tokens/s on
a text prompt (medians of `--repeats`), the ratio to f32, the weight bytes read per token,
and the logit error against f32 (max |diff| / max |logit| over the prompt) with the share of
generated greedy ids equal to f32's. No HF model is run for this part.

`--moe`: the 30B-A3B widths instead (hidden 2048, 128 experts of width 768, top 8; HF's
`Qwen3VLMoeForConditionalGeneration` beside ours); the decode bandwidth fraction then counts the
weights a token actually reads: the attention, the router and its 8 active experts per layer.
`--moe --parts experts`: one layer's experts alone (`moe.expert_ffn`, the CPU's `"tiled"` path,
against the HF model's first `Qwen3VLMoeTextExperts` with the implementation HF picked, the same
weights and routing)
at 256, 512 and 1,024 tokens, then the product both sides' expert loops are made of, one expert's
`[M, 2048] @ [2048, 1536]` at M = 16, 32, 64 rows (the rows an expert gets in those prefills), for 32
experts in turn: XLA's `dot` in a `lax.map` (what the tiled path runs) against torch's `linear`, in
GFLOP/s and as fractions of the matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (jit compile on our side, allocator warm-up on HF's)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--llm-layers", type=int, default=4, help="decoder layers kept from the 2B preset")
    parser.add_argument("--parts", nargs="+", choices=("vision", "generate", "experts"), default=["vision", "generate"],
                        help="experts: one MoE layer's experts and their products alone (with --moe)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--moe", action="store_true", help="the 30B-A3B widths (routed experts) instead of 2B")
    parser.add_argument("--quantize", nargs="+", choices=("int8", "int4", "fp8"), default=None,
                        help="benchmark quantized decoding against f32 and bf16 instead")
    args = parser.parse_args(argv)
    if "experts" in args.parts and not args.moe:
        parser.error("--parts experts needs --moe")

    import jax
    import torch
    import transformers

    from qwen3vl_jax import Qwen3VL, preset

    torch.manual_seed(0)
    name = "30b-a3b" if args.moe else "2b"
    config = preset(name)
    # (fewer decoder layers than deepstack levels: keep the levels that still have a layer)
    levels = config.vision.deepstack_visual_indexes[:args.llm_layers]
    config = config.replace(text={"num_hidden_layers": args.llm_layers}, vision={"deepstack_visual_indexes": levels})
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{name} widths: vision depth {config.vision.depth}, hidden {config.vision.hidden_size}; "
          f"LLM layers kept {config.text.num_hidden_layers}")
    hf_class = getattr(transformers, f"Qwen3VL{'Moe' if args.moe else ''}ForConditionalGeneration")
    hf = hf_class(config.to_hf_config()).eval()
    ours = None
    if args.quantize or {"vision", "generate"} & set(args.parts):  # (the experts part needs HF's model only)
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            if args.quantize:
                bench_quantized(tmp, config, args)
                return
            ours = Qwen3VL.from_pretrained(tmp)

    limits = machine_limits(args.repeats)
    if "experts" in args.parts:
        bench_experts(hf, config, args.repeats, limits)
    if "vision" in args.parts:
        bench_vision(hf, ours, config, args.repeats, limits)
    if "generate" in args.parts:
        bench_generate(hf, ours, config, args, limits)


def machine_limits(repeats: int) -> dict:
    """XLA's f32 FLOP rate on a large matmul and its bandwidth on a large matrix-vector product."""
    import jax
    import jax.numpy as jnp

    n = 4096
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    t_mm = _median_seconds(lambda: matmul(a).block_until_ready(), repeats)
    m = 8192
    w = jnp.asarray(np.random.default_rng(1).standard_normal((m, m)), jnp.float32)
    x = jnp.ones((1, m), jnp.float32)
    matvec = jax.jit(lambda w, x: x @ w)
    t_mv = _median_seconds(lambda: matvec(w, x).block_until_ready(), repeats)
    limits = {"flops": 2 * n**3 / t_mm, "bandwidth": m * m * 4 / t_mv}
    print(f"machine (XLA, same run): f32 matmul {n}^3 {limits['flops'] / 1e9:.0f} GFLOP/s; "
          f"f32 matrix-vector {m}^2 {limits['bandwidth'] / 1e9:.1f} GB/s")
    return limits


def bench_experts(hf_model, config, repeats: int, limits: dict) -> None:
    """One MoE layer's experts (ours `"tiled"`, HF's experts module of `hf_model`'s first layer, with
    the implementation HF picked for it) and the per-expert product."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax import lax
    from qwen3vl_jax import moe

    text = config.text
    e, h, width, k = text.num_experts, text.hidden_size, text.moe_intermediate_size, text.num_experts_per_tok
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((e, h, 2 * width), np.float32) * 0.02  # our layout [E, H, 2I]
    down = rng.standard_normal((e, width, h), np.float32) * 0.02
    hf = hf_model.model.language_model.layers[0].mlp.experts
    with torch.no_grad():  # HF's module layout [E, 2I, H], [E, H, I]
        hf.gate_up_proj.copy_(torch.from_numpy(gate_up).transpose(1, 2))
        hf.down_proj.copy_(torch.from_numpy(down).transpose(1, 2))
    gate_up_j, down_j = jnp.asarray(gate_up), jnp.asarray(down)
    ffn = jax.jit(lambda x, chosen, weights, gu, dn: moe.expert_ffn(
        x, moe.Routing(None, chosen, weights), gu, dn, implementation="tiled"))
    print(f"MoE experts alone (one layer, f32; HF's experts implementation "
          f"{getattr(hf.config, '_experts_implementation', None) or 'default'}):")
    for tokens in (256, 512, 1024):
        x = rng.standard_normal((tokens, h), np.float32)
        routing = moe.route(jnp.asarray(rng.standard_normal((tokens, e), np.float32)), k)
        chosen, weights = np.array(routing.experts), np.array(routing.weights)
        args = (jnp.asarray(x), routing.experts, routing.weights, gate_up_j, down_j)
        t_ours = _median_seconds(lambda: ffn(*args).block_until_ready(), repeats)
        xt, ct, wt = torch.from_numpy(x), torch.from_numpy(chosen).long(), torch.from_numpy(weights)
        with torch.no_grad():
            t_hf = _median_seconds(lambda: hf(xt, ct, wt), repeats)
            error = float(np.max(np.abs(np.asarray(ffn(*args)) - hf(xt, ct, wt).numpy())))
        flops = 2 * tokens * k * h * 3 * width
        print(f"  {tokens:5d} tokens ({tokens * k // e} rows per expert on average): ours {t_ours * 1e3:7.1f} ms "
              f"({flops / t_ours / 1e9:.0f} GFLOP/s), HF {t_hf * 1e3:7.1f} ms ({flops / t_hf / 1e9:.0f}); "
              f"HF / ours {t_hf / t_ours:.2f}; max |diff| {error:.1e}")

    experts = 32
    product = jax.jit(lambda x, w: lax.map(lambda pair: pair[0] @ pair[1], (x, w)))
    w = rng.standard_normal((experts, h, 2 * width), np.float32)
    w_j, w_t = jnp.asarray(w), torch.from_numpy(w).transpose(1, 2).contiguous()  # torch: [out, in]
    print(f"one expert's [M, {h}] @ [{h}, {2 * width}] for {experts} experts in turn (f32):")
    for rows in (16, 32, 64):
        x = rng.standard_normal((experts, rows, h), np.float32)
        x_j, x_t = jnp.asarray(x), torch.from_numpy(x)
        t_xla = _median_seconds(lambda: product(x_j, w_j).block_until_ready(), repeats)
        with torch.no_grad():
            t_torch = _median_seconds(lambda: [torch.nn.functional.linear(x_t[i], w_t[i]) for i in range(experts)],
                                      repeats)
        flops = 2 * experts * rows * h * 2 * width
        rate_xla, rate_torch = flops / t_xla, flops / t_torch
        print(f"  M = {rows:3d}: XLA dot {rate_xla / 1e9:5.0f} GFLOP/s ({rate_xla / limits['flops']:.2f} of the "
              f"matmul rate), torch linear {rate_torch / 1e9:5.0f} ({rate_torch / limits['flops']:.2f}); "
              f"torch / XLA {rate_torch / rate_xla:.2f}")


def vision_flops(config, grid) -> float:
    """Matmul FLOPs of the vision tower (patch embed, blocks, attention, mergers) for `grid`."""
    v = config.vision
    patches = int(np.prod(grid, axis=1).sum())
    e, i = v.hidden_size, v.intermediate_size
    frames = [int(h * w) for t, h, w in grid for _ in range(int(t))]
    attention = 2 * 2 * sum(n * n for n in frames) * e  # q.k and p.v over each frame's segment
    block = 2 * patches * (3 * e * e + e * e + 2 * e * i) + attention
    merged = patches // v.merge_unit
    merger = 2 * merged * (4 * e * 4 * e + 4 * e * v.out_hidden_size)
    levels = 1 + len(v.deepstack_visual_indexes)
    return 2 * patches * v.patch_dim * e + v.depth * block + levels * merger


def bench_vision(hf, ours, config, repeats: int, limits: dict) -> None:
    import jax
    import torch

    rows = []
    rng = np.random.default_rng(0)
    for name, grid in (("image 448x448", [[1, 28, 28]]), ("video 8x448x448", [[4, 28, 28]])):
        grid = np.asarray(grid)
        pix = rng.standard_normal((int(grid.prod(1).sum()), config.vision.patch_dim)).astype(np.float32)
        pix_t, grid_t = torch.from_numpy(pix), torch.from_numpy(grid)

        def run_hf():
            with torch.no_grad():
                return hf.model.visual(pix_t, grid_t).pooler_output

        def run_ours():
            merged, deepstack = ours.encode_vision(pix, grid)
            return jax.block_until_ready((merged, deepstack))

        diff = float(np.abs(np.asarray(run_ours()[0]) - run_hf().numpy()).max())
        t_hf, t_ours = _median_seconds(run_hf, repeats), _median_seconds(run_ours, repeats)
        rows.append((name, int(grid.prod()), t_hf, t_ours, diff, vision_flops(config, grid) / t_ours))

    print(f"\n{'vision tower':<18}{'patches':>9}{'HF eager s':>12}{'ours jit s':>12}{'HF/ours':>9}{'max|diff|':>11}"
          f"{'GFLOP/s':>9}{'of matmul':>11}")
    for name, patches, t_hf, t_ours, diff, rate in rows:
        print(f"{name:<18}{patches:>9}{t_hf:>12.3f}{t_ours:>12.3f}{t_hf / t_ours:>9.2f}{diff:>11.2e}"
              f"{rate / 1e9:>9.0f}{rate / limits['flops']:>11.0%}")


def decode_weight_bytes(model) -> int:
    """Parameter bytes one decode step reads: every decoder layer, the final norm and the LM head
    (the embedding matrix when tied; one embedding row is negligible); of a MoE layer's experts only
    the `num_experts_per_tok` a token is routed to."""
    from qwen3vl_jax.params import canonical_params

    params = canonical_params(model)
    text = model.config.text
    head = "language_model.embed_tokens.embedding" if model.config.tie_word_embeddings else "lm_head.kernel"
    names = [p for p in params if p.startswith(("language_model.layers.", "language_model.norm.")) or p == head]

    def read(p):
        share = text.num_experts_per_tok / text.num_experts if ".mlp.experts." in p else 1.0
        return params[p].size * params[p].dtype.itemsize * share

    return int(sum(read(p) for p in names))


def bench_generate(hf, ours, config, args, limits: dict) -> None:
    import torch

    from qwen3vl_jax.generate import DECODE_CHUNK

    rng = np.random.default_rng(1)
    cfg = config
    merged_side = 14  # a 448x448 image: 28x28 patches, 14x14 merged tokens
    image_prompt = np.concatenate([
        rng.integers(0, 1000, 16), [cfg.vision_start_token_id], np.full(merged_side**2, cfg.image_token_id),
        [cfg.vision_end_token_id], rng.integers(0, 1000, 16)])[None]
    pixels = rng.standard_normal((28 * 28, cfg.vision.patch_dim)).astype(np.float32)
    cases = {
        f"text {args.prompt_tokens} tok": dict(input_ids=rng.integers(0, 1000, (1, args.prompt_tokens))),
        "image 448x448": dict(input_ids=image_prompt, pixel_values=pixels, image_grid_thw=np.asarray([[1, 28, 28]])),
    }
    weight_bytes = decode_weight_bytes(ours)
    print(f"\ndecode reads {weight_bytes / 2**30:.2f} GiB of weights per token; 'of bw' = weight bytes per "
          f"token / time, against the matrix-vector bandwidth")
    print(f"{'generate (greedy)':<18}{'prompt':>7}{'HF prefill s':>14}{'ours prefill s':>16}{'ratio':>7}"
          f"{'HF tok/s':>10}{'ours tok/s':>12}{'ratio':>7}{'of bw':>7}{'chunk=1 tok/s':>15}{'of bw':>7}"
          f"{'same ids':>10}")
    for name, inputs in cases.items():
        mask = np.ones_like(inputs["input_ids"])
        types = (inputs["input_ids"] == cfg.image_token_id).astype(np.int64)
        ours_kw = dict(inputs, attention_mask=mask, mm_token_type_ids=types)
        hf_kw = {k: torch.from_numpy(np.asarray(v)) for k, v in ours_kw.items()}

        def hf_run(n):
            with torch.no_grad():
                return hf.generate(**hf_kw, max_new_tokens=n, min_new_tokens=n, do_sample=False).numpy()

        def ours_run(n, chunk=DECODE_CHUNK):
            return ours.generate(**ours_kw, max_new_tokens=n, eos_token_id=[], decode_chunk=chunk)

        n = args.new_tokens
        same = np.array_equal(hf_run(n), ours_run(n)) and np.array_equal(ours_run(n, 1), ours_run(n))
        hf_first, ours_first = _median_seconds(lambda: hf_run(1), args.repeats), _median_seconds(lambda: ours_run(1), args.repeats)
        hf_all, ours_all = _median_seconds(lambda: hf_run(n), args.repeats), _median_seconds(lambda: ours_run(n), args.repeats)
        per_token_all = _median_seconds(lambda: ours_run(n, 1), args.repeats)
        hf_rate, ours_rate = (n - 1) / (hf_all - hf_first), (n - 1) / (ours_all - ours_first)
        per_token_rate = (n - 1) / (per_token_all - ours_first)
        bandwidth = limits["bandwidth"]
        print(f"{name:<18}{inputs['input_ids'].shape[1]:>7}{hf_first:>14.3f}{ours_first:>16.3f}"
              f"{hf_first / ours_first:>7.2f}{hf_rate:>10.1f}{ours_rate:>12.1f}{ours_rate / hf_rate:>7.2f}"
              f"{ours_rate * weight_bytes / bandwidth:>7.0%}{per_token_rate:>15.1f}"
              f"{per_token_rate * weight_bytes / bandwidth:>7.0%}{str(same):>10}")


def bench_quantized(directory, config, args) -> None:
    """Decode tokens/s of f32, bf16 and each `--quantize` method, one model at a time, same run."""
    import jax.numpy as jnp

    from qwen3vl_jax import Qwen3VL

    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 1000, (1, 32))
    n = args.new_tokens
    variants = [("f32", dict()), ("bf16", dict(dtype=jnp.bfloat16))]
    variants += [(m, dict(quantize=m)) for m in args.quantize]
    rows, reference = [], None
    for name, options in variants:
        model = Qwen3VL.from_pretrained(directory, **options)
        logits = np.asarray(model(prompt), np.float32)
        ids = model.generate(prompt, max_new_tokens=n, eos_token_id=[])

        def run(k, model=model):
            return model.generate(prompt, max_new_tokens=k, eos_token_id=[])

        first = _median_seconds(lambda: run(1), args.repeats)
        total = _median_seconds(lambda: run(n), args.repeats)
        rate = (n - 1) / (total - first)
        if reference is None:
            reference = (logits, ids)
        error = np.abs(logits - reference[0]).max() / np.abs(reference[0]).max()
        new = slice(prompt.shape[1], None)  # the generated tokens only
        same = float(np.mean(np.asarray(ids)[:, new] == np.asarray(reference[1])[:, new]))
        rows.append((name, decode_weight_bytes(model), rate, error, same))
    print(f"\nquantized decode ({config.text.num_hidden_layers} decoder layers of the 2B widths; text prompt "
          f"{prompt.shape[1]} tokens, {n} new tokens; medians of {args.repeats})")
    print(f"{'weights':<8}{'decode GiB/tok':>15}{'tok/s':>8}{'vs f32':>8}{'logit err':>11}{'new ids as f32':>16}")
    for name, nbytes, rate, error, same in rows:
        print(f"{name:<8}{nbytes / 2**30:>15.3f}{rate:>8.2f}{rate / rows[0][2]:>8.2f}{error:>11.2e}{same:>16.0%}")


if __name__ == "__main__":
    main()
