"""A training stage's steps with the host loop's micro-batches cut at one length multiple against another
(data.micro_bucket), on a pipeline run's own data and model as its trainer sets them up: in one process each
step's batch runs at every multiple from the same state (the trainer goes on with the first); each step's seconds
less the compilations it triggered, its tokens run, and the losses compared.

    python bench/bench_micro_bucket.py --run WORKDIR [--stage critic] [--multiples 128,32] [--steps 6]

WORKDIR: as bench/bench_padding.py (`--proxy` builds a full-size stand-in).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import pathlib
import tempfile
import time

import jax
import ml_collections
import numpy as np

from bench_padding import stage_configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--stage", default="critic", help="critic, critic_no_info, mtdpo, rft or sweet")
    parser.add_argument("--multiples", default="128,32")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    from sweet_jax import costs
    from sweet_jax.pipeline import stages
    from sweet_jax.train import model_loading, passes, trainer
    workdir = pathlib.Path(args.run)
    run = stages.Run(ml_collections.ConfigDict(json.loads((workdir / "pipeline_config.json").read_text())), workdir)
    tconfig, _ = stage_configs(run)[args.stage]
    multiples = [int(m) for m in args.multiples.split(",")]
    costs.listen_to_compiles()
    rows = {m: [] for m in multiples}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as scope:
        c = ml_collections.ConfigDict(tconfig.to_dict())
        c.data.micro_bucket = multiples[0]
        tr = trainer.Trainer(c, pathlib.Path(tmp), model_loading.make_mesh(trainer.training_mesh_shape(c)))
        tr.setup(scope)
        tr.resume()
        variants = {multiples[0]: tr.train_step}
        for m in multiples[1:]:   # the same step (its compiled programs shared), micro-batches cut at m
            variants[m] = copy.copy(tr.train_step)
            variants[m].length_multiple = m
        extra = (tr.ref_params,) if tr.ref_params is not None else ()
        for _ in range(args.steps):
            batch = passes.to_global(next(tr.batches), tr.batch_sh)
            for m in reversed(multiples):   # every variant from the same state; the trainer goes on with the first
                state = tr.state if m == multiples[0] else jax.tree.map(lambda x: x.copy(), tr.state)
                costs.reset()
                t0 = time.perf_counter()
                new_state, metrics = variants[m](state, batch, *extra)
                metrics = jax.device_get(metrics)
                seconds = time.perf_counter() - t0
                got = costs.snapshot()
                rows[m].append({"loss": float(metrics["loss"]), "seconds": seconds,
                                "compile": got.get("compile_s", 0.0),
                                "padded": sum(int(np.prod(s)) for s in variants[m].last_micro_shapes)})
                if m == multiples[0]:
                    tr.state = new_state
    base = multiples[0]
    print(f"{args.stage} steps of {workdir}, micro-batch length multiple {' vs '.join(map(str, multiples))}:\n")
    print("| step | " + " | ".join(f"{m}: s (compile s), tokens run" for m in multiples) + " | loss difference |")
    print("|---|" + "---|" * len(multiples) + "---|")
    for i in range(args.steps):
        cells = [f"{rows[m][i]['seconds']:.1f} ({rows[m][i]['compile']:.1f}), {rows[m][i]['padded']}" for m in multiples]
        diff = max(abs(rows[m][i]["loss"] - rows[base][i]["loss"]) for m in multiples)
        print(f"| {i + 1} | " + " | ".join(cells) + f" | {diff:.2g} |")
    totals = {m: (sum(r["seconds"] - r["compile"] for r in rows[m]), sum(r["padded"] for r in rows[m])) for m in multiples}
    print("| all, compile excluded | " + " | ".join(f"**{totals[m][0]:.1f}**, {totals[m][1]}" for m in multiples)
          + " | |")
    for m in multiples[1:]:
        print(f"\n{base} / {m}: {totals[base][0] / totals[m][0]:.2f}x step seconds (compile excluded), "
              f"{totals[base][1] / totals[m][1]:.2f}x tokens run")


if __name__ == "__main__":
    main()
