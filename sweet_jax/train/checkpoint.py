"""Orbax checkpoints of a training run: save asynchronously, keep the last N, resume exactly.

A checkpoint holds named array items (train.py saves `params` and `opt_state`), each saved with its
arrays' shardings and restored straight onto the shardings of an abstract target (no full host copy of
an 8B model; export restores `params` alone), and
  meta   a small JSON dict: step, the data iterator's position, the RNG key data, anything else the
         loop needs to continue bit-for-bit.

Resume takes the latest checkpoint; if it cannot be read (a preempted save truncated a file, a disk
filled up) the next older one is used, with a warning naming the bad step, and the bad directory is
moved aside so later saves can reuse its step number. It never falls back silently to step 0: a checkpoint
whose arrays have other shapes than the model now built (a config change of the parameter tree) is a
CheckpointError that says so and moves nothing, and a directory whose checkpoints were all moved aside is one too.
Only damage moves a checkpoint: a restore that fails for another reason (memory, a device, a path Orbax refuses)
while the step's files read back whole is a CheckpointError that leaves it in place (Checkpointer.damage).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import shutil
import sys
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from sweet_jax.config_utils import absolute_path
from sweet_jax.errors import SweetJaxError, disk_full

log = logging.getLogger(__name__)


# The metadata files Orbax writes as JSON in a step directory (and array_metadatas/process_*).
JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")
# What tensorstore says when the bytes it read are short, missing or do not decode.
DATA_ERRORS = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "Error reading", "Error decoding", "checksum", "corrupt")


class CheckpointError(SweetJaxError):
    """No readable checkpoint where one was expected."""


def _not_a_full_disk(record: logging.LogRecord) -> bool:
    """Orbax's save threads log each failed write with its traceback, and asyncio logs each of their write tasks
    whose error nobody awaited ("Task exception was never retrieved") when it is collected, at exit or before; a
    full disk fails them all at once. The training loop reports it as one line (errors.disk_full), so those
    records are dropped."""
    error = record.exc_info[1] if record.exc_info else None
    return disk_full(error) is None if error is not None else disk_full(Exception(record.getMessage())) is None


logging.getLogger("absl").addFilter(_not_a_full_disk)
logging.getLogger("asyncio").addFilter(_not_a_full_disk)


def _quiet_closed_loop(previous, unraisable) -> None:
    """When a save fails (a full disk), its array writes still in flight complete into the save's closed event loop
    and TensorStore reports each as an unraisable RuntimeError: dropped, the save's own error says what happened."""
    value = unraisable.exc_value
    if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
        previous(unraisable)


sys.unraisablehook = functools.partial(_quiet_closed_loop, sys.unraisablehook)


