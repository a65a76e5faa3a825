"""Checkpointer: async save / exact restore onto shardings, keep-last-N, fallback past damaged checkpoints."""
from __future__ import annotations

import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from sweet_jax.train.checkpoint import CheckpointError, Checkpointer, abstract_like


def make_items(scale: float = 1.0):
    mesh = jax.make_mesh((8,), ("fsdp",))
    sharded = NamedSharding(mesh, PartitionSpec("fsdp"))
    params = {"w": jax.device_put(jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) * scale, sharded),
              "b": jnp.full((32,), scale, jnp.float32)}
    return {"params": params, "opt_state": optax.adamw(1e-3).init(params)}


def truncate_arrays(step_dir):
    for f in step_dir.rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)


def test_restore_returns_the_saved_arrays_meta_and_shardings(tmp_path):
    items = make_items()
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(7, items, {"data": {"epoch": 1, "index": 2}, "rng": [0, 42]})
    ckpt.wait()
    step, restored, meta = ckpt.restore(jax.tree.map(abstract_like, items))
    assert step == 7 and meta["data"] == {"epoch": 1, "index": 2} and meta["rng"] == [0, 42]
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(items)):
        np.testing.assert_array_equal(a, b)
        assert a.sharding == b.sharding
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(items["opt_state"])


def test_only_the_named_items_are_read(tmp_path):
    items = make_items()
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, items, {}, wait=True)
    _, restored, _ = ckpt.restore({"params": abstract_like(items["params"])})
    assert list(restored) == ["params"]


def test_keeps_the_last_n(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, make_items(step), {})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]


def test_truncated_latest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path / "ckpt")
    for step in (1, 2):
        ckpt.save(step, make_items(step), {"tag": step})
    ckpt.wait()
    truncate_arrays(tmp_path / "ckpt" / "2")
    with caplog.at_level(logging.WARNING, logger="sweet_jax.train.checkpoint"):
        step, restored, meta = Checkpointer(tmp_path / "ckpt").restore(jax.tree.map(abstract_like, make_items()))
    assert step == 1 and meta["tag"] == 1
    np.testing.assert_array_equal(restored["params"]["b"], np.full((32,), 1.0))
    assert "checkpoint step 2" in caplog.text and "unreadable" in caplog.text
    assert "resumed from step 1 instead of the latest step 2" in caplog.text
    # The damaged step is moved aside (kept), so the run can save step 2 again.
    assert Checkpointer(tmp_path / "ckpt").all_steps() == [1]
    assert [p.name.split("-")[0] for p in (tmp_path / "corrupt_checkpoints").iterdir()] == ["2"]


def test_no_readable_checkpoint_is_an_error_not_a_silent_fresh_start(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, make_items(), {}, wait=True)
    truncate_arrays(tmp_path / "ckpt" / "1")
    with pytest.raises(CheckpointError, match="every checkpoint .* is unreadable"):
        Checkpointer(tmp_path / "ckpt").restore(jax.tree.map(abstract_like, make_items()))


