"""Two JAX processes on this machine (jax.distributed over localhost, gloo CPU collectives, 4 fake devices
each) train exactly like one process with 8 devices."""
from __future__ import annotations

import socket
import subprocess

import numpy as np
import pytest

from test_train import REPO, env, records, small_trajectories, train_args

STEPS = 2


def args(workdir, data):
    return train_args(workdir, data, f"--config.train.num_steps={STEPS}", "--config.train.batch_size=8",
                      "--config.train.ckpt_every=0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    data = small_trajectories(tmp_path / "traj.jsonl", num_tasks=2)
    one = subprocess.run(args(tmp_path / "one", data), cwd=REPO, env=env(devices=8), capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]

    port = free_port()
    procs = [subprocess.Popen(args(tmp_path / "two", data), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=env(devices=4, JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                                      JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert "2 process(es)" in outputs[0][1] and "over 8 devices" in outputs[0][1]

    single, multi = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["step"] for r in multi] == [r["step"] for r in single] == list(range(1, STEPS + 1))
    # (pair_accuracy is left out: at the first steps every margin is ~1e-8 of float noise, so its sign, and
    # the accuracy, depend on the reduction order.)
    for key in ("loss", "margin", "chosen_score", "rejected_score", "grad_norm", "lr"):
        np.testing.assert_allclose([r[key] for r in multi], [r[key] for r in single], rtol=1e-6, atol=1e-7,
                                   err_msg=key)
    # Both processes took part in the final checkpoint (arrays sharded over both).
    final = tmp_path / "two" / "checkpoints" / str(STEPS) / "params"
    assert (final / "ocdbt.process_0").exists() and (final / "ocdbt.process_1").exists()
