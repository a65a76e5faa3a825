"""Matmul GFLOP/s at the SmolLM2 pipeline's shapes: XLA float32 and bfloat16, sweet_jax's oneDNN bf16 kernel
(model.cpu_matmul, models/cpu_matmul.py), PyTorch float32 and bfloat16 (its oneDNN), in one process.

    python bench/bench_matmul.py                 # the table of BENCHMARKS.md, 5 interleaved rounds
    python bench/bench_matmul.py --rounds 9 --shapes 2048x576x1536,64x576x1536

Every round times each implementation on each shape (best of --reps calls, after a warm-up) in a rotating order,
so all see the same machine load; the table gives the median over rounds and the [min, max] range. bfloat16
products accumulate in float32 everywhere (XLA: preferred_element_type=float32). The last row, 2048^3, is the
bf16 peak the train-step bench compares with (bench_train_step.py's peak side).
"""
from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sweet_jax.models import cpu_matmul  # noqa: E402

# (M x K x N): a projection of 2048 tokens up (q/gate/up: 576 -> 1536) and down, a batch-64 decode step's, the
# unembedding (vocab 49152) and a square one.
SHAPES = "2048x576x1536,2048x1536x576,64x576x1536,8x576x1536,2048x576x49152,2048x2048x2048"


def implementations():
    xla = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    impls = {
        "jax float32": ("jax", jnp.float32, xla),
        "jax bfloat16 (XLA, = xla_bf16)": ("jax", jnp.bfloat16, xla),
        "torch float32": ("torch", torch.float32, torch.matmul),
        "torch bfloat16": ("torch", torch.bfloat16, torch.matmul),
    }
    reason = cpu_matmul.unavailable_reason()
    if reason is None:
        impls["sweet_jax oneDNN bf16"] = ("jax", jnp.bfloat16, jax.jit(functools.partial(cpu_matmul.matmul,
                                                                                          backend="onednn")))
    return impls, reason


def operands(kind, dtype, M, K, N):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, K), np.float32), rng.standard_normal((K, N), np.float32)
    if kind == "jax":
        return jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    return torch.from_numpy(a).to(dtype), torch.from_numpy(b).to(dtype)


def best_seconds(kind, fn, a, b, reps):
    run = (lambda: fn(a, b).block_until_ready()) if kind == "jax" else (lambda: fn(a, b))
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="calls per measurement (the best is kept)")
    a = ap.parse_args()
    shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    impls, reason = implementations()
    data = {(name, shape): operands(kind, dtype, *shape) for name, (kind, dtype, _) in impls.items()
            for shape in shapes}
    gflops = {key: [] for key in data}
    load0, t0 = os.getloadavg(), time.time()
    names = list(impls)
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for shape in shapes:
            for name in order:
                kind, _, fn = impls[name]
                seconds = best_seconds(kind, fn, *data[name, shape], a.reps)
                gflops[name, shape].append(2 * np.prod(shape) / seconds / 1e9)
    load1 = os.getloadavg()
    flags = cpu_matmul.cpu_bf16_flags()
    print(f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}, bf16 flags: {', '.join(flags) or 'none'}; "
          f"{a.rounds} rounds, best of {a.reps} calls each; load average {load0[0]:.2f} at start, {load1[0]:.2f} at "
          f"the end; {time.time() - t0:.0f} s")
    if reason:
        print(f"sweet_jax oneDNN bf16: not run ({reason})")
    print("\nGFLOP/s, median over rounds [min-max]\n")
    print("| shape (M x K x N) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for shape in shapes:
        cells = [f"{np.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]" for v in (gflops[n, shape] for n in names)]
        print(f"| {' x '.join(map(str, shape))} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
