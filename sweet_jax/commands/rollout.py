"""Collect ColBench trajectories: the policy plays N tasks x best-of-k episodes against a human simulator.

    python -m sweet_jax.rollout --config configs/rollout.py:demo [--config.field=value ...]

Stages: config -> tasks -> policy sampler -> simulator -> sandbox -> episodes in batches -> summary (the
episodes loop, its output file and resume are sweet_jax.rl.episodes's).

- Batching, the output file (official JSONL plus a `rollout` field), resume without duplicates, failed
  episodes (OUTPUT.failed.jsonl) and the summary (OUTPUT.summary.json): see sweet_jax.rl.episodes.
- layout="official" (configs/rollout.py:official): once every episode has run, OUTPUT is rewritten in the
  official block layout, what the official `evaluate_code.py --k` expects: row b * N + i is sample b of task i
  (all tasks' first samples, then all their second samples, ...), and failed episodes stay in it as the official
  collector keeps every episode (their dialogue so far, answer "No answer", reward 0.0, `rollout.failure`).
"""
from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from sweet_jax import cli, config_utils
from sweet_jax.commands import launch


def main(argv):
    del argv
    config = flags.FLAGS.config
    config_utils.check_inputs(config, config_utils.ROLLOUT_PATH_FIELDS)
    from sweet_jax.rl.episodes import format_summary, run  # after the flags: --help in a second
    summary = dict(run(config, accept_config_change=flags.FLAGS.accept_config_change),
                   track=config.get("track", "backend"))
    print(format_summary(summary, config.output), flush=True)


def define_flags():
    config_flags.DEFINE_config_file("config", cli.resolve_config("configs/rollout.py:demo"),
                                    "rollout config (file:preset)", lock_config=True)
    cli.define_accept_config_change("OUTPUT.config_changes.jsonl")


HELP_CONFIGS = ("configs/rollout.py:demo",)

if __name__ == "__main__":
    launch("rollout")
