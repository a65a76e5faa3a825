"""A pipeline reads and checks every file and setting it will use when it starts (sweet_jax.pipeline.inputs): a
damaged frozen selection or reused run is refused in seconds, naming the file and the field, before the tasks,
init and offline stages run (hours, in smollm2_select)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from sweet_jax.pipeline import inputs, stages

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAINED = ("rft", "mtdpo", "sweet_no_info", "sweet")   # the test preset's trained methods (and zero_shot)


def pipeline_config(**overrides):
    sys.path.insert(0, str(REPO))
    from configs import pipeline as pipeline_configs

    c = pipeline_configs.get_config("test")
    for field, value in overrides.items():
        *section, name = field.split("__")
        (c[section[0]] if section else c)[name] = value
    return c


def honest_selection(path) -> pathlib.Path:
    """What a selecting run writes (stages.write_selection): its grid and every trained method's choice."""
    record = {"lrs": [0.001, 0.003], "steps": [1, 2], "seed": 0, "validation_tasks": 3, "episodes_per_task": 1,
              "zero_shot": {"success_rate": 0.0, "tests_passed_pct": 10.0},
              "methods": {m: {"curve": {"0.001/2": {"lr": 0.001, "step": 2, "success_rate": 0.5,
                                                    "tests_passed_pct": 60.0, "turns_per_episode": 3.0}},
                              "choice": {"lr": 0.001, "step": 2}} for m in TRAINED}}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def damage_selection(path, how):
    record = json.loads(path.read_text())
    if how == "truncated":
        path.write_text(path.read_text()[:200])
    elif how == "binary":
        path.write_bytes(b"\x00\x01\x02\xff" * 64)
    elif how == "method missing":
        del record["methods"]["sweet"]
    elif how == "step past the grid":
        record["methods"]["mtdpo"]["choice"]["step"] = 5
    elif how == "lr of -1":
        record["methods"]["rft"]["choice"]["lr"] = -1
    elif how == "NaN lr":
        record["methods"]["rft"]["choice"]["lr"] = float("nan")
    elif how == "lr off the grid":
        record["methods"]["sweet"]["choice"]["lr"] = 0.002
    elif how == "steps not numbers":
        record["steps"] = ["1", "2"]
    elif how == "link to /dev/zero":
        path.unlink()
        path.symlink_to("/dev/zero")
    if how not in ("truncated", "binary", "link to /dev/zero"):
        path.write_text(json.dumps(record))


@pytest.mark.parametrize("how, message", [
    ("truncated", r"malformed JSON .*the file ends early"),
    ("binary", r"is not UTF-8 text"),
    ("method missing", r"no choice for method 'sweet' \(it has rft, mtdpo, sweet_no_info\)"),
    ("step past the grid", r"field 'methods.mtdpo.choice.step': 5 is not one of its steps \(1, 2\)"),
    ("lr of -1", r"field 'methods.rft.choice.lr': -1 is not a positive learning rate"),
    ("NaN lr", r"field 'methods.rft.choice.lr': NaN is not a positive learning rate"),
    ("lr off the grid", r"field 'methods.sweet.choice.lr': 0.002 is not one of its learning rates \(0.001, 0.003\)"),
    ("steps not numbers", r"field 'steps': \[\"1\", \"2\"\] is not a list of positive step counts"),
    ("link to /dev/zero", r"is not a regular file"),
])
def test_a_damaged_frozen_selection_is_refused_before_any_stage_naming_the_file(tmp_path, how, message):
    selection = honest_selection(tmp_path / "selection.json")
    damage_selection(selection, how)
    c = pipeline_config(select__frozen=str(selection))
    with pytest.raises(stages.PipelineError, match=message) as refused:
        stages.run_pipeline(c, tmp_path / "run")
    assert str(selection) in str(refused.value)
    assert not (tmp_path / "run").exists()   # not one stage ran


def test_an_honest_frozen_selection_passes_the_start_and_gives_its_choices(tmp_path):
    c = pipeline_config(select__frozen=str(honest_selection(tmp_path / "selection.json")))
    inputs.check_inputs(c, stages.methods_of(c))
    grid = stages.selection_grid(c)
    assert (grid.lrs, grid.steps, grid.total_steps) == ([0.001, 0.003], [1, 2], 2)
    assert {m: (grid.lrs_of(m), grid.steps_of(m)) for m in TRAINED} == {m: ([0.001], [2]) for m in TRAINED}


