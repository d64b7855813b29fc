"""GPU benchmark and on-device correctness check of the Pallas kernels (needs a CUDA GPU).

    python scripts/bench_gpu.py [--iters 20] [--quick] [--no-sweep] [--json out.json]
    python scripts/bench_gpu.py --moe [--quick]   # the MoE experts only (`bench_moe`; --quick: 30B-A3B)
    python scripts/bench_gpu.py --cpu-smoke   # tiny shapes, interpret mode: checks this script only

For the 2B (vision: 16 heads x 64) and 8B (vision: 16 heads x 72, padded to 128 in the kernel)
shapes, and the LLM (head_dim 128, 16 or 32 query heads, 8 kv heads), in bf16:

- varlen vision attention: images of 448^2, 896^2, 1792^2 (patch 16: 784 / 3136 / 12544 tokens),
  an 8-frame 448^2 video (4 temporal slices of 784 tokens, one segment each) and the three images
  packed in one call. Pallas vs the model's XLA path vs `jax.nn.dot_product_attention(
  implementation="cudnn")` on the padded batch `[segments, max_len, H, D]` with sequence lengths.
- causal prefill, 4096 tokens: Pallas vs XLA (dense masked spec) vs cuDNN (`is_causal=True`).
- decode against an 8192-slot cache (batch 1 and 8): Pallas split-K vs XLA vs cuDNN (if it runs).
- position-embedding interpolation for the image sizes: Pallas vs XLA.

Each Pallas result is first checked against the XLA spec on the GPU (bf16 tolerance) and its
compiled HLO must contain the Triton custom call (no silent fallback). Prints, per row: time,
TFLOP/s (attention; for Pallas also at the padded head_dim, "kernel TFLOP/s"), GB/s
(interpolation output, decode K/V read), and the performance targets:
varlen >= 250 kernel TFLOP/s and >= 70% of cuDNN's speed; decode >= 70% of HBM bandwidth;
interpolation <= 2x the time to write its output. Exit status 1 on any correctness failure,
2 when no GPU is present (unless `--cpu-smoke`, which shrinks every shape, runs the kernels in
interpret mode, skips the Triton-presence check and measures nothing meaningful). Target misses
are reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}
TRITON = "__gpu$xla.gpu.triton"
VISION = {"2B": (16, 64, 1024), "8B": (16, 72, 1152)}  # heads, head_dim, hidden
LLM = {"2B": (16, 8), "8B": (32, 8)}  # query heads, kv heads (head_dim 128)
IMAGES = {  # name -> segment lengths (tokens per temporal slice)
    "448^2": [784],
    "896^2": [3136],
    "1792^2": [12544],
    "video 8f 448^2": [784] * 4,
    "packed 448+896+1792": [784, 3136, 12544],
}
GRIDS = {"448^2": [(1, 28, 28)], "896^2": [(1, 56, 56)], "1792^2": [(1, 112, 112)], "video 8f 448^2": [(4, 28, 28)]}


SMOKE = dict(  # --cpu-smoke: the same code paths on shapes the CPU interpreter runs in seconds
    VISION={"2B": (2, 64, 64), "8B": (2, 72, 48)},
    LLM={"2B": (4, 2), "8B": (8, 2)},
    IMAGES={"448^2": [48], "1792^2": [150], "video 8f 448^2": [16] * 4, "packed 448+896+1792": [16, 40, 90]},
    GRIDS={"448^2": [(1, 4, 6)], "1792^2": [(1, 8, 12)], "video 8f 448^2": [(4, 2, 2)]},
    PREFILL=128, CACHE=256, SWEEP=[(16, 16), (32, 16)], ITERS=1,
)

# hidden, expert width, experts, top-k
MOE = {"30B-A3B": (2048, 768, 128, 8), "235B-A22B": (4096, 1536, 128, 8)}
MOE_SMOKE = {"30B-A3B": (64, 32, 8, 2)}
MOE_TOKENS = (8, 4096)  # one decode step at batch 8; a prefill chunk (the smoke run too: tiny widths)


def bench_moe(report, shapes, iters: int, hbm: float, rng, smoke: bool = False) -> None:
    """The routed experts (`moe.expert_ffn`, the router excluded) in bf16 at the released MoE models'
    widths, for a decode step (8 tokens) and a prefill chunk (4,096 tokens): each implementation
    (`"ragged"`: `lax.ragged_dot`; `"tiled"`; `"tokamax"` when installed) checked against `"ragged"`
    and timed, beside HF's `Qwen3VLMoeTextExperts` on the same weights in torch on the same GPU (each
    `experts_implementation` it has: "eager", "grouped_mm") when torch sees a GPU. TFLOP/s count the
    routed rows' three products; GB/s count the weights of the experts the tokens chose (the bytes a
    decode step must read)."""
    import jax
    import jax.numpy as jnp

    from qwen3vl_jax import moe

    implementations = ["ragged", "tiled"]
    if moe.tokamax_installed():
        implementations.append("tokamax")
    else:
        print("(tokamax not installed: pip install 'qwen3vl-jax[tokamax]', Python >= 3.12)")
    torch = _torch_device(smoke)
    bf16 = jnp.bfloat16
    for model, (hidden, width, experts, k) in shapes.items():
        gate_up = jnp.asarray(0.02 * rng.standard_normal((experts, hidden, 2 * width), np.float32), bf16)
        down = jnp.asarray(0.02 * rng.standard_normal((experts, width, hidden), np.float32), bf16)
        for tokens in MOE_TOKENS:
            x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32), bf16)
            routing = moe.route(jnp.asarray(rng.standard_normal((tokens, experts), np.float32), bf16), k)
            flops = 2 * tokens * k * hidden * 3 * width
            chosen = len(np.unique(np.asarray(routing.experts)))
            weight_bytes = chosen * hidden * 3 * width * 2
            case = f"{model} {tokens} tok"
            args = (x, routing.experts, routing.weights, gate_up, down)
            outputs = {}
            for impl in implementations:
                fn = jax.jit(lambda x, e, w, gu, d, impl=impl: moe.expert_ffn(x, moe.Routing(None, e, w), gu, d,
                                                                               implementation=impl))
                try:
                    outputs[impl] = fn(*args)
                    err = report.check(f"moe {case} {impl}", outputs[impl], outputs["ragged"], 3e-2)
                    t = _time(fn, args, iters)
                    lowered = fn.lower(*args).as_text().lower()
                    kernel = next((f"; a {name} kernel" for key, name in (("mosaic", "Mosaic GPU"), ("triton", "Triton"))
                                   if key in lowered), "")
                    report.row("moe", case, impl, t, flops / t / 1e12, gbps=weight_bytes / t / 1e9,
                               note=f"max|err| {err:.2g} vs ragged; {chosen} experts chosen{kernel}")
                except Exception as e:  # a kernel that does not lower here is reported, not fatal
                    report.row("moe", case, impl, None, note=f"failed: {type(e).__name__}: {str(e)[:100]}")
            if "tokamax" in implementations:
                _bench_tokamax_mosaic(report, case, x, routing, gate_up, k, iters)
            if tokens < 64:
                report.target(f"moe {case}: our best >= 50% of HBM (the chosen experts' weights)",
                              weight_bytes / hbm >= 0.5 * _best(report, "moe", case),
                              f"{weight_bytes / 1e6:.0f} MB of weights, floor {weight_bytes / hbm * 1e6:.1f} us")
            if torch is not None:
                _bench_hf_experts(report, torch, case, args, outputs["ragged"], flops, weight_bytes, iters)


def _bench_tokamax_mosaic(report, case, x, routing, gate_up, k, iters) -> None:
    """The first product alone (`[T*K, H] x [E, H, 2I]`, rows sorted by expert) through tokamax's
    Mosaic GPU kernel forced, beside `lax.ragged_dot`: whether that kernel lowers here, and its speed
    (the `"tokamax"` rows above let tokamax choose, and fall back to XLA where Mosaic declines)."""
    import jax
    import jax.numpy as jnp

    from qwen3vl_jax import moe

    rows = jnp.repeat(x, k, axis=0)[jnp.argsort(routing.experts.reshape(-1), stable=True)]
    sizes = jnp.bincount(routing.experts.reshape(-1), length=gate_up.shape[0]).astype(jnp.int32)
    flops = 2 * rows.shape[0] * gate_up.shape[1] * gate_up.shape[2]
    ragged_dot = moe.tokamax_module().ragged_dot
    candidates = {"lax": lambda r, w, g: jax.lax.ragged_dot(r, w, g, preferred_element_type=jnp.float32),
                  "mosaic": lambda r, w, g: ragged_dot(r, w, g, preferred_element_type=jnp.float32,
                                                       implementation="mosaic")}
    expected = None
    for name, fn in candidates.items():
        fn = jax.jit(fn)
        try:
            out = fn(rows, gate_up, sizes)
            expected = out if expected is None else expected
            err = report.check(f"moe {case} gate_up {name}", out, expected, 3e-2)
            t = _time(fn, (rows, gate_up, sizes), iters)
            report.row("moe-gemm", case, name, t, flops / t / 1e12,
                       note=f"gate_up product only; max|err| {err:.2g}")
        except Exception as e:
            report.row("moe-gemm", case, name, None, note=f"failed: {type(e).__name__}: {str(e)[:160]}")


def _best(report, op, case) -> float:
    times = [r["ms"] for r in report.rows if r["op"] == op and r["case"] == case and r["ms"] is not None]
    return min(times) / 1e3 if times else float("inf")


def _torch_device(smoke: bool):
    """`(torch, device)`: torch on the GPU (on the CPU under --cpu-smoke), or None without it."""
    try:
        import torch
    except ImportError:
        return None
    if smoke:
        return torch, "cpu"
    return (torch, "cuda") if torch.cuda.is_available() else None


def _bench_hf_experts(report, torch_device, case, args, expected, flops, weight_bytes, iters) -> None:
    """HF's experts module on the same weights and routing, in torch on the GPU (see bench_moe)."""
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf

    torch, device = torch_device
    x, chosen, weights, gate_up, down = (torch.from_numpy(np.array(a.astype("float32"))).to(device) for a in args)
    x, weights = x.bfloat16(), weights.bfloat16()
    experts, hidden, width = gate_up.shape[0], gate_up.shape[1], down.shape[1]
    for impl in ("eager", "grouped_mm"):
        try:
            config = hf.Qwen3VLMoeTextConfig(hidden_size=hidden, moe_intermediate_size=width, num_experts=experts,
                                             num_experts_per_tok=chosen.shape[1], experts_implementation=impl)
            module = hf.Qwen3VLMoeTextExperts(config).to(device).bfloat16()
            with torch.no_grad():  # our [E, H, 2I] / [E, I, H] into the module's layout, whichever it holds
                for name, ours in (("gate_up_proj", gate_up), ("down_proj", down)):
                    param = getattr(module, name)
                    param.copy_(ours if param.shape == ours.shape else ours.transpose(1, 2))

            def run():
                with torch.no_grad():
                    return module(x, chosen.long(), weights)

            out = run().float().cpu().numpy()
            err = report.check(f"moe {case} hf {impl}", out, expected, 3e-2)
            t = _time(run, (), iters, wait=lambda _: torch.cuda.synchronize() if device == "cuda" else None)
            report.row("moe", case, f"hf-{impl}", t, flops / t / 1e12, gbps=weight_bytes / t / 1e9,
                       note=f"max|err| {err:.2g} vs ragged")
        except Exception as e:
            report.row("moe", case, f"hf-{impl}", None, note=f"failed: {type(e).__name__}: {str(e)[:100]}")


