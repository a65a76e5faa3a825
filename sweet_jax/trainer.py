"""Training the SWEET-RL critic or policy (and the baselines) as a library: `run(config, workdir)` is what
`python -m sweet_jax.train` and the pipeline's training stages call.

One linear story: config -> distributed init -> mesh -> tokenizer -> data (pairs, held-out split by
task) -> model -> reference log-probs -> train loop (metrics, eval, checkpoints) -> final eval -> plot.
Pointing the workdir at an existing run resumes it from its latest readable checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import pathlib
import signal
import tempfile
import time

import ml_collections
import numpy as np

from sweet_jax import cli, config_utils, host_malloc, rundir
from sweet_jax.errors import SweetJaxError
# What a run directory holds and how models load live in sweet_jax.rundir; these names are its.
from sweet_jax.rundir import (CHECKPOINT_DIR, CONFIG_FILE, build_model, demo_paths, initialize_distributed,  # noqa: F401
                              lora_trainable, model_config, read_config, tokenizer_path)

log = logging.getLogger("sweet_jax.train")



class TrainConfigError(SweetJaxError):
    """A config value that cannot work; the message names the field and what to set."""


class NanLossError(SweetJaxError):
    """The loss became NaN/inf; the last good checkpoint is kept."""


# ==========================================================================================================
# Config
# ==========================================================================================================

def check_config(config: ml_collections.ConfigDict) -> None:
    """Values that are valid types but cannot work: fail before anything slow happens."""
    def need(cond, field, msg):
        if not cond:
            raise TrainConfigError(f"config.{field}={config_get(config, field)!r}: {msg}")
    need(config.loss.kind in config_utils.LOSS_KINDS, "loss.kind", f"use one of {config_utils.LOSS_KINDS}")
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
    need(config.train.batch_size > 0, "train.batch_size", "must be > 0")
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


# ==========================================================================================================
# Data: every host lists the same examples, renders only its slice of them (data.batching.host_range)
# ==========================================================================================================

@dataclasses.dataclass
class Dataset:
    """One split as this host holds it. Every host lists the split's examples the same way (critic pairs from
    the rewards, successful trajectories, ranked pairs: no tokenizer, cheap), then renders only its slice:
    `examples` (tuples of P data.render.Rendered), `ids` their positions in the global list (the length
    policy may have dropped some), `num_global` the list's length. `lengths` = (ids, lengths) of every
    host's examples (gather_lengths), `extras` per-token arrays added later (the reference pass's ref_logp)."""
    examples: list
    ids: list[int]
    num_global: int
    tasks: int
    num_sequences: int
    extras: dict = dataclasses.field(default_factory=dict)
    lengths: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def with_extras(self, **extras) -> "Dataset":
        """This split with per-token arrays attached (e.g. ref_logp: one tuple of [L] arrays per example)."""
        return dataclasses.replace(self, extras={**self.extras, **extras})

    @property
    def num_examples(self) -> int:
        """Examples over all hosts (after gather_lengths)."""
        return len(self.lengths[0])

    def gather_lengths(self) -> None:
        from sweet_jax.data import batching
        self.lengths = batching.gather_lengths(np.asarray(self.ids),
                                               batching.example_lengths(self.examples, scored=True))

    def batches(self, config, *, pad_id: int, process_index: int = 0, process_count: int = 1, **kwargs):
        """A data.batching.BatchIterator over this split (its position goes into the checkpoint)."""
        from sweet_jax.data.batching import BatchIterator
        kwargs.setdefault("score_positions", bool(config.loss.get("score_positions", False)))
        return BatchIterator(
            self.examples, batch_size=config.train.batch_size, seed=config.train.seed, pad_id=pad_id,
            padding_side=config.data.padding_side, max_len=config.data.max_len, bucket_size=config.data.bucket,
            process_index=process_index, process_count=process_count, example_ids=self.ids,
            num_global=self.num_global, global_lengths=self.lengths, extras=self.extras,
            num_sequences=self.num_sequences, **kwargs)


def split_by_task(keys: list[str], eval_fraction: float, seed: int) -> set[str]:
    """The held-out task keys: a seeded eval_fraction of the distinct tasks (at least one when > 0)."""
    distinct = sorted(set(keys))
    if eval_fraction <= 0 or len(distinct) < 2:
        return set()
    n_eval = min(len(distinct) - 1, max(1, round(eval_fraction * len(distinct))))
    picked = np.random.default_rng(seed).choice(len(distinct), size=n_eval, replace=False)
    return {distinct[i] for i in picked}


def first_rows(num_rows: int, eval_fraction: float) -> int:
    """data.eval_split='first_rows' (the official trainer's split when the data has no test split): the first
    int(eval_fraction * rows) rows are evaluated on, and every row, those included, is trained on."""
    return int(num_rows * eval_fraction)


def _read_jsonl(path: str, what: str, field: str) -> list[dict]:
    from sweet_jax import jsonl
    from etils import epath
    if not epath.Path(path).exists():
        raise TrainConfigError(f"config.{field}={path!r} does not exist: set --config.{field} to the {what} JSONL")
    rows = jsonl.read(path)
    if not rows:
        raise TrainConfigError(f"config.{field}={path!r} has no rows: point --config.{field} at a non-empty {what} JSONL")
    return rows


def build_datasets(config, tokenizer, *, process_index: int = 0, process_count: int = 1) -> tuple[Dataset, Dataset]:
    """(train, eval) examples for config.loss.kind, this host's slice of each (process_index of
    process_count row slices of the global batch); eval = the examples of a held-out set of tasks."""
    from sweet_jax.data import batching
    from sweet_jax.data import pairs as pairs_lib
    from sweet_jax.data import schema

    kind = config.loss.kind
    options = pairs_lib.RenderOptions(
        max_len=config.data.max_len, overflow=config.data.length_policy,
        info_template=config.data.info_template, info_placement=config.data.info_placement,
        mask_style=config.data.get("mask_style", "turns"))
    mine = lambda n: batching.host_range(n, config.train.batch_size, process_index, process_count)  # noqa: E731
    if kind == "dpo":
        return _policy_pair_datasets(config, tokenizer, options, mine)

    path = config.data.trajectories or str(demo_paths().trajectories)
    if not config.data.trajectories and not pathlib.Path(path).exists():
        raise TrainConfigError(f"the bundled demo trajectories ({path}) are missing; set --config.data.trajectories")
    from etils import epath
    if epath.Path(path).exists() and not epath.Path(path).read_text().strip():
        raise TrainConfigError(f"config.data.trajectories={path!r} has no rows: point --config.data.trajectories "
                               "at a non-empty ColBench trajectories JSONL")
    try:
        trajectories = schema.load_trajectories(path)
    except schema.DataError as e:
        raise TrainConfigError(f"config.data.trajectories={path!r}: {e}") from None
    if not trajectories:
        raise TrainConfigError(f"config.data.trajectories={path!r} has no rows: point it at a non-empty "
                               "ColBench trajectories JSONL")
    def listing(trajs):  # critic / mtdpo: trajectory pairs; rft: the successful trajectories
        if kind in ("critic", "mtdpo"):
            return pairs_lib.trajectory_pairs(trajs, rule=config.data.get("pair_rule", "best_success"),
                                              min_gap=config.data.min_gap)
        return pairs_lib.rft_examples(trajs)

    if config.data.get("eval_split", "tasks") == "first_rows":
        everything = listing(trajectories)
        lists = (everything, everything[:first_rows(len(everything), config.data.eval_fraction)])
    else:
        eval_keys = split_by_task([t.task.key for t in trajectories], config.data.eval_fraction, config.train.seed)
        lists = (listing([t for t in trajectories if t.task.key not in eval_keys]),
                 listing([t for t in trajectories if t.task.key in eval_keys]))
    out = []
    for listed in lists:
        tasks = len({x.task_key if kind != "rft" else x.task.key for x in listed})
        if kind in ("critic", "mtdpo"):
            part = mine(len(listed))
            examples, _ = pairs_lib.pair_examples(tokenizer, listed[part.start:part.stop],
                                                  with_info=kind == "critic" and config.loss.use_info,
                                                  options=options, progress=len(part) > 200)
        else:  # rft: SFT on the successful trajectories
            part = mine(len(listed))
            examples, _ = pairs_lib.sft_examples(tokenizer, listed[part.start:part.stop], options=options,
                                                 progress=len(part) > 200)
        out.append(Dataset(list(examples), [part.start + i for i in examples.indices], len(listed), tasks,
                           1 if kind == "rft" else 2))
    if not out[0].num_global:
        what = "pairs (a task needs a trajectory with reward 1.0 and one with a lower reward)" \
            if kind != "rft" else "successful trajectories (reward 1.0)"
        raise TrainConfigError(f"config.data.trajectories={path!r}: {len(trajectories)} trajectories give no training "
                               f"{what}; use scored trajectories with successes and failures per task")
    return out[0], out[1]


def _policy_pair_datasets(config, tokenizer, options, mine) -> tuple[Dataset, Dataset]:
    """Step-level pairs written by `python -m sweet_jax.rank`: the prompt the candidates were sampled from,
    then the chosen / rejected reply (turn id 1) and its end-of-turn token."""
    from sweet_jax.data import pairs as pairs_lib
    from sweet_jax.data import render
    from sweet_jax.data.schema import Turn

    if not config.data.pairs:
        raise TrainConfigError("config.data.pairs is empty: loss.kind=dpo trains on the pairs JSONL written by "
                               "`python -m sweet_jax.rank`; set --config.data.pairs=PATH (or use loss.kind=mtdpo/rft)")
    records = _read_jsonl(config.data.pairs, "ranked policy pairs", "data.pairs")
    for n, r in enumerate(records, start=1):
        missing = [k for k in ("prompt_text", "chosen", "rejected") if k not in r]
        if missing and not pairs_lib.is_official_pair_row(r):
            raise TrainConfigError(f"{config.data.pairs}:{n}: missing field(s) {missing}; the file must come from "
                                   "`python -m sweet_jax.rank`, or be an official pairs file (chosen and rejected "
                                   "strings)")
    keys = [str(r.get("task_key", r.get("trajectory_index", n))) for n, r in enumerate(records)]
    if config.data.get("eval_split", "tasks") == "first_rows":
        n_eval = first_rows(len(records), config.data.eval_fraction)
        splits, eval_keys = (records, records[:n_eval]), set(keys[:n_eval])
    else:
        eval_keys = split_by_task(keys, config.data.eval_fraction, config.train.seed)
        splits = tuple([r for key, r in zip(keys, records) if (key in eval_keys) == held_out]
                       for held_out in (False, True))
    stats = render.LengthStats()
    out = []
    for held_out, listed in zip((False, True), splits):
        part = mine(len(listed))
        examples, ids = [], []
        for i in part:
            r = listed[i]
            if pairs_lib.has_sampled_ids(r):  # the sampled token ids, not their text tokenised again
                seqs = pairs_lib.sampled_pair_sequences(tokenizer, r, where=f"{config.data.pairs} (pair {i})")
            elif pairs_lib.is_official_pair_row(r):
                seqs = pairs_lib.official_pair_sequences(tokenizer, r, where=config.data.pairs)
            else:
                seqs = tuple(render.render_prerendered(tokenizer, (Turn("assistant", r[side], r["prompt_text"],
                                                                        r[side]),), label="last")
                             for side in ("chosen", "rejected"))
            fitted = render.fit_all(seqs, options.max_len, overflow=options.overflow, stats=stats)
            if fitted is not None:
                examples.append(fitted)
                ids.append(i)
        tasks = len({k for k in keys if (k in eval_keys) == held_out or (listed is records)})
        out.append(Dataset(examples, ids, len(listed), tasks, 2))
    stats.log("policy pairs", options.max_len)
    return out[0], out[1]

# ==========================================================================================================
# Model
# ==========================================================================================================

# ==========================================================================================================
# Moving batches onto the mesh, the reference pass, evaluation
# ==========================================================================================================

def data_shard(sharding, batch_size: int) -> tuple[int, int]:
    """(index, count) of the slice of global batch rows this process feeds (data.batching's process_index /
    process_count): (process_index, process_count) when the batch is split over processes, fewer slices when
    processes hold replicas of the same rows (a tensor axis across hosts)."""
    import jax

    if jax.process_count() == 1:
        return 0, 1
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map((batch_size,)).values():
        rows.update(range(*index[0].indices(batch_size)))
    lo, n = min(rows), len(rows)
    if max(rows) - lo + 1 != n or lo % n or batch_size % n:
        raise TrainConfigError(f"this process's devices hold batch rows {sorted(rows)} of {batch_size}, not one "
                               "aligned contiguous slice; set --config.mesh.shape so that each host's devices "
                               "are neighbours on the (data, fsdp) axes")
    return lo // n, batch_size // n


def to_global(batch: dict[str, np.ndarray], sharding) -> dict:
    """This process's rows of a batch -> global jax.Arrays (rows of all processes, in process order)."""
    import jax
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def to_host(x) -> np.ndarray:
    import jax
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def one_pass(dataset: Dataset, make_batches, **kwargs):
    """(iterator, steps) over every example once, longest first (little padding, few shapes to compile)."""
    it = make_batches(dataset, shuffle=False, longest_first=True, num_epochs=1, **kwargs)
    return it, range(it.steps_per_epoch)


