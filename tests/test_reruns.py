"""One rule for every command that writes results (rundir.record_config): rerunning rank, rollout or the pipeline
on results made with another config is refused, naming the fields, and the record is left as it was; with
--accept_config_change the rerun goes on and the change is recorded; a start that produced nothing is replaced."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from sweet_jax.pipeline import stages as pipeline
from sweet_jax.rl import episodes as rollout, ranking as rank
from sweet_jax.train import rundir

REPO = pathlib.Path(__file__).resolve().parents[1]


def preset(file: str, name: str):
    spec = importlib.util.spec_from_file_location(f"config_{name}", REPO / "configs" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(name)


def changes_of(record: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in rundir.changes_path(record).read_text().splitlines()]


def rank_run_with_pairs(tmp_path):
    """A rank output holding one pair, and the record of the config that made it."""
    config = preset("rank.py", "demo")
    config.output = str(tmp_path / "pairs.jsonl")
    rank.record_config(config)
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"trajectory_index": 0, "turn": 1}) + "\n")
    return config


def test_rank_rerun_with_another_critic_is_refused_and_keeps_its_record(tmp_path):
    config = rank_run_with_pairs(tmp_path)
    record = tmp_path / "pairs.jsonl.config.json"
    before = record.read_text()
    config.critic.path = str(tmp_path / "trained_critic")
    with pytest.raises(rundir.RunDirError, match=r"critic.path: '' -> '.*trained_critic'.*--accept_config_change"):
        rank.run(config)   # refused before any model loads
    assert record.read_text() == before and not rundir.changes_path(record).exists()


def test_rank_rerun_accepting_the_change_records_it(tmp_path):
    config = rank_run_with_pairs(tmp_path)
    config.num_pairs = 3
    assert rank.record_config(config, accept_config_change=True) == [("num_pairs", 2, 3)]
    record = tmp_path / "pairs.jsonl.config.json"
    assert json.loads(record.read_text())["num_pairs"] == 3
    [change] = changes_of(record)
    assert change["changes"] == [{"field": "num_pairs", "old": 2, "new": 3}] and change["why"].startswith("accepted")


def test_rank_rerun_may_change_how_fast_it_runs(tmp_path):
    config = rank_run_with_pairs(tmp_path)
    config.score_batch_size, config.progress = 2, False
    assert rank.record_config(config) == []


def rollout_run_with_an_episode(tmp_path):
    config = preset("rollout.py", "demo")
    config.output = str(tmp_path / "trajectories.jsonl")
    rollout.record_config(config)
    episode = {"task": {}, "dialogue_history": [], "answer": "", "rollout": {"task_index": 0, "sample": 0}}
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(episode) + "\n")
    return config


def test_rollout_rerun_at_another_temperature_is_refused_on_the_command_line(tmp_path):
    """The issue's case: `--config.sampling.temperature=0.5` on episodes sampled at 1.0. One line, exit 2, and
    the record still says 1.0."""
    rollout_run_with_an_episode(tmp_path)
    record = tmp_path / "trajectories.jsonl.config.json"
    before = record.read_text()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.rollout", "--config", "configs/rollout.py:demo",
                           f"--config.output={tmp_path / 'trajectories.jsonl'}", "--config.sampling.temperature=0.5"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [error] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "sampling.temperature: 1.0 -> 0.5" in error and "--accept_config_change" in error
    assert record.read_text() == before


def test_rollout_rerun_accepting_the_change_records_what_produced_the_data(tmp_path):
    config = rollout_run_with_an_episode(tmp_path)
    config.sampling.temperature = 0.5
    assert rollout.record_config(config, accept_config_change=True) == [("sampling.temperature", 1.0, 0.5)]
    record = tmp_path / "trajectories.jsonl.config.json"
    assert json.loads(record.read_text())["sampling"]["temperature"] == 0.5
    assert changes_of(record)[0]["changes"] == [{"field": "sampling.temperature", "old": 1.0, "new": 0.5}]


def test_rollout_start_that_played_nothing_is_replaced_by_its_fixed_rerun(tmp_path):
    config = preset("rollout.py", "demo")
    config.output = str(tmp_path / "trajectories.jsonl")
    config.tasks = str(tmp_path / "typo.jsonl")
    rollout.record_config(config)    # the start that then failed on the missing tasks file
    config.tasks = ""
    assert rollout.record_config(config) == [("tasks", str(tmp_path / "typo.jsonl"), "")]
    assert "produced nothing" in changes_of(tmp_path / "trajectories.jsonl.config.json")[0]["why"]


def test_pipeline_rerun_with_another_config_is_refused_once_a_stage_finished(tmp_path):
    config = preset("pipeline.py", "test")
    pipeline._check_same_config(config, tmp_path)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / pipeline.DONE).write_text("{}")
    record = tmp_path / "pipeline_config.json"
    before = record.read_text()
    config.seed = config.seed + 1
    with pytest.raises(rundir.RunDirError, match=r"seed: \d+ -> \d+.*--accept_config_change"):
        pipeline._check_same_config(config, tmp_path)
    assert record.read_text() == before
    pipeline._check_same_config(config, tmp_path, accept_change=True)
    assert json.loads(record.read_text())["seed"] == config.seed
    assert changes_of(record)[0]["changes"][0]["field"] == "seed"


def test_pipeline_start_that_finished_no_stage_is_replaced_by_its_fixed_rerun(tmp_path):
    config = preset("pipeline.py", "test")
    pipeline._check_same_config(config, tmp_path)
    config.seed = config.seed + 1
    pipeline._check_same_config(config, tmp_path)
    assert json.loads((tmp_path / "pipeline_config.json").read_text())["seed"] == config.seed


def test_the_changes_file_sits_beside_its_record():
    assert rundir.changes_path("/w/config.json").name == "config_changes.jsonl"
    assert rundir.changes_path("/w/config_pairs.jsonl.config.json").name == "config_pairs.jsonl.config_changes.jsonl"
    assert rundir.changes_path("/w/pipeline_config.json").name == "pipeline_config_changes.jsonl"