def test_a_frozen_selection_of_fewer_methods_serves_a_run_of_those_methods(tmp_path):
    selection = honest_selection(tmp_path / "selection.json")
    damage_selection(selection, "method missing")
    c = pipeline_config(select__frozen=str(selection), methods="zero_shot,rft")
    inputs.check_inputs(c, stages.methods_of(c))   # sweet is not in this run: its missing choice does not matter


def test_the_command_refuses_a_truncated_selection_in_one_line_before_the_tasks_stage(tmp_path):
    selection = honest_selection(tmp_path / "selection.json")
    damage_selection(selection, "truncated")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.pipeline", "--config", "configs/pipeline.py:test",
                           "--workdir", str(tmp_path / "run"), f"--config.select.frozen={selection}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert f"config.select.frozen='{selection}'" in errors[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "tasks").exists()


# ----------------------------------------------------------------------------------------------------------
# A reused starting policy (config.init.from_run)
# ----------------------------------------------------------------------------------------------------------

def finished_init(workdir: pathlib.Path, config) -> pathlib.Path:
    """The files a finished run's init stage leaves, as reuse_init reads them."""
    (workdir / "init" / "policy_hf").mkdir(parents=True)
    (workdir / "init" / "policy_hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (workdir / "init" / "demos.jsonl").write_text("")
    (workdir / "init" / "done.json").write_text(json.dumps(
        {"summary": {"policy_hf": str(workdir / "init" / "policy_hf"), "kind": "sft", "demos": 24}, "seconds": 12.5}))
    (workdir / "pipeline_config.json").write_text(config.to_json_best_effort())
    return workdir


@pytest.mark.parametrize("damage, message", [
    (lambda w: (w / "init/done.json").write_text('{"summary": {"policy_hf": '), r"init/done.json:1: malformed JSON"),
    (lambda w: (w / "init/done.json").write_text('{"seconds": 3}'), r"init/done.json: field 'summary': missing"),
    (lambda w: (w / "pipeline_config.json").write_text((w / "pipeline_config.json").read_text()[:100]),
     r"pipeline_config.json:\d+: malformed JSON"),
    (lambda w: (w / "init/policy_hf/config.json").unlink(), r"its starting policy=.* is not an HF checkpoint"),
    (lambda w: (w / "init/demos.jsonl").unlink(), r"init/demos.jsonl does not exist"),
    (lambda w: (w / "init/done.json").unlink(), r"init/done.json does not exist"),
])
def test_a_damaged_reused_run_is_refused_before_any_stage_naming_the_file(tmp_path, damage, message):
    c = pipeline_config()
    source = finished_init(tmp_path / "seed0", c)
    damage(source)
    c.init.from_run = str(source)
    with pytest.raises(stages.PipelineError, match=f"config.init.from_run='{source}'.*{message}"):
        stages.run_pipeline(c, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_reused_run_of_other_init_settings_is_refused_at_the_start(tmp_path):
    c = pipeline_config()
    source = finished_init(tmp_path / "seed0", c)
    c.init.from_run, c.model.hidden_size = str(source), 48
    with pytest.raises(stages.PipelineError, match=r"was trained with other settings \(model.hidden_size\)"):
        stages.run_pipeline(c, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_honest_reused_run_passes_the_start_and_is_copied(tmp_path):
    c = pipeline_config()
    source = finished_init(tmp_path / "seed0", c)
    c.seed, c.init.from_run = 1, str(source)   # another seed of the same comparison
    inputs.check_inputs(c, stages.methods_of(c))
    summary = stages.reuse_init(stages.Run(c, tmp_path / "run"), _made(tmp_path / "run" / "init"))
    assert summary["reused_from"] == str(source) and summary["reused_seconds"] == 12.5 and summary["demos"] == 24
    assert (tmp_path / "run/init/policy_hf/config.json").exists() and (tmp_path / "run/init/demos.jsonl").exists()


def _made(d: pathlib.Path) -> pathlib.Path:
    d.mkdir(parents=True)
    return d


@pytest.mark.parametrize("field", ["collect.trajectories", "tasks.train_path"])
def test_a_missing_data_file_of_a_later_stage_is_refused_at_the_start(tmp_path, field):
    section, name = field.split(".")
    c = pipeline_config(**{f"{section}__{name}": str(tmp_path / "typo.jsonl")})
    with pytest.raises(stages.PipelineError, match=rf"config.{field}: .*typo.jsonl: file not found"):
        stages.run_pipeline(c, tmp_path / "run")
    assert not (tmp_path / "run").exists()