def _fail_without_gpu(jax, smoke: bool):
    backend = jax.default_backend()
    if backend != "gpu" and not smoke:
        sys.stderr.write(
            f"bench_gpu.py: no GPU backend (jax.default_backend() = {backend!r}, devices {jax.devices()}).\n"
            "This script measures the compiled Triton kernels and must run on a CUDA GPU; it does not\n"
            "fall back to CPU or interpret mode. CPU checks live in tests/test_kernels*.py.\n"
        )
        sys.exit(2)


def _time(fn, args, iters: int, wait=None) -> float:
    """Median seconds per call over 3 rounds of `iters` back-to-back calls (after 2 warm-ups);
    `wait(out)` blocks until the device is done (default `jax.block_until_ready`; torch passes its
    own, so that HF's rows are timed the same way)."""
    import jax

    wait = wait or jax.block_until_ready
    for _ in range(2):
        wait(fn(*args))
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        wait(out)
        rounds.append((time.perf_counter() - start) / iters)
    return statistics.median(rounds)


class Report:
    def __init__(self):
        self.rows, self.failures, self.targets = [], [], []

    def row(self, op, case, impl, seconds, tflops=None, kernel_tflops=None, gbps=None, note=""):
        self.rows.append(dict(op=op, case=case, impl=impl, ms=None if seconds is None else seconds * 1e3,
                              tflops=tflops, kernel_tflops=kernel_tflops, gbps=gbps, note=note))
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        print(f"{op:9s} {case:28s} {impl:7s} {fmt(seconds and seconds * 1e3, '9.3f')} ms  "
              f"{fmt(tflops, '7.1f')} TFLOP/s  {fmt(kernel_tflops, '7.1f')} kTFLOP/s  {fmt(gbps, '8.1f')} GB/s  {note}",
              flush=True)

    def check(self, what, ours, ref, tol):
        a = np.asarray(ours, np.float32)
        b = np.asarray(ref, np.float32)
        err = float(np.abs(a - b).max()) if a.size else 0.0
        ok = a.shape == b.shape and np.all(np.isfinite(a)) and np.allclose(a, b, atol=tol, rtol=tol)
        if not ok:
            self.failures.append(f"{what}: max|err| {err:.3g} (tol {tol})")
            print(f"CORRECTNESS FAILURE {what}: max|err| {err:.3g}", flush=True)
        return err

    def target(self, what, ok, detail):
        self.targets.append(dict(what=what, ok=bool(ok), detail=detail))


