"""Collect ColBench trajectories: the policy plays N tasks x best-of-k episodes against a human simulator.

    python -m sweet_jax.rollout --config configs/rollout.py:demo [--config.field=value ...]

Stages: config -> tasks -> policy sampler -> simulator -> sandbox -> episodes in batches -> summary (the
episodes loop, its output file and resume are sweet_jax.collect's).

- Batching, the output file (official JSONL plus a `rollout` field), resume without duplicates, failed
  episodes (OUTPUT.failed.jsonl) and the summary (OUTPUT.summary.json): see sweet_jax.collect.
- layout="official" (configs/rollout.py:official): once every episode has run, OUTPUT is rewritten in the
  official block layout, what the official `evaluate_code.py --k` expects: row b * N + i is sample b of task i
  (all tasks' first samples, then all their second samples, ...), and failed episodes stay in it as the official
  collector keeps every episode (their dialogue so far, answer "No answer", reward 0.0, `rollout.failure`).
"""
from __future__ import annotations

import json
import pathlib

from sweet_jax import collect, policy_backend, rundir
from sweet_jax.collect import RolloutError, failures_path, summarize, summary_path
from sweet_jax.config_utils import ROLLOUT_RANGES, check_ranges


# Fields that change how fast the episodes come, not what they are: a rerun may change them freely.
OPERATIONAL_FIELDS = ("progress", "output", "batch_size", "max_batch_size", "mesh", "sandbox.workers")


def run(config, *, accept_config_change: bool = False) -> dict:
    check_ranges(config, ROLLOUT_RANGES, RolloutError)
    record_config(config, accept_config_change=accept_config_change)
    frontend = config.get("track", "backend") == "frontend"
    tasks = collect.load_task_list(config.tasks, config.num_tasks, frontend=frontend)
    if config.get("layout", "by_task") not in ("by_task", "official"):
        raise RolloutError(f"layout={config.layout!r}: use by_task or official (the official block layout)")
    mesh = rundir.make_mesh(config.mesh.shape)
    p = config.policy
    if p.backend == "openai" and config.simulator.kind == "model" and not config.simulator.path:
        raise RolloutError("simulator.kind='model' with simulator.path='' plays the human with the policy's own "
                           "in-process model; with policy.backend='openai' set simulator.path")
    with policy_backend.policy_sampler(
            p.backend, p.openai, p.path, rundir.tokenizer_dir(p.tokenizer, p.path),
            lambda: rundir.load_sampler(p.path, p.tokenizer, dtype=p.dtype, seed=config.seed, mesh=mesh,
                                        max_batch_size=config.max_batch_size), seed=config.seed) as sampler:
        return play(config, tasks, sampler, mesh, frontend=frontend)


def play(config, tasks, sampler, mesh, *, frontend: bool) -> dict:
    """The episodes of the config's tasks with the policy `sampler` (in-process or an engine)."""
    policy = collect.SamplerPolicy(sampler, max_new_tokens=config.sampling.max_new_tokens,
                                   temperature=config.sampling.temperature, top_p=config.sampling.top_p,
                                   top_k=config.sampling.top_k, system_prompt=collect.agent_prompt_for(config),
                                   seed=config.seed)
    if frontend:  # browsers + CLIP score the answers, the simulator compares pages (sweet_jax.envs.frontend)
        from sweet_jax.envs.frontend import FrontendEnv, FrontendTrack

        track = FrontendTrack(config.frontend, config.simulator, seed=config.seed)
        try:
            summary = collect.rollout(tasks, policy, track.simulator, pathlib.Path(config.output),
                                      best_of=config.best_of, batch_size=config.batch_size, max_turns=config.max_turns,
                                      evaluator=track.scorer, progress=config.progress, make_env=FrontendEnv)
        finally:
            track.close()
        return summary
    simulator = collect.make_simulator(
        config.simulator, seed=config.seed, policy_sampler=sampler,
        load_sampler=lambda: rundir.load_sampler(config.simulator.path, config.simulator.tokenizer,
                                                 dtype=config.policy.dtype, seed=config.seed, mesh=mesh))
    out = pathlib.Path(config.output)
    evaluator = None
    try:
        if config.sandbox.enabled:
            from sweet_jax.sandbox import Evaluator

            evaluator = Evaluator(workers=config.sandbox.workers or None, timeout_s=config.sandbox.timeout_s,
                                  compat=config.sandbox.compat, degraded_ok=config.sandbox.degraded_ok)
            evaluator.__enter__()
        summary = collect.rollout(tasks, policy, simulator, out, best_of=config.best_of,
                                  batch_size=config.batch_size, max_turns=config.max_turns, evaluator=evaluator,
                                  progress=config.progress)
        if config.get("layout", "by_task") == "official":
            collect.write_official_layout(out, tasks, config.best_of)
            summary = dict(summarize(collect.read_records(out)), failed_episodes=summary["failed_episodes"])
            summary_path(out).write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        if evaluator is not None:
            evaluator.__exit__(None, None, None)
        simulator.close()
    return summary


def record_config(config, *, accept_config_change: bool = False) -> list:
    """OUTPUT.config.json: the config that produced the episodes in OUTPUT (rundir.record_config's rule: a rerun
    with another config is refused while OUTPUT holds episodes, unless accept_config_change records the change
    in OUTPUT.config_changes.jsonl). Checked before any model loads: a refused run costs nothing."""
    out = pathlib.Path(config.output)
    produced = out.exists() and bool(collect.read_records(out))
    return rundir.record_output_config(config, out, produced=produced, accept_change=accept_config_change,
                                       ignore=OPERATIONAL_FIELDS, what="episodes")


def format_summary(summary: dict, out) -> str:
    pct = lambda x: "n/a" if x is None else f"{x:.1f}%"
    rate = summary["success_rate"]
    turns = summary["turns_per_episode"]
    failed = summary["failed_episodes"]
    failures = failures_path(pathlib.Path(out))
    # Name the failures file only where it exists: no failure in any run writes none.
    where = f", see {failures.name}" if failures.exists() else ""
    head = f"{out}: {summary['episodes']} episodes ({failed} failed this run{where})\n"
    if summary.get("track") == "frontend":
        cosine = summary.get("mean_reward")
        return (head + f"  mean CLIP cosine  {'n/a' if cosine is None else f'{cosine:.4f}'}\n"
                f"  turns per episode {'n/a' if turns is None else f'{turns:.2f}'}")
    return (head + f"  success rate      {pct(None if rate is None else 100 * rate)}\n"
            f"  tests passed      {pct(summary['tests_passed_pct'])}\n"
            f"  turns per episode {'n/a' if turns is None else f'{turns:.2f}'}")


def main(argv):
    del argv
    from absl import flags

    config = flags.FLAGS.config
    summary = dict(run(config, accept_config_change=flags.FLAGS.accept_config_change),
                   track=config.get("track", "backend"))
    print(format_summary(summary, config.output), flush=True)


def define_flags():
    from ml_collections import config_flags

    from sweet_jax import cli
    config_flags.DEFINE_config_file("config", cli.resolve_config("configs/rollout.py:demo"),
                                    "rollout config (file:preset)", lock_config=True)
    cli.define_accept_config_change("OUTPUT.config_changes.jsonl")


if __name__ == "__main__":
    from sweet_jax import cli
    cli.run(main, define_flags=define_flags, help_configs=("configs/rollout.py:demo",))
