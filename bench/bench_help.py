"""Seconds a command line takes to answer --help, a misspelt flag and a missing file, for every command.

    python bench/bench_help.py [--repeats 5] [--commands train,rank] [--ctrl_c]

Each case runs as a new process (`python -m sweet_jax.NAME ...`, what a user types) from a scratch directory,
`--repeats` times; the table shows the median and the fastest run in seconds, then the processor, the 1-minute
load average before and after, and the date. What it measures is the import and parse path: a command parses its
flags and checks its paths before it imports jax, Flax or transformers (sweet_jax/commands/__init__.py), so all
three answer without them. Target: under 1.5 s on an idle host.

--ctrl_c also measures how long `python -m sweet_jax.plan` (the 8B critic for v5e-16, a compile of minutes) takes
to exit after Ctrl-C (SIGINT) sent 10 s into its compile; the compile runs in a worker thread (cli.interruptible).
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

CASES = {  # command -> (a misspelt flag, a missing file or None)
    "train": (["--config", "configs/critic.py:demo", "--workdri", "x"],
              ["--config", "configs/critic.py:demo", "--workdir", "x", "--config.data.trajectories=nope.jsonl"]),
    "export": (["--workdri", "x"], ["--workdir", "nope", "--out", "hf"]),
    "serve": (["--modle", "x"], ["--model", "nope"]),
    "rollout": (["--outptu=x"], ["--config.tasks=nope.jsonl"]),
    "rank": (["--config.num_candidatez=2"], ["--config.critic.path=nope"]),
    "evaluate": (["x.jsonl", "--out", "o", "--detials"], ["nope.jsonl", "--out", "o"]),
    "plan": (["--topolgy", "v5e-16"], None),
    "pipeline": (["--workdir", "x", "--config.seeed=1"], ["--workdir", "x", "--config.init.from_run=nope"]),
    "pipeline_report": (["x", "--ot", "y"], ["nope", "--out", "o"]),
    "pipeline_diagnostics": (["x", "--prbes"], ["nope"]),
}


def seconds(args: list[str], cwd: str, expect: int) -> float:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != expect:
        raise SystemExit(f"{' '.join(args)}: exit status {proc.returncode}, expected {expect}:\n{proc.stderr[-2000:]}")
    return took


def plan_ctrl_c_seconds(cwd: str) -> float:
    """Seconds from SIGINT, sent 10 s after plan says it is compiling, to the process's exit (status 130)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}  # its lines as they are printed
    proc = subprocess.Popen([sys.executable, "-m", "sweet_jax.plan", "--config", "configs/critic.py:llama3_8b",
                             "--topology", "v5e-16"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            # A background job's SIGINT is ignored and a child inherits that: plan must hear it.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:
        if line.startswith("compiling"):
            break
    time.sleep(10)
    start = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()
    code = proc.wait()
    took = time.perf_counter() - start
    if code != 130 or "interrupted (Ctrl-C)" not in rest:
        raise SystemExit(f"plan after Ctrl-C: exit status {code}:\n{rest[-2000:]}")
    return took


def processor() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commands", default=",".join(CASES), help="comma-separated (default: all)")
    parser.add_argument("--ctrl_c", action="store_true", help="also: seconds plan takes to stop on Ctrl-C")
    args = parser.parse_args()
    names = [n for n in args.commands.split(",") if n]
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as cwd:
        for name in names:
            typo, missing = CASES[name]
            cells = []
            for case, expect in (((["--help"]), 0), (typo, 2), (missing, 2)):
                if case is None:
                    cells.append("-")
                    continue
                runs = [seconds([f"sweet_jax.{name}", *case], cwd, expect) for _ in range(args.repeats)]
                cells.append(f"{statistics.median(runs):.2f} ({min(runs):.2f})")
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
            print(rows[-1], file=sys.stderr, flush=True)
        ctrl_c = plan_ctrl_c_seconds(cwd) if args.ctrl_c else None
    load_after = os.getloadavg()[0]
    print(f"seconds to answer, median of {args.repeats} (fastest), each a new `python -m sweet_jax.NAME` process\n")
    print("| command | --help | a misspelt flag | a missing file |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    if ctrl_c is not None:
        print(f"\nplan, Ctrl-C 10 s into compiling the 8B critic step for v5e-16: exited (status 130) {ctrl_c:.2f} s "
              "after the signal")
    print(f"\n{processor()}, {os.cpu_count()} cores; 1-min load average {load_before:.2f} before, "
          f"{load_after:.2f} after; Python {platform.python_version()}; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")


if __name__ == "__main__":
    main()
