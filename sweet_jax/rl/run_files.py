"""The run files the reports read (`pipeline_report`, `pipeline_diagnostics`), each checked as it is read: a
results.json, its evidence/stages.json and evidence/episodes.json, a diagnostics.json beside it, and the ranked
pairs' trajectory indices.
A file that is not what the pipeline writes (truncated, binary, a link to a device, a figure that is NaN,
infinite or out of its range, an index outside the episodes) is a ReportError naming the file and the field: the
reports never print a number the run did not measure. Reads are bounded (jsonl.read_json, jsonl.MAX_JSON_BYTES).
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from sweet_jax import jsonl
from sweet_jax.errors import SweetJaxError


class ReportError(SweetJaxError):
    """A run file that is missing, damaged or not from the pipeline."""


class _Fields:
    """Field checks of one file: each failure a ReportError naming the file and the dotted field."""

    def __init__(self, path):
        self.path = path

    def error(self, field: str, message: str) -> ReportError:
        return ReportError(f"{self.path}: field '{field}': {message}; the pipeline does not write this: "
                           "rerun the stage that wrote the file, or restore it")

    def object(self, value, field: str) -> dict:
        if not isinstance(value, dict):
            raise self.error(field, f"expected an object, got {_show(value)}")
        return value

    def number(self, value, field: str, lo: float = -math.inf, hi: float = math.inf, *,
               optional: bool = False) -> float | None:
        """A finite number in [lo, hi] (None allowed when optional: a figure that was not measured)."""
        if value is None and optional:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.error(field, f"{_show(value)} is not a number")
        if not math.isfinite(value):
            raise self.error(field, f"{_show(value)} is not a finite number (a measured figure)")
        if not lo <= value <= hi:
            raise self.error(field, f"{_show(value)} is outside [{lo:g}, {hi:g}]")
        return value

    def count(self, value, field: str, *, optional: bool = False) -> int | None:
        if value is None and optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.error(field, f"{_show(value)} is not a count (an integer >= 0)")
        return value


def _show(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def read_json(path, what: str) -> Any:
    """jsonl.read_json as a ReportError (`what`: the file's role, for the message)."""
    try:
        return jsonl.read_json(path)
    except jsonl.DataError as e:
        raise ReportError(f"{what}: {e}") from None


# What each method's figures may be (results.json "methods"; stages.stage_report writes them).
METHOD_FIGURES = {"success_rate": (0.0, 1.0), "success_rate_pct": (0.0, 100.0), "tests_passed_pct": (0.0, 100.0),
                  "turns_per_episode": (0.0, math.inf), "cosine_pct": (-100.0, 100.0),
                  "win_rate_pct": (0.0, 100.0)}


def check_results(results, path, required: tuple[str, ...]) -> dict:
    """A results.json's value, checked: its methods and each one's figures (`required`: the table's columns),
    its diagnostics and its selection."""
    f = _Fields(path)
    f.object(results, "(top)")
    methods = f.object(results.get("methods"), "methods")
    if not methods:
        raise f.error("methods", "no method")
    for m, record in methods.items():
        f.object(record, f"methods.{m}")
        _unmeasured_nan_as_null(record, "win_rate_pct")
        for key, (lo, hi) in METHOD_FIGURES.items():
            if key in required and key not in record:
                raise f.error(f"methods.{m}.{key}", "missing")
            # win rate: not measured without the zero-shot policy's answers (null)
            f.number(record.get(key), f"methods.{m}.{key}", lo, hi, optional=key not in required or
                     key == "win_rate_pct")
        f.count(record.get("episodes"), f"methods.{m}.episodes", optional=True)
    f.count(results.get("heldout_tasks"), "heldout_tasks", optional=True)
    _unmeasured_nan_as_null(f.object(results.get("diagnostics", {}), "diagnostics"), "load_average")
    for key, value in f.object(results.get("diagnostics", {}), "diagnostics").items():
        if not isinstance(value, str):
            f.number(value, f"diagnostics.{key}", optional=True)
    if results.get("selection") is not None:
        check_selection(results["selection"], f, "selection.")
    return results


def _unmeasured_nan_as_null(record: dict, key: str) -> None:
    """Runs written before unmeasured figures were null hold NaN for these two (a win rate without the zero-shot
    policy's answers, a load average without records): read as not measured, never as a number."""
    value = record.get(key)
    if isinstance(value, float) and math.isnan(value):
        record[key] = None


def check_selection(selection, f: _Fields, prefix: str = "") -> dict:
    """A selection record (stages.write_selection) as the report's selection table reads it."""
    f.object(selection, prefix.rstrip(".") or "(top)")
    zero = selection.get("zero_shot")
    if zero is not None:
        f.number(f.object(zero, f"{prefix}zero_shot").get("success_rate"), f"{prefix}zero_shot.success_rate", 0, 1)
    for m, record in f.object(selection.get("methods"), f"{prefix}methods").items():
        at = f"{prefix}methods.{m}"
        choice = f.object(f.object(record, at).get("choice"), f"{at}.choice")
        curve = f.object(record.get("curve"), f"{at}.curve")
        for key, point in curve.items():
            f.object(point, f"{at}.curve.{key}")
            f.number(point.get("success_rate"), f"{at}.curve.{key}.success_rate", 0, 1)
            if "round" in choice:
                if not key.isdigit():
                    raise f.error(f"{at}.curve.{key}", "expected a round number")
                continue
            lr, step = key.partition("/")[::2]
            try:
                float(lr), int(step)
            except ValueError:
                raise f.error(f"{at}.curve.{key}", "expected 'lr/step'") from None
            f.number(point.get("lr"), f"{at}.curve.{key}.lr", 0)
            f.count(point.get("step"), f"{at}.curve.{key}.step")
        if "round" in choice:
            f.count(choice["round"], f"{at}.choice.round")
        else:
            f.number(choice.get("lr"), f"{at}.choice.lr", 0)
            f.count(choice.get("step"), f"{at}.choice.step")
    return selection


def check_stage_records(records, path) -> dict:
    """evidence/stages.json: stage directory -> its done.json record (wall and CPU seconds)."""
    f = _Fields(path)
    for directory, record in f.object(records, "(top)").items():
        f.object(record, directory)
        f.number(record.get("seconds"), f"{directory}.seconds", 0)
        f.number(record.get("cpu_seconds"), f"{directory}.cpu_seconds", 0, optional=True)
    return records


def check_run_diagnostics(report, path) -> dict:
    """A diagnostics.json (`pipeline_diagnostics --out`): each ranking's decided pairs, agreement and pair kinds,
    each policy's behaviour figures."""
    f = _Fields(path)
    f.object(report, "(top)")
    for name, ranking in f.object(report.get("rankings", {}), "rankings").items():
        at = f"rankings.{name}"
        f.object(ranking, at)
        decided = f.count(ranking.get("decided"), f"{at}.decided")
        f.number(ranking.get("agreement_pct"), f"{at}.agreement_pct", 0, 100, optional=not decided)
        for kind, counts in f.object(ranking.get("by_kind", {}), f"{at}.by_kind").items():
            if isinstance(counts, list):   # files written before ties were counted: [agree, decided]
                if len(counts) != 2 or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                               for c in counts) or counts[0] > counts[1]:
                    raise f.error(f"{at}.by_kind.{kind}", f"{_show(counts)} is not [agree, decided]")
                continue
            for verdict in ("agree", "disagree", "tie"):
                f.count(f.object(counts, f"{at}.by_kind.{kind}").get(verdict, 0), f"{at}.by_kind.{kind}.{verdict}")
    for name, figures in f.object(report.get("behaviour", {}), "behaviour").items():
        for key, value in f.object(figures, f"behaviour.{name}").items():
            if isinstance(value, dict):   # a breakdown (the discovery family's replies_per_episode by kind)
                for part, number in value.items():
                    f.number(number, f"behaviour.{name}.{key}.{part}", 0)
                continue
            f.number(value, f"behaviour.{name}.{key}", 0, optional=True)
    return report


