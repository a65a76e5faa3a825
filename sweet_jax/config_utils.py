"""Shared pieces of the training configs (configs/critic.py, configs/policy.py).

Every field a user can type on the command line is created here, once, with its default; a preset
only changes values. Field names are read by sweet_jax.train, sweet_jax.train.steps and sweet_jax.data.
"""
from __future__ import annotations

import os
import pathlib

import ml_collections

from sweet_jax.data.render import OFFICIAL_INFO_TEMPLATE
from sweet_jax.errors import SweetJaxError, TrainConfigError  # noqa: F401 - TrainConfigError: config_utils' error

LOSS_KINDS = ("critic", "dpo", "mtdpo", "rft")
ADVANTAGE_NORMS = ("turn_mean", "trajectory_mean", "sum")  # loss.advantage_norm (train.losses.turn_advantages)


def base_config() -> ml_collections.ConfigDict:
    """All training fields with defaults that make sense for a small CPU run."""
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.path = ""                 # HF checkpoint directory; '' = the demo tiny random model
    c.model.preset = "tiny"           # architecture when path is '': a models/llama.py PRESETS name (tiny, llama3_8b, ...)
    c.model.dtype = "float32"         # compute dtype
    c.model.param_dtype = "float32"   # storage dtype of the trained parameters
    c.model.remat = "none"            # none | full | dots_saveable
    c.model.attention_impl = "auto"   # auto | xla | cudnn | chunked | blocked (see models/llama.py)
    c.model.attention_chunk_size = 512  # query rows per block of attention_impl="chunked"
    c.model.cpu_matmul = "auto"       # auto | xla | xla_bf16 | onednn: projections as bf16 matmuls, float32
    #                                   accumulation, on the CPU's AMX/AVX512-BF16 units (models/cpu_matmul.py)
    c.model.scan_layers = False       # stacked decoder layers under jax.lax.scan (one layer compiled, not 32/80)
    c.model.sequence_parallel = False  # residual stream between layers split over 'tensor' along tokens

    # LoRA (models/lora.py): adapters of this rank on the target projections, trained while the base stays frozen
    # (the reference model is the base: no second copy of the weights); checkpoints hold only the adapters.
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0                   # 0: full fine-tuning
    c.lora.alpha = 16.0               # the adapters' update is scaled by alpha / rank (PEFT's lora_alpha)
    c.lora.targets = "q,k,v,o,gate,up,down"  # projections with adapters: q k v o (attention), gate up down (MLP)

    c.data = ml_collections.ConfigDict()
    c.data.trajectories = ""          # ColBench trajectories JSONL; '' = bundled demo trajectories
    c.data.tasks = ""                 # ColBench tasks JSONL; '' = bundled demo tasks
    c.data.pairs = ""                 # step-level pairs JSONL from `python -m sweet_jax.rank` (policy, loss.kind=dpo)
    c.data.tokenizer = ""             # HF tokenizer directory; '' = model.path if set, else the demo tokenizer
    c.data.max_len = 1024             # tokens per sequence (after bucketing)
    c.data.bucket = 128               # sequence lengths are rounded up to a multiple of this
    c.data.micro_bucket = 0           # one CPU device: each micro-batch's length rounds up to this (0 = data.bucket)
    c.data.share_prefix = True        # one CPU device: a pair's sequences as one row, their common prefix run once
    c.data.length_policy = "truncate"  # truncate | drop | cut_right (official): sequences longer than max_len
    c.data.mask_style = "turns"       # turns (reply + end-of-turn) | official (the fork's mask, data/render.py)
    c.data.info_template = OFFICIAL_INFO_TEMPLATE  # how c is said: the official code's wording
    c.data.info_placement = "system"  # system | first_user | raw_prefix: where c goes (see data/render.py)
    c.data.eval_fraction = 0.1        # fraction of *tasks* held out for evaluation
    c.data.eval_split = "tasks"       # tasks (held out) | first_rows (official: the first rows, trained on too)
    c.data.padding_side = "right"     # right | left
    c.data.min_gap = 0.0              # critic pairs: minimum reward gap between chosen and rejected
    c.data.pair_rule = "best_success"  # best_success (backend) | all_gaps (frontend: every pair >= min_gap apart)

    c.train = ml_collections.ConfigDict()
    c.train.batch_size = 8            # pairs per optimiser step (global, over all hosts)
    c.train.micro_batch_size = 0      # pairs per forward/backward; 0: on CPU steps.auto_micro_batch_size, else batch_size
    c.train.epochs = 1                # passes over the training examples (when num_steps is 0)
    c.train.num_steps = 0             # > 0 overrides epochs
    c.train.stop_at = 0               # > 0: stop after this step; the lr schedule still spans the whole run
    c.train.seed = 0                  # model init, data order and the held-out split
    c.train.log_every = 1             # a metrics.jsonl line every N steps
    c.train.eval_every = 0            # 0 = only at the end
    c.train.ckpt_every = 100          # 0 = only at the end (and on SIGTERM)
    c.train.keep_ckpts = 3            # checkpoints kept (the newest)
    c.train.ref_logp = "precompute"   # precompute (one pass before training) | in_step

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 2e-7                 # peak learning rate: linear warm-up, then cosine down to final_ratio x lr
    c.optim.warmup_ratio = 0.03       # fraction of the steps spent warming up
    c.optim.final_ratio = 0.1
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.weight_decay = 0.0
    c.optim.clip = 1.0                # global gradient-norm clip
    c.optim.moments_dtype = "float32"  # float32 | bfloat16: Adam's two moments stored in bf16 (half the state)
    c.optim.offload_state = False     # optimiser state in host memory between steps (TPU/GPU memory kinds)
    c.optim.layerwise_update = False  # scan_layers: the optimiser update one stacked layer at a time (less memory)

    c.loss = ml_collections.ConfigDict()
    c.loss.kind = "critic"            # critic | dpo | mtdpo | rft
    c.loss.beta = 0.1                 # DPO / Bradley-Terry scale of the log-ratio margins
    c.loss.advantage_norm = "turn_mean"  # turn_mean (paper) | trajectory_mean (official code) | sum
    c.loss.nll_coef = 0.0             # DPO: weight of the chosen reply's NLL (SWEET-RL actor: 0.01)
    c.loss.nll_scope = "reply"        # reply (the paper) | sequence (official: the whole chosen sequence's NLL)
    c.loss.label_smoothing = 0.0      # DPO: probability that a pair's preference is flipped (conservative DPO)
    c.loss.use_info = True            # critic sees the training-time information c (False = the "without c" baseline)
    # The log-probs (unembedding, vocabulary softmax, their backward) at the batch's score_pos: the same loss, less
    # work where most tokens are prompt, dialogue or history.
    c.loss.score_positions = True     # log-probs at the action tokens only (True) or at every token

    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (1, -1, 1)         # (data, fsdp, tensor); -1 = the rest of the devices
    c.metrics = metrics_config()
    return c


