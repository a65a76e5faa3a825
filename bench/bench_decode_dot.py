"""The decode step's matrix products alone: [M, K] x [K, N] with few rows M, JAX (XLA:CPU) vs PyTorch, same run.

    python bench/bench_decode_dot.py               # all cores
    python bench/bench_decode_dot.py --cores 1     # pinned to one core (both sides)

Why it exists: a batch-8 decode step of the sampler bench's 24M model is a chain of such products (every
weight read once per step, 8 rows), and its time sets the sampler's tokens/s. This prints, per shape and row
count M, the time of one product with its weights cold (a chain over distinct weight arrays, >= 128 MB in all,
each product's input depending on the last one's output), the weight bytes read per second and the FLOP/s, for
jax.jit (up to 16 products per compiled program, as in a decode step: separate weight arrays, no slicing) and for
PyTorch (eager, the same chain in a Python loop, as transformers runs its linears), next to two ceilings measured
in the same run: the read bandwidth (jnp.sum over 256 MB) and the float32 matmul peak (2048^3, the better side).
Shapes (K x N), the 24M row's: unembedding 256 x 32000, MLP gate (and up) 256 x 1024, down 1024 x 256, query (and
output) 256 x 256, key (and value) 256 x 128.
"""
from __future__ import annotations

import argparse
import os
import time

SHAPES = {"unembed": (256, 32000), "gate": (256, 1024), "down": (1024, 256), "query": (256, 256), "kv": (256, 128)}
COLD_BYTES = 128 << 20
GROUP = 16  # products per compiled program (one program per shape, dispatched per group)


def best_time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def jax_chain(weights_np: list, x_np, rounds: int, reps: int, group: int) -> float:
    """Seconds per product: `rounds` passes over the distinct weights, `group` products chained in one compiled
    program (the same program for every group of equal shapes), the groups dispatched back to back."""
    import jax
    import jax.numpy as jnp

    # Separate arrays, not slices of one [copies, K, N] array: a product over `w_CKN[i % copies]` in a loop makes
    # XLA copy the slice into a new buffer before every product (a dynamic-slice fusion: the unembedding's
    # 32.8 MB read and written again), and that copy would be timed with the product.
    weights = [jnp.asarray(w) for w in weights_np]
    groups = [tuple(weights[i:i + group]) for i in range(0, len(weights), group)]

    @jax.jit
    def run_group(weights, x):
        for w_KN in weights:
            y_MN = x @ w_KN
            # Feed a column of the output back so each product waits for the last (no reordering, no dead code).
            x = x + 1e-30 * y_MN[:, :1]
        return x

    def run():
        x = jnp.asarray(x_np)
        for _ in range(rounds):
            for weights in groups:
                x = run_group(weights, x)
        return x.block_until_ready()

    return best_time(run, reps) / (rounds * len(weights))


def torch_chain(weights_np: list, x_np, rounds: int, reps: int) -> float:
    import torch

    # nn.Linear's layout: weight [N, K], y = x @ weight.T (what transformers' Llama runs).
    weights = [torch.from_numpy(w.T.copy()) for w in weights_np]
    x_MK = torch.from_numpy(x_np)

    def run():
        x = x_MK
        with torch.inference_mode():
            for _ in range(rounds):
                for w_NK in weights:
                    y_MN = torch.nn.functional.linear(x, w_NK)
                    x = x + 1e-30 * y_MN[:, :1]
        return x

    return best_time(run, reps) / (rounds * len(weights))


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
    parser.add_argument("--chain", type=int, default=64, help="at least this many products per timed call "
                        "(whole passes over every weight copy)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per cell (best reported)")
    args = parser.parse_args()
    if args.cores:
        os.sched_setaffinity(0, range(args.cores))  # before jax and torch start their thread pools
    cores = len(os.sched_getaffinity(0))

    import jax
    import numpy as np
    import torch

    torch.set_num_threads(cores)
    bandwidth = read_bandwidth()
    peak = max(matmul_peak())
    print(f"\nfloat32 [M, K] x [K, N], weights cold ({COLD_BYTES >> 20} MB of distinct copies), {cores} core(s); "
          f"jax {jax.__version__} (XLA:CPU, up to {GROUP} products a program) vs torch {torch.__version__} eager "
          f"F.linear ({torch.get_num_threads()} threads). Read bandwidth (jnp.sum, 256 MB): "
          f"{bandwidth / 1e9:.1f} GB/s; matmul peak (2048^3, better side): {peak / 1e9:.1f} GFLOP/s.")
    print("| shape (K x N) | M | jax us | torch us | torch / jax | jax GB/s | jax GFLOP/s (% peak) | torch GB/s "
          "| torch GFLOP/s | jax's weight stream vs read bandwidth |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        K, N = SHAPES[name]
        copies = -(-COLD_BYTES // (K * N * 4))
        group = min(GROUP, copies)
        copies = -(-copies // group) * group
        rng = np.random.default_rng(0)
        weights = [(rng.standard_normal((K, N), dtype=np.float32) / np.float32(K ** 0.5)) for _ in range(copies)]
        rounds = max(1, -(-args.chain // copies))
        for M in (int(m) for m in args.rows.split(",")):
            x = rng.standard_normal((M, K), dtype=np.float32)
            ours = jax_chain(weights, x, rounds, args.reps, group)
            theirs = torch_chain(weights, x, rounds, args.reps)
            weight_bytes, flops = K * N * 4, 2 * M * K * N
            print(f"| {name} {K} x {N} | {M} | {ours * 1e6:.0f} | {theirs * 1e6:.0f} | {theirs / ours:.2f}x "
                  f"| {weight_bytes / ours / 1e9:.1f} | {flops / ours / 1e9:.1f} ({100 * flops / ours / peak:.0f}%) "
                  f"| {weight_bytes / theirs / 1e9:.1f} | {flops / theirs / 1e9:.1f} "
                  f"| {100 * weight_bytes / ours / bandwidth:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
