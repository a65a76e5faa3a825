"""The whole SWEET-RL comparison in one run (the stages are sweet_jax.pipeline.stages):

    python -m sweet_jax.pipeline --config configs/pipeline.py:demo --workdir /tmp/pipe [--config.field=value ...]

Rerunning the command on the same --workdir resumes: finished stages are skipped.
"""
from __future__ import annotations

import logging
import pathlib

from absl import flags
from ml_collections import config_flags

from sweet_jax import cli
from sweet_jax.commands import launch
from sweet_jax.pipeline.stages import run_pipeline


def main(argv):
    del argv
    FLAGS = flags.FLAGS
    logging.getLogger("sweet_jax.data").setLevel(logging.WARNING)  # every stage renders data: its counts, once
    summaries = run_pipeline(FLAGS.config, FLAGS.workdir, accept_config_change=FLAGS.accept_config_change)
    print(pathlib.Path(summaries["report"]["table"]).read_text(), flush=True)
    print(f"stages run: {', '.join(summaries['_ran']) or 'none'}; skipped (already done): "
          f"{', '.join(summaries['_skipped']) or 'none'}", flush=True)


def define_flags():
    config_flags.DEFINE_config_file("config", cli.resolve_config("configs/pipeline.py:demo"),
                                    "pipeline config (file:preset)", lock_config=True)
    flags.DEFINE_string("workdir", None, "run directory: every stage's artifacts; rerunning resumes")
    cli.define_accept_config_change("WORKDIR/pipeline_config_changes.jsonl")
    flags.mark_flags_as_required(["workdir"])

HELP_CONFIGS = ("configs/pipeline.py:demo",)

if __name__ == "__main__":
    launch('pipeline')