def reference_pass(ref_logp_fn, params, dataset: Dataset, make_batches, sharding, padding_side: str) -> list:
    """Label log-probs of the frozen reference model for every example of this host, one tuple of [L] arrays
    (one per sequence) per example; Dataset.with_extras(ref_logp=...) attaches them before the batches exist."""
    from tqdm.auto import tqdm
    import jax

    it, steps = one_pass(dataset, make_batches, score_positions=False)  # the reference covers every token
    refs: list = [None] * len(dataset)
    lo = it.process_index * it.local_batch_size
    for step in tqdm(steps, desc="reference log-probs", unit="batch", disable=jax.process_index() != 0):
        batch = it.batch_at(0, step)
        logp_BPT = to_host(ref_logp_fn(params, to_global(
            {k: batch[k] for k in ("input_ids", "attention_mask", "turn_ids")}, sharding)))
        T = batch["input_ids"].shape[-1]
        for row, i in enumerate(it.local_indices(0, step)):
            if i >= 0:
                refs[i] = tuple(logp_BPT[lo + row, p, :len(seq)] if padding_side == "right"
                                else logp_BPT[lo + row, p, T - len(seq):] for p, seq in enumerate(dataset.examples[i]))
    return refs


def make_eval_fn(config, state, mesh, spec):
    """eval(rest, params, batch[, ref_params]) -> the loss's metrics, no gradient (same LossSpec as the step).
    rest: the train state's current non-trained variables (a LoRA run's frozen base): an argument, not a closure,
    since a closed-over array is compiled in as a constant and the train step donates the state it was in."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from sweet_jax import steps

    graphdef, rest = state.graphdef, state.rest

    def fn(rest, params, batch, ref_params=None):
        _, metrics = steps.pair_loss(spec, graphdef, params, rest, batch, ref_params, spec.denominator(batch))
        return {k: jax.numpy.asarray(v, jax.numpy.float32) for k, v in metrics.items()}

    params_sh = steps.shardings_of(state.params)
    in_sh = (steps.shardings_of(rest), params_sh, steps.batch_sharding(mesh))
    if config.train.ref_logp == "in_step" and spec.needs_ref:
        in_sh = in_sh + (params_sh,)
    return jax.jit(fn, in_shardings=in_sh, out_shardings=NamedSharding(mesh, PartitionSpec()))


def evaluate(eval_fn, params, dataset: Dataset, make_batches, sharding, ref_params=None) -> dict:
    """Metrics over the whole held-out set (each batch's means weighted by its number of real examples)."""
    import jax
    totals: dict[str, float] = {}
    count = 0
    it, steps = one_pass(dataset, make_batches)
    for step in steps:
        args = (params, to_global(it.batch_at(0, step), sharding)) + ((ref_params,) if ref_params is not None else ())
        metrics = jax.device_get(eval_fn(*args))
        rows = it.real_rows(0, step)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) * rows
        count += rows
    return {k: v / count for k, v in totals.items()} if count else {}


