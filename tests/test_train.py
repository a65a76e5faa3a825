"""The training entry point end to end: `python -m sweet_jax.train` in subprocesses on the tiny demo model.

One uninterrupted run is shared (module fixture); the other tests compare against it: a run killed with
SIGKILL and resumed, a run whose latest checkpoint was truncated, a run whose loss diverges.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 6


def small_trajectories(path, *, num_tasks: int = 6) -> pathlib.Path:
    """The demo trajectories of the `num_tasks` tasks with the shortest dialogues (fast tests)."""
    from sweet_jax.data import demo

    rows = [json.loads(line) for line in demo.paths().trajectories.read_text().splitlines() if line.strip()]
    by_task = collections.defaultdict(list)
    for r in rows:
        by_task[r["task"]["problem_description"]].append(r)

    def size(group):
        return max(sum(len(t.get("content") or t.get("output") or "") for t in r["dialogue_history"]) for r in group)

    usable = [g for g in by_task.values() if max(r["reward"] for r in g) == 1.0 and min(r["reward"] for r in g) < 1.0]
    chosen = sorted(usable, key=size)[:num_tasks]
    path = pathlib.Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for g in chosen for r in g))
    return path


def env(devices: int = 1, **extra) -> dict:
    e = dict(os.environ)
    e.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    e.update(extra)
    return e


def train_args(workdir, data, *extra) -> list[str]:
    return [sys.executable, "-m", "sweet_jax.train", "--config", "configs/critic.py:demo", f"--workdir={workdir}",
            f"--config.data.trajectories={data}", "--config.data.max_len=256", "--config.data.bucket=256",
            "--config.train.batch_size=4", f"--config.train.num_steps={STEPS}", "--config.train.ckpt_every=2",
            "--config.train.eval_every=0", "--config.data.eval_fraction=0", *extra]


def run_train(workdir, data, *extra, check=True, **env_extra) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_args(workdir, data, *extra), cwd=REPO, env=env(**env_extra), capture_output=True,
                          text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def records(workdir, split="train") -> list[dict]:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["split"] == split]


def steps_on_disk(workdir) -> list[int]:
    return sorted(int(p.name) for p in (pathlib.Path(workdir) / "checkpoints").iterdir() if p.name.isdigit())


def trained_params(workdir, step: int | None = None) -> dict:
    """The parameters of the run's latest checkpoint, or of `step`'s."""
    from flax import nnx
    from sweet_jax.train import model_loading

    model, restored, _ = model_loading.restore_model(workdir, step=step)
    assert step is None or restored == step
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


DETERMINISTIC = ("loss", "pair_accuracy", "margin", "chosen_score", "rejected_score", "grad_norm", "lr")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_trajectories(tmp_path_factory.mktemp("data") / "trajectories.jsonl")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, data):
    """STEPS steps in one go, with a held-out eval split: the reference for the other tests."""
    workdir = tmp_path_factory.mktemp("straight")
    proc = run_train(workdir, data, "--config.data.eval_fraction=0.2")
    (workdir / "stderr.txt").write_text(proc.stderr)
    return workdir


@pytest.mark.slow
def test_rerunning_a_finished_run_returns_at_once_and_a_changed_config_is_refused(straight_run, data):
    """The same command again: nothing rendered, no reference pass, no line added to metrics.jsonl. Another
    learning rate on the same workdir: one line naming the field, exit 2, the saved config untouched."""
    metrics_before = (straight_run / "metrics.jsonl").read_text()
    config_before = (straight_run / "config.json").read_text()
    again = run_train(straight_run, data, "--config.data.eval_fraction=0.2")
    assert "nothing to do" in again.stderr and "reference log-probs" not in again.stderr, again.stderr[-2000:]
    assert (straight_run / "metrics.jsonl").read_text() == metrics_before
    changed = run_train(straight_run, data, "--config.data.eval_fraction=0.2", "--config.optim.lr=0.01", check=False)
    assert changed.returncode == 2, changed.stderr[-2000:]
    errors = [line for line in changed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "optim.lr: 0.003 -> 0.01" in errors[0] and "--accept_config_change" in errors[0]
    assert "Traceback" not in changed.stderr
    assert (straight_run / "config.json").read_text() == config_before


def test_an_accepted_config_change_is_recorded_with_its_time(tmp_path):
    from sweet_jax.train import rundir

    config = demo_config(file="critic.py", preset="demo")
    assert rundir.write_config(config, tmp_path) == []
    assert rundir.write_config(config, tmp_path) == []  # the same config: a plain resume
    (tmp_path / rundir.CHECKPOINT_DIR / "2").mkdir(parents=True)  # the run has saved a step: its results exist
    changed = demo_config(file="critic.py", preset="demo", optim__lr=0.01)
    with pytest.raises(rundir.RunDirError, match=r"optim.lr: 0.003 -> 0.01"):
        rundir.write_config(changed, tmp_path)
    assert rundir.read_config(tmp_path).optim.lr == 0.003
    assert rundir.write_config(changed, tmp_path, accept_change=True) == [("optim.lr", 0.003, 0.01)]
    assert rundir.read_config(tmp_path).optim.lr == 0.01
    [record] = [json.loads(line) for line in (tmp_path / rundir.CONFIG_CHANGES).read_text().splitlines()]
    assert record["changes"] == [{"field": "optim.lr", "old": 0.003, "new": 0.01}] and record["time"]
    assert record["why"].startswith("accepted")


@pytest.mark.slow
def test_a_start_that_failed_before_step_0_does_not_block_its_fixed_rerun(data, tmp_path):
    """Trajectories that hold no row fail after the run's config is written and before any step is saved; the
    rerun with the right file trains, and the replaced config is on record. (A path that does not exist is refused
    before anything is written: no config.json.)"""
    from sweet_jax.train import rundir

    missing = run_train(tmp_path / "run", data, f"--config.data.trajectories={tmp_path / 'typo.jsonl'}", check=False)
    assert missing.returncode == 2 and "typo.jsonl" in missing.stderr, missing.stderr[-2000:]
    assert not (tmp_path / "run" / "config.json").exists()
    (tmp_path / "empty.jsonl").write_text("")
    failed = run_train(tmp_path / "run", data, f"--config.data.trajectories={tmp_path / 'empty.jsonl'}", check=False)
    assert failed.returncode == 2 and "no rows" in failed.stderr, failed.stderr[-2000:]
    assert (tmp_path / "run" / "config.json").exists()
    assert not (tmp_path / "run" / "checkpoints").exists() or steps_on_disk(tmp_path / "run") == []
    run_train(tmp_path / "run", data, "--config.train.num_steps=2")
    assert steps_on_disk(tmp_path / "run") == [2]
    assert rundir.read_config(tmp_path / "run").data.trajectories == str(data)
    [record] = [json.loads(line) for line in (tmp_path / "run" / rundir.CONFIG_CHANGES).read_text().splitlines()]
    assert {c["field"] for c in record["changes"]} == {"data.trajectories", "train.num_steps"}
    assert "produced nothing" in record["why"]


@pytest.mark.slow
def test_extending_a_finished_run_warns_that_the_lr_schedule_restarts_and_keeps_the_mfu_peak(straight_run, data,
                                                                                              tmp_path):
    import shutil

    workdir = tmp_path / "extended"
    shutil.copytree(straight_run, workdir)
    peak = json.loads((workdir / "summary.json").read_text())["peak_flops"]
    proc = run_train(workdir, data, "--config.data.eval_fraction=0.2", f"--config.train.num_steps={STEPS + 2}",
                     "--accept_config_change")
    assert f"the run was made for {STEPS} steps and now has {STEPS + 2}" in proc.stderr, proc.stderr[-3000:]
    assert "the decay restarts" in proc.stderr
    assert "recorded at the run's first start" in proc.stderr
    assert json.loads((workdir / "summary.json").read_text())["peak_flops"] == peak


@pytest.mark.slow
@pytest.mark.parametrize("shorter, field", [(f"--config.train.num_steps={STEPS - 2}", f"train.num_steps={STEPS - 2}"),
                                            ("--config.train.stop_at=4", "train.stop_at=4")])
def test_resuming_a_run_past_its_new_last_step_is_refused_naming_both_steps(straight_run, data, tmp_path, shorter,
                                                                            field):
    """A run that reached step 6, resumed with 4 steps (or told to stop at 4), would stop at once and write a
    summary of 6 steps for a 4-step run: one line naming both numbers, exit 2, the run's files untouched. (The
    control, a longer run, goes on: the test above.)"""
    import shutil

    workdir = tmp_path / "shortened"
    shutil.copytree(straight_run, workdir)
    summary = (workdir / "summary.json").read_text()
    proc = run_train(workdir, data, "--config.data.eval_fraction=0.2", shorter, "--accept_config_change", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert f"has reached step {STEPS}, past this run's last step 4 ({field})" in errors[0]
    assert "Traceback" not in proc.stderr
    assert (workdir / "summary.json").read_text() == summary and steps_on_disk(workdir) == [2, 4, 6]


@pytest.mark.slow
def test_a_disk_that_fills_during_a_checkpoint_is_one_line(data, tmp_path):
    """The workdir on a 2 MiB filesystem (a tmpfs in a user and mount namespace of its own): the run's records fit,
    its first checkpoint does not. Orbax's save threads each logged a traceback and TensorStore's ValueError ended
    the run with one more (exit 1); now: one `error: no space left on the device writing ...` line, exit 2."""
    import shlex
    import shutil

    if not shutil.which("unshare") or subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("this kernel gives no user namespaces, so no small filesystem can be mounted for the test")
    small = tmp_path / "small"
    small.mkdir()
    train = " ".join(shlex.quote(a) for a in train_args(small / "run", data, "--config.train.num_steps=4"))
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           f"mount -t tmpfs -o size=2m tmpfs {shlex.quote(str(small))} && exec {train}"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines()
             if line.strip() and "%|" not in line and not re.match(r"\d\d:\d\d:\d\d [IW] ", line)]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: no space left on the device writing "), proc.stderr[-6000:]
    assert f"{small}/run/checkpoints/" in lines[0] and "Traceback" not in proc.stderr


def test_the_schedule_warning_names_the_lr_before_and_after():
    from sweet_jax.train import trainer

    optim = demo_config(file="critic.py", preset="demo").optim
    assert trainer.schedule_change(optim, 100, 100, 100) is None
    message = trainer.schedule_change(optim, 100, 200, 100)
    assert "made for 100 steps and now has 200" in message and "jumps from 0.0003 to 0.00" in message


def test_the_mfu_peak_is_measured_once_per_run(tmp_path, monkeypatch):
    import jax

    from sweet_jax.train import metrics

    first = metrics.run_peak_flops(tmp_path, jax.devices())
    monkeypatch.setattr(metrics, "peak_flops_total", lambda *_: (1.0, "measured again"))
    again = metrics.run_peak_flops(tmp_path, jax.devices())
    assert again[0] == first[0] and "recorded at the run's first start" in again[1]


@pytest.mark.slow
def test_the_command_line_runs_under_the_default_host_allocator_and_names_it(straight_run):
    """It re-executes itself once before jax starts (sweet_jax.host_malloc), and the log names the allocator."""
    import os
    from sweet_jax import host_malloc
    log = (straight_run / "stderr.txt").read_text()
    environ = {k: v for k, v in os.environ.items() if k not in (host_malloc.MODE_VAR, host_malloc.DONE_VAR)}
    mode, changes, _ = host_malloc.default_mode(environ)
    if changes:
        assert f"host allocator: {mode} (SWEET_JAX_MALLOC=system to turn off)" in log
    else:
        assert "host allocator: system" in log  # the automatic choice falls back without a warning


@pytest.mark.slow
def test_demo_run_writes_metrics_checkpoints_config_and_plot(straight_run):
    train = records(straight_run)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for key in DETERMINISTIC + ("tokens_per_s", "mfu"):
        assert all(np.isfinite(r[key]) for r in train), key
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in train)
    assert train[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)  # the critic starts as the reference
    assert train[-1]["loss"] < train[0]["loss"]
    evals = records(straight_run, "eval")
    assert evals and evals[-1]["step"] == STEPS and 0 <= evals[-1]["pair_accuracy"] <= 1
    assert steps_on_disk(straight_run) == [2, 4, 6]
    config = json.loads((straight_run / "config.json").read_text())
    assert config["train"]["num_steps"] == STEPS and config["loss"]["kind"] == "critic"
    [started] = [json.loads(line) for line in (straight_run / "invocations.jsonl").read_text().splitlines()]
    assert "sweet_jax.train" in " ".join(started["argv"]) and started["packages"]["jax"] and started["time"]
    assert started["devices"]["count"] == 1 and "git" in started
    assert (straight_run / "curves.png").stat().st_size > 10_000
    assert list((straight_run / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((straight_run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["eval_examples"] > 0


# The fault injected by the resume test: `python -m sweet_jax.train` whose checkpoint saves complete before the
# next step starts, and which hangs when step {step} is done (its saves durable) until it is killed.
HANG_AFTER_STEP = """
import runpy, sys, time
from sweet_jax.train import checkpoint, steps
save = checkpoint.Checkpointer.save
checkpoint.Checkpointer.save = lambda self, *a, **k: save(self, *a, **dict(k, wait=True))
make_step = steps.make_step
def hanging_factory(*a, **k):
    step_fn = make_step(*a, **k)
    def step(state, *rest):
        if int(state.step) == {step}:
            print("SWEET_JAX_TEST: hanging after step {step}", flush=True)
            while True:
                time.sleep(1)
        return step_fn(state, *rest)
    return step