def train_default(field: str):
    """The default of a train config field ('loss.advantage_norm'), as base_config declares it: for a function
    argument or a pipeline field that mirrors it, so that the default is written once."""
    return config_get(base_config(), field)


def setting(config, field: str, section: str = ""):
    """`config`'s value of the train field `field` (`section`.`field` when `config` is that section), or the field's
    default (base_config) where `config`, an older run's, predates it."""
    try:
        return config_get(config, field)
    except (KeyError, AttributeError):
        return train_default(f"{section}.{field}" if section else field)


def metrics_config() -> ml_collections.ConfigDict:
    """Experiment tracking (sweet_jax.train.metrics.MetricsWriter); metrics.jsonl is always written. Not part of what a
    run is: a rerun may change these freely."""
    c = ml_collections.ConfigDict()
    c.writers = "tensorboard"         # comma-separated: tensorboard (WORKDIR/tensorboard), wandb (pip install wandb)
    c.wandb_project = "sweet_jax"
    c.wandb_mode = "offline"          # offline (no network; `wandb sync WORKDIR/wandb/offline-run-*` later) | online
    c.group = ""                      # runs shown together (the pipeline: its workdir, one run per stage)
    c.name = ""                       # this run's name; '' = the workdir's name
    return c


# ==========================================================================================================
# Numeric ranges: one row per field, checked once (check_ranges) before anything is built
# ==========================================================================================================

INF = float("inf")
INT32_MAX = 2 ** 31 - 1   # token positions and lengths are int32 on the device


def closed(lo, hi=INF):
    """[lo, hi]"""
    return (lo, True, hi, True)


def at_least(lo):
    return (lo, True, INF, True)


def above(lo):
    """(lo, inf)"""
    return (lo, False, INF, True)


def between(lo, hi, *, hi_closed=False):
    """[lo, hi) (or [lo, hi])"""
    return (lo, True, hi, hi_closed)


