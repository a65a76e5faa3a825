"""Ranking configs: `python -m sweet_jax.rank --config configs/rank.py:PRESET [--config.field=value]`.

For every assistant turn of the offline trajectories: sample num_candidates replies from the policy,
score them with the critic (mean critic log-prob with c minus the reference, see sweet_jax/commands/rank.py) and
write num_pairs (chosen, rejected) pairs per turn for step-level DPO (configs/policy.py, data.pairs).

Presets:
  demo       tiny random policy, critic and reference, the bundled demo trajectories (first 4), 4
             candidates of at most 24 tokens; CPU, under a minute. Shows the machinery only.
  llama3_8b  the paper: Llama-3.1-8B-Instruct policy and reference (--config.policy.path), the trained
             critic exported as an HF directory (--config.critic.path), the offline trajectories
             (--config.trajectories), 16 candidates at temperature 1.0 of up to 1024 tokens, 4 pairs a turn.
  official   llama3_8b ranked as the official scripts do (docs/official.md): the sampler's
             mean log-prob as the reference (rank_reference=sampler), the critic's score over its official
             sequence (score_style=official: a second BOS, c as a raw prefix, the reply's 4 header tokens + the
             reply, no end-of-turn) at temperature 0.5, pairs drawn with replacement from the two halves, ties
             allowed (pairing=official), seed 42.
"""
import ml_collections

from sweet_jax import config_utils

# The critic must read c exactly as it was trained: keep these equal to the critic run's data settings.
OFFICIAL_INFO_TEMPLATE = config_utils.base_config().data.info_template


def get_config(preset: str = "demo"):
    c = ml_collections.ConfigDict()
    c.trajectories = ""           # offline trajectories JSONL; '' = the bundled demo trajectories
    c.num_trajectories = 0        # first N; 0 = all
    c.skip_bad = False            # drop malformed trajectory lines (reported) instead of failing

    c.policy = config_utils.policy_config()  # backend (in_process | openai: an engine) and openai
    c.policy.path = ""            # HF directory of the policy that samples candidates; '' = demo tiny random
    c.policy.tokenizer = ""       # '' = policy.path, or the demo tokenizer
    c.policy.dtype = "float32"

    c.critic = ml_collections.ConfigDict()
    c.critic.path = ""            # HF directory of the trained critic (or a training workdir); '' = demo random
    c.critic.dtype = "float32"
    c.critic.use_info = True      # False for a critic trained without c

    c.reference = ml_collections.ConfigDict()
    c.reference.path = ""         # pi_ref (HF directory); '' = the policy model itself

    c.rank_reference = "ref_with_info"  # ref_with_info (paper) | sampler (official code)
    c.score_style = "reply"       # reply (the reply's tokens + end-of-turn) | official (data.render.render_official_score)
    c.critic_temperature = 1.0    # scoring log-probs (critic, and pi_ref) are log softmax(logits / this); official 0.5
    c.pairing = "strict"          # strict (chosen scores higher, no repeats) | official (with replacement, ties allowed)
    c.num_candidates = 16
    c.num_pairs = 4
    c.temperature = 1.0
    c.max_new_tokens = 1024
    c.agent_prompt = True         # for message-form trajectories: the rollout's system prompt (envs.AGENT_PROMPT)
    c.info_template = OFFICIAL_INFO_TEMPLATE
    c.info_placement = "system"   # system | first_user | raw_prefix (pre-rendered trajectories: always a raw prefix)
    # info_template / info_placement / critic.use_info are read from the run when critic.path is a training workdir.
    c.max_len = 8192              # longest critic sequence
    c.bucket = 128                # critic sequence lengths are padded to a multiple of this
    c.score_batch_size = 16       # most rows per scoring pass: distinct candidates of one turn prompt, its prefix run once
    c.prompts_per_batch = 8       # turns sampled together (x num_candidates sampler rows)
    c.max_batch_size = 128        # sampler rows per compiled call
    c.output = "runs/rank/pairs.jsonl"
    c.seed = 0
    c.progress = True
    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = ()             # () = one device; (1, -1, 1) = FSDP over every chip

    if preset == "demo":
        c.num_trajectories = 4
        c.num_candidates = 4
        c.num_pairs = 2
        c.max_new_tokens = 24
        c.score_batch_size = 8
        c.max_len = 2048
        c.output = "runs/rank_demo/pairs.jsonl"
    elif preset in ("llama3_8b", "official"):
        c.policy.dtype = c.critic.dtype = "bfloat16"
        c.prompts_per_batch = 8
        c.score_batch_size = 16
        c.mesh.shape = (1, -1, 1)
        c.output = "runs/rank_8b/pairs.jsonl"
        if preset == "official":
            c.rank_reference = "sampler"
            c.score_style = "official"
            c.critic_temperature = 0.5
            c.pairing = "official"
            c.info_placement = "raw_prefix"
            c.seed = 42
    else:
        raise ValueError(f"unknown rank preset {preset!r}: use demo, llama3_8b or official (as configs/rank.py:demo)")
    return c
