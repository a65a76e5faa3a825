"""The frontend track end to end, reduced (configs/frontend.py:frontend_test): real Chromium renders, a random tiny
CLIP, the scripted design simulator, and the same critic / rank / DPO code as the backend."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from sweet_jax.data import load_trajectories
from sweet_jax.data.pairs import gap_pairs

REPO = pathlib.Path(__file__).resolve().parents[1]
# The run is one fixture: browsers + every stage, on a shared 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
STAGES = ["tasks", "init", "offline", "critic", "candidates", "rank", "eval_zero_shot", "policy_sweet", "eval_sweet",
          "report"]


def read_jsonl(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    wd = tmp_path_factory.mktemp("frontend_pipeline")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.pipeline", "--config", "configs/frontend.py:frontend_test",
                           "--workdir", str(wd)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"stages run: {', '.join(STAGES)}; skipped (already done): none" in proc.stdout
    return wd


def test_tasks_are_the_demo_pages(workdir):
    train, heldout = read_jsonl(workdir / "tasks/train.jsonl"), read_jsonl(workdir / "tasks/heldout.jsonl")
    assert (len(train), len(heldout)) == (4, 2)
    assert all(t["ground_truth"].startswith("<html") and t["test_cases"] == {} for t in train + heldout)


def test_offline_rewards_are_cosines_and_pairs_follow_the_gap_rule(workdir):
    trajectories = load_trajectories(workdir / "offline/trajectories.jsonl")
    rewards = np.array([t.reward for t in trajectories])
    assert ((rewards >= -1.0) & (rewards <= 1.0 + 1e-5)).all()
    exact = [t for t in trajectories if t.extra.get("scripted_agent") == "exact"]
    assert exact and all(t.reward == pytest.approx(1.0, abs=1e-4) for t in exact)  # a page against itself
    summary = json.loads((workdir / "offline/done.json").read_text())["summary"]
    assert summary["critic_pairs"] == len(gap_pairs(trajectories, min_gap=0.02)) > 0


def test_critic_is_trained_with_c_and_ranks_the_policys_candidates(workdir):
    critic = json.loads((workdir / "critic/done.json").read_text())["summary"]
    assert critic["use_info"] is True and critic["steps"] > 0
    pairs = read_jsonl(workdir / "rank/pairs.jsonl")
    assert pairs and all(p["chosen_score"] >= p["rejected_score"] for p in pairs)
    assert (workdir / "policies/sweet/hf/config.json").exists()


def test_report_has_cosine_and_win_rate_per_method(workdir):
    results = json.loads((workdir / "results.json").read_text())
    assert results["track"] == "frontend"
    for method in ("zero_shot", "sweet"):
        row = results["methods"][method]
        assert 0.0 <= row["win_rate_pct"] <= 100.0 and -100.0 <= row["cosine_pct"] <= 100.0
    assert results["methods"]["zero_shot"]["win_rate_pct"] == pytest.approx(50.0)  # against itself: all ties
    table = (workdir / "report" / "results.md") if (workdir / "report" / "results.md").exists() else \
        next(workdir.glob("**/results.md"))
    assert "Cosine Similarity (x100)" in table.read_text() and "Win Rate vs Zero-Shot" in table.read_text()