# field -> (type, range, what it means); int fields refuse floats and bools. (lora.* is checked by LoRAConfig.)
TRAIN_RANGES = {
    "model.attention_chunk_size": (int, above(0), "query rows per attention block"),
    "data.max_len": (int, closed(1, INT32_MAX), "tokens per sequence; positions are int32"),
    "data.bucket": (int, above(0), "sequence lengths round up to a multiple of it"),
    "data.micro_bucket": (int, at_least(0), "0 = data.bucket"),
    "data.eval_fraction": (float, between(0, 1), "fraction of tasks held out"),
    "data.min_gap": (float, at_least(0), "minimum reward gap of a critic pair"),
    "train.batch_size": (int, above(0), "pairs per optimiser step"),
    "train.micro_batch_size": (int, at_least(0), "0 = automatic"),
    "train.epochs": (int, at_least(0), "passes over the data"),
    "train.num_steps": (int, at_least(0), "0 = from epochs"),
    "train.stop_at": (int, at_least(0), "0 = the last step"),
    "train.seed": (int, at_least(0), "a seed"),
    "train.log_every": (int, above(0), "a metrics line every N steps"),
    "train.eval_every": (int, at_least(0), "0 = only at the end"),
    "train.ckpt_every": (int, at_least(0), "0 = only at the end"),
    "train.keep_ckpts": (int, above(0), "checkpoints kept (at least the newest)"),
    "optim.lr": (float, at_least(0), "peak learning rate"),
    "optim.warmup_ratio": (float, between(0, 1, hi_closed=True), "fraction of the steps warming up"),
    "optim.final_ratio": (float, between(0, 1, hi_closed=True), "final lr as a fraction of the peak"),
    "optim.b1": (float, between(0, 1), "Adam's first-moment decay"),
    "optim.b2": (float, between(0, 1), "Adam's second-moment decay"),
    "optim.weight_decay": (float, at_least(0), "AdamW's decoupled weight decay"),
    "optim.clip": (float, above(0), "global gradient-norm clip"),
    "loss.beta": (float, above(0), "scale of the log-ratio margins (<= 0 inverts or erases the preference)"),
    "loss.nll_coef": (float, at_least(0), "weight of the chosen reply's NLL"),
    "loss.label_smoothing": (float, between(0, 0.5), "probability a preference is flipped (>= 0.5 inverts it)"),
}


def policy_config() -> ml_collections.ConfigDict:
    """Where the policy samples, the `policy` block of the rollout, rank and pipeline configs
    (sampling.policy_backend.policy_sampler reads it and check_backend checks it): backend and its `openai`
    settings, declared and defaulted here only."""
    c = ml_collections.ConfigDict()
    c.backend = "in_process"      # in_process | openai: an OpenAI-compatible engine (vLLM, SGLang, sweet_jax.serve)
    # in_process: the K/V of prefilled prompts kept on the host up to this many MB, so that a dialogue's next
    # turn prefills only its new tokens (generate.PromptCache; pays on a CPU, where host memory is the device's)
    c.prompt_cache_mb = 0
    c.openai = openai_config()
    return c


def openai_config():
    """The `policy.openai` block of the rollout, rank and pipeline configs (defaults)."""
    c = ml_collections.ConfigDict()
    c.base_urls = ""              # comma-separated running engines, e.g. http://h1:8000/v1,http://h2:8000/v1
    c.command = ""                # or: start one per policy, e.g. "vllm serve {hf_dir} --port {port} ..."
    c.host = "127.0.0.1"          # where the started engine listens ({host})
    c.port = 0                    # its port ({port}); 0 = a free one
    c.startup_timeout_s = 900.0   # how long the started engine may take to answer GET /v1/models
    c.model = ""                  # served model name; '' = the first of GET /v1/models
    c.api_key = "EMPTY"
    c.concurrency = 64            # requests in flight (one prompt, n samples each)
    c.max_retries = 5
    c.backoff_s = 1.0             # first retry's wait; doubled each retry (at most 30 s)
    c.timeout_s = 600.0           # per request
    return c


def frontend_config():
    """The `frontend` block of rollout and pipeline configs (configs/frontend.py; envs.frontend.FrontendTrack
    reads it)."""
    f = ml_collections.ConfigDict()
    f.clip_path = ""               # HF CLIP checkpoint directory (openai/clip-vit-base-patch32); '' = a random
    #                                tiny CLIP: the mechanics only, its cosines mean nothing
    f.clip_batch_size = 8
    f.renderers = 2                # headless browsers rendering in parallel
    f.page_time_limit_s = 15.0     # per page: load, layout and screenshot
    return f


