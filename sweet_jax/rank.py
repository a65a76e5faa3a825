"""Best-of-N ranking: candidate replies for every turn of the offline trajectories, scored by the critic.

    python -m sweet_jax.rank --config configs/rank.py:demo [--config.field=value ...]

Stages: config -> trajectories -> turn prompts o_t -> N candidates per prompt from the policy (temperature
1.0, with their log-probs) -> critic score of each candidate -> policy pairs -> JSONL. The scoring, the
reference (rank_reference) and the pairs are sweet_jax.ranking's; see its docstring.
"""
from __future__ import annotations

import json
import logging

from sweet_jax.ranking import ReplyScorer, rank_turns, sample_candidates, turn_prompts

log = logging.getLogger("sweet_jax.rank")

# Fields that change how fast the pairs come, not which pairs: a rerun may change them freely.
OPERATIONAL_FIELDS = ("progress", "output", "score_batch_size", "prompts_per_batch", "max_batch_size", "mesh",
                      "skip_bad")


def record_config(config, *, accept_config_change: bool = False) -> list:
    """OUTPUT.config.json: the config that produced the pairs in OUTPUT (rundir.record_config's rule: a rerun
    with another config is refused while OUTPUT holds pairs, unless accept_config_change records the change)."""
    import pathlib

    from sweet_jax import jsonl, rundir
    out = pathlib.Path(config.output)
    produced = out.exists() and bool(jsonl.read(out, partial="drop"))
    return rundir.record_output_config(config, out, produced=produced, accept_change=accept_config_change,
                                       ignore=OPERATIONAL_FIELDS, what="pairs")


def run(config, *, accept_config_change: bool = False) -> dict:
    from sweet_jax import policy_backend, rundir
    from sweet_jax.config_utils import RANK_RANGES, check_ranges
    from sweet_jax.data import demo, schema

    check_ranges(config, RANK_RANGES)
    record_config(config, accept_config_change=accept_config_change)
    mesh = rundir.make_mesh(config.mesh.shape)
    trajectories = schema.load_trajectories(config.trajectories or str(demo.paths().trajectories),
                                          skip_bad=config.skip_bad)
    if config.num_trajectories > 0:
        trajectories = trajectories[:config.num_trajectories]
    prompts = turn_prompts(trajectories)
    p = config.policy
    with policy_backend.policy_sampler(
            p.backend, p.openai, p.path, rundir.tokenizer_dir(p.tokenizer, p.path),
            lambda: rundir.load_sampler(p.path, p.tokenizer, dtype=p.dtype, seed=config.seed, mesh=mesh,
                                        max_batch_size=config.max_batch_size), seed=config.seed) as sampler:
        return rank_with(config, prompts, sampler, mesh)


def rank_with(config, prompts, sampler, mesh) -> dict:
    """Candidates from `sampler` (in-process or an engine), scored by the critic, pairs appended to the output."""
    from sweet_jax import rundir
    from sweet_jax.data import tokenizers
    from sweet_jax.envs import AGENT_PROMPT

    tokenizer = sampler.tokenizer
    tokenizers.check_chat_template(tokenizer)
    critic, critic_run = rundir.load_model(config.critic.path, dtype=config.critic.dtype, mesh=mesh,
                                           tokenizer=tokenizer, seed=config.seed + 1, what="critic")
    info_template, info_placement, use_info = config.info_template, config.info_placement, config.critic.use_info
    if critic_run is not None:  # a training workdir: read c exactly as the critic was trained to
        info_template, info_placement = critic_run.data.info_template, critic_run.data.info_placement
        use_info = bool(critic_run.loss.use_info)
        log.info("critic run settings: info_template=%r info_placement=%s use_info=%s", info_template,
                 info_placement, use_info)
    scorer_kw = dict(info_template=info_template, info_placement=info_placement, use_info=use_info,
                     batch_size=config.score_batch_size, bucket=config.bucket, max_len=config.max_len,
                     style=config.get("score_style", "reply"), temperature=config.get("critic_temperature", 1.0),
                     system_prompt=AGENT_PROMPT if config.agent_prompt else None)
    critic_logp = ReplyScorer(critic, tokenizer, **scorer_kw)
    reference_logp = None
    if config.rank_reference == "ref_with_info":
        ref_path = config.reference.path or config.policy.path
        in_process = getattr(sampler, "model", None) is not None  # the openai backend holds no weights here
        reference = sampler.model if ref_path == config.policy.path and in_process else rundir.load_model(
            ref_path, dtype=config.critic.dtype, mesh=mesh, tokenizer=tokenizer, seed=config.seed, what="reference")[0]
        reference_logp = ReplyScorer(reference, tokenizer, **scorer_kw)
    calls = [0]

    def sample_fn(batch):
        calls[0] += 1
        return sample_candidates(sampler, batch, n=config.num_candidates, max_new_tokens=config.max_new_tokens,
                                 temperature=config.temperature, seed=config.seed * 1_000_003 + calls[0],
                                 system_prompt=AGENT_PROMPT if config.agent_prompt else None)

    result = rank_turns(prompts, sample_fn, critic_logp, reference_logp, config.output,
                        rank_reference=config.rank_reference, num_pairs=config.num_pairs, seed=config.seed,
                        prompts_per_batch=config.prompts_per_batch, progress=config.progress,
                        pairing=config.get("pairing", "strict"))
    unscorable = critic_logp.unscorable + (reference_logp.unscorable if reference_logp is not None else [])
    if unscorable:
        log.warning("%d candidates could not be scored and were left out; first: turn %s: %s", len(unscorable),
                    *unscorable[0])
    result["unscorable_candidates"] = len(unscorable)
    return result


def main(argv):
    del argv
    from absl import flags

    config = flags.FLAGS.config
    result = run(config, accept_config_change=flags.FLAGS.accept_config_change)
    print(f"{config.output}: {json.dumps(result)}", flush=True)


def define_flags():
    from ml_collections import config_flags

    from sweet_jax import cli
    config_flags.DEFINE_config_file("config", cli.resolve_config("configs/rank.py:demo"), "rank config (file:preset)",
                                    lock_config=True)
    cli.define_accept_config_change("OUTPUT.config_changes.jsonl")


if __name__ == "__main__":
    from sweet_jax import cli
    cli.run(main, define_flags=define_flags, help_configs=("configs/rank.py:demo",))