def rename_metrics(m: dict) -> dict:
    """Metric names as the logs and plot show them."""
    return {("pair_accuracy" if k == "accuracy" else k): v for k, v in m.items()}


# ==========================================================================================================
# The run
# ==========================================================================================================

class Preempted(cli.RunInterrupted):
    """SIGTERM (TPU preemption) or Ctrl-C arrived; a checkpoint of `step` was written. The command line exits
    with 128 + the signal's number (143, 130)."""

    def __init__(self, step: int, signum: int = signal.SIGTERM):
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        super().__init__(f"{name}: saved step {step}; rerun the same command to resume", 128 + signum)
        self.step = step


def nan_message(ckpt, step: int, m: dict, workdir) -> str:
    """Stop on a NaN/inf loss at `step`. The checkpoint of step-1 holds exactly the parameters that gave this
    loss, so it is not good either: it is moved aside, and resuming starts from the one before."""
    ckpt.wait()
    if ckpt.latest_step() == step - 1:
        ckpt.quarantine(step - 1, reason=f"its parameters give a {m['loss']} loss at step {step}")
    good = ckpt.latest_step()
    return (f"the loss became NaN/inf ({m['loss']}) at step {step} (grad norm {m.get('grad_norm')}); stopped "
            f"without saving. The last good checkpoint is "
            f"{'step %d' % good if good is not None else 'none (no earlier save)'} in {workdir / CHECKPOINT_DIR}: "
            "lower --config.optim.lr or check the data, then rerun with the same --workdir to resume from it")


