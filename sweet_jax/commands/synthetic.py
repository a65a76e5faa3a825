"""Write synthetic collaborative ColBench tasks (sweet_jax.envs.synthetic) and, optionally, scripted demonstrations
scored by the sandbox:

    python -m sweet_jax.commands.synthetic --num-tasks 200 --out tasks.jsonl [--trajectories demos.jsonl --per-task 4]
"""
from __future__ import annotations

import json
import sys

from sweet_jax import cli
from sweet_jax.commands import launch
from sweet_jax.envs.synthetic import make_tasks, scripted_trajectories
from sweet_jax.sandbox import Evaluator


def main(argv=None) -> None:
    parser = cli.ArgumentParser(description="Write synthetic collaborative ColBench tasks (and demos).")
    parser.add_argument("--num-tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-keys", type=int, default=2)
    parser.add_argument("--max-keys", type=int, default=4)
    parser.add_argument("--out", required=True, help="tasks JSONL")
    parser.add_argument("--trajectories", help="also write scripted, sandbox-scored trajectories here")
    parser.add_argument("--per-task", type=int, default=4)
    args = parser.parse_args(argv)
    tasks = make_tasks(args.num_tasks, seed=args.seed, min_keys=args.min_keys, max_keys=args.max_keys)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(t) + "\n" for t in tasks)
    print(f"wrote {len(tasks)} tasks to {args.out}", file=sys.stderr)
    if args.trajectories:
        with Evaluator(degraded_ok=True) as evaluator:
            trajectories = scripted_trajectories(tasks, seed=args.seed, per_task=args.per_task, evaluator=evaluator)
        with open(args.trajectories, "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in trajectories)
        rewards = [t["reward"] for t in trajectories]
        print(f"wrote {len(trajectories)} trajectories to {args.trajectories}: mean reward "
              f"{sum(rewards) / len(rewards):.3f}, success {sum(r == 1.0 for r in rewards) / len(rewards):.3f}",
              file=sys.stderr)


define_flags = None  # main parses its own argv (cli.ArgumentParser)


HELP_CONFIGS = ()

if __name__ == "__main__":
    launch("synthetic")