steps.make_step = hanging_factory
runpy.run_module("sweet_jax.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_resume_after_sigkill_and_a_truncated_checkpoint_matches_the_uninterrupted_run(straight_run, data, tmp_path):
    """Killed (SIGKILL) after step 5 with checkpoints 2 and 4 on disk; checkpoint 4 then truncated: the rerun
    warns, falls back to step 2 (not 0), and ends with the same losses and parameters as the straight run."""
    workdir = tmp_path / "killed"
    args = train_args(workdir, data, "--config.data.eval_fraction=0.2")
    proc = subprocess.Popen([sys.executable, "-c", HANG_AFTER_STEP.format(step=5), *args[3:]], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.time() + 600
        for line in proc.stdout:  # the run says it finished step 5 (its saves durable), then waits
            if "hanging after step 5" in line or time.time() > deadline:
                break
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert steps_on_disk(workdir) == [2, 4]
    for f in (workdir / "checkpoints" / "4" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)

    resumed_proc = run_train(workdir, data, "--config.data.eval_fraction=0.2")
    assert "checkpoint step 4" in resumed_proc.stderr and "unreadable" in resumed_proc.stderr
    assert "resumed from step 2 instead of the latest step 4" in resumed_proc.stderr
    assert [p.name.split("-")[0] for p in (workdir / "corrupt_checkpoints").iterdir()] == ["4"]  # kept aside
    assert steps_on_disk(workdir) == [2, 4, 6]
    resumed, straight = records(workdir), records(straight_run)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(resumed, straight):
        assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}, a["step"]
    pa, pb = trained_params(workdir), trained_params(straight_run)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


@pytest.mark.slow
def test_a_run_stopped_at_a_step_is_the_whole_runs_checkpoint_of_that_step(straight_run, data, tmp_path):
    """train.stop_at=4 of a 6-step run: the same schedule (the same lr at each step), losses and parameters as the
    straight run's first 4 steps, and no step after."""
    workdir = tmp_path / "stopped"
    run_train(workdir, data, "--config.data.eval_fraction=0.2", "--config.train.stop_at=4")
    assert steps_on_disk(workdir) == [2, 4]
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 4
    stopped, straight = records(workdir), records(straight_run)
    assert [r["step"] for r in stopped] == [1, 2, 3, 4]
    for a, b in zip(stopped, straight):
        assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}, a["step"]
    reference = trained_params(straight_run, step=4)
    params = trained_params(workdir)
    assert params.keys() == reference.keys()
    for k in params:
        np.testing.assert_array_equal(params[k], reference[k], err_msg=str(k))


