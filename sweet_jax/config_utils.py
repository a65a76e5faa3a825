"""Shared pieces of the training configs (configs/critic.py, configs/policy.py).

Every field a user can type on the command line is created here, once, with its default; a preset
only changes values. Field names are read by sweet_jax.train, sweet_jax.steps and sweet_jax.data.
"""
from __future__ import annotations

import pathlib

import ml_collections

from sweet_jax.errors import SweetJaxError

LOSS_KINDS = ("critic", "dpo", "mtdpo", "rft")


class TrainConfigError(SweetJaxError):
    """A config value that cannot work; the message names the field and what to set."""


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
    c.data.length_policy = "truncate"  # truncate | drop | cut_right (official): sequences longer than max_len
    c.data.mask_style = "turns"       # turns (reply + end-of-turn) | official (the fork's mask, data/render.py)
    c.data.info_template = "In light that the final answer is: {ground_truth}."  # the official code's wording
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


def metrics_config() -> ml_collections.ConfigDict:
    """Experiment tracking (sweet_jax.metrics.MetricsWriter); metrics.jsonl is always written. Not part of what a
    run is: a rerun may change these freely."""
    c = ml_collections.ConfigDict()
    c.writers = "tensorboard"         # comma-separated: tensorboard (WORKDIR/tensorboard), wandb (pip install wandb)
    c.wandb_project = "sweet_jax"
    c.wandb_mode = "offline"          # offline (no network; `wandb sync WORKDIR/wandb/offline-run-*` later) | online
    c.group = ""                      # runs shown together (the pipeline: its workdir, one run per stage)
    c.name = ""                       # this run's name; '' = the workdir's name
    return c


def check_config(config: ml_collections.ConfigDict) -> None:
    """Values that are valid types but cannot work: fail before anything slow happens."""
    def need(cond, field, msg):
        if not cond:
            raise TrainConfigError(f"config.{field}={config_get(config, field)!r}: {msg}")
    need(config.loss.kind in LOSS_KINDS, "loss.kind", f"use one of {LOSS_KINDS}")
    need(config.loss.advantage_norm in ("turn_mean", "trajectory_mean", "sum"), "loss.advantage_norm",
         "use turn_mean (paper), trajectory_mean (official code) or sum")
    from sweet_jax.models.llama import PRESETS
    need(config.model.preset in PRESETS, "model.preset", f"use one of {', '.join(PRESETS)}")
    need(config.train.ref_logp in ("precompute", "in_step"), "train.ref_logp", "use precompute or in_step")
    need(config.data.length_policy in ("truncate", "drop", "cut_right"), "data.length_policy",
         "use truncate, drop or cut_right (official)")
    need(config.data.get("mask_style", "turns") in ("turns", "official"), "data.mask_style", "use turns or official")
    need(config.loss.get("nll_scope", "reply") in ("reply", "sequence"), "loss.nll_scope", "use reply or sequence")
    need(config.data.padding_side in ("left", "right"), "data.padding_side", "use left or right")
    need(config.optim.get("moments_dtype", "float32") in ("float32", "bfloat16"), "optim.moments_dtype",
         "use float32 or bfloat16")
    need(config.train.batch_size > 0, "train.batch_size", "must be > 0")
    if "metrics" in config:
        from sweet_jax.metrics import writer_names
        try:
            writer_names(config.metrics.writers)
        except ValueError as e:
            need(False, "metrics.writers", str(e))
    mb = config.train.micro_batch_size
    need(mb == 0 or (mb > 0 and config.train.batch_size % mb == 0), "train.micro_batch_size",
         f"must be 0 (automatic) or divide train.batch_size={config.train.batch_size}")
    need(config.train.num_steps > 0 or config.train.epochs > 0, "train.epochs", "set epochs > 0 or train.num_steps > 0")
    need(config.data.max_len > 0 and config.data.bucket > 0, "data.max_len", "max_len and bucket must be > 0")
    need(0.0 <= config.data.eval_fraction < 1.0, "data.eval_fraction", "must be in [0, 1)")
    need(config.data.get("eval_split", "tasks") in ("tasks", "first_rows"), "data.eval_split",
         "use tasks (held-out tasks) or first_rows (official: the first rows, also trained on)")
    shape = tuple(config.mesh.shape)
    need(len(shape) == 3 and sum(1 for s in shape if s == -1) <= 1 and all(s == -1 or s > 0 for s in shape),
         "mesh.shape", "expected 3 sizes (data, fsdp, tensor), each > 0 or one -1 for the rest of the devices")
    try:
        from sweet_jax.models.lora import LoRAConfig
        LoRAConfig.from_config(config.get("lora"))
    except SweetJaxError as e:
        raise TrainConfigError(f"config.{e}") from None
    if config.model.path:
        p = pathlib.Path(config.model.path)
        need(p.is_dir() and (p / "config.json").exists(), "model.path",
             "is not a Hugging Face checkpoint directory (no config.json there); set --config.model.path to "
             "one, or to '' for the demo tiny model")


def config_get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def model_overrides(config: ml_collections.ConfigDict, *, attention_impl: str | None = None) -> dict:
    """The LlamaConfig fields a training config sets (compute/storage dtypes, remat, attention, layer layout),
    shared by sweet_jax.train and sweet_jax.plan so that the planned step is the trained one."""
    from sweet_jax.sharding import residual_sharding
    m = config.model
    return dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
                attention_impl=attention_impl or m.attention_impl, attention_chunk_size=int(m.attention_chunk_size),
                scan_layers=bool(m.scan_layers),
                # The residual stream's batch over ('data', 'fsdp') always: unconstrained, XLA may follow the
                # FSDP-sharded embedding instead (the whole batch on every chip, the hidden size split).
                residual_sharding=residual_sharding(sequence_parallel=bool(m.sequence_parallel)))


def lora_demo(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A demo preset trained through rank-8 adapters on every projection (`*_lora` presets)."""
    c.lora.rank = 8
    c.lora.alpha = 16.0
    c.optim.lr = 1e-2                 # adapters start at zero: LoRA takes a larger step than full fine-tuning
    return c


def official(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The official code's behaviour on top of paper_8b (README, "Coming from the official code"): its token
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


# The layouts `python -m sweet_jax.plan` measured to fit the slices people rent (README, "TPU fit of the paper's
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