# The `policy.openai` block (openai_config) and the simulator's engine settings.
ENGINE_RANGES = {
    "port": (int, closed(0, 65535), "0 = a free port"),
    "startup_timeout_s": (float, above(0), "seconds the started engine may take"),
    "concurrency": (int, above(0), "requests in flight"),
    "max_retries": (int, at_least(0), "retries of a failed request"),
    "backoff_s": (float, at_least(0), "first retry's wait"),
    "timeout_s": (float, above(0), "deadline of one request"),
}
SIMULATOR_RANGES = {"timeout_s": ENGINE_RANGES["timeout_s"], "max_retries": ENGINE_RANGES["max_retries"],
                    "backoff_s": ENGINE_RANGES["backoff_s"], "concurrency": ENGINE_RANGES["concurrency"],
                    "max_tokens": (int, above(0), "tokens of one simulator reply")}
SAMPLING_RANGES = {"max_new_tokens": (int, above(0), "tokens of one reply"),
                   "temperature": (float, at_least(0), "0 = greedy"),
                   "top_p": (float, between(0, 1, hi_closed=True), "nucleus mass; 1 = off"),
                   "top_k": (int, at_least(0), "0 = off")}

ROLLOUT_RANGES = {
    "num_tasks": (int, at_least(0), "0 = all"), "best_of": (int, above(0), "episodes per task"),
    "max_turns": (int, above(0), "agent turns per episode"), "batch_size": (int, above(0), "episodes played together"),
    "max_batch_size": (int, above(0), "sampler rows per call"), "seed": (int, at_least(0), "a seed"),
    "sandbox.workers": (int, at_least(0), "0 = one per core"), "sandbox.timeout_s": (float, above(0), "per test case"),
    **{f"sampling.{k}": v for k, v in SAMPLING_RANGES.items()},
    **{f"simulator.{k}": v for k, v in SIMULATOR_RANGES.items()},
    **{f"policy.openai.{k}": v for k, v in ENGINE_RANGES.items()},
}

RANK_RANGES = {
    "num_trajectories": (int, at_least(0), "0 = all"), "critic_temperature": (float, above(0), "scoring temperature"),
    "num_candidates": (int, closed(2), "candidates per turn (a pair needs two)"),
    "num_pairs": (int, above(0), "pairs per turn"), "temperature": (float, at_least(0), "0 = greedy"),
    "max_new_tokens": (int, above(0), "tokens of one candidate"), "max_len": (int, closed(1, INT32_MAX), "longest critic sequence"),
    "bucket": (int, above(0), "critic lengths round up to a multiple of it"),
    "score_batch_size": (int, above(0), "critic sequences per pass"),
    "prompts_per_batch": (int, above(0), "turns sampled together"),
    "max_batch_size": (int, above(0), "sampler rows per call"), "seed": (int, at_least(0), "a seed"),
    **{f"policy.openai.{k}": v for k, v in ENGINE_RANGES.items()},
}


# ==========================================================================================================
# The pipeline's training stages: train configs composed from the pipeline config's sections
# ==========================================================================================================

# A training stage's section of the pipeline config (configs/pipeline.py: init.sft, critic, sweet, mtdpo, rft):
# each field -> the train config field it sets, whose range (TRAIN_RANGES) and check (check_config) it has. Its
# default is that field's (base_config), except STAGE_DEFAULTS: the pipeline's short stages.
STAGE_FIELDS = {"num_steps": "train.num_steps", "epochs": "train.epochs", "lr": "optim.lr",
                "warmup_ratio": "optim.warmup_ratio", "batch_size": "train.batch_size", "beta": "loss.beta",
                "nll_coef": "loss.nll_coef", "label_smoothing": "loss.label_smoothing",
                "advantage_norm": "loss.advantage_norm", "eval_fraction": "data.eval_fraction",
                "ckpt_every": "train.ckpt_every"}
# eval_fraction: of this stage's *tasks*, held out for its own eval metrics; ckpt_every > 0: a checkpoint kept every
# this many steps (evidence of the run's course).
STAGE_DEFAULTS = {"lr": 1e-3, "warmup_ratio": 0.05, "eval_fraction": 0.0, "ckpt_every": 0}
TRAINING_STAGES = ("init.sft", "critic", "sweet", "mtdpo", "rft")  # the pipeline config's stage sections

# The pipeline config's fields shared by its training stages -> the train config field each one sets (a field the
# pipeline config lacks keeps the train config's default: collect.pair_rule and min_gap are the frontend track's).
SHARED_FIELDS = {"model.dtype": "model.dtype", "model.remat": "model.remat", "model.scan_layers": "model.scan_layers",
                 "model.attention_impl": "model.attention_impl", "model.cpu_matmul": "model.cpu_matmul",
                 "train.max_len": "data.max_len", "train.bucket": "data.bucket",
                 "train.micro_bucket": "data.micro_bucket",
                 "rank.info_template": "data.info_template", "rank.info_placement": "data.info_placement",
                 "collect.pair_rule": "data.pair_rule", "collect.min_gap": "data.min_gap",
                 "train.micro_batch_size": "train.micro_batch_size", "train.ref_logp": "train.ref_logp",
                 "train.mesh_shape": "mesh.shape"}