def stage_title(config, workdir, steps: int) -> str:
    """What the curves are of, in the method's words: the stage, the run directory, the steps."""
    kind = config.loss.kind
    stage = {"critic": "critic: Bradley-Terry on trajectory pairs" + ("" if config.loss.use_info else
                                                                      ", without training-time information"),
             "dpo": "policy: step-level DPO on critic-ranked pairs", "mtdpo": "policy: multi-turn DPO (baseline)",
             "rft": "policy: rejection fine-tuning (baseline)"}.get(kind, kind)
    where = "/".join(pathlib.PurePath(str(workdir)).parts[-2:])
    return f"{stage} ({where}, {steps} steps)"


def run(config: ml_collections.ConfigDict, workdir, *, accept_config_change: bool = False) -> dict:
    """Train as configured in `workdir` (resuming it if it holds a run). Returns a summary dict.

    A finished run made with the same config returns its summary at once. A run whose saved config differs
    is refused (naming the fields) unless accept_config_change, which records the change in the workdir."""
    check_config(config)
    finished = rundir.finished_summary(config, workdir)
    if finished is not None:
        log.info("%s already holds this run, finished at step %s: nothing to do (its summary.json and curves.png "
                 "are there; pick another --workdir to train again)", workdir, finished.get("steps"))
        return finished
    initialize_distributed()
    with contextlib.ExitStack() as mesh_scope:
        trainer = Trainer(config, workdir, rundir.make_mesh(training_mesh_shape(config)))
        trainer.setup(mesh_scope, accept_config_change=accept_config_change)
        trainer.resume()
        trainer.loop()
        return trainer.finish()


