"""Compile time of the decoder, unrolled (a list of layers) vs scanned (stacked layers under `lax.scan`).

    .venv/bin/python scripts/bench_compile.py [--presets 8b 32b] [--prompt 512] [--batch 1] [--dtype bfloat16]

For each preset, the text prefill (`generate.prefill` over a `--prompt`-token bucket, writing a
fresh KV cache) and one decode chunk (`generate._decode_chunk`: the on-device loop of
`generate.DECODE_CHUNK` steps) are lowered from abstract shapes (`Qwen3VL.abstract`: no weights are
allocated) and compiled for this machine's backend. Prints the lowering and compile seconds of
each, unrolled and scanned, and the ratio. Scanned compile time should stay roughly flat in depth
(8B: 36 layers, 32B: 64); unrolled grows with it. Writes nothing.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["8b", "32b"])
    parser.add_argument("--prompt", type=int, default=512, help="prefill bucket length")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode slots beyond the prompt")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qwen3vl_jax import Qwen3VL, preset
    from qwen3vl_jax.generate import DECODE_CHUNK, EOS_SLOTS, _decode_chunk, _DecodeState, prefill, cache_length
    from qwen3vl_jax.text import KVCache

    dtype = jnp.dtype(args.dtype)
    sds = jax.ShapeDtypeStruct
    print(f"jax {jax.__version__} ({jax.default_backend()}); {args.dtype}; batch {args.batch}, "
          f"prompt bucket {args.prompt}, decode chunk {DECODE_CHUNK}")
    print(f"{'preset':<7}{'layers':>7}{'layout':>10}{'stage':>9}{'lower s':>10}{'compile s':>11}")
    results = {}
    for name in args.presets:
        config = preset(name)
        text = config.text
        slots = cache_length(args.prompt, args.new_tokens)
        b = args.batch
        sampling = (sds((), jnp.float32), sds((), jnp.int32), sds((), jnp.float32))
        key = jax.random.key(0)
        for scan in (False, True):
            model = Qwen3VL.abstract(config, dtype=dtype, scan_layers=scan)
            graphdef, state = nnx.split(model)
            prefill_args = (graphdef, state, sds((b, args.prompt, text.hidden_size), dtype), None,
                            sds((3, b, args.prompt), jnp.int32), sds((b, args.prompt), jnp.bool_), key, *sampling)
            cache = jax.eval_shape(lambda: KVCache.empty(text, b, slots, dtype))
            decode = _DecodeState(cache, sds((b,), jnp.int32), sds((), jnp.int32), sds((b,), jnp.bool_))
            decode_args = (graphdef, state, decode, sds((b,), jnp.int32), sds((), jnp.int32),
                           sds((3, b), jnp.int32), sds((), jnp.int32), sds((EOS_SLOTS,), jnp.int32),
                           sds((), jnp.int32), key, *sampling)
            for stage, fn, fn_args, kwargs in (
                ("prefill", prefill, prefill_args, dict(slots=slots, do_sample=False)),
                ("decode", _decode_chunk, decode_args, dict(chunk=DECODE_CHUNK, do_sample=False)),
            ):
                start = time.perf_counter()
                lowered = fn.lower(*fn_args, **kwargs)
                lowering = time.perf_counter() - start
                start = time.perf_counter()
                lowered.compile()
                compiling = time.perf_counter() - start
                layout = "scanned" if scan else "unrolled"
                results[(name, layout, stage)] = lowering + compiling
                print(f"{name:<7}{text.num_hidden_layers:>7}{layout:>10}{stage:>9}{lowering:>10.2f}{compiling:>11.2f}",
                      flush=True)
    print("\nlower + compile seconds, unrolled / scanned:")
    for name in args.presets:
        for stage in ("prefill", "decode"):
            u, s = results[(name, "unrolled", stage)], results[(name, "scanned", stage)]
            print(f"  {name} {stage:<8} {u:8.2f} / {s:6.2f} = {u / s:5.1f}x")
    if len(args.presets) > 1:
        first, last = args.presets[0], args.presets[-1]
        for layout in ("unrolled", "scanned"):
            for stage in ("prefill", "decode"):
                a, z = results[(first, layout, stage)], results[(last, layout, stage)]
                print(f"  {layout} {stage}: {last} / {first} = {z / a:.2f}x "
                      f"(depth {preset(last).text.num_hidden_layers} / {preset(first).text.num_hidden_layers})")


if __name__ == "__main__":
    main()
