"""Every file and setting a pipeline run will use, read and checked when it starts (check_inputs, called by
run_pipeline before its first stage): a frozen selection, a finished run whose starting policy is reused, the
starting checkpoint, the task and trajectory files. A wrong one fails the run in seconds, naming the file and
the field, instead of hours in, after the tasks, init and offline stages, naming a training field."""
from __future__ import annotations

import json
import math
import pathlib
from typing import Sequence

from sweet_jax import jsonl
from sweet_jax.errors import SweetJaxError
from sweet_jax.train import rundir

DONE = "done.json"
INIT_FIELDS = ("init", "model", "tasks")   # what decides the starting policy (not the run seed)
# ... except these: how the steps are laid out in memory (same values and gradients, other speed and memory).
LAYOUT_FIELDS = ("model.remat", "model.scan_layers", "model.attention_impl")
# Methods the pipeline does not train with settings of their own: the starting policy, and iterative SWEET-RL
# (SWEET-RL's choice, then rounds).
UNTRAINED = ("zero_shot", "sweet_iterative")


class PipelineError(SweetJaxError):
    """A pipeline config or input that cannot work; the message says which field to change."""


def check_inputs(config, methods: Sequence[str]) -> None:
    """Each file and setting the stages of `methods` will read, checked now (the first wrong one a PipelineError)."""
    if "sweet_iterative" in methods and "sweet" not in methods:
        raise PipelineError("config.methods: sweet_iterative starts from SWEET-RL's policy (its round 1); add sweet")
    if "sweet_balanced" in methods and "sweet" not in methods:
        raise PipelineError("config.methods: sweet_balanced ranks with SWEET-RL's critic; add sweet")
    select = config.get("select")
    if select is not None and select.frozen:
        read_selection(select.frozen, methods)
    init = config.init
    if init.from_run:
        check_init_run(config)
    elif init.kind == "path":
        _check_hf_dir(init.path, "config.init.path", "set it to the starting policy, e.g. Llama-3.1-8B-Instruct")
    elif init.kind == "sft" and init.pretrained:
        _check_hf_dir(init.pretrained, "config.init.pretrained",
                      "convert a GGUF file first with `python -m sweet_jax.models.gguf FILE.gguf OUT_DIR` and pass "
                      "OUT_DIR")
    for field in ("tasks.train_path", "tasks.heldout_path", "collect.trajectories"):
        section, name = field.split(".")
        path = config[section].get(name)
        if path:
            try:
                jsonl.check_file(path)
            except jsonl.DataError as e:
                raise PipelineError(f"config.{field}: {e}") from None
    if config.model.tokenizer and not pathlib.Path(config.model.tokenizer).exists():
        raise PipelineError(f"config.model.tokenizer={config.model.tokenizer!r}: no such file or directory")


def _read(path, setting: str):
    try:
        return jsonl.read_json(path)
    except jsonl.DataError as e:
        raise PipelineError(f"{setting}: {e}") from None


def _check_hf_dir(path: str, setting: str, what_to_do: str) -> None:
    if not path or pathlib.Path(path).suffix == ".gguf" or not (pathlib.Path(path) / "config.json").exists():
        raise PipelineError(f"{setting}={path!r} is not an HF checkpoint directory (no config.json); {what_to_do}")
    if not isinstance(_read(pathlib.Path(path) / "config.json", setting), dict):
        raise PipelineError(f"{setting}: {pathlib.Path(path) / 'config.json'}: not a JSON object (an HF model config)")


# ==========================================================================================================
# A frozen selection (config.select.frozen): an earlier run's selection.json
# ==========================================================================================================

