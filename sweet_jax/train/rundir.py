"""What a training run directory is: its records (config, changes, invocations with provenance, summary), its lock.

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

Loading a run's model: sweet_jax.train.model_loading; exporting it: sweet_jax.train.export.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import pathlib
import subprocess
import sys
from importlib import metadata
from typing import Any

import jax
import ml_collections
from etils import epath

from sweet_jax import config_utils, jsonl
from sweet_jax.errors import SweetJaxError
from sweet_jax.jsonl import write_atomic

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

    workdir.mkdir(parents=True, exist_ok=True)
    path = os.path.join(os.fspath(workdir), ".lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise RunDirError(f"{workdir} is in use by another trainer ({holder}); wait for it to finish, stop it, "
                              "or pick another --workdir") from None
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        os.close(fd)  # the holder removed it between our open and flock: lock the new file
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}, started {_now()}\n".encode(), 0)
        yield
    finally:
        # Removed while still held, so that no .lock naming a finished (dead) process stays behind; a trainer
        # that opened the old file meanwhile sees it gone after its flock and locks a new one (the loop above).
        with contextlib.suppress(OSError):
            os.unlink(path)
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
    return [(prefix.rstrip("."), old, new)] if old != new and not _same_path(old, new) else []


def _same_path(old: Any, new: Any) -> bool:
    """A path recorded relative (before paths were recorded absolute) and the same path now absolute, as it
    resolves from the directory of this rerun: not a change."""
    return (isinstance(old, str) and isinstance(new, str) and bool(old) and not os.path.isabs(old)
            and "://" not in old and os.path.isabs(new) and os.path.abspath(old) == new)


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