def training_mesh_shape(config) -> tuple:
    """config.mesh.shape, or a valid mesh for the batch when its batch shards do not split it (logged)."""
    import jax
    from sweet_jax import sharding
    shape = tuple(config.mesh.shape)
    try:
        chosen, why = sharding.choose_mesh_shape(shape, jax.device_count(), config.train.batch_size,
                                                 config.train.micro_batch_size)
    except sharding.MeshError:
        return shape  # rundir.make_mesh names what the devices cannot fill
    if why:
        log.info("mesh: %s", why)
    return chosen


class Trainer:
    """One training run: setup (record the run, data, model, steps, reference log-probs, batches), resume (the
    latest readable checkpoint), loop (steps, evals, saves, SIGTERM / Ctrl-C), finish (summary, curves)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir, mesh):
        import jax
        from etils import epath

        self.config, self.mesh = config, mesh
        self.workdir = epath.Path(workdir)
        self.is_main = jax.process_index() == 0
        self.kind = config.loss.kind

    # ------------------------------------------------------------------------------------------------------
    def setup(self, mesh_scope: contextlib.ExitStack, *, accept_config_change: bool = False) -> None:
        import jax
        from sweet_jax import steps
        from sweet_jax.data.tokenizers import check_vocab, load_tokenizer, pad_id

        config, mesh, workdir = self.config, self.mesh, self.workdir
        if self.is_main:
            workdir.mkdir(parents=True, exist_ok=True)
        batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
        for field in ("batch_size", "micro_batch_size"):
            size = config.train[field]
            if size and size % batch_devices:
                raise TrainConfigError(
                    f"config.train.{field}={size} is not a multiple of the batch-sharded devices "
                    f"(mesh data x fsdp = {batch_devices}); set it to a multiple of {batch_devices}")
        changes = rundir.write_config(config, workdir, accept_change=accept_config_change, write=self.is_main)
        if changes:
            log.warning("config changed on this rerun (recorded in %s): %s", rundir.CONFIG_CHANGES,
                        "; ".join(f"{field}: {old!r} -> {new!r}" for field, old, new in changes))
        if self.is_main:
            rundir.record_invocation(workdir, accepted_config_changes=[field for field, _, _ in changes])
        log.info("mesh %s over %d devices (%s), %d process(es); host allocator: %s", dict(mesh.shape),
                 jax.device_count(), jax.devices()[0].device_kind, jax.process_count(), host_malloc.active())

        # Tokenizer and data: this host renders only its slice; the batches are the same for any host count.
        tokenizer = load_tokenizer(tokenizer_path(config))
        self.batch_sh = steps.batch_sharding(mesh)
        data_index, data_count = data_shard(self.batch_sh, config.train.batch_size)
        train_set, eval_set = build_datasets(config, tokenizer, process_index=data_index, process_count=data_count)
        for dataset in (train_set, eval_set):
            dataset.gather_lengths()
        if not train_set.num_examples:
            raise TrainConfigError(f"no training example fits data.max_len={config.data.max_len} "
                                   f"(data.length_policy={config.data.length_policy!r}): raise --config.data.max_len")
        log.info("data: %d train examples (%d tasks), %d eval examples (%d held-out tasks); this host renders "
                 "slice %d of %d", train_set.num_examples, train_set.tasks, eval_set.num_examples, eval_set.tasks,
                 data_index, data_count)

        def make_batches(dataset: Dataset, **kwargs):  # -> data.batching.BatchIterator
            return dataset.batches(config, pad_id=pad_id(tokenizer), process_index=data_index,
                                   process_count=data_count, **kwargs)
        self.make_batches = make_batches
        steps_per_epoch = make_batches(train_set).steps_per_epoch
        self.total_steps = (config.train.num_steps if config.train.num_steps > 0
                            else config.train.epochs * steps_per_epoch)

        # Model, optimiser, train state, the step functions.
        self.llama_config = model_config(config, vocab_size=len(tokenizer), tokenizer=tokenizer)
        check_vocab(self.llama_config.vocab_size, tokenizer, model=f"config.model.path={config.model.path!r}",
                    where=f"the tokenizer {tokenizer_path(config)}")
        model = build_model(config, self.llama_config, mesh)
        optimizer, lr_schedule = steps.optimizer_from_config(config.optim, self.total_steps)
        self.state = steps.create_train_state(model, optimizer, mesh, trainable=lora_trainable(config))
        del model
        if config.lora.rank:
            trained = sum(x.size for x in jax.tree.leaves(self.state.params))
            frozen = sum(x.size for x in jax.tree.leaves(self.state.rest))
            log.info("LoRA rank %d on %s: %d adapter parameters trained (%.2f%% of the %d frozen base parameters)",
                     config.lora.rank, config.lora.targets, trained, 100 * trained / max(frozen, 1), frozen)
        # The steps trace under the mesh: the model's sequence-parallel constraints (model.sequence_parallel) name
        # its axes. Not earlier: under a mesh, NNX would read the parameters' logical names as mesh axes at init.
        mesh_scope.enter_context(jax.set_mesh(mesh))
        self.spec = spec = steps.loss_spec(config.loss)
        self.train_step = steps.make_step(spec, self.state, optimizer, mesh,
                                          micro_batch_size=config.train.micro_batch_size, lr_schedule=lr_schedule,
                                          ref_in_step=config.train.ref_logp == "in_step")
        self.eval_fn = make_eval_fn(config, self.state, mesh, spec)

        # Reference log-probs of the initial (= reference) parameters, attached to the examples before the
        # batches are built; or a frozen copy of the parameters for in_step.
        self.ref_params = None
        if spec.needs_ref:
            if config.train.ref_logp == "precompute":
                ref_fn = steps.make_ref_logp_fn(self.state.graphdef, steps.shardings_of(self.state.params), mesh,
                                                rest=self.state.rest)
                train_set, eval_set = (
                    dataset.with_extras(ref_logp=reference_pass(ref_fn, self.state.params, dataset, make_batches,
                                                                self.batch_sh, config.data.padding_side))
                    if dataset.num_examples else dataset for dataset in (train_set, eval_set))
            else:
                self.ref_params = jax.tree.map(lambda x: x.copy(), self.state.params)  # state is donated
        self.train_set, self.eval_set = train_set, eval_set
        self.batches = make_batches(train_set)

    # ------------------------------------------------------------------------------------------------------
    def resume(self) -> None:
        """The latest readable checkpoint's parameters, optimiser state, data position and RNG, if any; then the
        metrics log from that step on (local, mirrored into a remote workdir at saves and at the end)."""
        import jax
        from sweet_jax import checkpoint, metrics as metrics_lib

        workdir = self.workdir
        self.ckpt = checkpoint.Checkpointer(workdir / CHECKPOINT_DIR, keep=self.config.train.keep_ckpts)
        self.rng = jax.random.key(self.config.train.seed)
        self.step = 0
        self.restored = self.ckpt.restore({"params": checkpoint.abstract_like(self.state.params),
                                           "opt_state": checkpoint.abstract_like(self.state.opt_state)})
        if self.restored is not None:
            self.step, items, meta = self.restored
            self.state = self.state.replace(params=items["params"], opt_state=items["opt_state"],
                                            step=jax.device_put(np.int32(self.step), self.state.step.sharding))
            self.batches.restore(meta["data"])
            self.rng = jax.random.wrap_key_data(np.asarray(meta["rng"], np.uint32))
            log.info("resumed from step %d of %s", self.step, workdir / CHECKPOINT_DIR)

        self.remote = "://" in str(workdir)
        self.logdir = (pathlib.Path(tempfile.gettempdir()) / "sweet_jax_logs" / workdir.name if self.remote
                       else pathlib.Path(str(workdir)))
        if self.remote and self.is_main:
            self.logdir.mkdir(parents=True, exist_ok=True)
            if (workdir / "metrics.jsonl").exists():
                (self.logdir / "metrics.jsonl").write_text((workdir / "metrics.jsonl").read_text())
        self.writer = metrics_lib.MetricsWriter(self.logdir, resume_step=self.step)
        self.peak_flops, self.peak_desc = metrics_lib.peak_flops_total(jax.devices())
        log.info("MFU peak: %s", self.peak_desc)
        self.all_finite = jax.jit(lambda tree: jax.numpy.all(jax.numpy.stack(
            [jax.numpy.all(jax.numpy.isfinite(x)) for x in jax.tree.leaves(tree)])))

    def save(self, at_step: int, *, wait: bool = False) -> None:
        import jax
        if not bool(self.all_finite(self.state.params)):  # a finite loss can hide inf/NaN weights: never save those
            self.ckpt.wait()
            good = self.ckpt.latest_step()
            raise NanLossError(f"parameters hold inf/NaN after step {at_step}; not saved. The last good checkpoint "
                               f"is {'step %d' % good if good is not None else 'none (no earlier save)'} in "
                               f"{self.workdir / CHECKPOINT_DIR}: lower --config.optim.lr, then rerun with the same "
                               "--workdir to resume from it")
        self.ckpt.save(at_step, {"params": self.state.params, "opt_state": self.state.opt_state},
                       {"data": self.batches.state(), "rng": np.asarray(jax.random.key_data(self.rng)).tolist(),
                        "total_steps": self.total_steps, "loss_kind": self.kind}, wait=wait)

    def sync_logs(self) -> None:
        if self.is_main and self.remote:
            for f in self.logdir.rglob("*"):
                if f.is_file():
                    dst = self.workdir / f.relative_to(self.logdir)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(f.read_bytes())

    def run_eval(self, at_step: int) -> None:
        if self.eval_set.num_examples:
            eval_fn = functools.partial(self.eval_fn, self.state.rest)
            self.last_eval = rename_metrics(evaluate(eval_fn, self.state.params, self.eval_set, self.make_batches,
                                                     self.batch_sh, self.ref_params))
            self.writer.write(at_step, self.last_eval, split="eval")
            log.info("eval at step %d: %s", at_step, {k: round(v, 4) for k, v in self.last_eval.items()})

    # ------------------------------------------------------------------------------------------------------
    def loop(self) -> None:
        """Train to total_steps: a metrics line per step, evals and saves as configured; SIGTERM (TPU preemption)
        or Ctrl-C finishes the step, saves it and raises Preempted."""
        import jax
        from tqdm.auto import tqdm

        config = self.config
        self.history: list[dict] = []
        self.last_eval: dict = {}
        signals = _StopSignals()
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {self.kind}", unit="step",
                   disable=not self.is_main)
        try:
            if self.restored is None and config.train.eval_every > 0:
                self.run_eval(0)
            while self.step < self.total_steps:
                m = self.train_one_step()
                step = self.step
                if step % config.train.log_every == 0 or step == self.total_steps:
                    self.writer.write(step, m)
                bar.set_postfix(loss=f"{m['loss']:.4f}", acc=f"{m.get('pair_accuracy', float('nan')):.2f}",
                                tok_s=f"{m['tokens_per_s']:.0f}")
                bar.update(1)
                if config.train.eval_every > 0 and step % config.train.eval_every == 0 and step < self.total_steps:
                    self.run_eval(step)
                if config.train.ckpt_every > 0 and step % config.train.ckpt_every == 0 and step < self.total_steps:
                    self.save(step)
                    self.sync_logs()
                if signals.requested(step):
                    self.save(step, wait=True)
                    raise Preempted(step, signals.signum)
            bar.close()
            self.run_eval(self.step)
            if self.restored is None or self.restored[0] < self.total_steps:
                self.save(self.step, wait=True)
        except Preempted as e:
            log.warning("%s (checkpoints in %s)", e, self.workdir / CHECKPOINT_DIR)
            raise
        finally:
            bar.close()  # before any error message, so the message is the last line
            signals.restore()
            self.ckpt.close()  # waits for saves in flight, on every way out (NaN, preemption, errors)
            self.writer.close()
            self.sync_logs()

    def train_one_step(self) -> dict:
        """One optimiser step on the next batch; its metrics (throughput and MFU added)."""
        import jax
        host_batch = next(self.batches)
        batch = to_global(host_batch, self.batch_sh)
        self.rng, _ = jax.random.split(self.rng)
        t0 = time.perf_counter()
        args = (self.state, batch) + ((self.ref_params,) if self.ref_params is not None else ())
        self.state, m = self.train_step(*args)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        seconds = time.perf_counter() - t0
        self.step += 1
        if not math.isfinite(m["loss"]):
            raise NanLossError(nan_message(self.ckpt, self.step, m, self.workdir))
        T = host_batch["input_ids"].shape[-1]
        tokens = m.pop("num_tokens")
        flops_factor = 4.0 / 3.0 if self.ref_params is not None else 1.0  # in_step: one more forward
        m["tokens_per_s"] = tokens / seconds
        m["mfu"] = flops_factor * self.llama_config.flops_per_token(T) * tokens / seconds / self.peak_flops
        m["step_seconds"] = seconds
        m["seq_len"] = T
        m = rename_metrics(m)
        self.history.append(m)
        return m

    # ------------------------------------------------------------------------------------------------------
    def finish(self) -> dict:
        """summary.json and curves.png; the summary."""
        from sweet_jax import metrics as metrics_lib

        summary = {"steps": self.step, "total_steps": self.total_steps, "train_examples": self.train_set.num_examples,
                   "eval_examples": self.eval_set.num_examples, "eval": self.last_eval, "peak_flops": self.peak_flops,
                   "peak": self.peak_desc}
        timed = self.history[1:] or self.history   # the first step of a run includes compilation
        if timed:
            summary["tokens_per_s"] = float(np.median([h["tokens_per_s"] for h in timed]))
            summary["mfu"] = float(np.median([h["mfu"] for h in timed]))
        if self.is_main:
            metrics_lib.plot_curves(self.logdir / "metrics.jsonl", self.logdir / "curves.png",
                                    title=stage_title(self.config, self.workdir, self.step))
            summary["plot"] = str(self.workdir / "curves.png")
            (self.logdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.sync_logs()
            log.info("done: %s", json.dumps(summary))
        return summary


class _StopSignals:
    """SIGTERM (TPU preemption) and, in one process, Ctrl-C: the current step finishes and is saved. With several
    processes they must agree on the step to save at: JAX's preemption sync point (the distributed runtime
    catches SIGTERM itself). A second Ctrl-C stops at once, without the save."""

    def __init__(self):
        import jax
        self.received: list[int] = []
        self.previous = {}
        self.multi = jax.process_count() > 1
        if not self.multi:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame):
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received.append(signum)

    @property
    def signum(self) -> int:
        return self.received[0] if self.received else signal.SIGTERM

    def requested(self, at_step: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils
            return multihost_utils.reached_preemption_sync_point(at_step)
        return bool(self.received)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
