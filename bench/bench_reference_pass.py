"""A training stage's reference pass two or more ways on a pipeline run's own data and model as its trainer sets
them up; one process, interleaved rounds (the first of each side compiles), values compared with the first side's.
The sides (--sides, default old,new):
  old     every example's sequences, the whole split, at their buckets;
  new     each distinct sequence once, only the examples the stage's steps reach;
  cut     as new, each batch cut to its longest sequence (the host loop's micro_bucket; the pipeline 2026-12-02);
  packed  as new, each distinct sequence once behind the prefix it shares with others (passes.packed_reference_pass:
          a turn prompt's candidates share the prompt, a task's trajectories its statement and c).

    python bench/bench_reference_pass.py --run WORKDIR [--stages critic,mtdpo,sweet] [--rounds 2]
    python bench/bench_reference_pass.py --run WORKDIR --sides cut,packed [--cpu-matmul xla]
    python bench/bench_reference_pass.py --run WORKDIR --sides cut,packed --cpu-matmul xla --save F32_DIR
    python bench/bench_reference_pass.py --run WORKDIR --sides cut,packed --against F32_DIR   # bf16 against float32

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


def compare(tconfig, num_steps: int, rounds: int, sides: list[str], save: pathlib.Path | None = None) -> dict:
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
        sides = {name: {"old": dict(deduplicate=False), "new": dict(only=reached),
                        "cut": dict(only=reached, length_multiple=tr.length_multiple),
                        "packed": dict(only=reached, packed=steps.make_packed_logp_fn(tr.state.graphdef,
                                                                                      rest=tr.state.rest),
                                       pad_id=tr.pad_id)}[name] for name in sides}
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
        base, *others = list(sides)
        out["max_abs_diff"] = {side: max(float(np.abs(a - b).max()) for i in reached
                                         for a, b in zip(values[base][i], values[side][i])) for side in others}
        out["max_sum_diff"] = {side: max(abs(float(a.sum()) - float(b.sum())) for i in reached
                                         for a, b in zip(values[base][i], values[side][i])) for side in others}
        if save is not None:  # each side's values of the examples reached, for --against
            np.savez(save, **{f"{side}/{i}/{p}": v for side in sides for i in reached
                              for p, v in enumerate(values[side][i])})
        return out


def against(here, there, sides: list[str]) -> dict:
    """{side: (largest token difference, largest sequence-sum difference)} of this run's sides against the
    other run's first side, over the sequences both hold."""
    first = there.files[0].split("/", 1)[0]  # the other run's first side (np.savez keeps the order)
    truth = {key.split("/", 1)[1]: there[key] for key in there.files if key.split("/", 1)[0] == first}
    out = {}
    for side in sides:
        pairs = [(here[f"{side}/{k}"], v) for k, v in truth.items() if f"{side}/{k}" in here.files]
        out[side] = (max(float(np.abs(a - b).max()) for a, b in pairs),
                     max(abs(float(a.sum()) - float(b.sum())) for a, b in pairs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a pipeline workdir with its offline (and rank) stage done")
    parser.add_argument("--stages", default="critic,critic_no_info,mtdpo,sweet")
    parser.add_argument("--rounds", type=int, default=2, help="passes per side (the first compiles)")
    parser.add_argument("--sides", default="old,new", help="two or more of old, new, cut, packed; the first the base")
    parser.add_argument("--cpu-matmul", default=None, help="model.cpu_matmul (default: the stage's)")
    parser.add_argument("--save", help="a folder: each stage's values by side (STAGE.npz)")
    parser.add_argument("--against",
                        help="a --save folder of another run (e.g. float32): each side against its first side")
    args = parser.parse_args()
    sides = args.sides.split(",")
    from sweet_jax.pipeline import stages
    workdir = pathlib.Path(args.run)
    run = stages.Run(ml_collections.ConfigDict(json.loads((workdir / "pipeline_config.json").read_text())), workdir)
    lines = [f"Reference passes of {workdir}'s training stages, {' / '.join(sides)}: seconds of each round, real / "
             "padded tokens:", "",
             "| stage | examples, reached | " + " | ".join(f"{side} s" for side in sides) + " | "
             + " | ".join(f"{sides[0]} / {side} (last round)" for side in sides[1:]) + " | "
             + " | ".join(f"{side} tokens" for side in sides)
             + " | largest difference: a token, a sequence's sum |",
             "|---|---|" + "---|" * (3 * len(sides))]
    wanted = args.stages.split(",")
    for name, (tconfig, num_steps) in stage_configs(run).items():
        if name not in wanted:
            continue
        if args.cpu_matmul:
            tconfig = ml_collections.ConfigDict(tconfig.to_dict())
            tconfig.model.cpu_matmul = args.cpu_matmul
        save = pathlib.Path(args.save) / f"{name}.npz" if args.save else None
        got = compare(tconfig, num_steps, args.rounds, sides, save)
        if args.against:
            got["against"] = against(np.load(save), np.load(pathlib.Path(args.against) / f"{name}.npz"), sides)
            print(f"{name}: each side against {args.against}'s first side, the largest difference a token / "
                  "a sequence's sum: " + ", ".join(f"{side} {a:.2g} / {b:.2g}"
                                                   for side, (a, b) in got["against"].items()), flush=True)
        base = got[sides[0]]
        seconds = [", ".join(f"{x['seconds']:.1f}" for x in got[side]) for side in sides]
        ratios = [f"**{base[-1]['seconds'] / got[side][-1]['seconds']:.2f}x**" for side in sides[1:]]
        tokens = [f"{got[side][-1]['tokens'] / 1e3:.1f}k / {got[side][-1]['padded'] / 1e3:.1f}k" for side in sides]
        diffs = ", ".join(f"{got['max_abs_diff'][side]:.2g} / {got['max_sum_diff'][side]:.2g}" for side in sides[1:])
        lines.append(f"| {name} | {got['examples']}, {got['reached']} | " + " | ".join(seconds + ratios + tokens)
                     + f" | {diffs} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