def test_empty_directory_restores_nothing_and_unknown_step_is_an_error(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    assert ckpt.restore({"params": abstract_like(make_items()["params"])}) is None
    ckpt.save(3, make_items(), {}, wait=True)
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 5 .*have \[3\]"):
        ckpt.restore({"params": abstract_like(make_items()["params"])}, step=5)


def test_a_checkpoint_of_other_shapes_is_a_config_change_named_as_such_and_left_in_place(tmp_path):
    """A config change of the parameter tree (e.g. a wider model) is not damage: nothing is moved aside."""
    ckpt = Checkpointer(tmp_path / "ckpt")
    for step in (1, 2):
        ckpt.save(step, make_items(), {}, wait=True)
    wider = {"params": {"w": jax.ShapeDtypeStruct((64, 48), jnp.float32), "b": jax.ShapeDtypeStruct((48,), jnp.float32)}}
    with pytest.raises(CheckpointError, match="step 2 .* other shapes than the model now built .* not damaged"):
        Checkpointer(tmp_path / "ckpt").restore(wider)
    assert Checkpointer(tmp_path / "ckpt").all_steps() == [1, 2]
    assert not (tmp_path / "corrupt_checkpoints").exists()


def test_a_rerun_after_every_checkpoint_was_moved_aside_does_not_restart_from_step_0(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, make_items(), {}, wait=True)
    truncate_arrays(tmp_path / "ckpt" / "1")
    with pytest.raises(CheckpointError, match="every checkpoint"):
        Checkpointer(tmp_path / "ckpt").restore(jax.tree.map(abstract_like, make_items()))
    with pytest.raises(CheckpointError, match="unreadable one.* were moved to .*corrupt_checkpoints.*step 0"):
        Checkpointer(tmp_path / "ckpt").restore(jax.tree.map(abstract_like, make_items()))


def test_a_relative_directory_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = Checkpointer("runs/a run/ckpt")  # Orbax itself refuses a relative path
    ckpt.save(1, make_items(), {"tag": 1}, wait=True)
    monkeypatch.chdir(tmp_path / "runs")
    step, _, meta = Checkpointer("a run/ckpt").restore(jax.tree.map(abstract_like, make_items()))
    assert (step, meta["tag"]) == (1, 1)


def test_a_restore_error_that_is_not_about_the_bytes_moves_nothing(tmp_path, monkeypatch):
    """The quarantine decides on what it reads back: good files and an error about something else (memory here)
    leave the checkpoint where it is, and the error says so."""
    ckpt = Checkpointer(tmp_path / "ckpt")
    for step in (1, 2):
        ckpt.save(step, make_items(step), {}, wait=True)

    def out_of_memory(self, step, abstract_items):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1073741824 bytes")

    monkeypatch.setattr(Checkpointer, "_restore_step", out_of_memory)
    with pytest.raises(CheckpointError, match=r"could not restore checkpoint step 2 .*RESOURCE_EXHAUSTED.*left in "
                                              "place: the error is not about its bytes"):
        Checkpointer(tmp_path / "ckpt").restore(jax.tree.map(abstract_like, make_items()))
    assert Checkpointer(tmp_path / "ckpt").all_steps() == [1, 2]
    assert not (tmp_path / "corrupt_checkpoints").exists()


def test_a_metadata_file_that_is_not_json_is_damage(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    for step in (1, 2):
        ckpt.save(step, make_items(step), {"tag": step}, wait=True)
    (tmp_path / "ckpt" / "2" / "params" / "_METADATA").write_text('{"tree_metadata": ')  # cut by a full disk
    step, _, meta = Checkpointer(tmp_path / "ckpt").restore(jax.tree.map(abstract_like, make_items()))
    assert (step, meta["tag"]) == (1, 1)
    assert [p.name.split("-")[0] for p in (tmp_path / "corrupt_checkpoints").iterdir()] == ["2"]


def test_a_write_task_that_failed_on_a_full_disk_is_not_logged_when_collected_and_others_still_are(caplog):
    """A full disk fails every in-flight array write of a save; the save's own error ends the run as one line
    (errors.disk_full), and asyncio logged each write task nobody awaited ("Task exception was never retrieved")
    when it was collected, at exit or before: a traceback after the one line, in about one run of ten."""
    import asyncio
    import gc

    async def fails(message):
        raise ValueError(message)

    def leave_unretrieved(message):
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(fails(message))
            loop.run_until_complete(asyncio.sleep(0))
            assert task.done()
        finally:
            loop.close()
        del task
        gc.collect()

    full = ('RESOURCE_EXHAUSTED: Error writing "1.0.mu.w/0.0" in OCDBT database at local file "/tmp/run/d/a0": '
            "No space left on device [os_error_code='28']")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        leave_unretrieved(full)
        assert not [r for r in caplog.records if r.name == "asyncio"]
        leave_unretrieved("some other failure")
    logged = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert len(logged) == 1 and logged[0].startswith("Task exception was never retrieved") and "other" in logged[0]


@pytest.mark.parametrize("dropped", [True, False])
def test_after_a_full_disk_a_write_that_never_ran_is_not_warned_of_at_exit(dropped):
    """The other trace of a save a full disk cut short: its array writes that never started, each a coroutine never
    awaited, which Python warns of at exit after the one-line error. Dropped once the run ends on a full disk."""
    import subprocess
    import sys

    script = ("from sweet_jax import errors\n"
              "async def write_fragment():\n    pass\n"
              f"{'errors.drop_abandoned_writes()' if dropped else 'pass'}\n"
              "writes = [write_fragment()]\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).resolve().parents[1])
    assert proc.returncode == 0
    assert (proc.stderr == "") if dropped else ("was never awaited" in proc.stderr), proc.stderr
