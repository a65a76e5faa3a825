"""Training the SWEET-RL critic or policy (and the baselines) as a library: `run(config, workdir)` is what
`python -m sweet_jax.train` and the pipeline's training stages call.

One linear story: config -> distributed init -> mesh -> tokenizer -> data (pairs, held-out split by
task) -> model -> reference log-probs -> train loop (metrics, eval, checkpoints) -> final eval -> plot.
Pointing the workdir at an existing run resumes it from its latest readable checkpoint.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import pathlib
import signal
import tempfile
import time

import jax
import ml_collections
import numpy as np
from etils import epath
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from sweet_jax import cli, costs, host_malloc, sharding
from sweet_jax.config_utils import (TRAIN_PATH_FIELDS, TrainConfigError, absolute_path, absolute_paths,
                                    check_config, setting)
from sweet_jax.data.datasets import build_datasets
from sweet_jax.data.tokenizers import check_vocab, load_tokenizer, pad_id
from sweet_jax.errors import SweetJaxError
from sweet_jax.train import checkpoint, metrics as metrics_lib, model_loading, passes, rundir, steps
from sweet_jax.train.optimizer import make_schedule, optimizer_from_config
from sweet_jax.train.rundir import CHECKPOINT_DIR

log = logging.getLogger("sweet_jax.train")


class NanLossError(SweetJaxError):
    """The loss became NaN/inf; the last good checkpoint is kept."""


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


def schedule_change(optim, saved_total: int | None, total: int, step: int) -> str | None:
    """What resuming at `step` does to the learning rate when the run's length changed from saved_total (the
    checkpoint's) to total: the warm-up + cosine schedule is laid over the new length, so the lr jumps (a
    finished run extended restarts the decay). None when the length is the same."""
    if not saved_total or saved_total == total:
        return None
    was = float(make_schedule(optim.lr, saved_total, warmup_ratio=optim.warmup_ratio,
                                    final_ratio=optim.final_ratio)(step))
    now = float(make_schedule(optim.lr, total, warmup_ratio=optim.warmup_ratio,
                                    final_ratio=optim.final_ratio)(step))
    return (f"the run was made for {saved_total} steps and now has {total}: its learning-rate schedule (warm-up, "
            f"then cosine to {optim.final_ratio} x lr) is laid over the new length, so at step {step} the lr jumps "
            f"from {was:.3g} to {now:.3g}{' (the decay restarts)' if now > was else ''}; to continue the old decay "
            "instead, train a new run from this one's export with the lr it had reached")


def stage_title(config, workdir, steps: int) -> str:
    """What the curves are of, in the method's words: the stage, the run directory, the steps."""
    kind = config.loss.kind
    stage = {"critic": "critic: Bradley-Terry on trajectory pairs" + ("" if config.loss.use_info else
                                                                      ", without training-time information"),
             "dpo": "policy: step-level DPO on critic-ranked pairs", "mtdpo": "policy: multi-turn DPO (baseline)",
             "rft": "policy: rejection fine-tuning (baseline)"}.get(kind, kind)
    where = "/".join(pathlib.PurePath(str(workdir)).parts[-2:])
    return f"{stage} ({where}, {steps} steps)"


# ==========================================================================================================
# The run
# ==========================================================================================================

def run(config: ml_collections.ConfigDict, workdir, *, accept_config_change: bool = False) -> dict:
    """Train as configured in `workdir` (resuming it if it holds a run). Returns a summary dict.

    A finished run made with the same config returns its summary at once. A run whose saved config differs
    is refused (naming the fields) unless accept_config_change, which records the change in the workdir.
    Relative paths (the workdir, the config's) are taken from the working directory, and recorded absolute."""
    config = absolute_paths(config, TRAIN_PATH_FIELDS)
    workdir = absolute_path(os.fspath(workdir))
    check_config(config)
    rundir.check_workdir(workdir)
    finished = rundir.finished_summary(config, workdir)
    if finished is not None:
        log.info("%s already holds this run, finished at step %s: nothing to do (its summary.json and curves.png "
                 "are there; pick another --workdir to train again)", workdir, finished.get("steps"))
        return finished
    model_loading.initialize_distributed()
    with contextlib.ExitStack() as mesh_scope:
        if jax.process_index() == 0:  # one trainer per workdir; the processes of one run share it
            mesh_scope.enter_context(rundir.workdir_lock(workdir))
        trainer = Trainer(config, workdir, model_loading.make_mesh(training_mesh_shape(config)))
        trainer.setup(mesh_scope, accept_config_change=accept_config_change)
        trainer.resume()
        trainer.loop()
        return trainer.finish()