def read_run(workdir, required: tuple[str, ...] | None = None) -> dict:
    """A run's results.json, checked, with its stage records (evidence/stages.json) as "stage_records" and the
    diagnostics.json beside it as "run_diagnostics", each checked. required: the figures every method must have
    (default: the table's columns of the run's track)."""
    path = pathlib.Path(workdir) / "results.json"
    if not path.exists() and not path.is_symlink():
        raise ReportError(f"{path} does not exist: run `python -m sweet_jax.pipeline --workdir {workdir}` to the end")
    results = read_json(path, "results")
    if isinstance(results, dict) and "methods" not in results:
        raise ReportError(f"{path}: no 'methods' field; this file was not written by sweet_jax.pipeline")
    if required is None:
        track = results.get("track") if isinstance(results, dict) else None
        required = ("cosine_pct",) if track == "frontend" else ("tests_passed_pct", "success_rate_pct")
    check_results(results, path, required)
    for records in (path.parent / "evidence" / "stages.json", path.parent / "stages.json"):
        if records.exists() or records.is_symlink():
            results["stage_records"] = check_stage_records(read_json(records, "stage records"), records)
            break
    diagnostics = path.parent / "diagnostics.json"   # `python -m sweet_jax.pipeline_diagnostics RUN --out` beside it
    if diagnostics.exists() or diagnostics.is_symlink():
        results["run_diagnostics"] = check_run_diagnostics(read_json(diagnostics, "diagnostics"), diagnostics)
    episodes = path.parent / "evidence" / "episodes.json"   # every held-out episode's reward (pipeline.write_evidence)
    if episodes.exists() or episodes.is_symlink():
        results["episodes"] = check_episodes(read_json(episodes, "held-out episodes"), episodes)
    return results


