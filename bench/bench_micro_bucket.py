"""A training stage's steps with the host loop's micro-batches cut at one length multiple against another
(data.micro_bucket), of one size against another (train.micro_batch_size, 0 = automatic), or with each pair's
sequences side by side against one packed row that runs their shared prefix once (data.share_prefix), on a run's
own data and model as its trainer sets them up: in one process each step's batch runs every way from the same
state (the trainer goes on with the first); each step's seconds less the compilations it triggered, its tokens
run, and the losses compared.

    python bench/bench_micro_bucket.py --run WORKDIR [--stage critic] [--multiples 128,32] [--steps 6]
    python bench/bench_micro_bucket.py --run WORKDIR --stage sweet --multiples 32 --micro-batch-sizes 0,8
    python bench/bench_micro_bucket.py --run WORKDIR --stage critic --multiples 32 --share-prefix 0,1

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
    parser.add_argument("--micro-batch-sizes", default="0", help="examples a micro-batch (0: automatic)")
    parser.add_argument("--share-prefix", default="1", help="0: a pair's sequences side by side, 1: packed")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    from sweet_jax import costs
    from sweet_jax.pipeline import stages
    from sweet_jax.train import model_loading, passes, trainer
    workdir = pathlib.Path(args.run)
    run = stages.Run(ml_collections.ConfigDict(json.loads((workdir / "pipeline_config.json").read_text())), workdir)
    tconfig, _ = stage_configs(run)[args.stage]
    ways = [(int(m), int(b), bool(int(p))) for m in args.multiples.split(",")
            for b in args.micro_batch_sizes.split(",") for p in args.share_prefix.split(",")]
    costs.listen_to_compiles()
    rows = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as scope:
        c = ml_collections.ConfigDict(tconfig.to_dict())
        c.data.micro_bucket = ways[0][0]
        c.train.micro_batch_size = ways[0][1]
        c.data.share_prefix = ways[0][2]
        tr = trainer.Trainer(c, pathlib.Path(tmp), model_loading.make_mesh(trainer.training_mesh_shape(c)))
        tr.setup(scope)
        tr.resume()
        variants = {ways[0]: tr.train_step}
        for m, b, p in ways[1:]:   # the same step (its compiled programs shared), micro-batches of b cut at m
            variants[m, b, p] = copy.copy(tr.train_step)
            variants[m, b, p].length_multiple, variants[m, b, p].micro_batch_size = m, b
            variants[m, b, p].share_prefix = p
        extra = (tr.ref_params,) if tr.ref_params is not None else ()
        for _ in range(args.steps):
            batch = passes.to_global(next(tr.batches), tr.batch_sh)
            for m in reversed(ways):   # every variant from the same state; the trainer goes on with the first
                state = tr.state if m == ways[0] else jax.tree.map(lambda x: x.copy(), tr.state)
                costs.reset()
                t0 = time.perf_counter()
                new_state, metrics = variants[m](state, batch, *extra)
                metrics = jax.device_get(metrics)
                seconds = time.perf_counter() - t0
                got = costs.snapshot()
                rows[m].append({"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                                "seconds": seconds,
                                "compile": got.get("compile_s", 0.0),
                                "padded": sum(int(np.prod(s)) for s in variants[m].last_micro_shapes)})
                rows[m][-1]["micro"] = len(variants[m].last_micro_shapes)
                if m == ways[0]:
                    tr.state = new_state
    base = ways[0]
    name = {w: f"multiple {w[0]}, micro-batch {w[1] or 'auto'}{', prefix once' if w[2] else ''}" for w in ways}
    print(f"{args.stage} steps of {workdir}, {' vs '.join(name[w] for w in ways)}:\n")
    print("| step | " + " | ".join(f"{name[w]}: s (compile s), tokens run, micro-batches" for w in ways)
          + " | loss difference | grad-norm difference |")
    print("|---|" + "---|" * len(ways) + "---|---|")
    for i in range(args.steps):
        cells = [f"{rows[w][i]['seconds']:.1f} ({rows[w][i]['compile']:.1f}), {rows[w][i]['padded']}, "
                 f"{rows[w][i]['micro']}" for w in ways]
        diff = max(abs(rows[w][i]["loss"] - rows[base][i]["loss"]) for w in ways)
        grad = max(abs(rows[w][i]["grad_norm"] - rows[base][i]["grad_norm"]) for w in ways)
        print(f"| {i + 1} | " + " | ".join(cells) + f" | {diff:.2g} | {grad:.2g} |")
    totals = {w: (sum(r["seconds"] - r["compile"] for r in rows[w]), sum(r["padded"] for r in rows[w])) for w in ways}
    print("| all, compile excluded | " + " | ".join(f"**{totals[w][0]:.1f}**, {totals[w][1]}" for w in ways)
          + " | | |")
    for w in ways[1:]:
        print(f"\n{name[base]} / {name[w]}: {totals[base][0] / totals[w][0]:.2f}x step seconds (compile excluded), "
              f"{totals[base][1] / totals[w][1]:.2f}x tokens run")


if __name__ == "__main__":
    main()
