"""Diagnostics of a pipeline run on the synthetic lookup tasks (sweet_jax.diagnostics), as JSON:

    python -m sweet_jax.pipeline_diagnostics WORKDIR [--probes] [--out FILE]

prints the rankings' agreement with the oracle (overall, by reply kind and state, ties counted) and each
policy's behaviour (questions on the task's keys, answers, copy accuracy of the values the user stated).
--probes adds the models' probes (sweet_jax.probes: P(answer) by state for the starting policy with and without
the agent prompt and for every kept checkpoint of the SWEET-RL runs, the implicit margin of a correct answer over
a repeated question where every value is known, the critics' per-turn scores by kind and normalisation): a few
minutes of forward passes on CPU for SmolLM2.
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
    parser.add_argument("--probes", action="store_true", help="also probe the run's models (forward passes)")
    parser.add_argument("--out", default="", help="write the JSON here too")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    workdir = pathlib.Path(args.workdir)
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
    if args.probes:
        report["probes"] = run_probes(workdir)
    text = json.dumps(report, indent=2)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text)


def run_probes(workdir: pathlib.Path) -> dict:
    """sweet_jax.probes over a pipeline run: the starting policy, each SWEET-RL run's kept checkpoints and
    final policy, the other trained policies, and the critics."""
    import ml_collections

    from sweet_jax import probes, ranking, rundir
    from sweet_jax.data import load_trajectories
    from sweet_jax.data.pairs import trajectory_pairs
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.envs.prompts import AGENT_PROMPT
    from sweet_jax.models import load_hf

    config = ml_collections.ConfigDict(json.loads((workdir / "pipeline_config.json").read_text()))
    offline = workdir / "offline" / "trajectories.jsonl"
    trajs = load_trajectories(offline)
    records = [t.to_json() for t in trajs]
    start_hf = json.loads((workdir / "init" / "done.json").read_text())["summary"]["policy_hf"]
    tokenizer = load_tokenizer(start_hf)   # every model of a run reads the starting policy's tokenizer
    start = load_hf(start_hf)
    system = AGENT_PROMPT if config.agent_prompt else None

    every = ranking.turn_prompts(trajs)
    r = config.rank
    ranked = every if not (workdir / "candidates" / "done.json").exists() else ranking.select_turn_prompts(
        every, r.get("turn_selection", "sample"), max_prompts=r.max_prompts, data_fraction=r.get("data_fraction", 1.0),
        seed=config.seed, tasks=[t["task"] for t in records])   # the ranked prompts, as the pipeline chose them
    ranked_states = probes.load_states(ranked, records)
    ready = [p for p, st in zip(every, probes.load_states(every, records)) if st["all_known"]]
    ready_tasks = [records[p.trajectory_index]["task"] for p in ready]
    out: dict = {"ranked_prompts": len(ranked), "offline_prompts_with_every_value_known": len(ready)}

    def policy_probes(model) -> dict:
        return {"answer_probability": probes.answer_probability(model, tokenizer, ranked, ranked_states,
                                                                system_prompt=system),
                "answer_over_repeat": probes.answer_over_repeat(model, start, tokenizer, ready, ready_tasks,
                                                                beta=config.sweet.beta, system_prompt=system)}

    out["starting policy"] = policy_probes(start)
    other = None if system else AGENT_PROMPT
    out["starting policy, agent prompt " + ("off" if system else "on")] = {
        "answer_probability": probes.answer_probability(start, tokenizer, ranked, ranked_states, system_prompt=other)}
    for method in ("sweet", "sweet_no_info"):
        train_dir = workdir / "policies" / method / "train"
        for step in probes.checkpoint_steps(train_dir):
            model = rundir.restore_model(train_dir, step)[0]
            out[f"{method} step {step}"] = policy_probes(model)
    for method in ("rft", "mtdpo", "sweet", "sweet_no_info"):
        hf = workdir / "policies" / method / "hf"
        if hf.is_dir():
            out[f"{method} (final)"] = policy_probes(load_hf(str(hf)))
    index = {id(t): i for i, t in enumerate(trajs)}
    pairs = [(index[id(p.chosen)], index[id(p.rejected)])
             for p in trajectory_pairs(trajs, rule=config.collect.get("pair_rule", "best_success"))]
    for name, use_info in (("critic", True), ("critic_no_info", False)):
        if (workdir / name / "hf").is_dir():
            out[name] = probes.critic_turn_scores(load_hf(str(workdir / name / "hf")), start, tokenizer, trajs, pairs,
                                                  use_info=use_info, info_template=config.rank.info_template,
                                                  info_placement=config.rank.info_placement)
    return out


if __name__ == "__main__":
    cli.run(main, allocator=False)
