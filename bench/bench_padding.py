"""Padding of a pipeline run's training steps at other length multiples: each training stage's batches rebuilt
from the run's own data as its trainer builds them (config, seed, steps), cut into the host loop's micro-batches
(steps.HostLoopStep: each at its own length, a multiple of data.bucket), and their real tokens against the tokens
the steps run at each multiple, with the number of distinct micro-batch shapes (each one compiled program of the
step). No model runs: the counts are exact, the time a step takes is about proportional to its tokens.

    python bench/bench_padding.py --run WORKDIR [--buckets 128,64,32]
    python bench/bench_padding.py --run OUT --proxy HF_DIR     # a stand-in for a full-size seed (proxy_run)

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
    grid = stages.selection_grid(c)
    for method in ("mtdpo", "rft", "sweet"):
        pairs = str(w / "rank" / "pairs.jsonl")
        if method == "sweet" and not pathlib.Path(pairs).exists():
            continue
        tconfig = stages.policy_train_config(run, method, policy, trajectories=offline, pairs=pairs)
        # as stages.stage_policy_grid: trained to the last of the grid's steps (frozen: the chosen one)
        steps = max(grid.steps_of(method)) if grid is not None else tconfig.train.num_steps
        out[method] = (tconfig, steps)
    return out


def proxy_run(out: pathlib.Path, model: str, *, seed: int = 2) -> None:
    """A stand-in for a full-size frozen seed's training data when none is at hand (no model runs): the
    smollm2_select preset's tasks; as offline episodes the scripted agents' (the starting policy's SFT mixture,
    init.policy_weights) on the 64 training tasks, 4 each, scored in the sandbox; as SWEET-RL's pairs seed 2's 220
    (bench/results/select_seed2: their texts, turns and repeats) on the prompts of those episodes' turns."""
    import sys
    from sweet_jax.data.tokenizers import apply_chat_template, load_tokenizer
    from sweet_jax.envs import synthetic
    from sweet_jax.pipeline import stages
    from sweet_jax.sandbox import Evaluator
    repo = pathlib.Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo))
    from bench_stages import frozen_selection
    from configs import pipeline as pipeline_configs
    out.mkdir(parents=True, exist_ok=True)
    c = pipeline_configs.get_config("smollm2_select")
    c.seed, c.init.pretrained = seed, model
    c.select.frozen = str(frozen_selection(out, 1.0))
    (out / "pipeline_config.json").write_text(c.to_json_best_effort(indent=1))
    run = stages.Run(c, out)
    (out / "tasks").mkdir(exist_ok=True)
    stages.stage_tasks(run, out / "tasks")
    (out / "init").mkdir(exist_ok=True)
    if not (out / "init" / "policy_hf").exists():
        (out / "init" / "policy_hf").symlink_to(pathlib.Path(model).resolve())
    with Evaluator() as evaluator:
        trajs = synthetic.scripted_trajectories(stages.load_task_split(run, "train"), seed=seed, per_task=4,
                                                policy_weights=stages._policy_weights(c.init.policy_weights),
                                                evaluator=evaluator)
    (out / "offline").mkdir(exist_ok=True)
    (out / "offline" / "trajectories.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trajs))
    tokenizer = load_tokenizer(run.tokenizer_dir)
    rows = []
    for line in (repo / "bench/results/select_seed2/evidence/pairs_rank.jsonl").read_text().splitlines():
        p = json.loads(line)
        t = trajs[p["trajectory_index"] % len(trajs)]
        turns = [i for i, m in enumerate(t["dialogue_history"]) if m["role"] == "assistant"]
        prompt = [{"role": m["role"], "content": m["content"]}
                  for m in t["dialogue_history"][:turns[min(p["turn_index"], len(turns) - 1)]]]
        rows.append({"trajectory_index": p["trajectory_index"], "turn": p["turn_index"], "task_key":
                     str(p["trajectory_index"]), "prompt": prompt, "prompt_text": apply_chat_template(
                         tokenizer, prompt, add_generation_prompt=True), "chosen": p["chosen"],
                     "rejected": p["rejected"], "chosen_score": p["chosen_score"],
                     "rejected_score": p["rejected_score"], "rank_reference": "ref_with_info"})
    (out / "rank").mkdir(exist_ok=True)
    (out / "rank" / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


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
    parser.add_argument("--proxy", default="", help="first build --run as proxy_run's stand-in from this HF "
                        "directory (SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    from sweet_jax.pipeline import stages
    workdir = pathlib.Path(args.run)
    if args.proxy:
        proxy_run(workdir, args.proxy)
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
