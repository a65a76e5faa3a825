"""Experiment tracking: metrics.jsonl always, TensorBoard event files by default, W&B when named in
metrics.writers: offline unless configured, and never a reason for a run to stop (absent, failing)."""
from __future__ import annotations

import json
import logging
import pathlib
import struct
import sys
import types

import jax.numpy as jnp
import pytest

from sweet_jax import config_utils
from sweet_jax.train import losses, metrics
from sweet_jax.pipeline import stages as pipeline


def event_scalars(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from the TFRecord event files under logdir (length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list] = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
            i += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


DPO_STEP = {"loss": 0.7, "dpo_loss": 0.69, "nll": 1.5, "chosen_logp": -12.0, "rejected_logp": -14.0, "margin": 0.2}


def test_dpo_loss_reports_its_parts_and_the_chosen_and_rejected_logprobs():
    _, m = losses.dpo_loss(jnp.array([-10.0, -14.0]), jnp.array([-12.0, -16.0]), jnp.array([-11.0, -15.0]),
                           jnp.array([-11.0, -15.0]), beta=0.1, chosen_nll_B=jnp.array([1.0, 2.0]), nll_coef=0.01)
    assert float(m["chosen_logp"]) == -12.0 and float(m["rejected_logp"]) == -14.0
    assert float(m["nll"]) == 1.5 and float(m["margin"]) == pytest.approx(0.2)
    assert float(m["loss"]) == pytest.approx(float(m["dpo_loss"]) + 0.01 * 1.5)


def test_tensorboard_event_files_hold_every_scalar_of_a_step(tmp_path):
    writer = metrics.MetricsWriter(tmp_path, enabled=True)
    writer.write(1, DPO_STEP)
    writer.write(1, {"loss": 0.6}, split="eval")
    writer.close()
    scalars = event_scalars(tmp_path / "tensorboard")
    assert {f"train/{k}" for k in DPO_STEP} | {"eval/loss"} == set(scalars)
    assert scalars["train/chosen_logp"] == [(1, -12.0)]


def test_without_wandb_installed_a_one_line_note_and_the_other_writers_go_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)   # what `import wandb` meets where it is not installed
    with caplog.at_level(logging.WARNING, logger="sweet_jax"):
        writer = metrics.MetricsWriter(tmp_path, enabled=True, writers="tensorboard,wandb")
    writer.write(1, DPO_STEP)
    writer.close()
    [note] = [r.getMessage() for r in caplog.records]
    assert "wandb" in note and "pip install wandb" in note and "\n" not in note
    assert set(event_scalars(tmp_path / "tensorboard")) == {f"train/{k}" for k in DPO_STEP}
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["dpo_loss"] == 0.69


class FakeWandb(types.ModuleType):
    """The part of the wandb API the writer uses, recording its calls (the real one spawns a service process)."""

    def __init__(self, fail_log: bool = False):
        super().__init__("wandb")
        self.inits, self.logged, self.finished, self.fail_log = [], [], 0, fail_log

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                if fake.fail_log:
                    raise ConnectionError("wandb: network unreachable")
                fake.logged.append((step, values))

            def finish(self):
                fake.finished += 1
        return Run()


def test_with_wandb_installed_it_logs_offline_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for step in (1, 2):   # a run, then its resume
        writer = metrics.MetricsWriter(tmp_path, enabled=True, writers="wandb", group="seed0", name="critic",
                                       resume_step=step - 1, config={"optim": {"lr": 1e-3}})
        writer.write(step, DPO_STEP)
        writer.close()
    first, resumed = fake.inits
    assert first["mode"] == "offline" and first["group"] == "seed0" and first["name"] == "critic"
    assert first["dir"] == str(tmp_path) and first["config"] == {"optim": {"lr": 1e-3}}
    assert resumed["id"] == first["id"] and resumed["resume"] == "allow"
    assert [step for step, _ in fake.logged] == [1, 2] and fake.logged[0][1]["train/nll"] == 1.5
    assert fake.finished == 2 and not (tmp_path / "tensorboard").exists()


def test_a_writer_that_fails_mid_run_is_dropped_and_the_others_go_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail_log=True))
    writer = metrics.MetricsWriter(tmp_path, enabled=True, writers="tensorboard,wandb")
    with caplog.at_level(logging.WARNING, logger="sweet_jax"):
        writer.write(1, DPO_STEP)
        writer.write(2, DPO_STEP)
    writer.close()
    [note] = [r.getMessage() for r in caplog.records]
    assert "wandb failed at step 1" in note and "network unreachable" in note
    assert [s for s, _ in event_scalars(tmp_path / "tensorboard")["train/loss"]] == [1, 2]


def test_an_unknown_writer_is_a_config_error_naming_the_choices():
    config = config_utils.base_config()
    config.metrics.writers = "tensorboard,mlflow"
    with pytest.raises(config_utils.TrainConfigError, match=r"metrics.writers.*'mlflow'.*tensorboard, wandb"):
        config_utils.check_config(config)


def test_the_pipeline_groups_its_training_stages_under_its_run(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("sweet_jax.train.trainer.run", lambda tconfig, workdir, **_: seen.append(tconfig) or {
        "steps": 1, "train_examples": 1, "eval_examples": 0})
    monkeypatch.setattr(pipeline, "export_trained", lambda *_: None)
    config = config_utils.base_config()   # stands in for a pipeline config: it has the same metrics section
    config.metrics.writers = "tensorboard,wandb"
    run = pipeline.Run(config, tmp_path / "seed0")
    for stage in ("critic", "policies/sweet"):
        pipeline.train_and_export(run, run.path(stage), config_utils.base_config())
    assert [(c.metrics.group, c.metrics.name, c.metrics.writers) for c in seen] == [
        ("seed0", "seed0/critic", "tensorboard,wandb"), ("seed0", "seed0/policies/sweet", "tensorboard,wandb")]