class Checkpointer:
    """Thin, explicit wrapper over ocp.CheckpointManager for one run directory."""

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        self.directory = epath.Path(absolute_path(os.fspath(directory)))  # Orbax refuses relative paths
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep and keep > 0 else None,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,   # a save killed half-way leaves a tmp dir: drop it
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    # ---------------------------------------------------------------- saving
    def save(self, step: int, items: dict[str, Any], meta: dict, *, wait: bool = False) -> None:
        """Start saving `items` (name -> array pytree) and `meta` (JSON dict) as `step`; async unless wait."""
        meta = dict(meta, step=int(step), saved_at=time.time())
        args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
        self._manager.save(int(step), args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(meta)), force=True)
        if wait:
            self.wait()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            self._manager.wait_until_finished()
        except BaseException:
            # a failed save (a full disk): stop the manager's threads anyway; the save's own error is raised
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001 — the same failure again
                pass
            raise
        self._manager.close()

    # ---------------------------------------------------------------- reading
    def all_steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore_meta(self, step: int) -> dict:
        return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def restore(self, abstract_items: dict[str, Any], step: int | None = None) -> tuple[int, dict, dict] | None:
        """Restore the named items onto `abstract_items` (name -> pytree of jax.ShapeDtypeStruct with shardings).

        Items not named are not read (export restores params without the optimiser state).

        step=None: the latest readable checkpoint (falling back past unreadable ones with a warning);
        returns None when the directory holds no checkpoint at all. An explicit step that cannot be
        read raises CheckpointError.
        """
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"no checkpoint for step {step} in {self.directory} (have {steps}); "
                                      "pass one of those steps")
            self._check_shapes(step, abstract_items)
            return (step, *self._restore_step(step, abstract_items))
        if not steps:
            moved = self.moved_aside()
            if moved:
                raise CheckpointError(
                    f"{self.directory} holds no checkpoint, but {len(moved)} unreadable one(s) were moved to "
                    f"{moved[0].parent} ({', '.join(p.name for p in moved[:5])}): this run trained before, and "
                    f"starting from step 0 would discard that; move a good one back, or delete {moved[0].parent} "
                    "to train from step 0")
            return None
        errors = []
        for candidate in reversed(steps):
            self._check_shapes(candidate, abstract_items)  # a config change is not damage: nothing is moved
            try:
                state, meta = self._restore_step(candidate, abstract_items)
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types; damage() tells which
                reason = self.damage(candidate, e)
                if reason is None:  # the files read back whole: the error is not about them, nothing is moved
                    raise CheckpointError(
                        f"could not restore checkpoint step {candidate} from {self.directory} "
                        f"({_first_line(e)}); its files read back whole, so it was left in place: the error is "
                        "not about its bytes (set SWEET_JAX_DEBUG=1 for the traceback)") from e
                errors.append(f"step {candidate}: {reason}")
                log.warning("checkpoint step %d in %s is unreadable (%s); falling back to the previous one",
                            candidate, self.directory, reason)
                self.quarantine(candidate, reason="unreadable")
                continue
            if errors:
                log.warning("resumed from step %d instead of the latest step %d", candidate, steps[-1])
            return candidate, state, meta
        raise CheckpointError(f"every checkpoint in {self.directory} is unreadable ({'; '.join(errors)}); "
                              "delete the directory to start from scratch or point --workdir elsewhere")

    def damage(self, step: int, error: BaseException) -> str | None:
        """What is wrong with the bytes of `step`, judged on what is read back, not on the restore's exception
        alone: a file of the step that cannot be read, a metadata file that is not JSON, or a restore error
        raised while reading or decoding its data (tensorstore's DATA_LOSS, OUT_OF_RANGE for a short file,
        NOT_FOUND for a missing one). None when the files read back whole and the error is about something else
        (a path Orbax refuses, memory, a device): such a checkpoint is good and is never moved aside."""
        root = self.directory / str(step)
        if not root.exists():
            return f"{root} is gone"
        for path in _files(root):
            is_json = path.name in JSON_FILES or path.parent.name == "array_metadatas"
            try:
                with path.open("rb") as f:
                    data = f.read() if is_json else f.read(1)  # the arrays' bytes: tensorstore's errors below
            except OSError as e:
                return f"{path}: cannot be read ({e.strerror or e})"
            if is_json:
                try:
                    json.loads(data)
                except ValueError:
                    return f"{path}: not JSON"
        chain, seen = error, set()
        while chain is not None and id(chain) not in seen:
            seen.add(id(chain))
            if isinstance(chain, (CheckpointError, FileNotFoundError, EOFError, json.JSONDecodeError)):
                return _first_line(chain)
            text = str(chain)
            if any(marker in text for marker in DATA_ERRORS):
                return _first_line(chain)
            chain = chain.__cause__ or chain.__context__
        return None

    def moved_aside(self) -> list[pathlib.Path]:
        """The checkpoint directories `quarantine` moved to ../corrupt_checkpoints/ (local runs)."""
        root = pathlib.Path(str(self.directory.parent)) / "corrupt_checkpoints"
        return sorted(p for p in root.iterdir() if p.is_dir()) if "://" not in str(self.directory) and \
            root.is_dir() else []

    def _check_shapes(self, step: int, abstract_items: dict[str, Any]) -> None:
        """CheckpointError when step's saved arrays (from its metadata; an unreadable one is left to the restore
        to judge as damage) are not the shapes and dtypes of `abstract_items`: the model changed, not the file."""
        try:  # each item's own metadata file (the manager's item_metadata is None for items not yet opened)
            handler = ocp.PyTreeCheckpointHandler()
            saved_leaves = {name: [(tuple(m.shape), str(m.dtype)) for m in jax.tree.leaves(
                handler.metadata(self.directory / str(step) / name).tree, is_leaf=lambda x: hasattr(x, "shape"))]
                for name in abstract_items}
        except Exception:  # noqa: BLE001 — damaged metadata: the restore below falls back past it
            return
        for name, target in abstract_items.items():
            want = sorted((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(target) if hasattr(x, "shape"))
            have = sorted(saved_leaves[name])
            if want != have:
                differ = sorted(set(have) ^ set(want))[:3] or [("same shapes", "different count")]
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} holds '{name}' of other shapes than the model now "
                    f"built ({len(have)} arrays saved, {len(want)} now; e.g. {differ}): the config changed the "
                    "parameter tree, the checkpoint is not damaged and was left in place. Rerun with the config it "
                    "was trained with (see config_changes.jsonl), or pick another --workdir to train the new one")

    def _restore_step(self, step: int, abstract_items: dict[str, Any]) -> tuple[dict, dict]:
        args = {name: ocp.args.StandardRestore(tree) for name, tree in abstract_items.items()}
        restored = self._manager.restore(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonRestore()))
        meta = dict(restored.meta)
        if int(meta.get("step", -1)) != step:
            raise CheckpointError(f"meta of step {step} says step {meta.get('step')}")
        return {name: restored[name] for name in abstract_items}, meta

    def quarantine(self, step: int, *, reason: str) -> None:
        """Move a bad step out of the manager's sight (kept for inspection under ../corrupt_checkpoints/)."""
        log.warning("moving checkpoint step %d of %s aside: %s", step, self.directory, reason)
        if jax.process_index() == 0:
            src = self.directory / str(step)
            dst_root = self.directory.parent / "corrupt_checkpoints"
            dst_root.mkdir(parents=True, exist_ok=True)
            dst = dst_root / f"{step}-{int(time.time())}"
            try:
                if isinstance(src, pathlib.Path) or str(src).startswith("/"):
                    shutil.move(str(src), str(dst))
                else:
                    src.rename(dst)
            except OSError as e:
                log.warning("could not move the unreadable checkpoint %s aside: %s", src, e)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"quarantine_{step}")
        self._manager.reload()


def _files(directory) -> list:
    """Every file under `directory` (epath: a remote tree is walked one level at a time, as gs:// requires)."""
    out = []
    for path in sorted(directory.iterdir()):
        out += _files(path) if path.is_dir() else [path]
    return out


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a live pytree: the restore target for `Checkpointer.restore`."""
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x
    return jax.tree.map(leaf, tree)
