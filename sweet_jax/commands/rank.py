"""Best-of-N ranking: candidate replies for every turn of the offline trajectories, scored by the critic.

    python -m sweet_jax.rank --config configs/rank.py:demo [--config.field=value ...]

Stages: config -> trajectories -> turn prompts o_t -> N candidates per prompt from the policy (temperature
1.0, with their log-probs) -> critic score of each candidate -> policy pairs -> JSONL. The scoring, the
reference (rank_reference) and the pairs are sweet_jax.rl.ranking's; see its docstring.
"""
from __future__ import annotations

import json

from absl import flags
from ml_collections import config_flags

from sweet_jax import cli, config_utils
from sweet_jax.commands import launch


def main(argv):
    del argv
    config = flags.FLAGS.config
    config_utils.check_inputs(config, config_utils.RANK_PATH_FIELDS)
    from sweet_jax.rl.ranking import run  # after the flags: --help in a second
    result = run(config, accept_config_change=flags.FLAGS.accept_config_change)
    print(f"{config.output}: {json.dumps(result)}", flush=True)


def define_flags():
    config_flags.DEFINE_config_file("config", cli.resolve_config("configs/rank.py:demo"), "rank config (file:preset)",
                                    lock_config=True)
    cli.define_accept_config_change("OUTPUT.config_changes.jsonl")


HELP_CONFIGS = ("configs/rank.py:demo",)

if __name__ == "__main__":
    launch("rank")
