"""Diagnostics of a pipeline run on the synthetic lookup tasks (sweet_jax.rl.diagnostics), as JSON:

    python -m sweet_jax.pipeline_diagnostics WORKDIR [--probes] [--out FILE]

prints the rankings' agreement with the oracle (overall, by reply kind and state, ties counted) and each
policy's behaviour (questions on the task's keys, answers, copy accuracy of the values the user stated).
--probes adds the models' probes (sweet_jax.rl.probes: P(answer) by state for the starting policy with and without
the agent prompt and for every kept checkpoint of the SWEET-RL runs, the implicit margin of a correct answer over
a repeated question where every value is known, the critics' per-turn scores by kind and normalisation): a few
minutes of forward passes on CPU for SmolLM2. Every file it reads is checked as it is read (a damaged one, or a pair
whose trajectory index is outside the episodes: one line naming the file and the field, exit 2); an existing
--out FILE is refused.
"""
from __future__ import annotations

import json
import pathlib
import sys

from sweet_jax import cli
from sweet_jax.commands import launch
from sweet_jax.errors import SweetJaxError


def main(argv=None) -> None:
    parser = cli.ArgumentParser(prog="python -m sweet_jax.pipeline_diagnostics",
                                description="Diagnostics of a pipeline run's rankings and policies (JSON).")
    parser.add_argument("workdir", help="a `python -m sweet_jax.pipeline` run directory")
    parser.add_argument("--probes", action="store_true", help="also probe the run's models (forward passes)")
    parser.add_argument("--out", default="", help="write the JSON here too")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    workdir = pathlib.Path(args.workdir)
    if args.out and (pathlib.Path(args.out).exists() or pathlib.Path(args.out).is_symlink()):
        raise SweetJaxError(f"--out {args.out}: already exists; pass a new file (or remove it first)")
    if not workdir.is_dir():
        raise SweetJaxError(f"{workdir} is not a directory: pass the --workdir of a `python -m sweet_jax.pipeline` run")
    if not any((workdir / stage).is_dir() for stage in ("offline", "rank", "rank_no_info")):
        raise SweetJaxError(f"{workdir} holds no pipeline stage (offline/, rank/): pass the --workdir of a "
                            "`python -m sweet_jax.pipeline` run")
    # After the flags: --help in a second.
    from sweet_jax.rl.diagnostics import behaviour_diagnostics, pair_kinds, rankings, run_diagnostics  # (above)
    report = {"rankings": run_diagnostics(workdir), "behaviour": behaviour_diagnostics(workdir)}
    stages = rankings(workdir)
    for name, ranking in report["rankings"].items():   # the rankings run_diagnostics found
        stage, trajectories = stages[name]
        ranking["by_kind"] = pair_kinds(stage / "pairs.jsonl", trajectories)
    if args.probes:
        from sweet_jax.rl.probes import run_probes  # the models' forward passes: jax, only with --probes
        report["probes"] = run_probes(workdir)
    text = json.dumps(report, indent=2)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text)


define_flags = None  # main parses its own argv (cli.ArgumentParser)


HELP_CONFIGS = ()

if __name__ == "__main__":
    launch("pipeline_diagnostics")
