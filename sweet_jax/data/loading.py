"""Reading and writing ColBench record files: JSONL paths, or `tfds://colbench/...` (the TFDS dataset of
sweet_jax.data.tfds_colbench), into the checked records of sweet_jax.data.schema. A bad row is a DataError naming
file:line and the field (or skipped with skip_bad)."""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

from sweet_jax import jsonl
from sweet_jax.data.schema import DataError, Task, Trajectory

log = logging.getLogger(__name__)


def load_records(path, record_type) -> list:
    """Every line of a JSONL file of `record_type` (CandidatesRecord, PolicyPair), checked: a bad line is a
    DataError naming file:line and the field. An empty file is an empty list."""
    return [record_type.from_json(jsonl.parse(line, where), where=where) for where, line in jsonl.lines(path)]


class Loaded(list):
    """A list of records plus `skipped`: [(line, message)] for rows dropped with skip_bad=True."""

    skipped: list[tuple[int, str]]

    def __init__(self, items=(), skipped=()):
        super().__init__(items)
        self.skipped = list(skipped)


def load_rows(path, parse: Callable[[Any, str], Any], *, skip_bad: bool, what: str) -> Loaded:
    path_str = os.fspath(path)
    if path_str.startswith("tfds://"):
        from sweet_jax.data import tfds_colbench  # lazy: it imports tensorflow_datasets (heavy, used only here)
        lines = tfds_colbench.read_json_lines(path_str)
    else:
        lines = jsonl.lines(path_str)
    items, skipped = [], []
    for where, line in lines:
        if not line.strip():
            continue
        try:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"malformed JSON ({e.msg} at column {e.colno})", where=where) from None
            jsonl.refuse_lone_surrogates(obj, line, where)
            items.append(parse(obj, where))  # the record types name a non-object line themselves
        except DataError as e:
            if not skip_bad:
                raise
            skipped.append((where, str(e)))
    if skipped:
        shown = ", ".join(w.rsplit(":", 1)[-1] for w, _ in skipped[:20])
        log.warning("%s: skipped %d bad %s (lines %s%s); first error: %s", path_str, len(skipped), what,
                    shown, ", ..." if len(skipped) > 20 else "", skipped[0][1])
    if not items:
        raise DataError(f"{path_str}: no valid {what} (skipped {len(skipped)} bad ones)")
    return Loaded(items, skipped)


def load_tasks(path, *, skip_bad: bool = False) -> Loaded:
    """Backend tasks from JSONL; skip_bad=True drops bad rows and reports them (`.skipped`, a warning)."""
    return load_rows(path, lambda obj, where: Task.from_json(obj, where=where), skip_bad=skip_bad, what="tasks")


def load_trajectories(path, *, skip_bad: bool = False, no_reply: str = "nothing to train on") -> Loaded:
    """Trajectories from JSONL (message turns or the official pre-rendered input/output turns). no_reply: what a
    row without an assistant turn is refused with (Trajectory.from_json)."""
    return load_rows(path, lambda obj, where: Trajectory.from_json(obj, where=where, no_reply=no_reply),
                 skip_bad=skip_bad, what="trajectories")


def write_jsonl(path, records) -> None:
    """Records (objects with .to_json() or dicts), one JSON object a line, written atomically (jsonl.write)."""
    jsonl.write(path, records)
