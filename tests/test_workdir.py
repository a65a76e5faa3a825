"""Run directories under hostile conditions: one trainer per workdir, a model directory is never a workdir, every
record is written whole, a full disk is one line."""
from __future__ import annotations

import errno
import json
import os
import pathlib

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


def test_tensorstores_full_disk_error_is_a_full_disk_naming_the_file():
    """Orbax writes arrays with TensorStore, which reports ENOSPC as a ValueError; a ValueError that is not one is
    not (the control)."""
    from sweet_jax.errors import disk_full

    error = ValueError('RESOURCE_EXHAUSTED: Error writing "layers.1.kernel/0.0" in OCDBT database at local file '
                       '"/runs/x/checkpoints/2.orbax-checkpoint-tmp/params/": Failed writing: "/runs/x/checkpoints/'
                       '2.orbax-checkpoint-tmp/params/d/68879b": Failed to write 179000 bytes to file 11: No space '
                       "left on device [os_error_code='28']")
    found = disk_full(error)
    assert found.errno == errno.ENOSPC
    assert found.filename == "/runs/x/checkpoints/2.orbax-checkpoint-tmp/params/d/68879b"
    assert disk_full(ValueError("RESOURCE_EXHAUSTED: Error writing: out of memory")) is None


def test_a_remote_path_that_cannot_be_reached_is_one_line_naming_it(capsys):
    """TensorFlow's file system (behind etils.epath) reports gs:// without network as its own error type with
    libcurl's message; any other error keeps its traceback (the control)."""
    from sweet_jax import cli

    def body():
        raise RuntimeError("Error executing an HTTP request: libcurl code 6 meaning 'Could not resolve hostname', "
                           "error details: Could not resolve host: www.googleapis.com\n\t when reading metadata of "
                           "gs://bucket/run")
    with pytest.raises(SystemExit) as exit_info:
        cli.guarded(body)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: cannot reach gs://bucket/run: Error executing an HTTP request: libcurl code 6")
    with pytest.raises(RuntimeError, match="a bug"):
        cli.guarded(lambda: (_ for _ in ()).throw(RuntimeError("a bug in gs://bucket/run's reader")))


def test_a_local_time_out_is_not_called_a_remote_path():
    """Orbax's save finalize times out on a local disk too (a process stopped for longer than its 1200 s): that
    error keeps its traceback; a time-out naming a remote path is still one line."""
    from sweet_jax.errors import remote_unreachable

    local = TimeoutError("ChainedFuture completed 3/5 futures but timed out after 2473.48 seconds.")
    local.__cause__ = TimeoutError("Thread write_metadata_after_commits did not complete within 1200 seconds.")
    assert remote_unreachable(local) is None
    assert remote_unreachable(ConnectionRefusedError("[Errno 111] Connection refused")) is None
    remote = remote_unreachable(TimeoutError("reading gs://bucket/run/checkpoints timed out after 60 s"))
    assert remote is not None and remote.startswith("cannot reach gs://bucket/run/checkpoints: ")


@pytest.mark.slow
def test_training_into_a_gs_path_without_network_is_one_line(tmp_path):
    """No network: the proxy's own name does not resolve (a .invalid name), so no request reaches storage. It was a
    traceback of TensorFlow's FailedPreconditionError."""
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "https_proxy": "http://no-such-proxy.invalid:9",
           "HTTPS_PROXY": "http://no-such-proxy.invalid:9", "http_proxy": "http://no-such-proxy.invalid:9"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.train", "--config", "configs/critic.py:demo",
                           "--workdir", "gs://sweet-jax-no-such-bucket/run"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: cannot reach gs://sweet-jax-no-such-bucket/run: ")
    # (TensorFlow's C++ logger may add its own warning about the credentials lookup: not a Python traceback)
