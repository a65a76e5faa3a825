"""Which bfloat16 rounding flips the sampler's greedy tokens: the same prompts through our Sampler with float32
matmuls and with each rounding, the rows whose greedy tokens equal the float32 ones counted.

    python bench/bench_greedy_rounding.py --model HF_DIR [--prompts 64] [--new-tokens 32]

Variants (each in its own process, one generate call over every prompt at once):
  float32             cpu_matmul=xla: the reference
  bf16_split          cpu_matmul=xla_bf16 as the sampler runs it: bf16 weights, activations as two bf16 halves
  bf16_split_decode   as bf16_split in the decode steps, bf16 activations in the prefill
  onednn_split        as bf16_split on the oneDNN kernel
  bf16                bf16 weights and bf16 activations (the split turned off)
  bf16_f32_unembed    as bf16, but the unembedding in float32
  bf16_weights_only   float32 matmuls on weights rounded to bf16 (what the split approximates)
  split_attention     the split in the attention projections and the unembedding only, bf16 activations
                      into the MLP (its matmuls are three quarters of a layer's)
  split_mlp           the split in the MLP only, bf16 activations into the attention projections and the
                      unembedding
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import subprocess
import sys

VARIANTS = ("float32", "bf16_split", "bf16_split_decode", "onednn_split", "bf16", "bf16_f32_unembed",
            "bf16_weights_only", "split_attention", "split_mlp")


def child(args) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench_sampler import chat_prompts
    from sweet_jax.models import cpu_matmul, load_hf
    from sweet_jax.sampling import generate

    variant = args._child
    matmul = {"float32": "xla", "bf16_weights_only": "xla", "onednn_split": "onednn"}.get(variant, "xla_bf16")
    if variant == "bf16_split_decode":
        generate._prefill = generate._prefill.__wrapped__  # the prefill traced without the split
    if variant in ("bf16", "bf16_f32_unembed"):
        cpu_matmul.split_activations = contextlib.nullcontext  # read when the sampler's programs are traced
    if variant == "bf16_f32_unembed":
        generate._split_unembedding = lambda graphdef, state, mesh: [
            nnx.merge(graphdef, state).unembedding().astype(jnp.float32)]
        generate._last_logits = lambda model, hidden, parts=None: jnp.concatenate(
            [hidden[:, -1].astype(jnp.float32) @ u.astype(jnp.float32)
             for u in (parts if parts is not None else [model.unembedding()])], axis=-1)
    if variant in ("split_attention", "split_mlp"):
        from sweet_jax.models import llama

        def unsplit(call):
            def traced(*a, **k):
                with cpu_matmul._set(cpu_matmul._split, False):
                    return call(*a, **k)
            return traced
        if variant == "split_attention":
            llama.MLP.__call__ = unsplit(llama.MLP.__call__)
        else:
            llama.Attention.__call__ = unsplit(llama.Attention.__call__)
            generate._last_logits = unsplit(generate._last_logits)
    model = load_hf(args.model, config_overrides={"cpu_matmul": matmul})
    if variant == "bf16_weights_only":
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32),
                                                           generate._bf16_kernels(state)))
    prompts = chat_prompts(args.model, args.prompts)
    out = generate.Sampler(model, max_batch_size=len(prompts)).generate(
        prompts, max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, seed=0)
    print("TOKENS " + json.dumps([list(map(int, g[0].token_ids)) for g in out]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an HF Llama checkpoint directory")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--_child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        return child(args)
    tokens = {}
    for variant in ["float32"] + [v for v in args.variants.split(",") if v != "float32"]:
        run = subprocess.run([sys.executable, __file__, "--model", args.model, "--prompts", str(args.prompts),
                              "--new-tokens", str(args.new_tokens), "--_child", variant],
                             capture_output=True, text=True, check=True, cwd=pathlib.Path(__file__).parent)
        tokens[variant] = json.loads(next(line[7:] for line in run.stdout.splitlines() if line.startswith("TOKENS ")))
    ref = tokens["float32"]
    print(f"{args.prompts} chat prompts x {args.new_tokens} greedy tokens, one call at batch {args.prompts}:")
    print("| variant | rows equal to float32 | first differing new-token position of each other row |")
    print("|---|---|---|")
    for variant, rows in tokens.items():
        if variant == "float32":
            continue
        same = sum(a == b for a, b in zip(rows, ref))
        first = sorted(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(rows, ref) if a != b)
        print(f"| {variant} | {same}/{len(ref)} | {first} |")


if __name__ == "__main__":
    main()
