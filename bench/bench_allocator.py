"""The host allocator's effect on a real training stage: step seconds and peak RSS under each SWEET_JAX_MALLOC mode.

    python bench/bench_allocator.py --from-run RUN/critic/train --steps 3
    python bench/bench_allocator.py --from-run RUN/critic/train --steps 3 --modes tcmalloc,hugepages --matmul auto

--from-run: a trainer run directory (its config.json, e.g. a pipeline's critic stage: PIPELINE/critic/train). The
same config runs again, from scratch into a temporary directory, for --steps steps, once per (matmul, mode), each in
its own process started with the mode's allocator settings (bench_train_step.child_env: those of
sweet_jax.host_malloc, any inherited ones removed; a mode that cannot apply here stops the bench), one after
another. Reported per run: every train step's seconds (from its metrics.jsonl; the first includes compiling), the
mean of the steps after the first, and the process's peak RSS (ru_maxrss). Run it on an idle machine: the modes
differ by a few seconds a step.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

MODES = ("tcmalloc", "hugepages", "system")


def child(args) -> None:
    import ml_collections

    from sweet_jax import host_malloc

    from sweet_jax.train import trainer
    config = ml_collections.ConfigDict(json.loads((pathlib.Path(args.from_run) / "config.json").read_text()))
    config.model.cpu_matmul = args._matmul
    config.train.num_steps = args.steps
    config.train.ckpt_every = 0
    trainer.run(config, pathlib.Path(args._out), accept_config_change=True)
    print("PEAK_RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, host_malloc.active(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-run", required=True, help="a trainer run directory holding config.json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {MODES}")
    parser.add_argument("--matmul", default="auto,xla", help="comma-separated model.cpu_matmul values")
    parser.add_argument("--_matmul", default="", help=argparse.SUPPRESS)
    parser.add_argument("--_out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._out:
        return child(args)
    from bench_train_step import child_env

    from sweet_jax import host_malloc
    rows = []
    for matmul in args.matmul.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                out = pathlib.Path(tmp) / "run"
                env = {**child_env(mode), host_malloc.DONE_VAR: mode}  # host_malloc.active() names it
                run = subprocess.run([sys.executable, os.path.abspath(__file__), "--from-run", args.from_run,
                                      "--steps", str(args.steps), "--_matmul", matmul, "--_out", str(out)],
                                     env=env, capture_output=True, text=True)
                if run.returncode != 0:
                    sys.exit(f"matmul={matmul} malloc={mode} failed:\n{run.stderr[-3000:]}")
                peak_line = next(line for line in run.stdout.splitlines() if line.startswith("PEAK_RSS "))
                _, peak, allocator = peak_line.split(" ", 2)
                steps = [r["step_seconds"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                         if r.get("split") == "train"]
            rest = steps[1:] or steps
            rows.append((matmul, mode, allocator, steps, sum(rest) / len(rest), int(peak) / 2**30))
            print(f"  {matmul} {mode}: {rows[-1][4]:.1f} s a step, peak RSS {rows[-1][5]:.2f} GiB", file=sys.stderr,
                  flush=True)
    print(f"\n{args.from_run}, {args.steps} steps a run, load average now {os.getloadavg()[0]:.1f}:")
    print("| model.cpu_matmul | SWEET_JAX_MALLOC | allocator | step s (each) | mean after the first | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for matmul, mode, allocator, steps, mean, peak in rows:
        print(f"| {matmul} | {mode} | {allocator.split(' (')[0]} | {' / '.join(f'{s:.1f}' for s in steps)} | "
              f"**{mean:.1f}** | **{peak:.2f}** |")


if __name__ == "__main__":
    main()
