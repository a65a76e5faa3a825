r"""Train the SWEET-RL critic or policy (and the baselines):

    python -m sweet_jax.train --config configs/critic.py:demo --workdir /tmp/critic
    python -m sweet_jax.train --config configs/critic.py:llama3_8b --workdir gs://b/run \
        --config.model.path=/ckpt/Llama-3.1-8B-Instruct --config.data.trajectories=gs://b/colbench.jsonl

The command line over sweet_jax.train.trainer (config -> data -> model -> reference log-probs -> loop -> summary).
Pointing --workdir at an existing run resumes it from its latest readable checkpoint.
"""
from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from sweet_jax import cli, config_utils
from sweet_jax.commands import launch


def main(argv):
    del argv
    config_utils.check_inputs(flags.FLAGS.config, config_utils.TRAIN_PATH_FIELDS)
    from sweet_jax.train import trainer  # after the flags: --help in a second
    trainer.run(flags.FLAGS.config, flags.FLAGS.workdir, accept_config_change=flags.FLAGS.accept_config_change)


def define_flags():
    config_flags.DEFINE_config_file("config", None, "a config file with preset: configs/critic.py:demo",
                                    lock_config=True)
    flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics, config; resumes if it holds a run")
    cli.define_accept_config_change("WORKDIR/config_changes.jsonl")
    flags.mark_flags_as_required(["config", "workdir"])


HELP_CONFIGS = ("configs/critic.py:demo", "configs/policy.py:demo")

if __name__ == "__main__":
    launch("train")
