"""One accelerator: MFU of the critic train step of a 1B-class Llama at sequence 4096, and the sampler's tokens/s.

    python bench/bench_gpu.py                # on one H100 (jax[cuda]): Llama-3.2-1B shapes, bf16 compute
    python bench/bench_gpu.py --smoke        # the same code path at tiny size on CPU (seconds)
    python bench/bench_gpu.py --remat dots_saveable --pairs 2 --json out.json

Critic step = forward + Bradley-Terry loss over per-turn-mean advantages (reference log-probs precomputed, as
in training) + backward + clip + AdamW, exactly the trainer's step (`steps.make_step` of the critic's
`steps.loss_spec`). Random weights (no download): the shapes are what matter for speed. Parameters and AdamW moments in float32, compute in bfloat16 (--dtype),
attention "auto" (cuDNN flash attention on GPU for 16-bit compute). MFU = model FLOPs (6 x matmul params +
12 x layers x heads x head_dim x T per token: no recompute, causal mask not discounted) / step time / the
device's dense bf16 peak from sweet_jax.train.metrics (989 TFLOP/s for an H100 SXM); on CPU (--smoke) the peak is a
measured float32 matmul. Sampler: `sweet_jax.sampling.generate.Sampler`, greedy, every row forced to --new-tokens
(eos ignored), one warm-up call (compilation) then the best of --repeats timed calls. Target (DESIGN.md):
>= 45% MFU on one H100.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import numpy as np


def make_batch(pairs: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """Critic pairs [pairs, 2, seq]: four assistant turns of seq/8 tokens each, precomputed reference log-probs."""
    rng = np.random.default_rng(seed)
    shape = (pairs, 2, seq)
    turns = np.zeros(shape, np.int32)
    for k, start in enumerate(range(seq // 8, seq, seq // 4)):
        turns[:, :, start:start + seq // 8] = k + 1
    return dict(input_ids=rng.integers(3, vocab, shape).astype(np.int32), attention_mask=np.ones(shape, np.int32),
                turn_ids=turns, ref_logp=(-rng.uniform(5, 12, shape)).astype(np.float32))


def model_config(args):
    from sweet_jax.models.llama import LlamaConfig
    kw = dict(dtype=args.dtype, param_dtype=args.param_dtype, remat=args.remat, attention_impl=args.attn)
    if args.smoke:
        return LlamaConfig.preset("tiny", vocab_size=512, **kw)
    return LlamaConfig.preset("llama3_1b", **kw)


def peak_flops(device) -> tuple[float, str]:
    from sweet_jax.train import metrics
    if device.platform == "cpu":
        peak = metrics.measure_cpu_matmul_peak()
        return peak, f"measured CPU float32 matmul {peak / 1e9:.1f} GFLOP/s"
    peak = metrics.known_peak_flops(device.device_kind)
    if peak is None:
        return math.nan, f"unknown device kind {device.device_kind!r} (add it to sweet_jax.train.metrics.PEAK_FLOPS)"
    return peak, f"{device.device_kind}: {peak / 1e12:.0f} TFLOP/s dense bf16"


def bench_train_step(args, config, device) -> dict:
    import jax
    from flax import nnx

    from sweet_jax import config_utils
    from sweet_jax.train import steps
    from sweet_jax.train.optimizer import make_optimizer
    from sweet_jax.models.attention import resolve_attention_impl
    from sweet_jax.models.llama import Llama

    model = Llama(config, rngs=nnx.Rngs(0))
    optimizer = make_optimizer(1e-5, 1000, warmup_ratio=0.0)
    state = steps.create_train_state(model, optimizer)
    del model  # its arrays are the state's now, and the step donates them
    loss = config_utils.base_config().loss  # critic, beta 0.1: the trainer's defaults
    step = steps.make_step(steps.loss_spec(loss, chunk_size=args.chunk), state, optimizer)
    batch = {k: jax.device_put(v, device) for k, v in make_batch(args.pairs, args.seq, config.vocab_size).items()}
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    times, losses = [], []
    for i in range(args.steps + 1):  # the first execution is a warm-up
        t0 = time.perf_counter()
        state, m = compiled(state, batch)
        losses.append(float(jax.block_until_ready(m)["loss"]))
        if i:
            times.append(time.perf_counter() - t0)
    tokens = args.pairs * 2 * args.seq
    flops = config.flops_per_token(args.seq) * tokens
    peak, peak_note = peak_flops(device)
    seconds = float(np.median(times))
    return dict(params=config.num_params(), tokens=tokens, step_s=seconds, tokens_per_s=tokens / seconds,
                model_tflops_per_step=flops / 1e12, achieved_tflops=flops / seconds / 1e12,
                mfu=flops / seconds / peak, peak_note=peak_note, compile_s=compile_s, losses=losses,
                attention=resolve_attention_impl(config, args.seq),
                temp_gib=mem.temp_size_in_bytes / 2**30 if mem else math.nan,
                args_gib=mem.argument_size_in_bytes / 2**30 if mem else math.nan)


def bench_sampler(args, config) -> dict:
    from flax import nnx

    from sweet_jax.sampling.generate import Sampler
    from sweet_jax.models.llama import Llama

    # Inference weights in the compute dtype (what a rollout worker holds).
    model = Llama(dataclasses.replace(config, param_dtype=args.dtype, remat="none"), rngs=nnx.Rngs(1))
    sampler = Sampler(model, max_batch_size=args.sample_batch)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.prompt_len // 2, args.prompt_len + 1, size=args.sample_batch)
    prompts = [rng.integers(3, config.vocab_size, size=int(n)).tolist() for n in lengths]

    def run():
        out = sampler.generate(prompts, max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, seed=0)
        return sum(len(group[0].token_ids) for group in out)

    run()  # compile
    best, produced = math.inf, 0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        produced = run()
        best = min(best, time.perf_counter() - t0)
    return dict(batch=args.sample_batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                tokens=produced, seconds=best, tokens_per_s=produced / best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes, any backend (a CPU check)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--pairs", type=int, default=1, help="critic pairs per step (x2 sequences)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype")
    ap.add_argument("--param-dtype", default="float32")
    ap.add_argument("--remat", default="none", help="none | full | dots_saveable | ...")
    ap.add_argument("--attn", default="auto", help="auto | xla | cudnn | chunked | blocked")
    ap.add_argument("--chunk", type=int, default=1024, help="log-prob chunk (tokens)")
    ap.add_argument("--sample-batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-sampler", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.steps, args.chunk = min(args.seq, 128), min(args.steps, 2), min(args.chunk, 32)
        args.sample_batch, args.prompt_len, args.new_tokens = 4, 8, 16
        args.dtype = "float32" if args.dtype == "bfloat16" else args.dtype

    import jax
    device = jax.devices()[0]
    config = model_config(args)
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}; model: "
          f"{config.num_params() / 1e6:.1f}M params, vocab {config.vocab_size}, {config.num_layers} layers; "
          f"compute {args.dtype}, params {args.param_dtype}, remat {args.remat}", flush=True)
    results = dict(device=device.device_kind, platform=device.platform, smoke=args.smoke, args=vars(args))
    if not args.skip_sampler:
        results["sampler"] = s = bench_sampler(args, config)
        print(f"sampler: batch {s['batch']}, prompts <= {s['prompt_len']}, {s['new_tokens']} new tokens: "
              f"{s['tokens_per_s']:.0f} tokens/s ({s['seconds']:.2f} s)", flush=True)
    if not args.skip_train:
        results["train"] = r = bench_train_step(args, config, device)
        print("\n| device | model | tokens/step | attention | step s | tokens/s | model TFLOP/s | MFU | temps GiB |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {device.device_kind} | {r['params'] / 1e6:.1f}M params, T={args.seq} | {r['tokens']} | {r['attention']} | "
              f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['achieved_tflops']:.1f} | {100 * r['mfu']:.1f}% | "
              f"{r['temp_gib']:.2f} |")
        print(f"peak: {r['peak_note']}; compile {r['compile_s']:.1f} s; losses {', '.join(f'{x:.4f}' for x in r['losses'])}")
        if not all(map(math.isfinite, r["losses"])):
            sys.exit("non-finite loss: the step is broken")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
