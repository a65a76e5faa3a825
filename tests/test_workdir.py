"""Run directories under hostile conditions: one trainer per workdir, a model directory is never a workdir, every
record is written whole, a full disk is one line."""
from __future__ import annotations

import errno
import json
import os

import pytest

from sweet_jax.train import rundir, trainer
from test_train import demo_config


def critic_demo():
    return demo_config(file="critic.py", preset="demo", train__num_steps=1)


def test_a_second_trainer_on_a_workdir_in_use_is_refused_naming_the_first(tmp_path):
    with rundir.workdir_lock(tmp_path / "run"):
        with pytest.raises(rundir.RunDirError, match=rf"run is in use by another trainer \(pid {os.getpid()} on .*"
                                                     "pick another --workdir"):
            trainer.run(critic_demo(), tmp_path / "run")
    with rundir.workdir_lock(tmp_path / "run"):  # released when the first one ends (or dies: the kernel's lock)
        pass


def test_the_lock_file_is_gone_once_the_trainer_ends_and_a_stale_one_is_taken_over(tmp_path):
    with rundir.workdir_lock(tmp_path / "run"):
        assert f"pid {os.getpid()} on" in (tmp_path / "run" / ".lock").read_text()
    assert not (tmp_path / "run" / ".lock").exists()
    (tmp_path / "run" / ".lock").write_text("pid 999999 on gone, started 2026-01-01\n")  # a SIGKILLed trainer's
    with rundir.workdir_lock(tmp_path / "run"):
        assert f"pid {os.getpid()} on" in (tmp_path / "run" / ".lock").read_text()
    assert not (tmp_path / "run" / ".lock").exists()


@pytest.mark.parametrize("model_file", ["model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                                        "model-q4.gguf"])
def test_a_model_directory_is_refused_as_a_workdir_and_left_untouched(tmp_path, model_file):
    model = tmp_path / "hf"
    model.mkdir()
    hf_config = json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 100})
    (model / "config.json").write_text(hf_config)
    (model / model_file).write_bytes(b"{}")
    with pytest.raises(rundir.RunDirError, match=f"holds a model \\({model_file}\\), not a training run"):
        trainer.run(critic_demo(), model, accept_config_change=True)
    assert (model / "config.json").read_text() == hf_config and sorted(os.listdir(model)) == sorted(
        ["config.json", model_file])


def test_a_foreign_or_damaged_config_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(rundir.RunDirError, match="config.json that is not a training run's"):
        rundir.check_workdir(tmp_path)
    (tmp_path / "config.json").write_text('{"train": {"batch_')  # cut short
    with pytest.raises(rundir.RunDirError, match="is not JSON"):
        rundir.check_workdir(tmp_path)


def test_a_record_write_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text('{"old": true}\n')

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        rundir.write_atomic(path, json.dumps({"new": "x" * 100000}))
    monkeypatch.undo()
    assert path.read_text() == '{"old": true}\n' and os.listdir(tmp_path) == ["config.json"]


def test_a_full_disk_is_one_line_naming_the_file_and_what_to_do(capsys):
    from sweet_jax import cli

    def body():
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoints/7")
        except OSError as e:
            raise RuntimeError("a library wrapped it") from e
    with pytest.raises(SystemExit) as exit_info:
        cli.guarded(body)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: no space left on the device writing /runs/x/checkpoints/7: free space")