def read_selection(path, methods: Sequence[str]) -> dict:
    """The selection.json of a selecting run (stages.write_selection), checked for a run of `methods`: its grid
    (positive learning rates, positive steps) and a choice for every method the run trains, at a learning rate of
    the grid and one of its steps (iterative SWEET-RL: a round >= 1, when it was chosen)."""
    setting = f"config.select.frozen={str(path)!r}"
    if not pathlib.Path(path).exists():
        raise PipelineError(f"{setting}: no such file; pass the selection.json that the selecting run (seed 0) wrote "
                            "in its workdir")
    record = _read(path, setting)

    def wrong(field: str, message: str):
        return PipelineError(f"{setting}: field '{field}': {message}; pass the selection.json the selecting run "
                             "wrote, unchanged")

    if not isinstance(record, dict):
        raise wrong("(top)", f"expected a JSON object, got {type(record).__name__}")
    for field in ("lrs", "steps", "methods"):
        if field not in record:
            raise wrong(field, "missing")
    lrs, steps, chosen = record["lrs"], record["steps"], record["methods"]
    if not isinstance(lrs, list) or not all(_positive_number(x) for x in lrs):
        raise wrong("lrs", f"{_show(lrs)} is not a list of positive learning rates")
    if not isinstance(steps, list) or not steps or not all(_positive_int(x) for x in steps):
        raise wrong("steps", f"{_show(steps)} is not a list of positive step counts")
    if not isinstance(chosen, dict):
        raise wrong("methods", f"expected an object of method -> choice, got {type(chosen).__name__}")
    for m in [m for m in methods if m not in UNTRAINED]:
        if not isinstance(chosen.get(m), dict) or not isinstance(chosen[m].get("choice"), dict):
            raise PipelineError(f"{setting}: its selection has no choice for method {m!r} (it has "
                                f"{', '.join(chosen) or 'none'}); run that method's selection first, or drop it "
                                "from config.methods")
        choice = chosen[m]["choice"]
        lr, step = choice.get("lr"), choice.get("step")
        if not _positive_number(lr):
            raise wrong(f"methods.{m}.choice.lr", f"{_show(lr)} is not a positive learning rate")
        if lrs and lr not in lrs:
            raise wrong(f"methods.{m}.choice.lr", f"{lr:g} is not one of its learning rates "
                        f"({', '.join(f'{x:g}' for x in lrs)})")
        if not _positive_int(step) or step not in steps:
            raise wrong(f"methods.{m}.choice.step", f"{_show(step)} is not one of its steps "
                        f"({', '.join(str(x) for x in steps)})")
    if "sweet_iterative" in methods and "sweet_iterative" in chosen:
        choice = chosen["sweet_iterative"].get("choice") if isinstance(chosen["sweet_iterative"], dict) else None
        if not isinstance(choice, dict) or not _positive_int(choice.get("round")):
            raise wrong("methods.sweet_iterative.choice.round", f"{_show((choice or {}).get('round'))} is not a round "
                        "number >= 1")
    return record


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ==========================================================================================================
# A reused starting policy (config.init.from_run): another run's init stage
# ==========================================================================================================

def check_init_run(config) -> dict:
    """The finished init stage of config.init.from_run, checked: its done.json record (returned), the run's
    pipeline_config.json with the same init/model/tasks settings as `config`, and the files the copy takes (its
    policy_hf checkpoint, its demonstrations when it made some)."""
    src = pathlib.Path(config.init.from_run)
    setting = f"config.init.from_run={str(src)!r}"
    marker = src / "init" / DONE
    if not marker.exists():
        raise PipelineError(f"{setting}: {marker} does not exist; run that workdir's pipeline first (or set "
                            "init.from_run='' to train the starting policy here)")
    record = _read(marker, setting)
    if not isinstance(record, dict) or not isinstance(record.get("summary"), dict):
        raise PipelineError(f"{setting}: {marker}: field 'summary': missing; not a finished stage's record")
    if not isinstance(record.get("seconds"), (int, float)) or not math.isfinite(record["seconds"]):
        raise PipelineError(f"{setting}: {marker}: field 'seconds': {_show(record.get('seconds'))} is not a number")
    theirs = _read(src / "pipeline_config.json", setting)
    if not isinstance(theirs, dict):
        raise PipelineError(f"{setting}: {src / 'pipeline_config.json'}: not a JSON object (a pipeline config)")
    ours = json.loads(config.to_json_best_effort())
    differ = [field for key in INIT_FIELDS
              for field, _, _ in rundir.config_changes({key: theirs.get(key)}, {key: ours.get(key)})
              if field != "init.from_run" and field not in LAYOUT_FIELDS]
    if differ:
        raise PipelineError(f"{setting} was trained with other settings ({', '.join(differ)}); use the same values "
                            "or set init.from_run=''")
    _check_hf_dir(str(src / "init" / "policy_hf"), setting + ": its starting policy",
                  "rerun that workdir's init stage (delete its init/ directory)")
    if record["summary"].get("kind") == "sft" and not (src / "init" / "demos.jsonl").is_file():
        raise PipelineError(f"{setting}: {src / 'init' / 'demos.jsonl'} does not exist; rerun that workdir's init "
                            "stage (delete its init/ directory)")
    return record