def _shared_values(pipeline: ml_collections.ConfigDict) -> dict:
    """{SHARED_FIELDS source: its value} for the shared fields the pipeline config has."""
    values = {}
    for source in SHARED_FIELDS:
        try:
            values[source] = config_get(pipeline, source)
        except (KeyError, AttributeError):
            continue
    return values


def stage_config(**values) -> ml_collections.ConfigDict:
    """A training stage's section of the pipeline config (STAGE_FIELDS), `values` over its defaults."""
    unknown = set(values) - set(STAGE_FIELDS)
    if unknown:
        raise TrainConfigError(f"not a training stage field: {', '.join(sorted(unknown))} (the fields: "
                               f"{', '.join(STAGE_FIELDS)})")
    base = base_config()
    return ml_collections.ConfigDict({name: values.get(name, STAGE_DEFAULTS.get(name, config_get(base, field)))
                                      for name, field in STAGE_FIELDS.items()})


def stage_train_config(pipeline: ml_collections.ConfigDict, stage: ml_collections.ConfigDict
                       ) -> ml_collections.ConfigDict:
    """The train config (base_config) of one training stage of a pipeline config: its shared fields
    (SHARED_FIELDS) and the stage section's (STAGE_FIELDS) set over the train config's defaults."""
    c = base_config()
    for source, value in _shared_values(pipeline).items():
        target = SHARED_FIELDS[source]
        config_set(c, target, tuple(value) if target == "mesh.shape" else value)
    for name, target in STAGE_FIELDS.items():
        config_set(c, target, stage[name])
    return c


def check_stages(pipeline: ml_collections.ConfigDict, error=None) -> None:
    """Every training stage section of a pipeline config (TRAINING_STAGES), as the train config it makes
    (stage_train_config), checked as trainer.run checks it (check_config): before any stage runs, the first wrong
    value an `error` (TrainConfigError) naming the pipeline field it came from (config.sweet.advantage_norm)."""
    shared = {SHARED_FIELDS[source]: source for source in _shared_values(pipeline)}
    for stage_name in TRAINING_STAGES:
        try:
            stage = config_get(pipeline, stage_name)
        except (KeyError, AttributeError):
            continue
        names = {**shared, **{target: f"{stage_name}.{name}" for name, target in STAGE_FIELDS.items()}}
        try:
            check_config(stage_train_config(pipeline, stage), names=names)
        except TrainConfigError as e:
            raise (error or TrainConfigError)(str(e)) from None


# The pipeline's own fields (configs/pipeline.py, configs/frontend.py); its training stages' are check_stages'.
PIPELINE_RANGES = {
    "seed": (int, at_least(0), "a seed"), "tasks.seed": (int, at_least(0), "a seed"),
    "tasks.num_train": (int, at_least(0), "training tasks; 0 = all of a file"), "tasks.num_heldout": (int, at_least(0), "held-out tasks"),
    "tasks.min_keys": (int, above(0), "keys of a synthetic task"), "tasks.max_keys": (int, above(0), "keys"),
    "model.hidden_size": (int, above(0), "width"), "model.intermediate_size": (int, above(0), "MLP width"),
    "model.num_layers": (int, above(0), "layers"), "model.num_heads": (int, above(0), "heads"),
    "model.num_kv_heads": (int, above(0), "KV heads"), "model.head_dim": (int, above(0), "head width"),
    "init.seed": (int, at_least(0), "a seed"), "init.num_tasks": (int, at_least(0), "0 = the training tasks"),
    "init.demos_per_task": (int, above(0), "demonstrations per task"),
    "collect.best_of": (int, above(0), "episodes per task"), "collect.temperature": SAMPLING_RANGES["temperature"],
    "collect.max_new_tokens": SAMPLING_RANGES["max_new_tokens"], "collect.batch_size": (int, above(0), "episodes"),
    "collect.max_turns": (int, above(0), "agent turns"), "collect.scripted_per_task": (int, at_least(0), "episodes"),
    "tasks.num_validation": (int, at_least(0), "validation tasks; 0 = none"),
    "tasks.validation_seed": (int, at_least(0), "a seed"),
    "rank.max_prompts": (int, at_least(0), "0 = all"),
    "rank.data_fraction": (float, (0.0, False, 1.0, True), "fraction of the offline trajectories"),
    "iterate.rounds": (int, above(0), "rounds of SWEET-RL; 1 = SWEET-RL itself"),
    "rank.num_candidates": RANK_RANGES["num_candidates"], "rank.num_pairs": RANK_RANGES["num_pairs"],
    "rank.temperature": RANK_RANGES["temperature"], "rank.max_new_tokens": RANK_RANGES["max_new_tokens"],
    "rank.score_batch_size": RANK_RANGES["score_batch_size"], "rank.prompts_per_batch": RANK_RANGES["prompts_per_batch"],
    "rank.max_batch_size": RANK_RANGES["max_batch_size"],
    "eval.samples": (int, above(0), "episodes per held-out task"), "eval.temperature": SAMPLING_RANGES["temperature"],
    "eval.max_new_tokens": SAMPLING_RANGES["max_new_tokens"], "eval.batch_size": (int, above(0), "episodes"),
    "eval.max_turns": (int, above(0), "agent turns"),
    "train.max_batch_size": (int, above(0), "sampler rows per call"),
    "sandbox.workers": ROLLOUT_RANGES["sandbox.workers"], "sandbox.timeout_s": ROLLOUT_RANGES["sandbox.timeout_s"],
    **{f"simulator.{k}": v for k, v in SIMULATOR_RANGES.items()},
    **{f"policy.openai.{k}": v for k, v in ENGINE_RANGES.items()},
}


