"""Memory of one sweet_jax train step on a real checkpoint: XLA's planned temporaries and the process's peak RSS.

    python bench/bench_step_memory.py --model HF_DIR                       # critic, 8 pairs x 2 x 512 tokens
    python bench/bench_step_memory.py --model HF_DIR --step dpo --seq 384  # the policy's DPO step
    python bench/bench_step_memory.py --model HF_DIR --micro 8 --attn xla --steps 0   # compile only, as before
    python bench/bench_step_memory.py --model HF_DIR --scan --remat full --steps 2    # the smollm2 preset's layout

The batch is the one bench_train_step.py builds (critic: 4 assistant turns of T/8 tokens; DPO: a reply of T/4
tokens at the end; log-probs at the action tokens, score_pos, as the trainer runs). --micro 0 is the trainer's
default (steps.auto_micro_batch_size). Run it under the allocator the command lines use (tcmalloc when
installed: sweet_jax.host_malloc re-executes this script under it).
"""
from __future__ import annotations

import argparse
import os
import resource
import time

import numpy as np

GiB = 1024 ** 3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF Llama checkpoint directory")
    ap.add_argument("--step", choices=("critic", "dpo"), default="critic")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro", type=int, default=0, help="pairs per forward/backward; 0: automatic")
    ap.add_argument("--attn", default="auto", help="attention_impl")
    ap.add_argument("--remat", default="none")
    ap.add_argument("--scan", action="store_true", help="stacked layers under jax.lax.scan (model.scan_layers)")
    ap.add_argument("--matmul", default="auto", help="model.cpu_matmul: auto | xla | xla_bf16 | onednn")
    ap.add_argument("--steps", type=int, default=1, help="steps to run after compiling (0: compile only)")
    a = ap.parse_args()
    from sweet_jax import host_malloc
    host_malloc.reexec_with_allocator()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from sweet_jax import config_utils
    from sweet_jax.train import steps
    from sweet_jax.train.optimizer import make_optimizer
    from sweet_jax.data import batching
    from sweet_jax.models import load_hf

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB

    model = load_hf(a.model, config_overrides=dict(attention_impl=a.attn, remat=a.remat, scan_layers=a.scan,
                                                    cpu_matmul=a.matmul))
    config = model.config
    optimizer = make_optimizer(1e-5, 100)
    state = steps.create_train_state(model, optimizer)
    del model
    rng = np.random.default_rng(0)
    B, T = a.pairs, a.seq
    turns = np.zeros((B, 2, T), np.int32)
    if a.step == "dpo":
        turns[:, :, T - T // 4:] = 1
    else:
        for k, start in enumerate(range(T // 8, T, T // 4)):
            turns[:, :, start:start + T // 8] = k + 1
    batch = dict(input_ids=rng.integers(3, config.vocab_size, (B, 2, T)).astype(np.int32),
                 attention_mask=np.ones((B, 2, T), np.int32), turn_ids=turns,
                 ref_logp=(-rng.uniform(5, 12, (B, 2, T))).astype(np.float32),
                 score_pos=batching.score_positions(turns, T // 2))
    loss = config_utils.base_config().loss  # the trainer's loss defaults
    loss.kind = a.step
    # One program, for XLA's memory analysis; the trainer's host loop (steps.HostLoopStep) runs the same
    # micro-batch programs one at a time, so its temps are one micro-batch's.
    step = steps.make_step(steps.loss_spec(loss), state, optimizer, micro_batch_size=a.micro, host_loop=False)
    start = time.time()
    compiled = step.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    micro = a.micro or steps.auto_micro_batch_size(config, (B, 2, T))
    print(f"{a.step} step, {config.num_params() / 1e6:.1f}M params, {B} pairs x 2 x {T} tokens, micro-batches of "
          f"{micro} pairs, attention {a.attn}, remat {a.remat}, cpu_matmul {a.matmul}, host allocator "
          f"{host_malloc.active()}: XLA temps "
          f"{mem.temp_size_in_bytes / GiB:.2f} GiB, arguments {mem.argument_size_in_bytes / GiB:.2f} GiB "
          f"(compiled in {time.time() - start:.0f} s; peak RSS {peak():.2f} GiB)", flush=True)
    for i in range(a.steps):
        start = time.time()
        state, metrics = compiled(state, batch)
        loss = float(jax.block_until_ready(metrics)["loss"])
        print(f"step {i + 1}: {time.time() - start:.1f} s, loss {loss:.5f}, peak RSS {peak():.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
