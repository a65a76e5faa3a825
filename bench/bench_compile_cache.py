"""What JAX's persistent compilation cache saves a seed's stages when it keeps every program, not only those that
took a second or more to compile (JAX's default `jax_persistent_cache_min_compile_time_secs`).

Stages of a finished run are run again in scratch workdirs (every other stage of the run linked in, finished), under
each threshold with a compilation cache of its own, empty at the start: the first pass fills it (a cold seed), the
second reads it (a later seed of the same protocol on the same machine, whose programs have the same shapes). Each
pass's records (wall, compile seconds, programs compiled, cache hits) are printed side by side, and every rerun
stage's episodes are compared with the run's own.

    python bench/bench_compile_cache.py --run RUN --out OUT --stages eval/zero_shot,eval/rft -- PIPELINE_FLAGS...

PIPELINE_FLAGS: the run's own command line after `python -m sweet_jax.pipeline` (its --config and overrides; the
workdir and --carry are this script's), so that its recorded config matches. The run is read, never written.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
DONE = "done.json"


def mirror(run: pathlib.Path, dst: pathlib.Path, rerun: set[str], rel: str = "") -> None:
    """dst as run: finished stage directories linked (skipped, never written), other directories made and filled
    the same way, files copied (the pipeline rewrites some at the top), the stages in `rerun` left out."""
    (dst / rel).mkdir(parents=True, exist_ok=True)
    for child in sorted((run / rel).iterdir()):
        name = f"{rel}/{child.name}" if rel else child.name
        if name in rerun:
            continue
        if child.is_dir() and (child / DONE).exists() and not any(r.startswith(name + "/") for r in rerun):
            (dst / name).symlink_to(child.resolve())
        elif child.is_dir():
            mirror(run, dst, rerun, name)
        else:
            shutil.copy2(child, dst / name)


def episodes(path: pathlib.Path) -> list[str]:
    """A stage's episodes as comparable lines: each trajectory's messages and reward, nothing timed."""
    out = []
    for line in (path / "trajectories.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append(json.dumps([row["task"]["ground_truth"], [m["content"] for m in row["dialogue_history"]],
                               row.get("reward")], sort_keys=True))
    return out


def main() -> None:
    argv = sys.argv[1:]
    pipeline_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a finished pipeline workdir (read only)")
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="eval/zero_shot", help="stage directories to run again, comma-separated")
    p.add_argument("--thresholds", default="1,0", help="min compile seconds a program needs to be cached")
    p.add_argument("--passes", type=int, default=2, help="passes a threshold: the first fills its cache")
    args = p.parse_args(own)
    run, out = pathlib.Path(args.run).resolve(), pathlib.Path(args.out).resolve()
    stages = [s for s in args.stages.split(",") if s]
    for s in stages:
        if not (run / s / DONE).exists():
            raise SystemExit(f"error: --stages {s}: {run / s / DONE} does not exist; the run must have finished it")
    rows = []
    for threshold in args.thresholds.split(","):
        cache = out / f"cache_{threshold}"
        for k in range(args.passes):
            workdir = out / f"min{threshold}_pass{k}"
            if not all((workdir / s / DONE).exists() for s in stages):
                shutil.rmtree(workdir, ignore_errors=True)
                if k == 0:
                    shutil.rmtree(cache, ignore_errors=True)
                mirror(run, workdir, set(stages))
                env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
                           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=threshold)
                cmd = [sys.executable, "-m", "sweet_jax.pipeline", *pipeline_flags, f"--workdir={workdir}"]
                print(f"$ JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS={threshold}", " ".join(cmd), flush=True)
                subprocess.run(cmd, cwd=REPO, env=env, check=True)
            for s in stages:
                record = json.loads((workdir / s / DONE).read_text())
                c = record["costs"]
                same = episodes(workdir / s) == episodes(run / s)
                rows.append((s, threshold, k, record["seconds"], c.get("compile_s", 0.0),
                             c.get("compile_backend_compile_s", 0.0), int(c.get("compiles", 0)),
                             int(c.get("compile_cache_hits", 0)), record["load_average"], same))
        entries = sorted(cache.rglob("*")) if cache.exists() else []
        print(f"cache at min {threshold} s: {sum(1 for e in entries if e.is_file())} entries, "
              f"{sum(e.stat().st_size for e in entries if e.is_file()) / 2**20:.1f} MiB")
    print("| stage | min compile s cached | pass | wall s | compile s | backend compile s | compiles | cache hits "
          "| load | episodes = the run's |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s, t, k, wall, comp, backend, n, hits, load, same in rows:
        print(f"| {s} | {t} | {k} | {wall:.0f} | {comp:.1f} | {backend:.1f} | {n} | {hits} | "
              f"{load[0]:.1f}-{load[1]:.1f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