def _show(lo, lo_closed, hi, hi_closed) -> str:
    if hi == INF:
        return f"{'>=' if lo_closed else '>'} {lo}"
    return f"in {'[' if lo_closed else '('}{lo}, {hi}{']' if hi_closed else ')'}"


def check_ranges(config, ranges: dict, error=None, *, prefix: str = "config.", names: dict | None = None) -> None:
    """Every field of `ranges` present in `config` has its type and lies in its range (NaN never does); the first
    that does not is an `error` (TrainConfigError) naming the field, its value, the range and what it means.
    names: field -> the name the user set it by, where that is another (a pipeline stage's field)."""
    error = error or TrainConfigError
    names = names or {}
    for field, (kind, (lo, lo_closed, hi, hi_closed), meaning) in ranges.items():
        try:
            value = config_get(config, field)
        except (KeyError, AttributeError):
            continue  # an older or smaller config without this field
        ok_type = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            kind is float or isinstance(value, int))
        ok = ok_type and (value >= lo if lo_closed else value > lo) and (value <= hi if hi_closed else value < hi)
        if not ok:  # NaN fails every comparison above
            expected = f"{'an integer' if kind is int else 'a number'} {_show(lo, lo_closed, hi, hi_closed)}"
            shown = names.get(field, field)
            raise error(f"{prefix}{shown}={value!r}: must be {expected} ({meaning}); set --{prefix}{shown}")


def check_config(config: ml_collections.ConfigDict, *, names: dict | None = None) -> None:
    """Values that are valid types but cannot work: fail before anything slow happens. names: field -> the name the
    user set it by, where that is another (a pipeline stage's field, check_stages)."""
    names = names or {}

    def need(cond, field, msg):
        if not cond:
            raise TrainConfigError(f"config.{names.get(field, field)}={config_get(config, field)!r}: {msg}")
    check_ranges(config, TRAIN_RANGES, names=names)
    need(config.loss.kind in LOSS_KINDS, "loss.kind", f"use one of {LOSS_KINDS}")
    need(config.loss.advantage_norm in ADVANTAGE_NORMS, "loss.advantage_norm",
         "use turn_mean (paper), trajectory_mean (official code) or sum")
    from sweet_jax.models.llama import PRESETS  # here: the configs load without jax (a command's --help in a second)
    need(config.model.preset in PRESETS, "model.preset", f"use one of {', '.join(PRESETS)}")
    need(config.train.ref_logp in ("precompute", "in_step"), "train.ref_logp", "use precompute or in_step")
    need(config.data.length_policy in ("truncate", "drop", "cut_right"), "data.length_policy",
         "use truncate, drop or cut_right (official)")
    need(setting(config, "data.mask_style") in ("turns", "official"), "data.mask_style", "use turns or official")
    need(setting(config, "loss.nll_scope") in ("reply", "sequence"), "loss.nll_scope", "use reply or sequence")
    need(config.data.padding_side in ("left", "right"), "data.padding_side", "use left or right")
    need(setting(config, "optim.moments_dtype") in ("float32", "bfloat16"), "optim.moments_dtype",
         "use float32 or bfloat16")
    if "metrics" in config:
        try:
            writer_names(config.metrics.writers)
        except ValueError as e:
            need(False, "metrics.writers", str(e))
    mb = config.train.micro_batch_size
    need(mb == 0 or config.train.batch_size % mb == 0, "train.micro_batch_size",
         f"must be 0 (automatic) or divide {names.get('train.batch_size', 'train.batch_size')}="
         f"{config.train.batch_size}")
    need(config.train.num_steps > 0 or config.train.epochs > 0, "train.epochs",
         f"set epochs > 0 or {names.get('train.num_steps', 'train.num_steps')} > 0")
    need(setting(config, "data.eval_split") in ("tasks", "first_rows"), "data.eval_split",
         "use tasks (held-out tasks) or first_rows (official: the first rows, also trained on)")
    shape = tuple(config.mesh.shape)
    need(len(shape) == 3 and sum(1 for s in shape if s == -1) <= 1 and all(s == -1 or s > 0 for s in shape),
         "mesh.shape", "expected 3 sizes (data, fsdp, tensor), each > 0 or one -1 for the rest of the devices")
    from sweet_jax.models.lora import LoRAConfig  # here: the configs load without jax (--help in a second)
    try:
        LoRAConfig.from_config(config.get("lora"))
    except SweetJaxError as e:
        raise TrainConfigError(f"config.{e}") from None
    if config.model.path:
        p = pathlib.Path(config.model.path)
        need(p.is_dir() and (p / "config.json").exists(), "model.path",
             "is not a Hugging Face checkpoint directory (no config.json there); set --config.model.path to "
             "one, or to '' for the demo tiny model")


