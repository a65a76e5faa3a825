"""Label log-probs of 1 x 8192 tokens over a 128256-token vocabulary: chunked vs naive peak memory.

    python bench/bench_logprob_memory.py                 # compiled memory of forward + backward (no run)
    python bench/bench_logprob_memory.py --measure       # also run each variant in its own process, peak RSS

The naive path materialises [T, V] float32 logits (8192 x 128256 x 4 B = 3.9 GiB) and its log-softmax;
sweet_jax.train.losses.token_logprobs scans over sequence chunks and rematerialises each chunk's logits in the
backward pass. Memory is XLA's own accounting of the compiled program (temps = everything that is not an
input or output), so it is the same number the TPU fit check (sweet_jax.plan) reads. Target: chunked <= 1/4.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from sweet_jax.train import losses  # noqa: E402

GiB = 1024 ** 3


def loss_fn(variant: str, chunk_size: int):
    def naive(h, w, ids):
        return losses.token_logprobs_naive(jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32),
                                           ids).sum()

    def chunked(h, w, ids):
        return losses.token_logprobs(h, w, ids, chunk_size=chunk_size).sum()

    fn = naive if variant == "naive" else chunked
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))


def abstract_args(T, D, V, dtype):
    return (jax.ShapeDtypeStruct((1, T, D), dtype), jax.ShapeDtypeStruct((D, V), dtype),
            jax.ShapeDtypeStruct((1, T), jnp.int32))


def compiled_memory(variant, T, D, V, dtype, chunk_size):
    compiled = loss_fn(variant, chunk_size).lower(*abstract_args(T, D, V, dtype)).compile()
    m = compiled.memory_analysis()
    return dict(args=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, temps=m.temp_size_in_bytes)


def measure_in_this_process(variant, T, D, V, dtype, chunk_size):
    """Run forward + backward once; peak RSS of this process minus its RSS before the run."""
    key = jax.random.PRNGKey(0)
    h = jax.random.normal(key, (1, T, D), dtype)
    w = (0.02 * jax.random.normal(key, (D, V))).astype(dtype)
    ids = jax.random.randint(key, (1, T), 0, V)
    fn = loss_fn(variant, chunk_size)
    compiled = fn.lower(h, w, ids).compile()
    jax.block_until_ready((h, w, ids))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(h, w, ids))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(peak_rss_growth=peak - before, seconds=seconds)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096, help="4096 = Llama-3.1-8B")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="bfloat16", help="hidden/unembedding dtype (logits are float32 either way)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--measure", action="store_true", help="also run each variant (needs ~12 GiB free RAM)")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    dtype = jnp.dtype(a.dtype)
    if a._child:
        print(json.dumps(measure_in_this_process(a._child, a.seq, a.hidden, a.vocab, dtype, a.chunk)))
        return

    print(f"log-probs + gradient of 1 x {a.seq} tokens, hidden {a.hidden}, vocab {a.vocab}, {a.dtype} inputs, "
          f"float32 logits, chunk {a.chunk}; backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    rows = {}
    for variant in ("naive", "chunked"):
        rows[variant] = compiled_memory(variant, a.seq, a.hidden, a.vocab, dtype, a.chunk)
        if a.measure:
            out = subprocess.run([sys.executable, __file__, "--_child", variant, "--seq", str(a.seq), "--hidden",
                                  str(a.hidden), "--vocab", str(a.vocab), "--dtype", a.dtype, "--chunk",
                                  str(a.chunk)], capture_output=True, text=True)
            if out.returncode:
                rows[variant]["measure_error"] = out.stderr.strip().splitlines()[-1]
            else:
                rows[variant].update(json.loads(out.stdout.strip().splitlines()[-1]))
    full_logits = a.seq * a.vocab * 4
    print(f"\n(one [T, V] float32 logits tensor = {full_logits / GiB:.2f} GiB)\n")
    header = "| variant | compiled temps GiB | args GiB | outputs GiB |"
    sep = "|---|---|---|---|"
    if a.measure:
        header += " measured peak RSS growth GiB | seconds |"
        sep += "---|---|"
    print(header)
    print(sep)
    for variant, r in rows.items():
        line = f"| {variant} | {r['temps'] / GiB:.3f} | {r['args'] / GiB:.3f} | {r['outputs'] / GiB:.3f} |"
        if a.measure:
            if "measure_error" in r:
                line += f" failed: {r['measure_error']} | |"
            else:
                line += f" {r['peak_rss_growth'] / GiB:.3f} | {r['seconds']:.2f} |"
        print(line)
    ratio = rows["chunked"]["temps"] / rows["naive"]["temps"]
    print(f"\nchunked / naive compiled temps: {ratio:.3f}  (target <= 0.25: {'met' if ratio <= 0.25 else 'MISSED'})")
    if a.measure and all("peak_rss_growth" in r for r in rows.values()):
        print(f"chunked / naive measured peak growth: "
              f"{rows['chunked']['peak_rss_growth'] / max(rows['naive']['peak_rss_growth'], 1):.3f}")


if __name__ == "__main__":
    main()
