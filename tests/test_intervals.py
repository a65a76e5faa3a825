"""Paired per-task bootstrap intervals pooled over seeds (sweet_jax/rl/intervals.py), against what they must be."""
import numpy as np
import pytest

from sweet_jax.rl import intervals


def test_a_constant_difference_has_a_degenerate_interval():
    est, low, high = intervals.bootstrap_interval([np.full(20, 0.5)])
    assert est == low == high == 0.5


def test_tasks_are_resampled_within_each_seed_and_weighted_equally():
    # seed 0: 10 tasks all +1; seed 1: 30 tasks all 0. Resampling within a seed cannot change its sum, so the
    # interval is the point 10 / 40; resampling the 40 tasks together would spread it.
    est, low, high = intervals.bootstrap_interval([np.ones(10), np.zeros(30)])
    assert est == low == high == pytest.approx(0.25)


def test_the_interval_matches_the_normal_approximation_on_many_tasks():
    rng = np.random.default_rng(1)
    d = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], size=4000, p=[0.1, 0.15, 0.4, 0.2, 0.15])
    est, low, high = intervals.bootstrap_interval([d[:2000], d[2000:]], resamples=4000)
    half = 1.96 * d.std() / np.sqrt(len(d))
    assert est == pytest.approx(d.mean())
    assert (high - low) / 2 == pytest.approx(half, rel=0.08)
    assert (low + high) / 2 == pytest.approx(est, abs=0.1 * half)


def test_per_task_success_pairs_the_methods_task_by_task():
    episodes = {"sweet": [[0, 0, 1.0], [0, 1, 1.0], [1, 0, 0.5], [1, 1, 1.0], [2, 0, None], [2, 1, 0.0]],
                "mtdpo": [[0, 0, 0.0], [0, 1, 1.0], [1, 0, 1.0], [1, 1, 1.0], [3, 0, 1.0], [3, 1, 1.0]]}
    assert intervals.task_success(episodes["sweet"]) == {0: 1.0, 1: 0.5, 2: 0.0}
    assert intervals.task_success(episodes["sweet"], "reward") == {0: 1.0, 1: 0.75, 2: 0.0}
    (d,) = intervals.paired_differences([episodes], "sweet", "mtdpo")
    assert d.tolist() == [0.5, -0.5]          # tasks 0 and 1: the only ones both played
    table = intervals.intervals_table([episodes, episodes], {"sweet": "SWEET-RL", "mtdpo": "Multi-Turn DPO"})
    assert "| SWEET-RL - Multi-Turn DPO | +0.0 [" in table and "| 4 (2) |" in table
    only = intervals.intervals_table([episodes], {})   # only the differences whose two methods both ran
    assert "| sweet - mtdpo | +0.0 [-50.0, +50.0] | +12.5 [" in only and "rft" not in only and "oracle" not in only