# The path fields of a training config: read again by later commands (export, serve, rank) from the run's
# config.json, maybe from another directory, so they are recorded absolute (absolute_paths).
TRAIN_PATH_FIELDS = ("model.path", "data.trajectories", "data.tasks", "data.pairs", "data.tokenizer")
RANK_PATH_FIELDS = ("trajectories", "policy.path", "policy.tokenizer", "critic.path", "reference.path", "output")
ROLLOUT_PATH_FIELDS = ("tasks", "policy.path", "policy.tokenizer", "agent_prompt_path", "simulator.path",
                       "simulator.tokenizer", "simulator.prompt_path", "frontend.clip_path", "output")
PIPELINE_PATH_FIELDS = ("tasks.train_path", "tasks.heldout_path", "model.tokenizer", "init.path", "init.pretrained",
                        "init.from_run", "collect.trajectories", "select.frozen", "frontend.clip_path")


def absolute_path(value: str) -> str:
    """A path as the user typed it, made absolute against the directory the command runs in (`~` expanded);
    '' (the field's "not set") and remote paths (gs://...) are returned unchanged. Symbolic links are kept: the
    path names what the user named."""
    if not value or "://" in value:
        return value
    return os.path.abspath(os.path.expanduser(value))


def absolute_paths(config: ml_collections.ConfigDict, fields) -> ml_collections.ConfigDict:
    """A copy of `config` whose path `fields` (dotted names; those it lacks are skipped) are absolute: where the
    paths a user gives enter the library, so that they mean the same in every later stage and command, whatever
    its working directory (and Orbax, which refuses relative paths, never sees one)."""
    config = ml_collections.ConfigDict(config.to_dict()) if isinstance(config, ml_collections.FrozenConfigDict) \
        else config.copy_and_resolve_references()
    for field in fields:
        section, _, name = field.rpartition(".")
        try:
            node = config_get(config, section) if section else config
        except (KeyError, AttributeError):
            continue
        if name in node and isinstance(node[name], str):
            node[name] = absolute_path(node[name])
    return config


def check_inputs(config: ml_collections.ConfigDict, fields) -> None:
    """A SweetJaxError naming the first of the path `fields` (those it holds, `output` aside: it is written) that
    does not exist: what a command checks before it imports the library, so that a mistyped path answers in a
    second."""
    for field in fields:
        section, _, name = field.rpartition(".")
        try:
            value = (config_get(config, section) if section else config)[name]
        except (KeyError, AttributeError):
            continue
        if name == "output" or not isinstance(value, str) or not value or "://" in value:
            continue
        if not os.path.exists(os.path.expanduser(value)):
            where = "" if os.path.isabs(value) else f" (relative to {os.getcwd()})"
            raise SweetJaxError(f"config.{field}={value!r}: no such file or directory{where}; give an existing path "
                                f"with --config.{field}=PATH")


def config_get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def config_set(config, dotted: str, value) -> None:
    section, _, name = dotted.rpartition(".")
    (config_get(config, section) if section else config)[name] = value


