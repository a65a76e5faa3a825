"""Padding of a pipeline run's training steps at other length multiples: each training stage's batches rebuilt
from the run's own data as its trainer builds them (config, seed, steps), cut into the host loop's micro-batches
(steps.HostLoopStep: each at its own length, a multiple of data.bucket), and their real tokens against the tokens
the steps run at each multiple, with the number of distinct micro-batch shapes (each one compiled program of the
step). No model runs: the counts are exact, the time a step takes is about proportional to its tokens.

    python bench/bench_padding.py --run WORKDIR [--buckets 128,64,32]

WORKDIR: a pipeline workdir (smollm2 presets) with its offline stage done; the critic stages (with and without c),
multi-turn DPO and RFT read offline/trajectories.jsonl, SWEET-RL's DPO rank/pairs.jsonl when it exists.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import types

import ml_collections


def stage_configs(run) -> dict:
    """(train config, steps) of each training stage the run's data allows, as the pipeline makes them."""
    from sweet_jax.pipeline import stages
    c, w = run.config, run.workdir
    policy = str(w / "init" / "policy_hf")
    offline = str(w / "offline" / "trajectories.jsonl")
    out = {}
    for name, use_info in (("critic", True), ("critic_no_info", False)):
        out[name] = (stages.train_config(c, kind="critic", stage=c.critic, model_path=policy, tokenizer=run.tokenizer_dir,
                                         trajectories=offline, use_info=use_info, seed_offset=1), c.critic.num_steps)
    frozen = stages.selection_grid(c)
    for method in ("mtdpo", "rft", "sweet"):
        pairs = str(w / "rank" / "pairs.jsonl")
        if method == "sweet" and not pathlib.Path(pairs).exists():
            continue
        tconfig = stages.policy_train_config(run, method, policy, trajectories=offline, pairs=pairs)
        steps = frozen.frozen[method]["step"] if frozen is not None and frozen.frozen else tconfig.train.num_steps
        out[method] = (tconfig, steps)
    return out


def padding(tconfig, num_steps: int, buckets: list[int]) -> dict:
    from sweet_jax.data.datasets import build_datasets
    from sweet_jax.data.tokenizers import load_tokenizer, pad_id
    from sweet_jax.train import model_loading, steps
    tokenizer = load_tokenizer(model_loading.tokenizer_path(tconfig))
    train_set, _ = build_datasets(tconfig, tokenizer)
    train_set.gather_lengths()
    model_config = model_loading.model_config(tconfig, vocab_size=len(tokenizer), tokenizer=tokenizer)
    it = train_set.batches(tconfig, pad_id=pad_id(tokenizer))
    per_epoch = it.steps_per_epoch
    out = {"examples": train_set.num_examples, "steps": num_steps}
    for b in buckets:
        cutter = types.SimpleNamespace(length_multiple=b, score_positions=bool(tconfig.loss.score_positions))
        real = padded = 0
        shapes = set()
        for step in range(num_steps):
            batch = it.batch_at(*divmod(step, per_epoch))
            mb = tconfig.train.micro_batch_size or steps.auto_micro_batch_size(model_config, batch["input_ids"].shape)
            for micro in steps.HostLoopStep.micro_batches(cutter, batch, mb):
                real += int(micro["attention_mask"].sum())
                padded += micro["input_ids"].size
                shapes.add(micro["input_ids"].shape)
        out[b] = {"real": real, "padded": padded, "shapes": len(shapes)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a pipeline workdir with its offline stage done")
    parser.add_argument("--buckets", default="128,64,32", help="length multiples, the first the run's")
    args = parser.parse_args()
    from sweet_jax.pipeline import stages
    workdir = pathlib.Path(args.run)
    config = ml_collections.ConfigDict(json.loads((workdir / "pipeline_config.json").read_text()))
    run = stages.Run(config, workdir)
    buckets = [int(b) for b in args.buckets.split(",")]
    lines = [f"Training steps of {workdir}: real tokens / tokens run (real share), distinct micro-batch shapes, at "
             "each length multiple:", "", "| stage | examples | steps | " + " | ".join(f"multiple {b}" for b in buckets)
             + " |", "|---|---|---|" + "---|" * len(buckets)]
    for name, (tconfig, num_steps) in stage_configs(run).items():
        got = padding(tconfig, num_steps, buckets)
        cells = [f"{got[b]['real'] / 1e3:.1f}k / {got[b]['padded'] / 1e3:.1f}k ({got[b]['real'] / got[b]['padded']:.0%}), "
                 f"{got[b]['shapes']} shapes" for b in buckets]
        lines.append(f"| {name} | {got['examples']} | {got['steps']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