def test_a_stop_past_the_last_step_is_refused_before_the_model_is_built(data, tmp_path):
    from sweet_jax.train import trainer

    config = demo_config(file="critic.py", preset="demo", data__trajectories=str(data), data__max_len=256,
                         data__bucket=256, train__batch_size=4, train__num_steps=3, train__stop_at=5)
    with pytest.raises(trainer.TrainConfigError, match=r"train.stop_at=5 is past the run's last step \(3\)"):
        trainer.run(config, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_batch_the_configured_mesh_cannot_split_trains_on_a_chosen_mesh(data, tmp_path, caplog):
    """FSDP over the 8 devices (the presets' (1, -1, 1)) cannot split a batch of 4 pairs: the trainer runs on
    (1, 4, 2) instead, says so, and trains the step."""
    import logging

    from sweet_jax.train import trainer

    config = demo_config(file="critic.py", preset="demo", data__trajectories=str(data), data__max_len=256,
                         data__bucket=256, train__batch_size=4, train__num_steps=1, train__ckpt_every=0,
                         train__eval_every=0, data__eval_fraction=0.0, mesh__shape=(1, -1, 1))
    with caplog.at_level(logging.INFO, logger="sweet_jax.train"):
        summary = trainer.run(config, tmp_path / "chosen_mesh")
    assert summary["steps"] == 1
    assert any("using (1, 4, 2) (data, fsdp, tensor)" in r.getMessage() for r in caplog.records)
    assert any("mesh {'data': 1, 'fsdp': 4, 'tensor': 2}" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(data, tmp_path, monkeypatch):
    """The step's loss turns NaN at step 3: the run stops, checkpoint 2 (whose weights gave that loss) is
    moved aside, checkpoint 1 stays as the last good one."""
    from sweet_jax.train import steps, trainer

    real_factory = steps.make_step

    def factory_with_nan_at_step_3(*args, **kwargs):
        step_fn = real_factory(*args, **kwargs)

        def poisoned(state, batch, *rest):
            state, metrics = step_fn(state, batch, *rest)
            if int(state.step) == 3:
                metrics = dict(metrics, loss=metrics["loss"] * float("nan"))
            return state, metrics
        return poisoned

    monkeypatch.setattr(steps, "make_step", factory_with_nan_at_step_3)
    config = demo_config(file="critic.py", preset="demo", data__trajectories=str(data), data__max_len=256,
                         data__bucket=256, train__batch_size=4, train__num_steps=4, train__ckpt_every=1,
                         train__eval_every=0, data__eval_fraction=0.0, mesh__shape=(1, 1, 1))
    with pytest.raises(trainer.NanLossError) as error:
        trainer.run(config, tmp_path / "nan")
    message = str(error.value)
    assert "\n" not in message and "NaN/inf (nan) at step 3" in message
    assert "last good checkpoint is step 1" in message and "--config.optim.lr" in message
    assert steps_on_disk(tmp_path / "nan") == [1]
    assert [p.name.split("-")[0] for p in (tmp_path / "nan" / "corrupt_checkpoints").iterdir()] == ["2"]


@pytest.mark.parametrize("case", ["unknown_field", "missing_model_path", "empty_data", "mesh_too_big"])
def test_bad_input_gives_a_one_line_error(case, data, tmp_path):
    extra = {
        "unknown_field": ["--config.optim.lrr=1e-6"],
        "missing_model_path": [f"--config.model.path={tmp_path / 'no_such_model'}"],
        "empty_data": [f"--config.data.trajectories={tmp_path / 'empty.jsonl'}"],
        "mesh_too_big": ["--config.mesh.shape=(2,8,1)"],
    }[case]
    (tmp_path / "empty.jsonl").write_text("")
    proc = run_train(tmp_path / "run", data, *extra, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    expected = {
        "unknown_field": ["optim.lrr", "did you mean optim.lr"],
        "missing_model_path": ["config.model.path", "no_such_model", "--config.model.path"],
        "empty_data": ["config.data.trajectories", "no rows"],
        "mesh_too_big": ["mesh.shape", "needs 16 devices", "but this run has 1"],
    }[case]
    for text in expected:
        assert text in errors[0], errors[0]


def demo_config(**overrides):
    import importlib.util

    spec = importlib.util.spec_from_file_location("policy_or_critic", REPO / "configs" / overrides.pop("file"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(overrides.pop("preset"))
    for dotted, value in overrides.items():
        section, field = dotted.split("__")
        c[section][field] = value
    return c


def ranked_pairs(path, trajectories_path, tokenizer) -> pathlib.Path:
    """A pairs JSONL in the format `python -m sweet_jax.rank` writes: first-turn replies of a successful and a
    failed trajectory of each task, after the same prompt."""
    rows = [json.loads(line) for line in pathlib.Path(trajectories_path).read_text().splitlines()]
    by_task = collections.defaultdict(list)
    for r in rows:
        by_task[r["task"]["problem_description"]].append(r)
    out = []
    for i, group in enumerate(by_task.values()):
        best = max(group, key=lambda r: r["reward"])
        worst = min(group, key=lambda r: r["reward"])
        first = next(j for j, t in enumerate(best["dialogue_history"]) if t["role"] == "assistant")
        messages = [{"role": t["role"], "content": t["content"]} for t in best["dialogue_history"][:first]]
        reply = lambda r: next(t["content"] for t in r["dialogue_history"] if t["role"] == "assistant")  # noqa: E731
        out.append({"trajectory_index": i, "turn": 1, "task_key": f"task{i}", "prompt": messages,
                    "prompt_text": tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                    "chosen": reply(best), "rejected": reply(worst) + " (rejected)", "chosen_score": 1.0,
                    "rejected_score": 0.0, "rank_reference": "ref_with_info"})
    path = pathlib.Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


@pytest.mark.slow
def test_each_loss_kind_gets_its_examples_and_a_task_held_out_split(data, tmp_path):
    from sweet_jax.train import model_loading
    from sweet_jax.data import datasets
    from sweet_jax.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(model_loading.tokenizer_path(demo_config(file="critic.py", preset="demo")))
    pairs = ranked_pairs(tmp_path / "pairs.jsonl", data, tokenizer)
    common = dict(data__trajectories=str(data), data__pairs=str(pairs), data__max_len=4096, data__eval_fraction=0.34)
    built = {}
    for file, preset in [("critic.py", "demo"), ("critic.py", "demo_no_info"), ("policy.py", "demo"),
                         ("policy.py", "demo_mtdpo"), ("policy.py", "demo_rft")]:
        train_set, eval_set = datasets.build_datasets(demo_config(file=file, preset=preset, **common), tokenizer)
        built[preset if file == "critic.py" or preset != "demo" else "policy_dpo"] = (train_set, eval_set)
        assert len(train_set) and len(eval_set) and train_set.tasks == 4 and eval_set.tasks == 2
    P = {k: len(v[0].examples[0]) for k, v in built.items()}
    assert P == {"demo": 2, "demo_no_info": 2, "policy_dpo": 2, "demo_mtdpo": 2, "demo_rft": 1}
    assert all(v[0].num_sequences == P[k] for k, v in built.items())
    # The critic with c reads the reference solution: every sequence is longer than without it.
    with_c, without_c = built["demo"][0].examples, built["demo_no_info"][0].examples
    assert all(len(a) > len(b) for ex_a, ex_b in zip(with_c, without_c) for a, b in zip(ex_a, ex_b))
    # Step-level policy pairs: only the reply (turn id 1) is trained, after the shared prompt.
    chosen, rejected = built["policy_dpo"][0].examples[0]
    assert set(np.unique(chosen.turn_ids)) == {0, 1}
    prompt_len = int(np.argmax(chosen.turn_ids > 0))
    np.testing.assert_array_equal(chosen.input_ids[:prompt_len], rejected.input_ids[:prompt_len])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_policy_dpo_trains_on_ranked_pairs_and_saves_on_sigterm(data, tmp_path, monkeypatch, signum):
    """Step-level DPO on rank's pairs; a SIGTERM (TPU preemption) or a Ctrl-C during step 1 ends the run after
    that step with a checkpoint of it, and the command line's exit status names the signal."""
    from sweet_jax.train import model_loading, steps, trainer
    from sweet_jax.data.tokenizers import load_tokenizer

    real_factory = steps.make_step

    def factory_sigterm_in_step_1(*args, **kwargs):
        step_fn = real_factory(*args, **kwargs)

        def step_with_sigterm(state, batch, *rest):
            if int(state.step) == 0:
                os.kill(os.getpid(), signum)
            return step_fn(state, batch, *rest)
        return step_with_sigterm

    monkeypatch.setattr(steps, "make_step", factory_sigterm_in_step_1)
    tokenizer = load_tokenizer(model_loading.tokenizer_path(demo_config(file="critic.py", preset="demo")))
    pairs = ranked_pairs(tmp_path / "pairs.jsonl", data, tokenizer)
    config = demo_config(file="policy.py", preset="demo", data__pairs=str(pairs), data__max_len=256,
                         data__bucket=256, train__num_steps=3, train__eval_every=0, data__eval_fraction=0.0,
                         mesh__shape=(1, 1, 1))
    handler_before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(trainer.Preempted) as preempted:
        trainer.run(config, tmp_path / "policy")
    assert preempted.value.step == 1 and preempted.value.exit_code == 128 + signum
    assert steps_on_disk(tmp_path / "policy") == [1]
    rows = records(tmp_path / "policy")
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["loss"] == pytest.approx(np.log(2) + 0.01 * rows[0]["nll"], rel=1e-5)  # DPO at the reference + NLL
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handler_before  # handlers gone


def test_peak_flops_by_device_kind_and_measured_on_cpu():
    from sweet_jax.train import metrics

    assert metrics.known_peak_flops("TPU v6 lite") == 918e12
    assert metrics.known_peak_flops("TPU v5 lite") == 197e12
    assert metrics.known_peak_flops("TPU v5p") == 459e12
    assert metrics.known_peak_flops("TPU v4") == 275e12
    assert metrics.known_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.known_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert metrics.known_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert metrics.known_peak_flops("Some New Chip") is None
    peak = metrics.measure_cpu_matmul_peak(n=256, seconds=0.05)
    assert 1e8 < peak < 1e13


def test_metrics_log_drops_records_past_the_resume_point_and_plots(tmp_path):
    from sweet_jax.train import metrics

    writer = metrics.MetricsWriter(tmp_path)
    for step in (1, 2, 3, 4):
        writer.write(step, {"loss": 1.0 / step, "pair_accuracy": 0.5})
    writer.write(4, {"loss": 0.3}, split="eval")
    writer.close()
    resumed = metrics.MetricsWriter(tmp_path, resume_step=2)  # steps 3, 4 will be trained again
    resumed.write(2, {"loss": 9.0})  # step 2 is logged already: not again
    resumed.write(3, {"loss": 0.2})
    resumed.write(3, {"loss": 0.25}, split="eval")
    resumed.write(3, {"loss": 0.26}, split="eval")  # an eval of a step already evaluated: one line
    resumed.close()
    rows = metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["split"], r["loss"]) for r in rows] == [(1, "train", 1.0), (2, "train", 0.5), (3, "train", 0.2),
                                                                  (3, "eval", 0.25)]
    png = metrics.plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_entry_points_show_user_errors_as_one_line_and_exit_2(capsys):
    """errors.cli_main, shared by the train and export entry points."""
    import logging

    from sweet_jax import errors

    log = logging.getLogger("sweet_jax.test_cli")
    assert errors.cli_main(log, lambda: 7) == 7

    def bad_input():
        raise errors.SweetJaxError("config.data.max_len=0: must be > 0")
    with pytest.raises(SystemExit) as exited:
        errors.cli_main(log, bad_input)
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: config.data.max_len=0: must be > 0\n"
    with pytest.raises(KeyError):  # a bug is not a user error: it keeps its traceback
        errors.cli_main(log, lambda: {}["missing"])


@pytest.mark.slow
def test_scanned_sequence_parallel_training_matches_the_per_layer_model(data, tmp_path):
    """model.scan_layers + model.sequence_parallel (the layout the 8B/70B plan rows use) reach the trainer: on a
    (1, 2, 2) mesh the stacked-layer, token-split model trains like the per-layer one on one device, and its
    export is the same HF checkpoint."""
    from flax import nnx
    from safetensors.numpy import load_file
    from sweet_jax.train import export as run_export, model_loading, trainer
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.models import Llama, save_hf

    common = dict(file="critic.py", preset="demo", data__trajectories=str(data), data__max_len=256,
                  data__bucket=256, train__batch_size=4, train__num_steps=3, train__ckpt_every=3,
                  train__eval_every=0, data__eval_fraction=0.0)
    # Both runs start from one HF checkpoint (a scanned random init draws its layers differently).
    config = demo_config(**common)
    tokenizer_dir = model_loading.tokenizer_path(config)
    tokenizer = load_tokenizer(tokenizer_dir)
    init = Llama(model_loading.model_config(config, vocab_size=len(tokenizer), tokenizer=tokenizer), rngs=nnx.Rngs(0))
    save_hf(init, tmp_path / "init", tokenizer_dir=tokenizer_dir)
    common["model__path"] = str(tmp_path / "init")
    trainer.run(demo_config(**common, mesh__shape=(1, 1, 1)), tmp_path / "plain")
    trainer.run(demo_config(**common, mesh__shape=(1, 2, 2), model__scan_layers=True, model__sequence_parallel=True),
              tmp_path / "scan")
    model, _, _ = model_loading.restore_model(tmp_path / "scan")
    assert model.config.scan_layers and model.config.residual_sharding is not None
    plain, scan = records(tmp_path / "plain"), records(tmp_path / "scan")
    assert len(plain) == 3 and plain[-1]["loss"] != plain[0]["loss"]  # it trained
    np.testing.assert_allclose([r["loss"] for r in scan], [r["loss"] for r in plain], rtol=1e-5)
    tensors = {}
    for name in ("plain", "scan"):
        run_export.export_run(tmp_path / name, tmp_path / f"{name}_hf")
        tensors[name] = {k: v for f in sorted((tmp_path / f"{name}_hf").glob("*.safetensors"))
                         for k, v in load_file(f).items()}
    assert tensors["scan"].keys() == tensors["plain"].keys()
    for key, value in tensors["plain"].items():
        np.testing.assert_allclose(tensors["scan"][key], value, rtol=2e-5, atol=2e-6, err_msg=key)