def model_overrides(config: ml_collections.ConfigDict, *, attention_impl: str | None = None) -> dict:
    """The LlamaConfig fields a training config sets (compute/storage dtypes, remat, attention, layer layout),
    shared by sweet_jax.train and sweet_jax.plan so that the planned step is the trained one."""
    from sweet_jax import sharding  # here: the configs load without jax (a command's --help in a second)
    m = config.model
    return dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
                attention_impl=attention_impl or m.attention_impl, attention_chunk_size=int(m.attention_chunk_size),
                scan_layers=bool(m.scan_layers), cpu_matmul=m.cpu_matmul,
                # The residual stream's batch over ('data', 'fsdp') always: unconstrained, XLA may follow the
                # FSDP-sharded embedding instead (the whole batch on every chip, the hidden size split).
                residual_sharding=sharding.residual_sharding(sequence_parallel=bool(m.sequence_parallel)))


def lora_demo(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A demo preset trained through rank-8 adapters on every projection (`*_lora` presets)."""
    c.lora.rank = 8
    c.lora.alpha = 16.0
    c.optim.lr = 1e-2                 # adapters start at zero: LoRA takes a larger step than full fine-tuning
    return c


def official(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The official code's behaviour on top of paper_8b (docs/official.md): its token
    mask, right-cut over-long sequences, the trajectory-mean critic score, the whole-sequence NLL."""
    c.data.mask_style = "official"
    c.data.length_policy = "cut_right"
    c.data.info_placement = "raw_prefix"
    c.loss.advantage_norm = "trajectory_mean"
    c.loss.nll_scope = "sequence"
    c.data.eval_split = "first_rows"
    c.data.eval_fraction = 0.03
    return c


def paper_8b(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The paper's Llama-3.1-8B setting shared by critic and policy (its Table 5 and the official trainer)."""
    c.model.preset = "llama3_8b"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = "full"
    c.model.attention_impl = "chunked"  # query-chunked: [B, N, T, T] logits never exist (8 GiB/layer at 8192)
    c.data.max_len = 8192
    c.data.bucket = 1024
    c.train.batch_size = 8
    c.train.micro_batch_size = 0
    c.train.log_every = 1
    c.train.eval_every = 200
    c.train.ckpt_every = 200
    c.optim.lr = 2e-7
    c.loss.beta = 0.1
    c.mesh.shape = (1, -1, 1)         # FSDP over every chip (a valid mesh is chosen where 8 pairs do not split)
    return c


# The layouts `python -m sweet_jax.plan` measured to fit the slices people rent (docs/tpu.md, "TPU fit of the paper's
# setting": critic rows 2 and 11 at 8192 tokens, policy rows 4 and 6 at 16384), as presets
# configs/{critic,policy}.py:llama3_8b_<slice>. A slice not here: `python -m sweet_jax.plan --fit`.
_SP_MICRO_2 = {"model.scan_layers": True, "optim.moments_dtype": "bfloat16", "optim.offload_state": True,
               "model.sequence_parallel": True, "train.micro_batch_size": 2}
SLICE_LAYOUTS = {
    ("critic", "v5e_16"): {**_SP_MICRO_2, "mesh.shape": (1, 2, 8)},                           # row 11: 10.64 / 16
    ("critic", "v6e_8"): {"model.scan_layers": True, "optim.moments_dtype": "bfloat16"},       # row 2: 26.48 / 32
    ("policy", "v5e_16"): {**_SP_MICRO_2, "mesh.shape": (1, 2, 8)},                           # row 6: 11.86 / 16
    ("policy", "v6e_8"): {**_SP_MICRO_2, "mesh.shape": (1, 2, 4)},                            # row 4: 27.04 / 32
}


def slice_preset(preset: str, role: str) -> tuple[str, dict]:
    """'llama3_8b_v5e_16' -> ('llama3_8b', the measured layout of that slice); any other preset -> (it, {})."""
    for (kind, slice_name), layout in SLICE_LAYOUTS.items():
        if kind == role and preset.endswith("_" + slice_name):
            return preset[:-len(slice_name) - 1], layout
    return preset, {}


def apply_layout(c: ml_collections.ConfigDict, layout: dict) -> ml_collections.ConfigDict:
    for field, value in layout.items():
        section, name = field.split(".")
        c[section][name] = value
    return c


WRITERS = ("tensorboard", "wandb")   # metrics.writers: where the scalars go besides metrics.jsonl (always written)



def writer_names(text: str) -> tuple[str, ...]:
    """'tensorboard,wandb' -> ('tensorboard', 'wandb'); an unknown name is a ValueError naming the choices."""
    names = tuple(n.strip() for n in str(text).split(",") if n.strip())
    unknown = [n for n in names if n not in WRITERS]
    if unknown:
        raise ValueError(f"unknown metrics writer {unknown[0]!r}: use a comma-separated list of {', '.join(WRITERS)}")
    return names
