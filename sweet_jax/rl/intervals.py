"""Paired per-task bootstrap intervals for differences between methods, pooled over seeds.

Within a seed every method plays the same held-out tasks the same number of times, so a difference between two
methods is measured task by task: d_t = (method A's success rate on task t) - (method B's on task t). The pooled
estimate is the mean of d_t over every (seed, task). Its 95% interval: resample the tasks of each seed with
replacement (the seeds themselves, and each seed's number of tasks, stay as they are), recompute the pooled mean,
10,000 times, and take the 2.5th and 97.5th percentiles. Tasks are the unit because a task's two episodes are not
independent (the same task is easy or hard for both).

Input: each run's held-out episodes, {method: [[task index, sample, reward], ...]} (evidence/episodes.json, written
by the pipeline's report stage).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

# The differences the comparison reports: SWEET-RL against the trajectory-level baselines, and the oracle control
DIFFERENCES = (("sweet", "mtdpo"), ("sweet", "rft"), ("sweet_oracle", "mtdpo"), ("sweet_oracle", "sweet"))
RESAMPLES = 10_000


def task_success(episodes: Sequence[Sequence], metric: str = "success") -> dict[int, float]:
    """task index -> the mean over its episodes of success (reward == 1.0) or of the reward."""
    by_task: dict[int, list[float]] = {}
    for task, _, reward in episodes:
        value = 0.0 if reward is None else float(reward == 1.0) if metric == "success" else float(reward)
        by_task.setdefault(int(task), []).append(value)
    return {t: float(np.mean(v)) for t, v in by_task.items()}


def paired_differences(runs_episodes: Sequence[Mapping[str, Sequence]], a: str, b: str, *,
                       metric: str = "success") -> list[np.ndarray]:
    """Per seed, the per-task differences a - b over the tasks both methods played (in task order)."""
    out = []
    for episodes in runs_episodes:
        if a not in episodes or b not in episodes:
            continue
        sa, sb = task_success(episodes[a], metric), task_success(episodes[b], metric)
        tasks = sorted(set(sa) & set(sb))
        out.append(np.array([sa[t] - sb[t] for t in tasks]))
    return out


def bootstrap_interval(per_seed: Sequence[np.ndarray], *, resamples: int = RESAMPLES, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float, float]:
    """(pooled mean, low, high) of the per-task differences, tasks resampled within each seed."""
    per_seed = [d for d in per_seed if len(d)]
    if not per_seed:
        raise ValueError("no task was played by both methods")
    count = sum(len(d) for d in per_seed)
    estimate = float(sum(d.sum() for d in per_seed) / count)
    rng = np.random.default_rng(seed)
    totals = np.zeros(resamples)
    for d in per_seed:
        totals += d[rng.integers(0, len(d), size=(resamples, len(d)))].sum(axis=1)
    means = totals / count
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return estimate, float(low), float(high)


def intervals_table(runs_episodes: Sequence[Mapping[str, Sequence]], names: Mapping[str, str]) -> str:
    """Markdown: each difference of DIFFERENCES both of whose methods ran, in points of success rate and of % tests
    passed, with its paired per-task bootstrap 95% interval pooled over the runs."""
    rows = []
    for a, b in DIFFERENCES:
        success = paired_differences(runs_episodes, a, b)
        if not success:
            continue
        cells = []
        for metric, diffs in (("success", success), ("reward", paired_differences(runs_episodes, a, b,
                                                                                   metric="reward"))):
            est, low, high = bootstrap_interval(diffs)
            cells.append(f"{100 * est:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]")
        tasks = sum(len(d) for d in success)
        rows.append(f"| {names.get(a, a)} - {names.get(b, b)} | {cells[0]} | {cells[1]} | {tasks} ({len(success)}) |")
    if not rows:
        return ""
    return "\n".join([
        "Differences on the held-out tasks, points, with the paired per-task bootstrap 95% interval pooled over seeds "
        f"({RESAMPLES:,} resamples of each seed's tasks):", "",
        "| difference | success rate | % tests passed | tasks (seeds) |", "|---|---|---|---|", *rows]) + "\n"