def check_episodes(episodes, path) -> dict:
    """A run's evidence/episodes.json ({method: [[task index, sample, reward], ...]}), checked: what the paired
    per-task intervals read."""
    f = _Fields(path)
    for method, rows in f.object(episodes, "(top)").items():
        if not isinstance(rows, list):
            raise f.error(method, f"expected a list of [task index, sample, reward], got {_show(rows)}")
        for i, row in enumerate(rows):
            at = f"{method}[{i}]"
            if not isinstance(row, list) or len(row) != 3:
                raise f.error(at, f"expected [task index, sample, reward], got {_show(row)}")
            f.count(row[0], f"{at}[0] (task index)")
            f.count(row[1], f"{at}[1] (sample)")
            f.number(row[2], f"{at}[2] (reward)", 0.0, 1.0, optional=True)
    return episodes


def check_trajectory_index(index, trajectories: list, where: str, field: str = "trajectory_index") -> dict:
    """trajectories[index] for a pair or scores line at `where` (file:line): an index outside the episodes
    (negative ones too, which Python would read from the end) is a ReportError, never another episode."""
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(trajectories):
        raise ReportError(f"{where}: field '{field}': {_show(index)} is not the index of one of the "
                          f"{len(trajectories)} episodes it ranks; the file does not belong with these trajectories")
    episode = trajectories[index]
    task = episode.get("task") if isinstance(episode, dict) else None
    if not isinstance(task, dict) or not isinstance(episode.get("dialogue_history"), list):
        raise ReportError(f"{where}: field '{field}': episode {index} has no task or dialogue_history")
    return episode


def read_episodes(path) -> list[dict]:
    """The episodes of a trajectories JSONL file (offline, a round's or an evaluation's), each checked as the
    diagnostics read it: a task with its reference solution, a dialogue of user/assistant turns with text, a
    reward that is null or in [0, 1]. A DataError or ReportError names file:line and the field."""
    episodes = []
    for where, line in jsonl.lines(path):
        episode = jsonl.parse(line, where)
        f = _Fields(where)
        task = f.object(episode.get("task"), "task")
        if not isinstance(task.get("ground_truth"), str):
            raise f.error("task.ground_truth", f"{_show(task.get('ground_truth'))} is not the reference solution")
        history = episode.get("dialogue_history")
        if not isinstance(history, list):
            raise f.error("dialogue_history", f"expected a list of turns, got {_show(history)}")
        for i, turn in enumerate(history):
            f.object(turn, f"dialogue_history.{i}")
            if turn.get("role") not in ("user", "assistant") or not isinstance(turn.get("content"), str):
                raise f.error(f"dialogue_history.{i}", "expected {\"role\": \"user\"|\"assistant\", \"content\": text}")
        f.number(episode.get("reward"), "reward", 0, 1, optional=True)
        episodes.append(episode)
    return episodes
