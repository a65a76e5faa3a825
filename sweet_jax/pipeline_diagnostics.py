"""Diagnostics of a pipeline run on the synthetic lookup tasks (sweet_jax.diagnostics), as JSON:

    python -m sweet_jax.pipeline_diagnostics WORKDIR

prints the rankings' agreement with the oracle (overall and by reply kind) and each policy's behaviour
(questions on the task's keys, answers, copy accuracy of the values the user stated).
"""
from __future__ import annotations

import json
import pathlib
import sys

from sweet_jax import cli
from sweet_jax.diagnostics import behaviour_diagnostics, pair_kinds, run_diagnostics
from sweet_jax.errors import SweetJaxError


def main(argv=None) -> None:
    parser = cli.ArgumentParser(prog="python -m sweet_jax.pipeline_diagnostics",
                                description="Diagnostics of a pipeline run's rankings and policies (JSON).")
    parser.add_argument("workdir", help="a `python -m sweet_jax.pipeline` run directory")
    workdir = pathlib.Path(parser.parse_args(sys.argv[1:] if argv is None else argv).workdir)
    if not workdir.is_dir():
        raise SweetJaxError(f"{workdir} is not a directory: pass the --workdir of a `python -m sweet_jax.pipeline` run")
    if not any((workdir / stage).is_dir() for stage in ("offline", "rank", "rank_no_info")):
        raise SweetJaxError(f"{workdir} holds no pipeline stage (offline/, rank/): pass the --workdir of a "
                            "`python -m sweet_jax.pipeline` run")
    report = {"rankings": run_diagnostics(workdir), "behaviour": behaviour_diagnostics(workdir)}
    traj = workdir / "offline" / "trajectories.jsonl"
    for name in ("rank", "rank_no_info"):
        if (workdir / name / "pairs.jsonl").exists():
            report["rankings"][name]["by_kind"] = pair_kinds(workdir / name / "pairs.jsonl", traj)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    cli.run(main, allocator=False)
