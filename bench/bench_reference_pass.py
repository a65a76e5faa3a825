"""A training stage's reference pass, the old way (every example's sequences, the whole split) against now (each
distinct sequence once, only the examples the stage's steps reach), on a pipeline run's own data and model as its
trainer sets them up; one process, interleaved rounds (the first of each side compiles), values compared.

    python bench/bench_reference_pass.py --run WORKDIR [--stages critic,mtdpo,sweet] [--rounds 2]

WORKDIR: a pipeline workdir (smollm2 presets) with its offline stage done (the critics, multi-turn DPO) and its
rank stage (SWEET-RL's DPO); the stages' configs as bench/bench_padding.py builds them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import tempfile
import time

import ml_collections
import numpy as np

from bench_padding import stage_configs


def compare(tconfig, num_steps: int, rounds: int) -> dict:
    from sweet_jax import costs
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.train import model_loading, passes, steps, trainer
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as scope:
        tr = trainer.Trainer(tconfig, tmp, model_loading.make_mesh(trainer.training_mesh_shape(tconfig)))
        tokenizer = load_tokenizer(model_loading.tokenizer_path(tconfig))
        train_set, _ = tr.load_data(tokenizer)
        tr.build_steps(tokenizer, scope)
        ref_fn = steps.make_ref_logp_fn(tr.state.graphdef, steps.shardings_of(tr.state.params), tr.mesh,
                                        rest=tr.state.rest)
        reached = passes.trained_examples(tr.make_batches(train_set), num_steps)
        sides = {"old": dict(deduplicate=False), "new": dict(only=reached)}
        out = {"examples": train_set.num_examples, "reached": len(reached)}
        values = {}
        for r in range(rounds):
            for side, kw in sides.items():
                costs.reset()
                t0 = time.perf_counter()
                values[side] = passes.reference_pass(ref_fn, tr.state.params, train_set, tr.make_batches, tr.batch_sh,
                                                     tconfig.data.padding_side, **kw)
                c = costs.snapshot()
                out.setdefault(side, []).append({"seconds": time.perf_counter() - t0,
                                                 "tokens": c.get("ref_logp_tokens", 0),
                                                 "padded": c.get("ref_logp_padded_tokens", 0)})
        diff = max(float(np.abs(a - b).max()) for i in reached for a, b in zip(values["old"][i], values["new"][i]))
        out["max_abs_diff"] = diff
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a pipeline workdir with its offline (and rank) stage done")
    parser.add_argument("--stages", default="critic,critic_no_info,mtdpo,sweet")
    parser.add_argument("--rounds", type=int, default=2, help="passes per side (the first compiles)")
    args = parser.parse_args()
    from sweet_jax.pipeline import stages
    workdir = pathlib.Path(args.run)
    run = stages.Run(ml_collections.ConfigDict(json.loads((workdir / "pipeline_config.json").read_text())), workdir)
    lines = [f"Reference passes of {workdir}'s training stages, old (every example) / new (distinct sequences, "
             "reached examples): seconds of each round, real / padded tokens:", "",
             "| stage | examples, reached | old s | new s | ratio (last round) | old tokens | new tokens | "
             "largest difference |", "|---|---|---|---|---|---|---|---|"]
    wanted = args.stages.split(",")
    for name, (tconfig, num_steps) in stage_configs(run).items():
        if name not in wanted:
            continue
        got = compare(tconfig, num_steps, args.rounds)
        old, new = got["old"], got["new"]
        seconds = [", ".join(f"{x['seconds']:.1f}" for x in side) for side in (old, new)]
        lines.append(f"| {name} | {got['examples']}, {got['reached']} | {seconds[0]} | {seconds[1]} | "
                     f"**{old[-1]['seconds'] / new[-1]['seconds']:.2f}x** | {old[-1]['tokens'] / 1e3:.1f}k / "
                     f"{old[-1]['padded'] / 1e3:.1f}k | {new[-1]['tokens'] / 1e3:.1f}k / {new[-1]['padded'] / 1e3:.1f}k | "
                     f"{got['max_abs_diff']:.2g} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
