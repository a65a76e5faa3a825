"""Paths as people type them: every command takes the paths it is given (workdir, model, data, output, tasks,
init.from_run) relative to the directory it runs in, through symbolic links and with spaces, and records them
absolute so that a later command run from elsewhere finds them; a good checkpoint is never moved aside."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import urllib.request

import pytest

from sweet_jax.data import demo
from test_train import env, small_trajectories

REPO = pathlib.Path(__file__).resolve().parents[1]


def command(cwd, *args, timeout=900) -> subprocess.CompletedProcess:
    """`python -m sweet_jax.NAME ...` run in `cwd` (not the checkout: the presets are found through the package)."""
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=timeout)


def steps_of(run: pathlib.Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> pathlib.Path:
    """A directory with spaces holding data/ and a critic trained there by `python -m sweet_jax.train` with
    relative paths: runs/critic run (and `link to run`, a relative symbolic link to it)."""
    root = tmp_path_factory.mktemp("paths") / "a place"
    (root / "data").mkdir(parents=True)
    small_trajectories(root / "data" / "trajectories.jsonl", num_tasks=4)
    shutil.copyfile(demo.paths().tasks, root / "data" / "tasks.jsonl")
    proc = command(root, "sweet_jax.train", "--config", "configs/critic.py:demo", "--workdir", "runs/critic run",
                   "--config.data.trajectories=data/trajectories.jsonl", "--config.data.max_len=256",
                   "--config.data.bucket=256", "--config.train.num_steps=2", "--config.train.eval_every=0",
                   "--config.train.ckpt_every=1", "--config.data.eval_fraction=0.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (root / "link to run").symlink_to("runs/critic run")
    return root


@pytest.mark.slow
def test_train_takes_relative_paths_and_records_them_absolute(place):
    run = place / "runs" / "critic run"
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert steps_of(run) == ["1", "2"]
    config = json.loads((run / "config.json").read_text())
    assert config["data"]["trajectories"] == str(place / "data" / "trajectories.jsonl")
    assert not (run / ".lock").exists()


@pytest.mark.slow
def test_export_of_a_relative_symlinked_path_with_spaces_finds_every_checkpoint_in_place(place):
    run = place / "runs" / "critic run"
    before = steps_of(run)
    proc = command(place / "runs", "sweet_jax.export", "--workdir", "../link to run", "--out", "../hf out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (place / "hf out" / "config.json").is_file() and list((place / "hf out").glob("*.safetensors"))
    assert steps_of(run) == before == ["1", "2"]
    assert not (run / "corrupt_checkpoints").exists() and not (place / "corrupt_checkpoints").exists()


@pytest.mark.slow
def test_rollout_takes_a_relative_policy_run_tasks_and_output(place):
    proc = command(place, "sweet_jax.rollout", "--config", "configs/rollout.py:demo",
                   "--config.policy.path=link to run", "--config.tasks=data/tasks.jsonl",
                   "--config.output=out/episodes.jsonl", "--config.num_tasks=2", "--config.best_of=1",
                   "--config.max_turns=2", "--config.sampling.max_new_tokens=8", "--config.sandbox.workers=1",
                   "--config.progress=False")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((place / "out" / "episodes.jsonl").read_text().splitlines()) == 2
    record = json.loads((place / "out" / "episodes.jsonl.config.json").read_text())
    assert record["policy"]["path"] == str(place / "link to run") and record["output"] == str(
        place / "out" / "episodes.jsonl")
    assert steps_of(place / "runs" / "critic run") == ["1", "2"]


@pytest.mark.slow
def test_rank_takes_a_relative_critic_run_trajectories_and_output(place):
    proc = command(place / "data", "sweet_jax.rank", "--config", "configs/rank.py:demo",
                   "--config.critic.path=../runs/critic run", "--config.trajectories=trajectories.jsonl",
                   "--config.num_trajectories=2", "--config.output=../out/pairs.jsonl", "--config.num_candidates=4",
                   "--config.max_new_tokens=8", "--config.progress=False")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = [json.loads(line) for line in (place / "out" / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen_score"] > p["rejected_score"] for p in pairs)


@pytest.mark.slow
def test_serve_takes_a_relative_training_run(place):
    proc = subprocess.Popen([sys.executable, "-m", "sweet_jax.serve", "--model", "link to run", "--port", "0"],
                            cwd=place, env=env(PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                break
        assert proc.poll() is None, "".join(lines)[-3000:]
        url = line.strip().rsplit(" ", 1)[-1]
        body = json.dumps({"model": "link to run", "prompt": "def f(", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert steps_of(place / "runs" / "critic run") == ["1", "2"]


@pytest.mark.slow
def test_pipeline_takes_a_relative_workdir_and_init_from_run(place):
    """The README's `--workdir runs/...` from another directory than the checkout, and a second seed that copies
    the first one's starting policy through a relative init.from_run."""
    args = ["sweet_jax.pipeline", "--config", "configs/pipeline.py:test", "--config.methods=zero_shot"]
    first = command(place, *args, "--workdir", "runs/pipe seed0")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (place / "runs" / "pipe seed0" / "results.json").is_file()
    second = command(place / "runs", *args, "--workdir", "pipe seed1", "--config.seed=1",
                     "--config.init.from_run=pipe seed0")
    assert second.returncode == 0, second.stderr[-3000:]
    recorded = json.loads((place / "runs" / "pipe seed1" / "pipeline_config.json").read_text())
    assert recorded["init"]["from_run"] == str(place / "runs" / "pipe seed0")
    assert json.loads((place / "runs" / "pipe seed1" / "init" / "done.json").read_text())
    assert (place / "runs" / "pipe seed1" / "results.json").is_file()
    assert not os.path.exists(place / "runs" / "pipe seed1" / "init" / "corrupt_checkpoints")
