"""The decode step's matrix products alone: [M, K] x [K, N] with few rows M, JAX (XLA:CPU) vs PyTorch, same run.

    python bench/bench_decode_dot.py               # all cores
    python bench/bench_decode_dot.py --cores 1     # pinned to one core (both sides)

Why it exists: a batch-8 decode step of the sampler bench's 24M model is a chain of such products (every
weight read once per step, 8 rows), and its time sets the sampler's tokens/s. This prints, per shape and row
count M, the time of one product with its weights cold (a chain over distinct weight copies, >= 128 MB in all,
each product's input depending on the last one's output), the weight bytes read per second and the FLOP/s, for
jax.jit (a fori_loop of the chain: one XLA execution, no dispatch between products) and for PyTorch (eager, the
same chain in a Python loop, as transformers runs its linears), next to two ceilings measured in the same run:
the read bandwidth (jnp.sum over 256 MB) and the float32 matmul peak (2048^3, the better of the two sides).
Shapes (K x N), the 24M row's: unembedding 256 x 32000, MLP gate (and up) 256 x 1024, down 1024 x 256, query (and
output) 256 x 256, key (and value) 256 x 128.
"""
from __future__ import annotations

import argparse
import os
import time

SHAPES = {"unembed": (256, 32000), "gate": (256, 1024), "down": (1024, 256), "query": (256, 256), "kv": (256, 128)}
COLD_BYTES = 128 << 20


def best_time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def jax_chain(M: int, K: int, N: int, copies: int, chain: int, reps: int) -> float:
    """Seconds per product: `chain` products over `copies` distinct [K, N] weights in one compiled loop."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    w_CKN = jnp.asarray(rng.standard_normal((copies, K, N), dtype=np.float32) / np.sqrt(K))
    x_MK = jnp.asarray(rng.standard_normal((M, K), dtype=np.float32))

    @jax.jit
    def run(w_CKN, x_MK):
        def body(i, x):
            y_MN = x @ w_CKN[i % copies]
            # Feed a column of the output back so each product waits for the last (no reordering, no dead code).
            return x + 1e-30 * y_MN[:, :1]
        return jax.lax.fori_loop(0, chain, body, x_MK)

    return best_time(lambda: run(w_CKN, x_MK).block_until_ready(), reps) / chain


def torch_chain(M: int, K: int, N: int, copies: int, chain: int, reps: int) -> float:
    import torch

    gen = torch.Generator().manual_seed(0)
    # nn.Linear's layout: weight [N, K], y = x @ weight.T (what transformers' Llama runs).
    w_CNK = torch.randn(copies, N, K, generator=gen) / K ** 0.5
    x_MK = torch.randn(M, K, generator=gen)

    def run():
        x = x_MK
        with torch.inference_mode():
            for i in range(chain):
                y_MN = torch.nn.functional.linear(x, w_CNK[i % copies])
                x = x + 1e-30 * y_MN[:, :1]
        return x

    return best_time(run, reps) / chain


def read_bandwidth() -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64 << 20,), jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / best_time(lambda: total(x).block_until_ready(), 5)


def matmul_peak(n: int = 2048) -> tuple[float, float]:
    import jax
    import jax.numpy as jnp
    import torch

    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    jax_s = best_time(lambda: mm(a, a).block_until_ready(), 3)
    t = torch.ones(n, n)
    torch_s = best_time(lambda: torch.mm(t, t), 3)
    return 2 * n ** 3 / jax_s, 2 * n ** 3 / torch_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, default=0, help="pin both sides to the first N cores (0: all)")
    parser.add_argument("--rows", default="1,8,32", help="comma-separated row counts M (8: the sampler bench)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated of {list(SHAPES)}")
    parser.add_argument("--chain", type=int, default=64, help="products per timed call")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per cell (best reported)")
    args = parser.parse_args()
    if args.cores:
        os.sched_setaffinity(0, range(args.cores))  # before jax and torch start their thread pools
    cores = len(os.sched_getaffinity(0))

    import jax
    import torch

    torch.set_num_threads(cores)
    bandwidth = read_bandwidth()
    peak = max(matmul_peak())
    print(f"\nfloat32 [M, K] x [K, N], weights cold ({COLD_BYTES >> 20} MB of distinct copies), {cores} core(s); "
          f"jax {jax.__version__} (XLA:CPU, one jitted loop) vs torch {torch.__version__} eager F.linear "
          f"({torch.get_num_threads()} threads). Read bandwidth (jnp.sum, 256 MB): {bandwidth / 1e9:.1f} GB/s; "
          f"matmul peak (2048^3, better side): {peak / 1e9:.1f} GFLOP/s.")
    print("| shape (K x N) | M | jax us | torch us | torch / jax | jax GB/s | jax GFLOP/s (% peak) | torch GB/s "
          "| torch GFLOP/s | jax's weight stream vs read bandwidth |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        K, N = SHAPES[name]
        copies = max(1, -(-COLD_BYTES // (K * N * 4)))
        for M in (int(m) for m in args.rows.split(",")):
            ours = jax_chain(M, K, N, copies, args.chain, args.reps)
            theirs = torch_chain(M, K, N, copies, args.chain, args.reps)
            weight_bytes, flops = K * N * 4, 2 * M * K * N
            print(f"| {name} {K} x {N} | {M} | {ours * 1e6:.0f} | {theirs * 1e6:.0f} | {theirs / ours:.2f}x "
                  f"| {weight_bytes / ours / 1e9:.1f} | {flops / ours / 1e9:.1f} ({100 * flops / ours / peak:.0f}%) "
                  f"| {weight_bytes / theirs / 1e9:.1f} | {flops / theirs / 1e9:.1f} "
                  f"| {100 * weight_bytes / ours / bandwidth:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
