"""Train steps on real sequence lengths: one program over the batch padded to its longest sequence vs the host
loop (steps.HostLoopStep: each micro-batch cut to its own longest sequence), the trainer's default on one CPU
device. Same model, same batches, same micro-batches, one process, interleaved rounds.

    python bench/bench_host_loop.py --model HF_DIR --trajectories RUN/offline/trajectories.jsonl            # critic
    python bench/bench_host_loop.py --model HF_DIR --trajectories RUN/offline/trajectories.jsonl --step rft

Batches are drawn from the trajectories file as the trainer would batch them: critic = pairs of trajectories of
one task rendered with the task's ground truth (c) before the dialogue, rft = single trajectories; T = the
length bucket of the batch's longest sequence (--bucket, powers of two up to --max-len as data.batching cuts
them), right padding, log-probs at the action tokens (score_pos) when they fit T/2, random reference log-probs.
Micro-batches: the trainer's automatic choice (steps.auto_micro_batch_size) unless --micro.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def render_batches(a, tokenizer):
    from sweet_jax.data import batching, schema
    from sweet_jax.data.render import render_trajectory
    trajectories = [schema.Trajectory.from_json(json.loads(line)) for line in open(a.trajectories)]
    rendered = [render_trajectory(tokenizer, t, with_info=a.step == "critic") for t in trajectories]
    rendered = [r for r in rendered if len(r.input_ids) <= a.max_len]
    rng = np.random.default_rng(0)
    P = 2 if a.step == "critic" else 1
    buckets = batching.bucket_lengths(a.max_len, a.bucket)
    out = []
    for _ in range(a.rounds):
        examples = [tuple(rendered[i] for i in rng.choice(len(rendered), P, replace=False)) for _ in range(a.pairs)]
        T = batching.bucket_for(int(batching.example_lengths(examples).max()), buckets)
        most = int(max(np.count_nonzero(s.turn_ids) for ex in examples for s in ex))
        batch = batching.collate(examples, length=T, score_length=T // 2 if most <= T // 2 else None)
        batch["ref_logp"] = np.where(batch["attention_mask"] > 0,
                                     -rng.uniform(1, 8, batch["input_ids"].shape), 0).astype(np.float32)
        out.append(batch)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF Llama checkpoint directory (with its tokenizer)")
    ap.add_argument("--trajectories", required=True, help="ColBench trajectories JSONL (e.g. a pipeline's offline)")
    ap.add_argument("--step", choices=("critic", "rft"), default="critic")
    ap.add_argument("--pairs", type=int, default=8, help="examples per batch")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--micro", type=int, default=0, help="examples per micro-batch (0: automatic)")
    ap.add_argument("--remat", default="none")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per side (one batch each, after a warm-up)")
    a = ap.parse_args()
    from sweet_jax import host_malloc
    host_malloc.reexec_with_allocator()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from transformers import AutoTokenizer
    from sweet_jax import config_utils
    from sweet_jax.train import steps
    from sweet_jax.train.optimizer import make_optimizer
    from sweet_jax.models import load_hf

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    batches = render_batches(a, tokenizer)
    loss = config_utils.base_config().loss
    loss.kind = a.step
    spec = steps.loss_spec(loss)
    sides = {}
    for name, host_loop in (("one program", False), ("host loop", True)):
        # Its own copy of the weights: each step donates its state.
        model = load_hf(a.model, config_overrides=dict(remat=a.remat, scan_layers=True))
        optimizer = make_optimizer(1e-5, 100, warmup_ratio=0.0)
        state = steps.create_train_state(model, optimizer)
        step = steps.make_step(spec, state, optimizer, micro_batch_size=a.micro, host_loop=host_loop,
                               length_multiple=a.bucket)
        sides[name] = dict(step=step, state=state, seconds=[], losses=[])
    real = [float((b["attention_mask"].sum())) for b in batches]
    padded = [float(np.prod(b["input_ids"].shape)) for b in batches]
    print(f"{a.step} step, {model.config.num_params() / 1e6:.1f}M params, {a.pairs} examples a batch, lengths from "
          f"{a.trajectories}: real tokens / padded to the batch's T = {sum(real) / sum(padded):.2f}", flush=True)
    # Two passes over the same batches: the first compiles every shape (untimed), the second is timed, the sides
    # alternating which goes first.
    for timed in (False, True):
        for i, batch in enumerate(batches):
            for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                side = sides[name]
                t0 = time.perf_counter()
                side["state"], m = side["step"](side["state"], batch)
                loss_value = float(jax.block_until_ready(m)["loss"])
                seconds = time.perf_counter() - t0
                if isinstance(side["step"], steps.HostLoopStep) and timed:
                    side.setdefault("micro_T", []).append([s[-1] for s in side["step"].last_micro_shapes])
                if timed:
                    side["seconds"].append(seconds)
                    side["losses"].append(loss_value)
                print(f"{'timed' if timed else 'warm-up'} batch {i} (T {batch['input_ids'].shape[-1]}) {name}: "
                      f"{seconds:.1f} s, loss {loss_value:.5f}", flush=True)
    print("\n| side | s per step (median) | loss per step |")
    print("|---|---|---|")
    for name, side in sides.items():
        print(f"| {name} | {statistics.median(side['seconds']):.1f} | "
              f"{', '.join(f'{x:.5f}' for x in side['losses'])} |")
    ratio = [p / h for p, h in zip(sides["one program"]["seconds"], sides["host loop"]["seconds"])]
    print(f"\nper-batch ratio one program / host loop: {', '.join(f'{r:.2f}' for r in ratio)} "
          f"(median {statistics.median(ratio):.2f}); host-loop micro-batch lengths: {sides['host loop']['micro_T']}")


if __name__ == "__main__":
    main()
