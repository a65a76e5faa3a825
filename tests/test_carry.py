"""A run's small state carried to another machine (sweet_jax/pipeline/carry.py), the stage rule that trains again
only the models a stage still to run reads (Run.stage's consumers), and what a finished stage leaves behind. The
whole pipeline resumed from a carried state:
tests/test_pipeline.py::test_a_run_goes_on_from_its_carried_state_on_a_new_machine."""
import gc
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from sweet_jax.pipeline import carry, stages


def _workdir(root: pathlib.Path) -> pathlib.Path:
    """A workdir's shape: an HF directory and checkpoints (models), records and episodes (small state)."""
    wd = root / "run"
    (wd / "init/policy_hf").mkdir(parents=True)
    (wd / "init/policy_hf/config.json").write_text("{}")
    (wd / "init/policy_hf/model.safetensors").write_bytes(b"\0" * 64)
    (wd / "init/train/checkpoints/8").mkdir(parents=True)
    (wd / "init/train/checkpoints/8/state").write_bytes(b"\0" * 64)
    (wd / "init/train/metrics.jsonl").write_text('{"step": 1, "loss": 1.5}\n')
    (wd / "init/train/.lock").write_text("pid 1")
    (wd / "init/done.json").write_text(json.dumps({"summary": {"policy_hf": str(wd / "init/policy_hf")}}))
    (wd / "critic/train").mkdir(parents=True)          # a stage still running: it starts over elsewhere
    (wd / "critic/train/metrics.jsonl").write_text('{"step": 1, "loss": 0.7}\n')
    (wd / "pipeline_config.json").write_text("{}")
    (wd / "eval/rft").mkdir(parents=True)
    (wd / "eval/rft/trajectories.jsonl").write_text('{"reward": 1.0}\n')
    (wd / "eval/rft/done.json").write_text(json.dumps({"summary": {
        "trajectories": str(wd / "eval/rft/trajectories.jsonl"), "policy": str(wd / "policies/rft/hf"),
        "paths": [str(wd / "eval/rft"), "elsewhere/" + str(wd)], "success_rate": 0.5}}))
    return wd


def test_the_carry_keeps_every_file_but_the_models_and_moves_paths_on_restore(tmp_path):
    wd = _workdir(tmp_path)
    assert carry.save(wd, tmp_path / "carry") == 5
    kept = sorted(str(p.relative_to(tmp_path / "carry")) for p in (tmp_path / "carry").rglob("*") if p.is_file())
    assert kept == ["carry.json", "eval/rft/done.json", "eval/rft/trajectories.jsonl", "init/done.json",
                    "init/train/metrics.jsonl", "pipeline_config.json"]
    assert carry.save(wd, tmp_path / "carry") == 0            # unchanged files are not copied again
    (wd / "init/train/metrics.jsonl").write_text('{"step": 1, "loss": 1.5}\n{"step": 2, "loss": 1.2}\n')
    assert carry.save(wd, tmp_path / "carry") == 1

    new = tmp_path / "elsewhere" / "run2"
    (new / "eval/rft").mkdir(parents=True)
    (new / "eval/rft/trajectories.jsonl").write_text("mine\n")   # a file the workdir has is never replaced
    assert carry.restore(tmp_path / "carry", new) == 4
    assert (new / "eval/rft/trajectories.jsonl").read_text() == "mine\n"
    assert (new / "init/train/metrics.jsonl").read_text().count("\n") == 2
    assert not (new / "init/policy_hf").exists() and not (new / "carry.json").exists()
    record = json.loads((new / "eval/rft/done.json").read_text())["summary"]
    assert record == {"trajectories": str(new / "eval/rft/trajectories.jsonl"), "policy": str(new / "policies/rft/hf"),
                      "paths": [str(new / "eval/rft"), "elsewhere/" + str(wd)], "success_rate": 0.5}
    assert carry.restore(tmp_path / "nothing", new) == 0


def test_a_stage_whose_models_are_gone_runs_again_only_for_a_stage_that_still_reads_them(tmp_path):
    run = stages.Run(ml_collections.ConfigDict(), tmp_path)
    calls = []

    def train(d):
        calls.append(d.name)
        (d / "hf").mkdir()
        (d / "hf/model.safetensors").write_bytes(b"1")
        return {"hf": str(d / "hf"), "steps": 8}

    assert run.stage("policy", "policy", train, consumers=["eval"]) == {"hf": str(tmp_path / "policy/hf"), "steps": 8}
    assert run.stage("policy", "policy", train, consumers=["eval"])["steps"] == 8 and calls == ["policy"]
    (tmp_path / "policy/hf/model.safetensors").unlink()
    (tmp_path / "policy/hf").rmdir()                  # a new machine: the record came back, the model did not
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval/done.json").write_text(json.dumps({"summary": {}}))
    run.stage("policy", "policy", train, consumers=["eval"])
    assert calls == ["policy"]                        # its one reader finished: not trained again
    (tmp_path / "eval/done.json").unlink()
    run.stage("policy", "policy", train, consumers=["eval"])
    assert calls == ["policy", "policy"] and (tmp_path / "policy/hf/model.safetensors").exists()
    (tmp_path / "policy/hf/model.safetensors").unlink()
    (tmp_path / "policy/hf").rmdir()
    run.stage("policy", "policy", train)              # no consumers named: any later stage may read it
    assert len(calls) == 3
    record = json.loads((tmp_path / "policy/done.json").read_text())
    assert record["host"]["cores"] >= 1 and "processor" in record["host"]


def test_a_finished_stage_leaves_no_array_held_only_by_a_reference_cycle(tmp_path):
    """A stage's trainer and model often sit in reference cycles; Run.stage collects them when the stage ends, so
    the next stage does not run beside the last one's parameters (automatic collection is off here: without that
    collection the cycle's array would still be alive)."""
    run = stages.Run(ml_collections.ConfigDict(), tmp_path)
    ids = []

    def train(d):
        trainer = {"params": jnp.ones((256, 256))}
        trainer["self"] = trainer                       # a cycle, as a trainer's callbacks and modules make
        ids.append(id(trainer["params"]))
        return {"steps": 1}

    enabled = gc.isenabled()
    gc.disable()
    try:
        run.stage("policy", "policy", train)
        assert ids and ids[0] not in {id(a) for a in jax.live_arrays()}
    finally:
        if enabled:
            gc.enable()


def test_method_learning_rates_replace_the_grid_rates_for_the_methods_they_name():
    c = ml_collections.ConfigDict({"methods": "zero_shot,rft,sweet", "tasks": {"num_validation": 4},
                                   "select": {"lrs": "1e-5,3e-6", "steps": "8,16", "frozen": "",
                                              "method_lrs": "sweet:3e-6"}})
    grid = stages.selection_grid(c)
    assert grid.lrs_of("sweet") == [3e-6] and grid.lrs_of("rft") == [3e-6, 1e-5] and grid.steps_of("sweet") == [8, 16]
    c.select.lrs, c.select.method_lrs = "", "rft:1e-5, sweet:3e-6"
    grid = stages.selection_grid(c)
    assert grid.lrs_of("rft") == [1e-5] and grid.all_lrs == [3e-6, 1e-5]
    for bad, message in (("zero_shot:1e-5", "not a trained method"), ("sweet=3e-6", "not a trained method"),
                         ("sweet:fast", "expected method:learning_rate"), ("sweet:-1", "must be positive")):
        c.select.method_lrs = bad
        with pytest.raises(stages.PipelineError, match=message):
            stages.selection_grid(c)
