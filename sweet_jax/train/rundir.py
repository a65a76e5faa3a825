"""What a run directory is, and how a model, its tokenizer and a sampler are loaded from a path.

A training run directory (`--workdir`) holds
  config.json / config.txt   the resolved config (JSON read back by export, serve, rank; a readable copy)
  config_changes.jsonl       every accepted change of the config on a rerun (--accept_config_change), timed
  invocations.jsonl          one line per start: time, argv, git SHA, package versions, devices
  checkpoints/               Orbax checkpoints (params, optimiser state, data position, RNG)
  metrics.jsonl, tensorboard/, curves.png, summary.json (at the end)
  .lock                      held (flock) by the one trainer running in it; its pid and start time inside

Every record (config.json, config.txt, summary.json, ...) is written atomically (write_atomic): a crash or a full
disk leaves the old file or the new one, never half of one. A directory that holds something else (a model's
files, a config.json that is not a run's) is refused as a workdir (check_workdir).

A model path is one of: a Hugging Face checkpoint directory (config.json + *.safetensors), a training run
directory (its latest readable checkpoint), or '' for the demo tiny random model (its vocabulary from the
tokenizer). `load_model` and `load_sampler` are the one way every command loads them.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import math
import os
import pathlib
import subprocess
import sys
from typing import Any

import jax
import ml_collections
from etils import epath
from flax import nnx

from sweet_jax.errors import SweetJaxError
from sweet_jax import config_utils, jsonl, sharding
from sweet_jax.jsonl import write_atomic
from sweet_jax.config_utils import model_overrides
from sweet_jax.data import demo
from sweet_jax.data.tokenizers import check_vocab, end_of_turn_ids, load_tokenizer
from sweet_jax.models import Llama, LlamaConfig, load_hf, lora, save_hf
from sweet_jax.models.hf import read_hf_config
from sweet_jax.models.lora import LoRAConfig, add_adapters
from sweet_jax.sampling import generate
from sweet_jax.train import checkpoint

CONFIG_FILE = "config.json"
CONFIG_TEXT = "config.txt"
CONFIG_CHANGES = "config_changes.jsonl"
INVOCATIONS = "invocations.jsonl"
CHECKPOINT_DIR = "checkpoints"
SUMMARY_FILE = "summary.json"
TRACKING_FIELDS = ("metrics",)   # where the metrics go, not what the run is: a rerun may change them
PACKAGES = ("jax", "jaxlib", "libtpu", "flax", "optax", "orbax-checkpoint", "transformers", "tokenizers", "numpy",
            "ml_collections", "sweet-jax")


class RunDirError(SweetJaxError):
    """A path that is not what the command needs (no run there, a changed config, ...)."""


def _path(workdir):
    return epath.Path(os.fspath(workdir))


# A model's files: a directory holding one is a model, not a training run (--workdir must not overwrite it).
MODEL_FILE_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.gguf", "pytorch_model*.bin", "tokenizer.json",
                       "tokenizer.model", "tokenizer_config.json", "generation_config.json")


def check_workdir(workdir) -> None:
    """A RunDirError unless `workdir` is absent, holds no run's files yet, or holds a training run: a model
    directory (weights, tokenizer files) or one whose config.json is not a training config is refused."""
    workdir = _path(workdir)
    if not workdir.exists():
        return
    if not workdir.is_dir():
        raise RunDirError(f"--workdir {workdir} is a file, not a directory; pick a directory for the run")
    found = next((f.name for pattern in MODEL_FILE_PATTERNS for f in workdir.glob(pattern)), None)
    if found is not None:
        raise RunDirError(f"--workdir {workdir} holds a model ({found}), not a training run; a run would overwrite "
                          "its config.json: pick an empty or new directory (a model to start from goes in "
                          "--config.model.path)")
    config = workdir / CONFIG_FILE
    if config.exists():
        try:
            saved = json.loads(config.read_text())
        except (ValueError, UnicodeDecodeError):
            raise RunDirError(f"{config} is not JSON (damaged?): it is the run's config; restore it from "
                              f"{CONFIG_TEXT} or pick another --workdir") from None
        if not (isinstance(saved, dict) and {"train", "loss", "model"} <= set(saved)):
            raise RunDirError(f"--workdir {workdir} holds a config.json that is not a training run's (no train, "
                              "loss and model sections); pick an empty or new directory")


@contextlib.contextmanager
def workdir_lock(workdir):
    """Hold `workdir`/.lock for the block: one trainer per workdir at a time. A second one is refused with the
    first one's pid and start time. The lock is the kernel's (flock), so a killed trainer never leaves it held.
    Remote workdirs (gs://...) are not locked."""
    workdir = _path(workdir)
    if "://" in str(workdir):
        yield
        return
    import fcntl

    workdir.mkdir(parents=True, exist_ok=True)
    path = os.path.join(os.fspath(workdir), ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise RunDirError(f"{workdir} is in use by another trainer ({holder}); wait for it to finish, stop it, "
                              "or pick another --workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}, started {_now()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


# ==========================================================================================================
# The config of a run
# ==========================================================================================================

def config_json(config) -> str:
    return config.to_json_best_effort(indent=2, sort_keys=True) + "\n"


def read_config(workdir):
    """The resolved config of the training run in `workdir`."""
    path = _path(workdir) / CONFIG_FILE
    if not path.exists():
        raise RunDirError(f"{path} does not exist: --workdir must be the directory of a training run")
    try:
        return ml_collections.ConfigDict(json.loads(path.read_text()))
    except (ValueError, UnicodeDecodeError):
        raise RunDirError(f"{path} is not JSON (damaged?): restore it from {CONFIG_TEXT} beside it") from None


def config_changes(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(field, old value, new value) of every field that differs between two JSON configs, sorted."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += config_changes(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [(prefix.rstrip("."), old, new)] if old != new else []


def _new_field_at_its_default(field: str, old: Any, new: Any) -> bool:
    """A field that a run's saved config predates (e.g. lora.rank), at its default: not a change of the run."""
    if old is not None:
        return False
    default: Any = json.loads(config_json(config_utils.base_config()))
    for key in field.split("."):
        if not isinstance(default, dict) or key not in default:
            return False
        default = default[key]
    return default == new


def record_output_config(config, output, *, produced: bool, accept_change: bool, ignore: tuple[str, ...],
                         what: str) -> list[tuple[str, Any, Any]]:
    """record_config for a command that appends results to one JSONL file (rank's pairs, rollout's episodes):
    the record is OUTPUT.config.json; an accepted change is also said in the log, since the `what` already in
    OUTPUT keep the old values."""
    out = _path(output)
    changes = record_config(config, out.with_name(out.name + ".config.json"), produced=produced,
                            accept_change=accept_change, ignore=ignore, where=str(out))
    if changes and produced:
        logging.getLogger("sweet_jax.train.rundir").warning(
            "config changed on this rerun; the %s already in %s came from the old values, only the ones not made "
            "yet use the new ones: %s", what, out, "; ".join(f"{field}: {old!r} -> {new!r}"
                                                             for field, old, new in changes))
    return changes


def record_config(config, record, *, produced: bool, accept_change: bool = False, write: bool = True,
                  ignore: tuple[str, ...] = (), text_record=None, where: str = "") -> list[tuple[str, Any, Any]]:
    """The one rule of every command that writes results (train, rank, rollout, pipeline): `record` (a JSON file)
    says which config produced the data beside it.

    - No record yet: it is written.
    - The same config (fields in `ignore`, which do not change the data, aside): nothing to do, a plain resume.
    - Another config while the old one's results exist (`produced`): refused, naming the fields, unless
      accept_change; then the change is appended, timed, to RECORD's `_changes.jsonl` sibling and the new config
      becomes the record. A refused run writes nothing.
    - Another config but nothing produced yet (a start that failed before its first result, e.g. a wrong path):
      the fixed rerun is accepted; the replacement is appended to the changes file all the same.
    Returns the changes. write=False: check only (the processes of a multi-host run other than the first)."""
    record = _path(record)
    text = config_json(config)
    changes = []
    if record.exists():
        changes = [change for change in config_changes(json.loads(record.read_text()), json.loads(text))
                   if not _new_field_at_its_default(*change)
                   and not any(change[0] == f or change[0].startswith(f + ".") for f in ignore)]
        if changes and produced and not accept_change:
            shown = "; ".join(f"{field}: {old!r} -> {new!r}" for field, old, new in changes[:8])
            more = f" (and {len(changes) - 8} more)" if len(changes) > 8 else ""
            raise RunDirError(f"{where or record.parent} holds results of another config ({shown}{more}): rerun "
                              "with the same flags to resume, write elsewhere, or pass --accept_config_change to "
                              f"go on with the new values (recorded in {changes_path(record).name})")
        if changes and write:
            append_record(changes_path(record), {"time": _now(), "changes": [
                {"field": field, "old": old, "new": new} for field, old, new in changes],
                "why": "accepted (--accept_config_change)" if produced else
                "the earlier start produced nothing: its config is replaced"})
    if write and (changes or not record.exists()):
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, text)
        if text_record is not None:
            write_atomic(text_record, str(config))
    return changes


def changes_path(record):
    """Where the accepted changes of a config record go: config.json -> config_changes.jsonl,
    pairs.jsonl.config.json -> pairs.jsonl.config_changes.jsonl."""
    record = _path(record)
    stem = record.name[:-len(".json")] if record.name.endswith(".json") else record.name
    before, found, after = stem.rpartition("config")
    return record.with_name(f"{before}config_changes{after}.jsonl" if found else f"{stem}.config_changes.jsonl")


def has_checkpoints(workdir) -> bool:
    """Whether the training run in `workdir` has saved a step: its config has produced something to resume."""
    directory = _path(workdir) / CHECKPOINT_DIR
    return directory.exists() and any(p.name.isdigit() for p in directory.iterdir())


def write_config(config, workdir, *, accept_change: bool = False, write: bool = True) -> list[tuple[str, Any, Any]]:
    """The training run's config record (record_config): config.json (+ a readable config.txt) in the workdir.
    A changed config is refused once the run has saved a checkpoint; before that (a start that failed before
    step 0) the fixed rerun replaces it."""
    workdir = _path(workdir)
    return record_config(config, workdir / CONFIG_FILE, produced=has_checkpoints(workdir),
                         accept_change=accept_change, write=write, text_record=workdir / CONFIG_TEXT,
                         where=str(workdir), ignore=TRACKING_FIELDS)


def finished_summary(config, workdir) -> dict | None:
    """The summary of a finished run in `workdir` made with this very config, else None."""
    workdir = _path(workdir)
    summary, saved = workdir / SUMMARY_FILE, workdir / CONFIG_FILE
    if not (summary.exists() and saved.exists()):
        return None
    if [change for change in config_changes(json.loads(saved.read_text()), json.loads(config_json(config)))
            if not _new_field_at_its_default(*change) and change[0].split(".")[0] not in TRACKING_FIELDS]:
        return None
    return json.loads(summary.read_text())


# ==========================================================================================================
# Where a run came from
# ==========================================================================================================

def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def git_revision(directory: pathlib.Path | None = None) -> str | None:
    """The checkout's commit (with '+dirty' when files differ from it), None outside a git checkout."""
    directory = directory or pathlib.Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "-C", str(directory), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "") if sha else None


def package_versions() -> dict[str, str | None]:
    from importlib import metadata
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance() -> dict:
    """Time, argv, git SHA, package versions and devices of this process."""
    devices = jax.devices()
    return {"time": _now(), "argv": list(getattr(sys, "orig_argv", sys.argv)), "git": git_revision(),
            "python": sys.version.split()[0], "packages": package_versions(),
            "devices": {"platform": devices[0].platform, "kind": devices[0].device_kind,
                        "count": jax.device_count(), "processes": jax.process_count()},
            "host": os.uname().nodename}


def record_invocation(workdir, **extra) -> None:
    """Append this start of the run (provenance + extra) to workdir/invocations.jsonl."""
    append_record(_path(workdir) / INVOCATIONS, {**provenance(), **extra})


def append_record(path, record: dict) -> None:
    """One JSON line appended to a run's log (jsonl.append locally: whole records only; remote: rewritten)."""
    if "://" in str(path):
        old = path.read_text() if path.exists() else ""
        path.write_text(old + ("" if not old or old.endswith("\n") else "\n") + json.dumps(record) + "\n")
    else:
        jsonl.append(path, [record])


# ==========================================================================================================
# Tokenizer, distributed init, mesh
# ==========================================================================================================

def demo_paths():
    return demo.paths()


def tokenizer_dir(*choices) -> str:
    """The tokenizer directory: the first non-empty of `choices` (tokenizer or model directories, in order of
    preference), else the bundled demo tokenizer (the demo tiny model's)."""
    for choice in choices:
        if choice:
            return str(choice)
    return str(demo_paths().tokenizer)


def tokenizer_path(config) -> str:
    """A training config's tokenizer: data.tokenizer, else model.path, else the bundled demo tokenizer."""
    return tokenizer_dir(config.data.tokenizer, config.model.path)


def initialize_distributed() -> bool:
    """sharding.initialize_distributed: jax.distributed when this is one process of several."""
    return sharding.initialize_distributed()


def make_mesh(shape, *, field: str = "config.mesh.shape"):
    """The ('data', 'fsdp', 'tensor') mesh of `shape` (-1 = the rest of the devices); None for an empty shape
    (one device, no sharding). A shape the devices cannot fill is a one-line error naming `field`."""
    if not shape:
        return None

    shape = tuple(int(s) for s in shape)
    n = jax.device_count()
    fixed = math.prod(s for s in shape if s != -1)
    if len(shape) != 3 or fixed > n or (-1 in shape and n % fixed):
        raise RunDirError(
            f"{field}={shape} needs {fixed} devices{'' if -1 not in shape else ' (times the -1 axis)'}, "
            f"but this run has {n}; set {field} so the sizes multiply to {n} (e.g. '(1,-1,1)')")
    return sharding.make_mesh(shape)


# ==========================================================================================================
# Models and samplers
# ==========================================================================================================

def model_config(config, vocab_size: int, tokenizer=None):
    """The LlamaConfig of a training config: from model.path's config.json, or the named preset (demo: tiny,
    whose vocabulary and bos/eos come from the tokenizer so an exported demo model generates and stops)."""
    overrides = model_overrides(config)
    if config.model.path:
        return LlamaConfig.from_hf(read_hf_config(config.model.path), **overrides)
    if config.model.preset == "tiny":
        overrides["vocab_size"] = vocab_size
        if tokenizer is not None:
            overrides.update(demo_token_ids(tokenizer))
    return LlamaConfig.preset(config.model.preset, **overrides)


def demo_token_ids(tokenizer) -> dict:
    """bos/eos of the tiny demo model, from its tokenizer (eos: every end-of-turn token)."""
    eos = tuple(sorted(end_of_turn_ids(tokenizer)))
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos)


def is_hf_checkpoint(path) -> bool:
    p = pathlib.Path(os.fspath(path))
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def is_training_run(path) -> bool:
    """A sweet_jax.train run directory (checkpoints/ + the run's config.json), not a HF checkpoint."""
    p = pathlib.Path(os.fspath(path))
    return (p / CHECKPOINT_DIR).is_dir() and (p / CONFIG_FILE).is_file() and not any(p.glob("*.safetensors"))


def build_model(config, llama_config, mesh):
    """The model to train, sharded on the mesh: HF weights from model.path, or a seeded random init; with
    config.lora.rank > 0, fresh LoRA adapters on it (models/lora.py: the base weights are then frozen)."""
    def with_adapters(model):
        return add_adapters(model, LoRAConfig.from_config(config.get("lora")), seed=int(config.train.seed))

    if config.model.path:
        overrides = {k: v for k, v in model_overrides(config).items() if k != "param_dtype"}
        return with_adapters(load_hf(config.model.path, dtype=llama_config.param_dtype, mesh=mesh,
                                     config_overrides=overrides))
    # Random init straight onto the shardings (jit with out_shardings): big presets never sit on one device.
    abstract = nnx.eval_shape(lambda: Llama(llama_config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = sharding.param_shardings(abstract_state, mesh)
    seed = int(config.train.seed)
    state = jax.jit(lambda: nnx.split(Llama(llama_config, rngs=nnx.Rngs(seed)))[1], out_shardings=shardings)()
    return with_adapters(nnx.merge(graphdef, state))


def lora_trainable(config):
    """What a run trains (steps.create_train_state's filter): nnx.LoRAParam, the adapters, when config.lora.rank
    > 0; else every nnx.Param."""
    return nnx.LoRAParam if LoRAConfig.from_config(config.get("lora")).enabled else nnx.Param


def restore_model(workdir, step: int | None = None):
    """(the trained model as an nnx Llama, its step, the run's config) from a training run directory: only
    the trained parameters, restored straight onto a mesh over the local devices. A LoRA run's checkpoints
    hold the adapters: the base is rebuilt as the run built it (model.path or the seeded demo init) and the
    model comes back with its adapters (models.lora.merge folds them in)."""
    workdir = pathlib.Path(workdir)
    config = read_config(workdir)
    tokenizer = load_tokenizer(tokenizer_path(config))
    llama_config = model_config(config, vocab_size=len(tokenizer), tokenizer=tokenizer)
    mesh = sharding.make_mesh((1, -1, 1))
    trainable = lora_trainable(config)
    if trainable is nnx.Param:
        abstract = nnx.eval_shape(lambda: Llama(llama_config, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    else:
        graphdef, params, rest = nnx.split(build_model(config, llama_config, mesh), trainable, ...)
    shardings = sharding.param_shardings(params, mesh)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
    ckpt = checkpoint.Checkpointer(workdir / CHECKPOINT_DIR, keep=0, async_save=False)
    restored = ckpt.restore({"params": target}, step=step)
    if restored is None:
        raise RunDirError(f"{workdir / CHECKPOINT_DIR} holds no checkpoint: train first "
                          f"(python -m sweet_jax.train --workdir {workdir} ...)")
    got_step, items, _ = restored
    ckpt.close()
    return nnx.merge(graphdef, items["params"], rest), got_step, config


def export_run(workdir, out, *, step: int | None = None, dtype: str | None = None,
               max_shard_size: str = "5GB", peft_out: str | None = None) -> pathlib.Path:
    """A training run's parameters (latest readable checkpoint, or `step`) as a Hugging Face checkpoint in `out`,
    with the run's tokenizer files: what transformers and vLLM load. A LoRA run is exported with its adapters
    merged in, and with peft_out also as a PEFT adapter for the base model."""
    import logging

    log = logging.getLogger("sweet_jax.export")
    model, got_step, config = restore_model(workdir, step)
    if lora.has_adapters(model):
        if peft_out:
            lora.save_peft(model, lora.LoRAConfig.from_config(config.lora), peft_out,
                           base_model=config.model.path, dtype=dtype)
            log.info("wrote the LoRA adapter of step %d in PEFT format to %s", got_step, peft_out)
        model = lora.merge(model)
    elif peft_out:
        raise RunDirError(f"--peft_out={peft_out}: the run {workdir} has no LoRA adapters (its lora.rank is 0)")
    path = save_hf(model, out, tokenizer_dir=tokenizer_path(config), dtype=dtype, max_shard_size=max_shard_size)
    log.info("exported step %d of %s to %s", got_step, workdir, path)
    return path


def load_tokenizer_for(path: str, tokenizer: str | None = None, run_config=None, *, chat_template: bool = True):
    """The tokenizer that goes with a model path: `tokenizer` when given, else the checkpoint's own files,
    the training run's tokenizer, or the demo tokenizer for ''."""
    directory = tokenizer_dir(tokenizer, tokenizer_path(run_config) if run_config is not None else path)
    return load_tokenizer(directory, require_chat_template=chat_template)


def load_model(path: str, *, dtype: str | None = None, mesh=None, tokenizer=None, seed: int = 0,
               what: str = "model"):
    """(model, the training run's config or None) for a model path (see the module docstring). `tokenizer`
    sizes the demo model's vocabulary ('' path) and is checked against the loaded one's."""
    if not path:
        if tokenizer is None:
            tokenizer = load_tokenizer_for("")
        config = LlamaConfig.preset("tiny", vocab_size=len(tokenizer), **demo_token_ids(tokenizer))
        return Llama(config, rngs=nnx.Rngs(seed)), None
    p = pathlib.Path(path)
    if not p.exists():
        raise RunDirError(f"{what} path {path}: no such directory; pass a Hugging Face checkpoint directory "
                          "(config.json + *.safetensors), a training run directory, or '' for the demo model")
    if is_hf_checkpoint(p):
        if tokenizer is not None:  # before reading the weights
            check_vocab(read_hf_config(p).get("vocab_size", 0), tokenizer, model=f"{what} {path}")
        return load_hf(str(p), dtype=dtype or None, mesh=mesh), None
    if is_training_run(p):
        model, step, run_config = restore_model(p)
        import logging
        logging.getLogger(__name__).info("%s: step %d of the training run %s", what, step, p)
        return model, run_config
    raise RunDirError(f"{what} path {path}: neither a Hugging Face checkpoint directory (config.json + "
                      "*.safetensors) nor a training run directory (config.json + checkpoints/)")


def load_sampler(path: str, tokenizer: str | None = None, *, dtype: str | None = None, mesh=None, seed: int = 0,
                 max_batch_size: int = 64, chat_template: bool = True, reuse=None):
    """A generate.Sampler for a model path, with the model's tokenizer (or `tokenizer`, a directory).

    reuse: a Sampler to load a Hugging Face checkpoint of the same architecture into: only its parameters are
    swapped, so its compiled prefill/decode programs (one per shape) serve the new model too instead of being
    compiled again (the pipeline samples from several policies of one architecture). Another architecture
    gets a new Sampler."""
    if reuse is not None and is_hf_checkpoint(path):
        try:
            reuse.set_params(load_hf(path, dtype=dtype or None), seed=seed)
            return reuse
        except generate.GenerateError:  # another architecture: a new Sampler (and new compilations)
            pass

    run_config = read_config(path) if path and is_training_run(path) else None
    tok = load_tokenizer_for(path, tokenizer, run_config, chat_template=chat_template)
    model, _ = load_model(path, dtype=dtype, mesh=mesh if run_config is None else None, tokenizer=tok, seed=seed)
    if run_config is not None and mesh is None:
        mesh = sharding.make_mesh((1, -1, 1))  # restore_model placed the parameters on this mesh
    return generate.Sampler(model, tok, mesh, max_batch_size=max_batch_size, seed=seed)
