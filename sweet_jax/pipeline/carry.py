"""A run's small state kept in a second place (`python -m sweet_jax.pipeline ... --carry DIR`), so that a run
outlives the machine it started on.

After every stage, every file of the finished stages except the models (HF directories with their weights,
training checkpoints) is copied into DIR, with the run's own files: task splits, episodes, candidates, pairs,
validation and held-out plays, per-step metrics, the stage records. DIR is small (a seed of the SmolLM2
protocols: a few MB) and can live in git or a bucket. A workdir that is missing or partial on a new machine is
first filled from DIR (files it lacks), and the run goes on: a finished stage whose models are gone runs again
only where a stage still to run needs them (`Run.stage`'s consumers), so a starting policy is trained again, a
critic only if its ranking is unfinished, a policy only if one of its validation or held-out plays is.

The stage records hold absolute paths into the workdir; DIR/carry.json names the workdir they were written in,
and a restore into another path rewrites them in the JSON files it copies.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil

from sweet_jax.train.rundir import CHECKPOINT_DIR

log = logging.getLogger(__name__)

MANIFEST = "carry.json"
DONE = "done.json"                      # a finished stage's record (stages.DONE)
RUN_DIRS = ("evidence",)                # the run's own, not a stage's (the report writes it: stages.write_evidence)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".msgpack", ".gguf", ".pt")
NOT_CARRIED = (".lock",)                # a running trainer's lock (rundir.py): this machine's only


def is_model_dir(d: pathlib.Path) -> bool:
    """An HF directory (weights beside config.json) or a training run's checkpoints: not carried."""
    if d.name == CHECKPOINT_DIR:   # Orbax checkpoints
        return True
    return any(f.suffix in WEIGHT_SUFFIXES for f in d.iterdir() if f.is_file())


def small_files(workdir: pathlib.Path):
    """Every file of workdir outside model directories, as paths relative to it."""
    for root, dirs, files in os.walk(workdir):
        root_path = pathlib.Path(root)
        dirs[:] = sorted(d for d in dirs if not is_model_dir(root_path / d))
        for name in sorted(files):
            path = root_path / name
            if (path.is_file() and not path.is_symlink() and path.suffix not in WEIGHT_SUFFIXES
                    and name not in NOT_CARRIED and not name.endswith(".carry-tmp")):
                yield path.relative_to(workdir)


def finished(workdir: pathlib.Path, rel: pathlib.Path) -> bool:
    """A run's own file (top level) or one of a finished stage (a directory above it holds done.json): an unfinished
    stage runs again from its start on the new machine, and its partial files would only be in its way."""
    if rel.parent == pathlib.Path(".") or rel.parts[0] in RUN_DIRS:
        return True
    return any((workdir / d / DONE).exists() for d in rel.parents if d != pathlib.Path("."))


def save(workdir, carry_dir) -> int:
    """Copy the small files of workdir's finished stages (and its own files) that are new or changed into
    carry_dir (atomically each); returns how many."""
    workdir, carry_dir = pathlib.Path(workdir), pathlib.Path(carry_dir)
    carry_dir.mkdir(parents=True, exist_ok=True)
    copied = 0
    for rel in small_files(workdir):
        if not finished(workdir, rel):
            continue
        src, dst = workdir / rel, carry_dir / rel
        if (dst.exists() and dst.stat().st_size == src.stat().st_size
                and dst.stat().st_mtime_ns >= src.stat().st_mtime_ns):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".carry-tmp")
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
        copied += 1
    manifest = carry_dir / MANIFEST
    record = {"workdir": str(workdir)}
    if not manifest.exists() or json.loads(manifest.read_text()) != record:
        manifest.write_text(json.dumps(record, indent=2) + "\n")
    return copied


def restore(carry_dir, workdir) -> int:
    """Copy into workdir every file of carry_dir it lacks (never over a file it has), with the workdir paths of the
    JSON files rewritten from the carried run's to this one's; returns how many."""
    workdir, carry_dir = pathlib.Path(workdir), pathlib.Path(carry_dir)
    manifest = carry_dir / MANIFEST
    if not manifest.exists():
        return 0
    old = json.loads(manifest.read_text())["workdir"]
    new = str(workdir)
    restored = 0
    for rel in small_files(carry_dir):
        if rel.name == MANIFEST and rel.parent == pathlib.Path("."):
            continue
        dst = workdir / rel
        if dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        moved = rewrite_paths((carry_dir / rel).read_text(), old, new) if rel.suffix == ".json" and old != new else None
        if moved is not None:
            dst.write_text(moved)
        else:
            shutil.copy2(carry_dir / rel, dst)
        restored += 1
    if restored:
        log.info("restored %d files of %s (a run of %s) into %s", restored, carry_dir, old, workdir)
    return restored


def rewrite_paths(text: str, old: str, new: str) -> str | None:
    """JSON text with every string that is old or starts with old + '/' moved under new (None: not JSON)."""
    def move(value):
        if isinstance(value, str) and (value == old or value.startswith(old + "/")):
            return new + value[len(old):]
        if isinstance(value, list):
            return [move(v) for v in value]
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return json.dumps(move(value), indent=2) + "\n"
