"""Rollout configs: `python -m sweet_jax.rollout --config configs/rollout.py:PRESET [--config.field=value]`.

Presets:
  demo         tiny random policy, 6 bundled demo tasks x 2 samples, scripted simulator (replies with the
               hidden information); CPU, about a minute. Only shows the machinery: the random policy
               rarely answers, so rewards are ~0.
  demo_server  demo with the simulator behind an OpenAI-compatible endpoint: start one first, e.g.
               `python -m sweet_jax.serve --model HF_DIR --tokenizer TOKENIZER_DIR --port 8000
               --served-model-name sweet_jax` (the name must match --config.simulator.model).
  collect_8b   the paper's data collection: Llama-3.1-8B-Instruct policy (set --config.policy.path), the
               tasks file (--config.tasks), 3 samples per task at temperature 1.0, simulator
               Llama-3.1-70B-Instruct behind an OpenAI-compatible endpoint (vLLM or sweet_jax.serve).
  eval_8b      evaluation: one greedy episode per task, same simulator.
  official     collect_8b as the official collection script runs it (docs/official.md):
               the output rewritten in the official block layout with failed episodes kept (layout=official),
               the evaluator's official scoring rules (sandbox.compat=sweet_rl) and 1 s per test case. Point
               --config.agent_prompt_path / --config.simulator.prompt_path at the official prompt files.
  official_eval  evaluation as the official scripts: one episode per task sampled at temperature 1.0 (up to
               1024 tokens), the same layout, scoring rules and timeout.
"""
import ml_collections

from sweet_jax import config_utils



def get_config(preset: str = "demo"):
    c = ml_collections.ConfigDict()
    c.policy = config_utils.policy_config()  # backend (in_process | openai: an engine) and openai
    c.policy.path = ""            # HF checkpoint directory of the policy; '' = the demo tiny random model
    c.policy.tokenizer = ""       # tokenizer directory; '' = policy.path, or the demo tokenizer
    c.policy.dtype = "float32"    # parameter dtype when loading (bfloat16 for 8B on TPU)

    c.tasks = ""                  # ColBench tasks JSONL; '' = the bundled demo tasks
    c.num_tasks = 0               # first N tasks; 0 = all
    c.best_of = 1                 # k episodes per task
    c.max_turns = 10              # agent turns per episode (ColBench: 10)
    c.agent_prompt = True         # prepend the task rules (envs.AGENT_PROMPT) as a system message
    c.agent_prompt_path = ""      # a text file used verbatim as that system message instead (e.g. the official one)
    c.layout = "by_task"          # by_task (appended as episodes finish) | official (block layout, failures kept)

    c.sampling = ml_collections.ConfigDict()
    c.sampling.max_new_tokens = 512
    c.sampling.temperature = 1.0  # 0 = greedy
    c.sampling.top_p = 1.0
    c.sampling.top_k = 0

    c.simulator = ml_collections.ConfigDict()
    c.simulator.kind = "scripted"  # openai | model | scripted
    c.simulator.base_url = "http://127.0.0.1:8000/v1"
    c.simulator.model = "meta-llama/Llama-3.1-70B-Instruct"
    c.simulator.api_key = "EMPTY"
    c.simulator.timeout_s = 120.0
    c.simulator.max_retries = 3
    c.simulator.backoff_s = 1.0
    c.simulator.concurrency = 32
    c.simulator.max_tokens = 256  # replies are cut to 400 characters anyway
    c.simulator.path = ""         # kind=model: HF directory of the simulator; '' = the policy's model
    c.simulator.tokenizer = ""
    c.simulator.prompt_path = ""  # a template file over {problem_description} {hidden_information} {dialogue_history}

    c.output = "runs/rollout/trajectories.jsonl"
    c.batch_size = 16             # episodes played together (one sampler call per agent turn)
    c.max_batch_size = 64         # sampler rows per compiled call
    c.seed = 0
    c.progress = True
    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = ()             # () = no mesh (one device); e.g. (1, -1, 1) to shard the policy (FSDP)

    c.sandbox = ml_collections.ConfigDict()
    c.sandbox.enabled = True
    c.sandbox.workers = 0         # 0 = one per core
    c.sandbox.timeout_s = 5.0     # per test case
    c.sandbox.compat = "strict"   # strict | sweet_rl
    c.sandbox.degraded_ok = False  # allow the weaker sandbox where user namespaces are unavailable

    if preset in ("demo", "demo_server"):
        c.num_tasks = 6
        c.best_of = 2
        c.batch_size = 6
        c.sampling.max_new_tokens = 32
        c.output = "runs/rollout_demo/trajectories.jsonl"
        if preset == "demo_server":
            c.simulator.kind = "openai"
            c.simulator.model = "sweet_jax"
            c.simulator.max_tokens = 48
    elif preset in ("collect_8b", "eval_8b", "official", "official_eval"):
        c.policy.dtype = "bfloat16"
        c.simulator.kind = "openai"
        c.sampling.max_new_tokens = 1024
        c.batch_size = 64
        c.max_batch_size = 64
        c.mesh.shape = (1, -1, 1)
        if preset in ("collect_8b", "official"):
            c.best_of = 3
            c.output = "runs/rollout_8b/trajectories.jsonl"
        else:
            c.sampling.temperature = 0.0
            c.output = "runs/eval_8b/trajectories.jsonl"
        if preset.startswith("official"):
            c.layout = "official"
            c.sandbox.compat = "sweet_rl"
            c.sandbox.timeout_s = 1.0  # the official evaluator's per-case limit
            c.sampling.temperature = 1.0
            c.num_tasks = 1000 if preset == "official_eval" else 0  # its README evaluates 1000 test tasks
    else:
        raise ValueError(f"unknown rollout preset {preset!r}: use demo, demo_server, collect_8b, eval_8b, official or "
                         "official_eval (as configs/rollout.py:demo)")
    return c
