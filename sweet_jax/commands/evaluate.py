r"""Scores ColBench backend trajectories in the sandbox and writes them back with `reward` set.

    python -m sweet_jax.evaluate TRAJECTORIES.jsonl --out SCORED.jsonl [--details] \
        [--compat strict|sweet_rl] [--workers N] [--timeout_s 2.0]

reward = fraction of the task's test cases passed; success = reward 1.0. Every field of the input
records is kept. A trajectory whose evaluation hit a sandbox failure (status infra_error) is
written without a reward and makes the command exit with status 2: it is never scored as a pass.
"""

import dataclasses
import sys
import time

from sweet_jax import cli, jsonl
from sweet_jax.commands import launch


def _load(path, skip_bad):
    """[(record to write back, task, answer)]: a bad row is one line naming file:line and field."""
    from sweet_jax.data.loading import load_trajectories  # after the flags: --help in a second
    no_reply = ("the agent never replied, so the row holds no answer to evaluate; drop it (or pass --skip_bad to "
                "skip such rows) or add the agent's turns and its final `answer`")
    return [(t, t.task, t.answer) for t in load_trajectories(path, skip_bad=skip_bad, no_reply=no_reply)]


def _with_reward(record, reward, details):
    if isinstance(record, dict):
        out = dict(record)
        if reward is None:
            out.pop("reward", None)
        else:
            out["reward"] = reward
    else:
        out = dataclasses.replace(record, reward=reward).to_json()
    if details is not None:
        out["evaluation"] = details
    return out


def main(argv=None):
    parser = cli.ArgumentParser(prog="python -m sweet_jax.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("trajectories", help="JSONL of trajectories (task, dialogue_history, answer)")
    parser.add_argument("--out", required=True, help="where to write the scored JSONL")
    parser.add_argument("--details", action="store_true",
                        help="print per-task results and store per-case outcomes under 'evaluation'")
    parser.add_argument("--compat", choices=("strict", "sweet_rl"), default="strict",
                        help="sweet_rl: the official evaluator's scoring rules (deny-list, exec into locals)")
    parser.add_argument("--workers", type=int, default=None, help="sandbox workers (default: cores)")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="wall-clock limit per test case (default 2.0; 1.0 with --compat sweet_rl, the official)")
    parser.add_argument("--degraded-ok", action="store_true",
                        help="run without namespaces where they are unavailable (labelled degraded)")
    parser.add_argument("--skip-bad", action="store_true", help="skip malformed records instead of failing")
    args = parser.parse_args(argv)

    if args.timeout_s is None:
        args.timeout_s = 1.0 if args.compat == "sweet_rl" else 2.0
    rows = _load(args.trajectories, args.skip_bad)
    from sweet_jax.sandbox import Evaluator  # after the flags: --help in a second
    with Evaluator(workers=args.workers, timeout_s=args.timeout_s, compat=args.compat,
                   degraded_ok=args.degraded_ok) as evaluator:
        start = time.perf_counter()
        scores = evaluator.score_many([(task, answer) for _, task, answer in rows], progress=True)
        elapsed = time.perf_counter() - start
        mode = evaluator.mode

    infra = [i for i, s in enumerate(scores) if s.status != "ok"]
    jsonl.write(args.out, [_with_reward(record, score.reward if score.status == "ok" else None,
                                        score.to_json() if args.details else None)
                           for (record, _, _), score in zip(rows, scores)])

    ok = [s for s in scores if s.status == "ok"]
    cases = sum(s.total for s in ok)
    print(f"trajectories: {len(scores)}   sandbox: {mode}   compat: {args.compat}")
    if ok:
        print(f"tests passed: {100 * sum(s.reward for s in ok) / len(ok):.1f}% (mean reward, as in the "
              f"paper; {100 * sum(s.passed for s in ok) / max(cases, 1):.1f}% of all cases)")
        print(f"success rate: {100 * sum(s.reward == 1.0 for s in ok) / len(ok):.1f}% (reward == 1.0)")
    print(f"throughput: {len(scores) / elapsed * 60:.0f} evals/min ({elapsed:.1f}s)")
    if args.details:
        for i, ((_, task, _), score) in enumerate(zip(rows, scores)):
            description = (getattr(task, "problem_description", None) if not isinstance(task, dict)
                           else task.get("problem_description")) or ""
            outcomes = " ".join(c["outcome"] for c in score.details.get("cases", []))
            print(f"[{i}] reward={score.reward:.2f} {score.status} {description[:60]!r} {outcomes}")
    print(f"wrote {args.out}")
    if infra:
        print(f"ERROR: {len(infra)} trajectories hit a sandbox failure (status infra_error), written "
              f"without a reward: {infra[:10]}", file=sys.stderr)
        return 2
    return 0


define_flags = None  # main parses its own argv (cli.ArgumentParser)


HELP_CONFIGS = ()

if __name__ == "__main__":
    launch("evaluate")