def _assert_triton(jax, fn, args, what, report):
    if jax.default_backend() != "gpu":  # --cpu-smoke: interpret mode has no Triton call
        return
    text = jax.jit(fn).lower(*args).as_text()
    if TRITON not in text:
        report.failures.append(f"{what}: compiled HLO has no Triton custom call (silent fallback?)")


def _sweep_row(report, label: str, fn, args, iters: int, flops: float) -> None:
    """One block-size sweep row: the time and TFLOP/s, or why that block size failed (e.g. shared
    memory exhausted), reported, not raised."""
    try:
        t = _time(fn, args, iters)
        report.row("sweep", label, "pallas", t, flops / t / 1e12)
    except Exception as e:
        report.row("sweep", label, "pallas", None, note=f"failed: {type(e).__name__}: {str(e)[:80]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2B shapes and the 448/1792 images only")
    parser.add_argument("--no-sweep", action="store_true", help="skip the block-size sweep")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--moe", action="store_true", help="only the MoE expert matmuls (see bench_moe)")
    parser.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    _fail_without_gpu(jax, args.cpu_smoke)
    vision, llm, image_cases, grids = VISION, LLM, IMAGES, GRIDS
    prefill, cache, sweep = 4096, 8192, [(64, 64), (128, 64), (64, 128), (128, 128)]
    if args.cpu_smoke:
        vision, llm, image_cases, grids = SMOKE["VISION"], SMOKE["LLM"], SMOKE["IMAGES"], SMOKE["GRIDS"]
        prefill, cache, sweep, args.iters = SMOKE["PREFILL"], SMOKE["CACHE"], SMOKE["SWEEP"], SMOKE["ITERS"]
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Triton backend warns on jax >= 0.11
    from pallas_kernels.attention import api as attn
    from pallas_kernels.pos_embed import api as pos
    from pallas_kernels.pos_embed import reference as pos_ref

    kind = jax.devices()[0].device_kind
    hbm = next((v for k, v in HBM_BYTES_PER_S.items() if k in kind), 4.8e12)
    print(f"jax {jax.__version__} on {kind} ({jax.device_count()} device(s)); HBM peak used: {hbm / 1e12:.2f} TB/s\n")
    report = Report()
    rng = np.random.default_rng(0)
    if args.moe:
        shapes = MOE_SMOKE if args.cpu_smoke else {"30B-A3B": MOE["30B-A3B"]} if args.quick else MOE
        bench_moe(report, shapes, args.iters, hbm, rng, args.cpu_smoke)
        return _finish(report, args, kind, jax)
    models = ["2B"] if args.quick else list(vision)
    images = ["448^2", "1792^2"] if args.quick else list(image_cases)
    bf16 = jnp.bfloat16

    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), bf16)

    # ------------------------------------------------------------------ varlen vision attention
    for model in models:
        heads, dim, _ = vision[model]
        padded = max(16, 1 << (dim - 1).bit_length())
        for image in images:
            lengths = image_cases[image]
            tokens = sum(lengths)
            seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths).astype(np.int32))
            q, k, v = (normal((tokens, heads, dim)) for _ in range(3))
            flops = 4 * heads * dim * sum(n * n for n in lengths)
            case = f"{model} {image}"
            f_pallas = jax.jit(lambda q, k, v, s: attn.varlen_attention(q, k, v, s, implementation="pallas"))
            f_xla = jax.jit(lambda q, k, v, s: attn.varlen_attention(q, k, v, s, implementation="xla"))
            _assert_triton(jax, f_pallas, (q, k, v, seg), f"varlen {case}", report)
            err = report.check(f"varlen {case}", f_pallas(q, k, v, seg), f_xla(q, k, v, seg), 2e-2)
            t_p = _time(f_pallas, (q, k, v, seg), args.iters)
            report.row("varlen", case, "pallas", t_p, flops / t_p / 1e12, flops * padded / dim / t_p / 1e12,
                       note=f"max|err| {err:.2g}")
            t_x = _time(f_xla, (q, k, v, seg), max(3, args.iters // 4))
            report.row("varlen", case, "xla", t_x, flops / t_x / 1e12)
            # cuDNN on the padded batch [segments, max_len, H, D]
            longest = max(lengths)
            batch = jnp.zeros((len(lengths), longest, heads, dim), bf16)
            qb, kb, vb = batch, batch, batch
            start = 0
            for i, n in enumerate(lengths):
                qb, kb, vb = (x.at[i, :n].set(y[start:start + n]) for x, y in ((qb, q), (kb, k), (vb, v)))
                start += n
            lens = jnp.asarray(lengths, jnp.int32)
            if len(lengths) == 1:
                f_cudnn = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
            else:
                f_cudnn = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
                    q, k, v, query_seq_lengths=n, key_value_seq_lengths=n, implementation="cudnn"))
            try:
                t_c = _time(f_cudnn, (qb, kb, vb, lens), args.iters)
                report.row("varlen", case, "cudnn", t_c, flops / t_c / 1e12)
                report.target(f"varlen {case} >= 70% of cuDNN speed", t_p <= t_c / 0.7,
                              f"pallas {t_p * 1e3:.3f} ms vs cuDNN {t_c * 1e3:.3f} ms ({t_c / t_p:.0%})")
            except Exception as e:  # cuDNN is the yardstick, not ours: report and go on
                report.row("varlen", case, "cudnn", None, note=f"unavailable: {type(e).__name__}: {str(e)[:80]}")
            if tokens >= 2048:
                kt = flops * padded / dim / t_p / 1e12
                report.target(f"varlen {case} >= 250 kernel TFLOP/s", kt >= 250, f"{kt:.0f} TFLOP/s at D={padded}")

    # ------------------------------------------------------------------ block-size sweep
    if not args.no_sweep:
        for model in models:
            heads, dim, _ = vision[model]
            lengths = image_cases["1792^2"]
            tokens = sum(lengths)
            seg = jnp.zeros((tokens,), jnp.int32)
            q, k, v = (normal((tokens, heads, dim)) for _ in range(3))
            flops = 4 * heads * dim * tokens * tokens
            for bq, bk in sweep:
                f = jax.jit(lambda q, k, v, s, bq=bq, bk=bk: attn.varlen_attention(
                    q, k, v, s, implementation="pallas", block_q=bq, block_k=bk))
                _sweep_row(report, f"{model} 1792^2 ({tokens} tok) bq{bq} bk{bk}", f, (q, k, v, seg), args.iters, flops)

    # ------------------------------------------------------------------ causal prefill 4k
    for model in models:
        heads, kv_heads = llm[model]
        size = prefill
        q = normal((1, size, heads, 128))
        k, v = (normal((1, size, kv_heads, 128)) for _ in range(2))
        n = jnp.array([size], jnp.int32)
        flops = 2 * heads * size * size * 128  # causal: half of 4 * S^2 * D per head
        case = f"{model} {size} hq{heads} hkv{kv_heads}"
        f_pallas = jax.jit(lambda q, k, v, n: attn.causal_attention(q, k, v, n, implementation="pallas"))
        f_xla = jax.jit(lambda q, k, v, n: attn.causal_attention(q, k, v, n, implementation="xla"))
        _assert_triton(jax, f_pallas, (q, k, v, n), f"causal {case}", report)
        err = report.check(f"causal {case}", f_pallas(q, k, v, n), f_xla(q, k, v, n), 2e-2)
        t_p = _time(f_pallas, (q, k, v, n), args.iters)
        report.row("prefill", case, "pallas", t_p, flops / t_p / 1e12, note=f"max|err| {err:.2g}")
        t_x = _time(f_xla, (q, k, v, n), max(3, args.iters // 4))
        report.row("prefill", case, "xla", t_x, flops / t_x / 1e12)
        try:
            f_c = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                        implementation="cudnn"))
            t_c = _time(f_c, (q, k, v), args.iters)
            report.row("prefill", case, "cudnn", t_c, flops / t_c / 1e12)
        except Exception as e:
            report.row("prefill", case, "cudnn", None, note=f"unavailable: {type(e).__name__}: {str(e)[:80]}")
        report.target(f"prefill {case} >= 250 TFLOP/s", flops / t_p / 1e12 >= 250, f"{flops / t_p / 1e12:.0f} TFLOP/s")
        for bq, bk in ([] if args.no_sweep else sweep):
            f = jax.jit(lambda q, k, v, n, bq=bq, bk=bk: attn.causal_attention(
                q, k, v, n, implementation="pallas", block_q=bq, block_k=bk))
            _sweep_row(report, f"prefill {case} bq{bq} bk{bk}", f, (q, k, v, n), args.iters, flops)

    # ------------------------------------------------------------------ decode, 8k cache
    for model in models:
        heads, kv_heads = llm[model]
        for batch in (1, 8):
            q = normal((batch, heads, 128))
            kc, vc = (normal((batch, cache, kv_heads, 128)) for _ in range(2))
            n = jnp.full((batch,), cache, jnp.int32)
            kv_bytes = 2 * batch * cache * kv_heads * 128 * 2
            case = f"{model} b{batch} cache {cache}"
            f_pallas = jax.jit(lambda q, k, v, n: attn.decode_attention(q, k, v, n, implementation="pallas"))
            f_xla = jax.jit(lambda q, k, v, n: attn.decode_attention(q, k, v, n, implementation="xla"))
            _assert_triton(jax, f_pallas, (q, kc, vc, n), f"decode {case}", report)
            err = report.check(f"decode {case}", f_pallas(q, kc, vc, n), f_xla(q, kc, vc, n), 2e-2)
            t_p = _time(f_pallas, (q, kc, vc, n), args.iters * 5)
            report.row("decode", case, "pallas", t_p, gbps=kv_bytes / t_p / 1e9, note=f"max|err| {err:.2g}")
            t_x = _time(f_xla, (q, kc, vc, n), args.iters * 5)
            report.row("decode", case, "xla", t_x, gbps=kv_bytes / t_x / 1e9)
            try:
                f_c = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
                    q[:, None], k, v, query_seq_lengths=jnp.ones_like(n), key_value_seq_lengths=n,
                    implementation="cudnn")[:, 0])
                t_c = _time(f_c, (q, kc, vc, n), args.iters * 5)
                report.row("decode", case, "cudnn", t_c, gbps=kv_bytes / t_c / 1e9)
            except Exception as e:
                report.row("decode", case, "cudnn", None, note=f"unavailable: {type(e).__name__}: {str(e)[:80]}")
            frac = kv_bytes / t_p / hbm
            report.target(f"decode {case} >= 70% HBM", frac >= 0.7,
                          f"{frac:.0%} of {hbm / 1e12:.1f} TB/s")
            for splits in (8, 32):
                f = jax.jit(lambda q, k, v, n, s=splits: attn.decode_attention(q, k, v, n, implementation="pallas",
                                                                               num_splits=s))
                t = _time(f, (q, kc, vc, n), args.iters * 5)
                report.row("decode", case + f" splits{splits}", "pallas", t, gbps=kv_bytes / t / 1e9)

    # ------------------------------------------------------------------ position-embedding interpolation
    for model in models:
        hidden = vision[model][2]
        table = normal((2304, hidden))
        for image, grid in grids.items():
            if args.quick and image not in images:
                continue
            idx, wgt = pos_ref.interpolation_taps(grid, 48, 2)
            idx, wgt = jnp.asarray(idx), jnp.asarray(wgt)
            out_bytes = idx.shape[0] * hidden * 4  # float32 output
            case = f"{model} {image} ({idx.shape[0]} tok)"
            f_pallas = jax.jit(lambda t, i, w: pos.interpolate_pos_embed(t, i, w, implementation="pallas"))
            f_xla = jax.jit(lambda t, i, w: pos.interpolate_pos_embed(t, i, w, implementation="xla"))
            _assert_triton(jax, f_pallas, (table, idx, wgt), f"pos_embed {case}", report)
            err = report.check(f"pos_embed {case}", f_pallas(table, idx, wgt), f_xla(table, idx, wgt), 1e-5)
            t_p = _time(f_pallas, (table, idx, wgt), args.iters * 5)
            report.row("pos_embed", case, "pallas", t_p, gbps=out_bytes / t_p / 1e9, note=f"max|err| {err:.2g}")
            t_x = _time(f_xla, (table, idx, wgt), args.iters * 5)
            report.row("pos_embed", case, "xla", t_x, gbps=out_bytes / t_x / 1e9)
            floor = out_bytes / hbm
            report.target(f"pos_embed {case} <= 2x output write", t_p <= 2 * floor,
                          f"pallas {t_p * 1e6:.1f} us, xla {t_x * 1e6:.1f} us, write floor {floor * 1e6:.1f} us")

    return _finish(report, args, kind, jax)


def _finish(report, args, kind, jax) -> int:
    """Print the targets, write the JSON rows, and the exit status (1 on any correctness failure)."""
    print("\nTargets:")
    for t in report.targets:
        print(f"  [{'met ' if t['ok'] else 'MISS'}] {t['what']}: {t['detail']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=kind, jax=jax.__version__, rows=report.rows, targets=report.targets,
                           failures=report.failures), fh, indent=1)
    if report.failures:
        print("\nFAILURES:\n  " + "\n  ".join(report.failures))
        return 1
    print("\nAll on-device correctness checks passed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