def training_mesh_shape(config) -> tuple:
    """config.mesh.shape, or a valid mesh for the batch when its batch shards do not split it (logged)."""
    shape = tuple(config.mesh.shape)
    try:
        chosen, why = sharding.choose_mesh_shape(shape, jax.device_count(), config.train.batch_size,
                                                 config.train.micro_batch_size)
    except sharding.MeshError:
        return shape  # model_loading.make_mesh names what the devices cannot fill
    if why:
        log.info("mesh: %s", why)
    return chosen


class Trainer:
    """One training run: setup (record the run, data, model, steps, reference log-probs, batches), resume (the
    latest readable checkpoint), loop (steps, evals, saves, SIGTERM / Ctrl-C), finish (summary, curves)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir, mesh):
        self.config, self.mesh = config, mesh
        self.workdir = epath.Path(workdir)
        self.is_main = jax.process_index() == 0
        self.kind = config.loss.kind

    # ------------------------------------------------------------------------------------------------------
    def setup(self, mesh_scope: contextlib.ExitStack, *, accept_config_change: bool = False) -> None:
        """The run recorded in the workdir; this host's data; the model, train state and steps; the reference
        log-probs attached to the data; then the training batches."""
        self.record_run(accept_config_change)
        tokenizer = load_tokenizer(model_loading.tokenizer_path(self.config))
        train_set, eval_set = self.load_data(tokenizer)
        self.build_steps(tokenizer, mesh_scope)
        self.train_set, self.eval_set = self.attach_reference(train_set, eval_set)
        self.batches = self.make_batches(self.train_set)

    def record_run(self, accept_config_change: bool) -> None:
        """Refuse batch sizes the mesh cannot split; write (or check) the workdir's config and this invocation."""
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

    def load_data(self, tokenizer):
        """(train, eval) data.datasets.Dataset: this host renders only its slice; the batches are the same for any
        host count. Sets make_batches (a Dataset -> its BatchIterator on this host) and total_steps."""
        config = self.config
        self.batch_sh = steps.batch_sharding(self.mesh)
        data_index, data_count = passes.data_shard(self.batch_sh, config.train.batch_size)
        train_set, eval_set = build_datasets(config, tokenizer, process_index=data_index, process_count=data_count)
        for dataset in (train_set, eval_set):
            dataset.gather_lengths()
        if not train_set.num_examples:
            raise TrainConfigError(f"no training example fits data.max_len={config.data.max_len} "
                                   f"(data.length_policy={config.data.length_policy!r}): raise --config.data.max_len")
        log.info("data: %d train examples (%d tasks), %d eval examples (%d held-out tasks); this host renders "
                 "slice %d of %d", train_set.num_examples, train_set.tasks, eval_set.num_examples, eval_set.tasks,
                 data_index, data_count)
        self.pad_id = pad_id(tokenizer)
        self.make_batches = lambda dataset, **kwargs: dataset.batches(  # noqa: E731
            config, pad_id=self.pad_id, process_index=data_index, process_count=data_count, **kwargs)
        self.total_steps = (config.train.num_steps if config.train.num_steps > 0
                            else config.train.epochs * self.make_batches(train_set).steps_per_epoch)
        if config.train.get("stop_at", 0) > self.total_steps:
            raise TrainConfigError(f"train.stop_at={config.train.stop_at} is past the run's last step "
                                   f"({self.total_steps}): stop at or before it, or raise train.num_steps")
        return train_set, eval_set

    def build_steps(self, tokenizer, mesh_scope: contextlib.ExitStack) -> None:
        """The model, optimiser and train state on the mesh; the train and eval steps of the config's LossSpec."""
        config, mesh = self.config, self.mesh
        self.llama_config = model_loading.model_config(config, vocab_size=len(tokenizer), tokenizer=tokenizer)
        check_vocab(self.llama_config.vocab_size, tokenizer, model=f"config.model.path={config.model.path!r}",
                    where=f"the tokenizer {model_loading.tokenizer_path(config)}")
        model = model_loading.build_model(config, self.llama_config, mesh)
        optimizer, lr_schedule = optimizer_from_config(config.optim, self.total_steps)
        self.state = steps.create_train_state(model, optimizer, mesh, trainable=model_loading.lora_trainable(config),
                                              offload_opt_state=config.optim.get("offload_state", False))
        del model
        if config.lora.rank:
            trained = sum(x.size for x in jax.tree.leaves(self.state.params))
            frozen = sum(x.size for x in jax.tree.leaves(self.state.rest))
            log.info("LoRA rank %d on %s: %d adapter parameters trained (%.2f%% of the %d frozen base parameters)",
                     config.lora.rank, config.lora.targets, trained, 100 * trained / max(frozen, 1), frozen)
        # The steps trace under the mesh: the model's sequence-parallel constraints (model.sequence_parallel) name
        # its axes. Not earlier: under a mesh, NNX would read the parameters' logical names as mesh axes at init.
        mesh_scope.enter_context(jax.set_mesh(mesh))
        self.spec = steps.loss_spec(config.loss)
        self.length_multiple = config.data.get("micro_bucket", 0) or config.data.bucket   # the host loop's lengths
        ref_in_step = config.train.ref_logp == "in_step"
        self.train_step = steps.make_step(self.spec, self.state, optimizer, mesh, lr_schedule=lr_schedule,
                                          micro_batch_size=config.train.micro_batch_size, ref_in_step=ref_in_step,
                                          length_multiple=self.length_multiple,
                                          score_positions=config.loss.score_positions,
                                          share_prefix=setting(config, "data.share_prefix"))
        self.eval_step = steps.make_eval_step(self.spec, self.state, mesh, ref_in_step=ref_in_step)

    def attach_reference(self, train_set, eval_set):
        """The splits with the initial (= reference) parameters' log-probs attached (train.ref_logp=precompute),
        before any of their batches is built; or, for in_step, a frozen copy of the parameters (ref_params)."""
        self.ref_params = None
        if not self.spec.needs_ref:
            return train_set, eval_set
        if self.config.train.ref_logp == "in_step":
            self.ref_params = jax.tree.map(lambda x: x.copy(), self.state.params)  # the state is donated
            return train_set, eval_set
        ref_fn = steps.make_ref_logp_fn(self.state.graphdef, steps.shardings_of(self.state.params), self.mesh,
                                        rest=self.state.rest)
        # The training split's examples that this run's steps reach (train.stop_at, or fewer steps than an epoch)
        end = self.config.train.get("stop_at", 0) or self.total_steps
        trained = passes.trained_examples(self.make_batches(train_set), end) if jax.process_count() == 1 else None
        # One CPU device: each reference batch cut to its own longest sequence, as the host loop's micro-batches;
        # with data.share_prefix, every distinct sequence once behind the prefix it shares (a turn prompt's
        # candidates, a task's trajectories), as the host loop's steps run a pair's prefix once.
        host_loop = steps.uses_host_loop(self.mesh)
        cut = self.length_multiple if host_loop else None
        packed = (steps.make_packed_logp_fn(self.state.graphdef, rest=self.state.rest)
                  if host_loop and setting(self.config, "data.share_prefix") else None)
        return tuple(
            dataset.with_extras(ref_logp=passes.reference_pass(ref_fn, self.state.params, dataset, self.make_batches,
                                                               self.batch_sh, self.config.data.padding_side,
                                                               only=only, length_multiple=cut, packed=packed,
                                                               pad_id=self.pad_id))
            if dataset.num_examples else dataset for dataset, only in ((train_set, trained), (eval_set, None)))

    # ------------------------------------------------------------------------------------------------------
    def resume(self) -> None:
        """The latest readable checkpoint's parameters, optimiser state, data position and RNG, if any; then the
        metrics log from that step on (local, mirrored into a remote workdir at saves and at the end)."""
        workdir = self.workdir
        self.ckpt = checkpoint.Checkpointer(workdir / CHECKPOINT_DIR, keep=self.config.train.keep_ckpts)
        self.rng = jax.random.key(self.config.train.seed)
        self.step = 0
        self.restored = self.ckpt.restore({"params": checkpoint.abstract_like(self.state.params),
                                           "opt_state": checkpoint.abstract_like(self.state.opt_state)})
        if self.restored is not None:
            self.step, items, meta = self.restored
            end = self.config.train.get("stop_at", 0) or self.total_steps
            if self.step > end:   # it would stop at once and write a summary of `end` steps holding more
                self.ckpt.close()
                field = (f"train.stop_at={self.config.train.stop_at}" if self.config.train.get("stop_at", 0)
                         else f"train.num_steps={self.config.train.num_steps}" if self.config.train.num_steps > 0
                         else f"train.epochs={self.config.train.epochs} ({self.total_steps} steps)")
                raise TrainConfigError(
                    f"{workdir / CHECKPOINT_DIR} has reached step {self.step}, past this run's last step {end} "
                    f"({field}): set it to {self.step} or more to go on, or train in another --workdir")
            self.state = self.state.replace(params=items["params"], opt_state=items["opt_state"],
                                            step=jax.device_put(np.int32(self.step), self.state.step.sharding))
            self.batches.restore(meta["data"])
            self.rng = jax.random.wrap_key_data(np.asarray(meta["rng"], np.uint32))
            log.info("resumed from step %d of %s", self.step, workdir / CHECKPOINT_DIR)
            changed = schedule_change(self.config.optim, meta.get("total_steps"), self.total_steps, self.step)
            if changed:
                log.warning("%s", changed)

        self.remote = "://" in str(workdir)
        self.logdir = (pathlib.Path(tempfile.gettempdir()) / "sweet_jax_logs" / workdir.name if self.remote
                       else pathlib.Path(str(workdir)))
        if self.remote and self.is_main:
            self.logdir.mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", metrics_lib.PEAK_FILE):
                if (workdir / name).exists():
                    (self.logdir / name).write_text((workdir / name).read_text())
        tracking = self.config.get("metrics") or {}
        self.writer = metrics_lib.MetricsWriter(
            self.logdir, resume_step=self.step, writers=tracking.get("writers", "tensorboard"),
            group=tracking.get("group", ""), name=tracking.get("name", ""),
            wandb_project=tracking.get("wandb_project", "sweet_jax"), wandb_mode=tracking.get("wandb_mode", "offline"),
            config=json.loads(rundir.config_json(self.config)))
        self.peak_flops, self.peak_desc = metrics_lib.run_peak_flops(self.logdir if self.is_main else None,
                                                                     jax.devices())
        log.info("MFU peak: %s", self.peak_desc)
        self.all_finite = jax.jit(lambda tree: jax.numpy.all(jax.numpy.stack(
            [jax.numpy.all(jax.numpy.isfinite(x)) for x in jax.tree.leaves(tree)])))

    def save(self, at_step: int, *, wait: bool = False) -> None:
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
            eval_step = functools.partial(self.eval_step, self.state.rest)  # the current rest: the step donates
            self.last_eval = passes.rename_metrics(passes.evaluate(eval_step, self.state.params, self.eval_set,
                                                                   self.make_batches, self.batch_sh, self.ref_params))
            self.writer.write(at_step, self.last_eval, split="eval")
            log.info("eval at step %d: %s", at_step, {k: round(v, 4) for k, v in self.last_eval.items()})

    # ------------------------------------------------------------------------------------------------------
    def loop(self) -> None:
        """Train to total_steps (or train.stop_at, on the same schedule): a metrics line per step, evals and saves as
        configured; SIGTERM (TPU preemption) or Ctrl-C finishes the step, saves it and raises Preempted."""
        config = self.config
        end = config.train.get("stop_at", 0) or self.total_steps
        self.history: list[dict] = []
        self.last_eval: dict = {}
        signals = _StopSignals()
        bar = tqdm(total=end, initial=self.step, desc=f"train {self.kind}", unit="step",
                   disable=not self.is_main)
        try:
            if self.restored is None and config.train.eval_every > 0:
                self.run_eval(0)
            while self.step < end:
                m = self.train_one_step()
                step = self.step
                if step % config.train.log_every == 0 or step == end:
                    self.writer.write(step, m)
                bar.set_postfix(loss=f"{m['loss']:.4f}", acc=f"{m.get('pair_accuracy', float('nan')):.2f}",
                                tok_s=f"{m['tokens_per_s']:.0f}")
                bar.update(1)
                if config.train.eval_every > 0 and step % config.train.eval_every == 0 and step < end:
                    self.run_eval(step)
                if config.train.ckpt_every > 0 and step % config.train.ckpt_every == 0 and step < end:
                    self.save(step)
                    self.sync_logs()
                if signals.requested(step):
                    self.save(step, wait=True)
                    raise Preempted(step, signals.signum)
            bar.close()
            self.run_eval(self.step)
            if self.restored is None or self.restored[0] < end:
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
        host_batch = next(self.batches)
        batch = passes.to_global(host_batch, self.batch_sh)
        self.rng, _ = jax.random.split(self.rng)
        t0 = time.perf_counter()
        args = (self.state, batch) + ((self.ref_params,) if self.ref_params is not None else ())
        self.state, m = self.train_step(*args)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        seconds = time.perf_counter() - t0
        costs.add("train_step_s", seconds)
        costs.add("train_step_calls")
        # padded: what the step ran (a host loop's micro-batches each at their own length), real: the mask's ones
        shapes = getattr(self.train_step, "last_micro_shapes", None) or [host_batch["input_ids"].shape]
        costs.tokens("train", host_batch["attention_mask"].sum(), sum(int(np.prod(s)) for s in shapes))
        self.step += 1
        if not math.isfinite(m["loss"]):
            raise NanLossError(nan_message(self.ckpt, self.step, m, self.workdir))
        T = host_batch["input_ids"].shape[-1]
        tokens = m.pop("num_tokens")
        flops_factor = 4.0 / 3.0 if self.ref_params is not None else 1.0  # in_step: one more forward
        m["tokens_per_s"] = tokens / seconds
        # MFU counts the tokens the forwards ran: a pair's shared prefix once (steps.HostLoopStep)
        run_tokens = getattr(self.train_step, "last_run_tokens", 0) or tokens
        m["mfu"] = flops_factor * self.llama_config.flops_per_token(T) * run_tokens / seconds / self.peak_flops
        m["step_seconds"] = seconds
        m["seq_len"] = T
        m = passes.rename_metrics(m)
        self.history.append(m)
        return m

    # ------------------------------------------------------------------------------------------------------
    def finish(self) -> dict:
        """summary.json and curves.png; the summary."""
        summary = {"steps": self.step, "total_steps": self.total_steps, "train_examples": self.train_set.num_examples,
                   "eval_examples": self.eval_set.num_examples, "eval": self.last_eval, "peak_flops": self.peak_flops,
                   "peak": self.peak_desc}
        timed = self.history[1:] or self.history   # the first step of a run includes compilation
        if timed:
            summary["tokens_per_s"] = float(np.median([h["tokens_per_s"] for h in timed]))
            summary["mfu"] = float(np.median([h["mfu"] for h in timed]))
        if self.is_main:
            metrics_lib.plot_curves(self.logdir / "metrics.jsonl", self.logdir / "curves.png",
                                    title=stage_title(self.config, self.workdir, self.step),
                                    loss_label=("loss (NLL, nats per action token)" if self.kind in ("rft", "sft")
                                                else "loss (nats per pair)"))
            summary["plot"] = str(self.workdir / "curves.png")
            rundir.write_atomic(self.logdir / "summary.json", json.dumps(summary, indent=2) + "\n")
            self.sync_logs()
            log.info("done: %s", json.dumps(summary))
        return summary


class _StopSignals:
    """SIGTERM (TPU preemption) and, in one process, Ctrl-C: the current step finishes and is saved. With several
    processes they must agree on the step to save at: JAX's preemption sync point (the distributed runtime
    catches SIGTERM itself). A second Ctrl-C stops at once, without the save."""

    def __init__(self):
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
            return multihost_utils.reached_preemption_sync_point(at_step)
        return bool(self.received)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
