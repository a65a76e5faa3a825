"""The whole SWEET-RL comparison in one command, with the paper's baselines:

    python -m sweet_jax.pipeline --config configs/pipeline.py:demo --workdir runs/demo_seed0 [--config.seed=1]

Stages (each writes its artifacts under the workdir and a `done.json`; a stage whose done.json exists is
skipped, so rerunning the command resumes an interrupted run):

  tasks          tasks/train.jsonl, tasks/heldout.jsonl: synthetic tasks (demo) or ColBench files, split.
  init           init/policy_hf: the starting policy. demo: a tiny random Llama fine-tuned on mixed-quality
                 scripted demonstrations (envs/synthetic.py) so it speaks the ColBench protocol, weakly;
                 colbench_8b: the given HF checkpoint. It is the zero-shot baseline, pi_ref and the critics'
                 initialisation. init.from_run=WORKDIR copies a finished run's instead (other seeds, one start).
  offline        offline/trajectories.jsonl: the starting policy against the simulator, scored in the sandbox
                 (sweet_jax.rollout), or the given trajectories.
  critic         critic/hf: the step-level critic trained with the Bradley-Terry loss, reading c (train.py);
  critic_no_info critic_no_info/hf: the same without c (the ablation).
  candidates     candidates/candidates.jsonl: num_candidates replies sampled from the starting policy for each
                 (sampled) turn prefix of the offline trajectories, shared by both rankings (appended batch by
                 batch: an interrupted stage resumes).
  rank, rank_no_info  rank*/pairs.jsonl: candidates scored by each critic, step-level pairs (sweet_jax.rank).
  policy_*       policies/*/hf: SWEET-RL (step-level DPO), SWEET-RL without c, rejection fine-tuning (SFT on the
                 successful offline trajectories), multi-turn DPO (trajectory-level DPO on the critic's pairs,
                 without c); each from the starting policy.
  eval_*         eval/<method>/trajectories.jsonl: every policy on the held-out tasks (rollout with the
                 simulator and the sandbox): success rate and % tests passed.
  report         results.json, results.md (the paper's table) and results.png (bar chart).

--carry DIR keeps the run's small state (its finished stages' files but the models) in DIR too, after each
stage, and restores it into a new workdir first: on another machine the run goes on, training again only the
models a stage still to run needs (sweet_jax/pipeline/carry.py).

Where the policy samples (offline, candidates, eval_*): config.policy.backend = in_process, or openai = an
inference engine (vLLM, SGLang, python -m sweet_jax.serve) started for each policy from config.policy.openai.command
after its export, or running at config.policy.openai.base_urls (sweet_jax/sampling/policy_backend.py).
"""
from __future__ import annotations

import logging
import pathlib

from absl import flags
from ml_collections import config_flags

from sweet_jax import cli, config_utils
from sweet_jax.commands import launch


def main(argv):
    del argv
    FLAGS = flags.FLAGS
    config_utils.check_inputs(FLAGS.config, config_utils.PIPELINE_PATH_FIELDS)
    from sweet_jax.pipeline.stages import run_pipeline  # after the flags: --help in a second
    logging.getLogger("sweet_jax.data").setLevel(logging.WARNING)  # every stage renders data: its counts, once
    summaries = run_pipeline(FLAGS.config, FLAGS.workdir, accept_config_change=FLAGS.accept_config_change,
                             carry_dir=FLAGS.carry or None)
    print(pathlib.Path(summaries["report"]["table"]).read_text(), flush=True)
    print(f"stages run: {', '.join(summaries['_ran']) or 'none'}; skipped (already done): "
          f"{', '.join(summaries['_skipped']) or 'none'}", flush=True)


def define_flags():
    config_flags.DEFINE_config_file("config", cli.resolve_config("configs/pipeline.py:demo"),
                                    "pipeline config (file:preset)", lock_config=True)
    flags.DEFINE_string("workdir", None, "run directory: every stage's artifacts; rerunning resumes")
    flags.DEFINE_string("carry", "", "a second directory for the run's small state (its finished stages' files "
                        "but the models), saved after each stage and restored first: the run resumes on another "
                        "machine (docs/pipeline.md)")
    cli.define_accept_config_change("WORKDIR/pipeline_config_changes.jsonl")
    flags.mark_flags_as_required(["workdir"])


HELP_CONFIGS = ("configs/pipeline.py:demo",)

if __name__ == "__main__":
    launch("pipeline")
