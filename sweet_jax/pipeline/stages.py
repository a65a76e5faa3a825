"""The stages of the whole SWEET-RL comparison and the graph that runs them (run_pipeline): each stage writes its
artifacts under the workdir and a done.json, and a finished stage is skipped on a rerun. The command, with the
list of stages and their files: sweet_jax.commands.pipeline (`python -m sweet_jax.pipeline --help`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import platform
import pathlib
import random
import resource
import shutil
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
import psutil
from flax import nnx
from tqdm import tqdm

from sweet_jax import config_utils, costs, jsonl
from sweet_jax.config_utils import (PIPELINE_PATH_FIELDS, PIPELINE_RANGES, absolute_path, absolute_paths, check_ranges,
                                    check_stages)
from sweet_jax.data import demo_paths, load_tasks as load_colbench_tasks, load_trajectories
from sweet_jax.data.frontend import load_frontend_tasks
from sweet_jax.data.loading import load_records
from sweet_jax.data.pairs import trajectory_pairs
from sweet_jax.data.schema import CandidatesRecord, PolicyPair
from sweet_jax.data.tokenizers import end_of_turn_ids, load_tokenizer
from sweet_jax.envs import families
from sweet_jax.envs.frontend import FrontendTrack, frontend_evaluation, scripted_design_trajectories
from sweet_jax.jsonl import write as write_jsonl   # atomic: a crash never leaves half a stage's file
from sweet_jax.models import Llama, LlamaConfig, cpu_matmul, save_hf
from sweet_jax.pipeline import carry
from sweet_jax.pipeline.inputs import PipelineError, check_init_run, check_inputs, read_selection
from sweet_jax.rl import diagnostics as diagnostics_lib, episodes, ranking, results as results_lib
from sweet_jax.rl.episodes import agent_prompt_for, summarize
from sweet_jax.sampling import policy_backend
from sweet_jax.sandbox import Evaluator
from sweet_jax.train import export as run_export, model_loading, rundir, trainer
from sweet_jax.train.rundir import CHECKPOINT_DIR

log = logging.getLogger("sweet_jax.pipeline")

DONE = "done.json"
ALL_METHODS = ("zero_shot", "rft", "mtdpo", "sweet_no_info", "sweet", "sweet_oracle", "sweet_balanced",
               "sweet_iterative")


# ==========================================================================================================
# Stages: a directory, a function, a done.json
# ==========================================================================================================

@dataclasses.dataclass
class Run:
    """What every stage reads: the config, the workdir, and a lazily started sandbox evaluator."""
    config: ml_collections.ConfigDict
    workdir: pathlib.Path
    _evaluator: Any = None
    sampler: Any = None
    starting_policy: str = ""   # the init stage's policy_hf
    skipped: list = dataclasses.field(default_factory=list)
    ran: list = dataclasses.field(default_factory=list)
    carry_dir: pathlib.Path | None = None   # --carry: the run's small state copied there after each stage (carry.py)

    @property
    def tokenizer_dir(self) -> str:
        """The tokenizer every model of a run reads, the starting policy's: model.tokenizer, else the starting
        checkpoint's."""
        c = self.config
        return model_loading.tokenizer_dir(c.model.tokenizer, c.init.path if c.init.kind == "path" else "",
                                           c.init.pretrained)

    def path(self, *parts) -> pathlib.Path:
        return self.workdir.joinpath(*parts)

    @property
    def evaluator(self):
        if self._evaluator is None:
            s = self.config.sandbox
            self._evaluator = Evaluator(workers=s.workers or None, timeout_s=s.timeout_s, compat=s.compat,
                                        degraded_ok=s.degraded_ok).__enter__()
        return self._evaluator

    _frontend: Any = None

    @property
    def frontend(self) -> bool:
        return self.config.get("track", "backend") == "frontend"

    @property
    def frontend_track(self):
        """Browsers, the frontend simulator and the CLIP scorer (sweet_jax.envs.frontend), started once."""
        if self._frontend is None:
            self._frontend = FrontendTrack(self.config.frontend, self.config.simulator, seed=self.config.seed)
        return self._frontend

    @property
    def scorer(self):
        """What scores answers: the sandbox (backend) or browser + CLIP (frontend)."""
        return self.frontend_track.scorer if self.frontend else self.evaluator

    @contextlib.contextmanager
    def policy_sampler(self, hf_dir: str, d: pathlib.Path, *, seed: int):
        """The policy in hf_dir as a sampler for one stage: policy_backend.policy_sampler with the run's settings
        (config.policy; an engine's output in d/engine.log; running engines serve the starting policy). Every
        policy of a run has the starting policy's architecture, so in process the run keeps one Sampler and swaps
        its parameters (generate.load_sampler's reuse): its compiled programs serve every rollout."""
        c = self.config
        mesh = model_loading.make_mesh(tuple(c.train.sampler_mesh_shape), field="config.train.sampler_mesh_shape")
        with policy_backend.policy_sampler(
                c.policy, hf_dir, self.tokenizer_dir, seed=seed, dtype=c.model.dtype if c.model.dtype != "float32"
                else "", mesh=mesh, max_batch_size=c.train.max_batch_size, reuse=self.sampler,
                cpu_matmul=c.model.cpu_matmul, served=self.starting_policy, field="config.policy",
                engine_log=d / "engine.log") as sampler:
            if c.policy.backend == "in_process":
                self.sampler = sampler
            try:
                yield sampler
            finally:
                # The prompt cache holds this policy's K/V (up to policy.prompt_cache_mb), which no later stage
                # reads: kept, it would sit through the training stages until the next policy replaced it.
                if getattr(sampler, "prompt_cache", None) is not None:
                    sampler.prompt_cache.clear()

    def play(self, hf_dir: str, tasks: Sequence[dict], out: pathlib.Path, settings, *, best_of: int,
             seed: int) -> dict:
        """episodes.play of the policy in hf_dir on `tasks` into out, with the run's human and scorer; settings:
        config.collect or config.eval (temperature, max_new_tokens, batch_size, max_turns)."""
        with self.policy_sampler(hf_dir, out.parent, seed=seed) as sampler:
            return episodes.play(tasks, sampler, out, best_of=best_of, batch_size=settings.batch_size,
                                 max_turns=settings.max_turns, max_new_tokens=settings.max_new_tokens,
                                 temperature=settings.temperature, system_prompt=agent_prompt_for(self.config),
                                 seed=seed, simulator=self.config.simulator, field="config.simulator",
                                 evaluator=None if self.frontend else self.evaluator,
                                 frontend=self.frontend_track if self.frontend else None)

    def close(self):
        if self._frontend is not None:
            self._frontend.close()
            self._frontend = None
        if self._evaluator is not None:
            self._evaluator.__exit__(None, None, None)
            self._evaluator = None

    def stage(self, name: str, directory: str, fn: Callable[[pathlib.Path], dict], *,
              consumers: Sequence[str] | None = None) -> dict:
        """Run fn(dir) unless dir/done.json exists; return (and store) its summary.

        A finished stage whose outputs (the paths under its directory that its summary names) are gone, as on a
        new machine that restored the run's small state (carry.py), runs again unless every stage that reads them
        has finished: consumers, their directories (None: any stage may read them, so it always runs again)."""
        d = self.path(directory)
        marker = d / DONE
        if marker.exists():
            summary = json.loads(marker.read_text())["summary"]
            gone = [p for p in paths_under(summary, d) if not p.exists()]
            waiting = [c for c in (consumers or ()) if not self.path(c, DONE).exists()]
            if not gone or (consumers is not None and not waiting):
                log.info("stage %-14s skipped: %s exists", name, marker)
                self.skipped.append(name)
                return summary
            log.info("stage %-14s runs again: its outputs are gone (%s) and %s still needs them", name,
                     os.path.relpath(gone[0], self.workdir), ", ".join(waiting) or "a later stage")
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        log.info("stage %-14s running in %s", name, d)
        costs.listen_to_compiles()
        costs.reset()
        t0, cpu0, load0, rss0 = time.time(), _cpu_seconds(), os.getloadavg()[0], _rss_gb()
        summary = fn(d)
        # A finished stage's trainer, sampler and model are garbage, but some of it sits in reference cycles
        # (a training stage's parameters and optimizer state, ~2 GB at SmolLM2-135M) that only a full collection
        # frees, which a long run may not reach before the next stage allocates its own.
        gc.collect()
        seconds = time.time() - t0
        # CPU seconds and load averages beside the wall time: on a shared machine the wall time alone says
        # little; cpu_seconds / cores is the idle machine's wall time, roughly. costs: where the seconds went.
        # rss_gb: the pipeline process's resident memory before and after (what a long run keeps between stages).
        record = {"stage": name, "seconds": seconds, "cpu_seconds": _cpu_seconds() - cpu0,
                  "load_average": [load0, os.getloadavg()[0]], "rss_gb": [rss0, _rss_gb()], "host": host_record(),
                  "costs": costs.snapshot(), "summary": summary}
        marker.write_text(json.dumps(record, indent=2) + "\n")
        log.info("stage %-14s done in %.0f s (%.0f CPU s, load %.1f -> %.1f): %s", name, seconds,
                 record["cpu_seconds"], *record["load_average"], _short(summary))
        self.ran.append(name)
        if self.carry_dir is not None:
            carry.save(self.workdir, self.carry_dir)
        return summary


def paths_under(summary, directory: pathlib.Path) -> list[pathlib.Path]:
    """The paths under a stage's directory that its summary names: its outputs (a policy, a critic, a file); a
    path elsewhere (the policy an evaluation played) is another stage's."""
    if isinstance(summary, dict):
        return [p for v in summary.values() for p in paths_under(v, directory)]
    if isinstance(summary, list):
        return [p for v in summary for p in paths_under(v, directory)]
    if isinstance(summary, str) and summary.startswith(str(directory) + os.sep):
        return [pathlib.Path(summary)]
    return []


def host_record() -> dict:
    """The machine a stage ran on: its processor, bf16 matrix units (which decide the CPU's matmul precision,
    models/cpu_matmul.py) and cores; a run resumed on another machine shows where each stage ran."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
        name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    except OSError:
        name = ""
    return {"processor": name or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "bf16_flags": list(cpu_matmul.cpu_bf16_flags()), "jax_backend": jax.default_backend()}


def _rss_gb() -> float:
    return round(psutil.Process().memory_info().rss / 2**30, 2)


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (user + system)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _short(summary: dict) -> str:
    text = json.dumps({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
    return text if len(text) < 300 else text[:300] + "..."


def methods_of(config) -> list[str]:
    methods = [m.strip() for m in str(config.methods).split(",") if m.strip()]
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad or not methods:
        raise PipelineError(f"config.methods={config.methods!r}: unknown {bad}; use a comma-separated subset of "
                            f"{','.join(ALL_METHODS)}")
    return [m for m in ALL_METHODS if m in methods]


# ==========================================================================================================
# (1) tasks
# ==========================================================================================================

def stage_tasks(run: Run, d: pathlib.Path) -> dict:
    t = run.config.tasks
    if t.source == "synthetic" and draw_of(run.config) == "seeded":
        return write_task_splits(d, *seeded_draw(run.config), source=t.source)
    if t.source == "synthetic":
        tasks = synthetic_tasks(run.config, t.num_train + t.num_heldout, seed=t.seed)
        rng = random.Random(t.seed)
        rng.shuffle(tasks)
        train, heldout = tasks[:t.num_train], tasks[t.num_train:]
    elif t.source in ("files", "frontend_files"):
        load_tasks = load_frontend_tasks if t.source == "frontend_files" else load_colbench_tasks
        if not t.train_path and t.source == "files":
            raise PipelineError("config.tasks.source='files' needs --config.tasks.train_path (ColBench tasks JSONL)")
        train = [x.to_json() for x in load_tasks(t.train_path or str(demo_paths().frontend_tasks))]
        if t.heldout_path:
            heldout = [x.to_json() for x in load_tasks(t.heldout_path)][:t.num_heldout or None]
        else:
            rng = random.Random(t.seed)
            rng.shuffle(train)
            heldout, train = train[:t.num_heldout], train[t.num_heldout:]
        if t.num_train:
            train = train[:t.num_train]
    else:
        raise PipelineError(f"config.tasks.source={t.source!r}: use synthetic, files or frontend_files")
    validation = validation_tasks(run.config, train, heldout)
    if t.source != "synthetic":
        taken = {x["ground_truth"] for x in validation}
        train = [x for x in train if x["ground_truth"] not in taken]
    return write_task_splits(d, train, heldout, validation, source=t.source)


def write_task_splits(d: pathlib.Path, train: list[dict], heldout: list[dict], validation: list[dict], *,
                      source: str) -> dict:
    if not train or not heldout:
        raise PipelineError(f"tasks: {len(train)} training and {len(heldout)} held-out tasks; both must be > 0 "
                            "(config.tasks.num_train / num_heldout / heldout_path)")
    write_jsonl(d / "train.jsonl", train)
    write_jsonl(d / "heldout.jsonl", heldout)
    if validation:
        write_jsonl(d / "validation.jsonl", validation)
    return {"train": len(train), "heldout": len(heldout), "validation": len(validation), "source": source}


TASK_DRAWS = ("fixed", "seeded")


def draw_of(config) -> str:
    """config.tasks.draw: fixed (the same tasks for every run seed: tasks.seed, tasks.validation_seed) or seeded
    (each run seed draws its own training, validation and held-out tasks; seeded_draw)."""
    draw = config.tasks.get("draw", "fixed")
    if draw not in TASK_DRAWS:
        raise PipelineError(f"config.tasks.draw={draw!r}: use one of {', '.join(TASK_DRAWS)}")
    return draw


def family_of(config) -> str:
    """config.tasks.family of a synthetic run (lookup or discovery, envs/families.py)."""
    name = config.tasks.get("family", "lookup")
    if name not in families.FAMILIES:
        raise PipelineError(f"config.tasks.family={name!r}: use one of {', '.join(families.FAMILIES)}")
    return name


def synthetic_tasks(config, num_tasks: int, *, seed: int) -> list[dict]:
    t = config.tasks
    return families.make_tasks(family_of(config), num_tasks, seed=seed, min_keys=t.min_keys, max_keys=t.max_keys)


def seeded_draw(config) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, held-out, validation) of run seed config.seed: tasks.num_train + num_heldout + num_validation
    distinct tasks of the family drawn with seed tasks.seed + 1000 * seed, none sharing a reference solution with
    a demonstration task (those come from a fixed seed, so every run seed starts from the same policy), split in
    that order. docs/discovery.md, "The protocol"."""
    t = config.tasks
    demos = {x["ground_truth"] for x in demonstration_pool(config, 0)}
    wanted = t.num_train + t.num_heldout + t.get("num_validation", 0)
    pool = [x for x in synthetic_tasks(config, wanted + len(demos), seed=t.seed + 1000 * config.seed)
            if x["ground_truth"] not in demos][:wanted]
    if len(pool) < wanted:
        raise PipelineError(f"tasks: only {len(pool)} tasks of family {family_of(config)} outside the demonstrations; "
                            f"lower tasks.num_train / num_heldout / num_validation")
    return (pool[:t.num_train], pool[t.num_train:t.num_train + t.num_heldout],
            pool[t.num_train + t.num_heldout:])


def validation_tasks(config, train: list[dict], heldout: list[dict]) -> list[dict]:
    """config.tasks.num_validation tasks drawn with tasks.validation_seed: synthetic ones disjoint from the
    training and held-out tasks and from every task the starting policy's demonstrations may be drawn from (so
    adding validation tasks leaves the demonstrations as they were), or a seeded sample of the training file's
    tasks (which then leave the training set)."""
    t = config.tasks
    if not t.get("num_validation"):
        return []
    if t.source == "synthetic":
        taken = {x["ground_truth"] for x in train + heldout}
        taken |= {x["ground_truth"] for x in demonstration_pool(config, len(taken))}
        pool = synthetic_tasks(config, t.num_validation + len(taken), seed=t.validation_seed)
        return [x for x in pool if x["ground_truth"] not in taken][:t.num_validation]
    if t.num_validation >= len(train):
        raise PipelineError(f"config.tasks.num_validation={t.num_validation} leaves no training task of "
                            f"{len(train)}; lower it")
    picked = random.Random(t.validation_seed).sample(range(len(train)), t.num_validation)
    return [train[i] for i in sorted(picked)]


def load_task_split(run: Run, split: str) -> list[dict]:
    return jsonl.read(run.path("tasks", f"{split}.jsonl"))


# ==========================================================================================================
# Training stages: sweet_jax.train.trainer.run with a config built from config_utils + the pipeline's values
# ==========================================================================================================

def train_config(config, *, kind: str, stage, model_path: str, tokenizer: str = "", trajectories: str = "",
                 pairs: str = "", use_info: bool = False, seed_offset: int = 0) -> ml_collections.ConfigDict:
    """A sweet_jax.train config (the fields of configs/critic.py and configs/policy.py) for one stage: the pipeline
    config's shared fields and the stage section's (config_utils.stage_train_config), and this stage's own.
    tokenizer: the run's (Run.tokenizer_dir; '' = the trainer's rule, model_path's or the demo tokenizer)."""
    c = config_utils.stage_train_config(config, stage)
    c.model.path = model_path
    c.data.tokenizer = tokenizer
    c.data.trajectories = trajectories
    c.data.pairs = pairs
    c.train.seed = config.seed + seed_offset
    c.train.log_every = 1             # every step's metrics: the results keep them as evidence
    c.train.eval_every = 0
    c.train.keep_ckpts = 1 if not c.train.ckpt_every else 1000
    c.loss.kind = kind
    c.loss.use_info = use_info
    return c


def train_and_export(run: Run, d: pathlib.Path, tconfig) -> dict:
    """train.run into d/train, then the trained parameters as an HF checkpoint in d/hf."""
    summary = run_training(run, d, tconfig)
    export_trained(d / "train", d / "hf")
    return {"hf": str(d / "hf"), "steps": summary["steps"], "train_examples": summary["train_examples"],
            "eval_examples": summary["eval_examples"], "eval": summary.get("eval", {}),
            "tokens_per_s": summary.get("tokens_per_s")}


def run_training(run: Run, d: pathlib.Path, tconfig) -> dict:
    """trainer.run of one stage into d/train. A rerun of the pipeline with other values goes on with them
    (run_pipeline's rule); the training run records the change. Tracking: every stage of this pipeline run in
    one group (W&B), TensorBoard runs under WORKDIR/STAGE/train."""
    tconfig.metrics.update(run.config.get("metrics") or {})
    tconfig.metrics.group = tconfig.metrics.group or run.workdir.name
    tconfig.metrics.name = f"{run.workdir.name}/{d.relative_to(run.workdir)}"
    return trainer.run(tconfig, d / "train", accept_config_change=True)


def export_trained(train_dir: pathlib.Path, out_hf: pathlib.Path, *, step: int | None = None) -> None:
    """The latest checkpoint (or `step`'s) of a train.run workdir as an HF directory (written whole, then renamed
    into place)."""
    tmp = out_hf.with_name(out_hf.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        run_export.export_run(train_dir, tmp, step=step)
    except rundir.RunDirError as e:
        raise PipelineError(f"{e}; delete {train_dir.parent} and rerun to train this stage again") from None
    shutil.rmtree(out_hf, ignore_errors=True)
    os.replace(tmp, out_hf)


# ==========================================================================================================
# (2) the starting policy
# ==========================================================================================================

def _policy_weights(text: str) -> dict[str, float]:
    weights = {}
    for part in str(text).split(","):
        name, _, w = part.partition(":")
        try:
            weights[name.strip()] = float(w)
        except ValueError:
            raise PipelineError(f"config.init.policy_weights={text!r}: expected 'name:weight,...' "
                                "(e.g. thorough:1,partial:2,naive:1)") from None
    return weights


def reuse_init(run: Run, d: pathlib.Path) -> dict:
    """The init stage of another run (config.init.from_run) with the same init/model/tasks settings, copied:
    the seeds of a comparison start from one starting policy, as the paper's runs all start from one checkpoint."""
    src = pathlib.Path(run.config.init.from_run)
    record = check_init_run(run.config)
    for name in ("policy_hf", "demos.jsonl"):
        if (src / "init" / name).is_dir():
            shutil.copytree(src / "init" / name, d / name, dirs_exist_ok=True)
        elif (src / "init" / name).exists():   # demonstrations: an SFT start's
            shutil.copy2(src / "init" / name, d / name)
    return dict(record["summary"], policy_hf=str(d / "policy_hf"), reused_from=str(src),
                reused_seconds=record["seconds"])


def pretrained_dir(config) -> str:
    """The HF directory the starting policy's SFT begins from (config.init.pretrained), checked."""
    path = pathlib.Path(config.init.pretrained)
    if path.suffix == ".gguf" or not (path / "config.json").exists():
        raise PipelineError(
            f"config.init.pretrained={config.init.pretrained!r} is not an HF checkpoint directory (no config.json); "
            "convert a GGUF file first with `python -m sweet_jax.models.gguf FILE.gguf OUT_DIR` and pass OUT_DIR")
    return str(path)


def stage_init(run: Run, d: pathlib.Path) -> dict:
    config = run.config
    if config.init.from_run:
        return reuse_init(run, d)
    if config.init.kind == "path":
        if not config.init.path or not (pathlib.Path(config.init.path) / "config.json").exists():
            raise PipelineError(f"config.init.path={config.init.path!r} is not an HF checkpoint directory (no "
                                "config.json); set it to the starting policy, e.g. Llama-3.1-8B-Instruct")
        return {"policy_hf": config.init.path, "kind": "path"}
    if config.init.kind not in ("sft", "random"):
        raise PipelineError(f"config.init.kind={config.init.kind!r}: use sft, random or path")
    if config.init.kind == "sft" and config.tasks.source != "synthetic":
        raise PipelineError("config.init.kind='sft' trains on scripted demonstrations of the synthetic task "
                            "family; with tasks.source='files' set init.kind='path' and init.path")

    if config.init.kind == "random":  # no demonstrations: the run shows the mechanics with an untrained policy
        model = Llama(_tiny_llama_config(config, run.tokenizer_dir), rngs=nnx.Rngs(config.init.seed))
        save_hf(model, d / "policy_hf", tokenizer_dir=run.tokenizer_dir)
        return {"policy_hf": str(d / "policy_hf"), "kind": "random",
                "parameters": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))}

    # Mixed-quality demonstrations through the real environment, scored by the sandbox, on tasks of their own
    # (init.num_tasks fresh tasks, none a training or held-out task): with many distinct tasks the tiny model
    # cannot memorise answers and has to learn to copy keys and values from the dialogue.
    demo_tasks = load_task_split(run, "train")
    if config.init.num_tasks:
        taken = {t["ground_truth"] for split in ("train", "heldout") for t in load_task_split(run, split)}
        demo_tasks = [t for t in demonstration_pool(config, len(taken))
                      if t["ground_truth"] not in taken][:config.init.num_tasks]
    demos = families.scripted_trajectories(family_of(config), demo_tasks, seed=config.init.seed,
                                           per_task=config.init.demos_per_task,
                                           policy_weights=_policy_weights(config.init.policy_weights),
                                           evaluator=run.evaluator, max_turns=config.collect.max_turns)
    write_jsonl(d / "demos.jsonl", demos)
    # SFT imitates every demonstration, good and bad (that is what makes the policy weak and varied); the
    # trainer's SFT kind (rft) keeps reward 1.0 rows, so the SFT copy marks every row as a target.
    write_jsonl(d / "sft_data.jsonl", [dict(t, reward=1.0, demo_reward=t["reward"]) for t in demos])

    if config.init.pretrained:
        # A pretrained chat model learns the protocol from the demonstrations; it already copies.
        start = pretrained_dir(config)
        parameters = LlamaConfig.from_hf(json.loads((pathlib.Path(start) / "config.json").read_text())
                                         ).num_params()
    else:
        model = Llama(_tiny_llama_config(config, run.tokenizer_dir), rngs=nnx.Rngs(config.init.seed))
        parameters = int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
        save_hf(model, d / "random_hf", tokenizer_dir=run.tokenizer_dir)
        start = str(d / "random_hf")
    tconfig = train_config(config, kind="rft", stage=config.init.sft, model_path=start, tokenizer=run.tokenizer_dir,
                           trajectories=str(d / "sft_data.jsonl"))
    tconfig.train.seed = config.init.seed   # the starting policy is the run seeds' common "pretrained" model
    trained = train_and_export(run, d, tconfig)
    rewards = np.array([t["reward"] for t in demos])
    shutil.rmtree(d / "policy_hf", ignore_errors=True)   # left by an interrupted earlier attempt
    os.replace(d / "hf", d / "policy_hf")
    return {"policy_hf": str(d / "policy_hf"), "kind": "sft", "demos": len(demos), "demo_tasks": len(demo_tasks),
            "demo_success_pct": float(100 * np.mean(rewards == 1.0)),
            "demo_tests_passed_pct": float(100 * rewards.mean()),
            "sft": {k: v for k, v in trained.items() if k != "hf"},
            "parameters": parameters}


def demonstration_pool(config, num_taken: int) -> list[dict]:
    """The synthetic tasks the starting policy's demonstrations are drawn from (the first init.num_tasks of them
    that are neither training nor held-out tasks, num_taken of which there are; with seeded draws exactly
    init.num_tasks, which the run seeds' draws avoid)."""
    if config.init.kind != "sft" or not config.init.num_tasks:
        return []
    extra = 0 if draw_of(config) == "seeded" else num_taken
    return synthetic_tasks(config, config.init.num_tasks + extra, seed=config.init.seed + 7919)


def _tiny_llama_config(config, tokenizer_dir: str):
    tok = load_tokenizer(tokenizer_dir)
    m = config.model
    return LlamaConfig.preset(
        "tiny", vocab_size=len(tok), hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        tie_word_embeddings=m.tie_word_embeddings, bos_token_id=tok.bos_token_id,
        eos_token_id=tuple(sorted(end_of_turn_ids(tok))))


# ==========================================================================================================
# Policies as samplers; rollouts (offline collection and evaluation)
# ==========================================================================================================

# ==========================================================================================================
# (3) offline trajectories
# ==========================================================================================================

def stage_offline(run: Run, d: pathlib.Path, policy_hf: str) -> dict:
    c = run.config
    out = d / "trajectories.jsonl"
    if c.collect.trajectories:
        trajs = [t.to_json() for t in load_trajectories(c.collect.trajectories)]
        unscored = [t for t in trajs if t.get("reward") is None]
        if unscored:
            scores = run.scorer.score_many([(t["task"], t["answer"]) for t in unscored])
            for t, s in zip(unscored, scores):
                t["reward"] = float(s.reward) if s.status == "ok" else 0.0
        write_jsonl(out, trajs)
        summary = summarize(trajs)
    else:
        collected = d / "collected.jsonl"
        run.play(policy_hf, load_task_split(run, "train"), collected, c.collect, best_of=c.collect.best_of,
                 seed=c.seed + 100)
        trajs = jsonl.read(collected)
        if c.collect.scripted_per_task and run.frontend:
            scripted = scripted_design_trajectories(load_task_split(run, "train"), run.scorer, seed=c.seed + 1,
                                                    per_task=c.collect.scripted_per_task)
            trajs += [dict(t, scripted=True) for t in scripted]
        elif c.collect.scripted_per_task:
            if c.tasks.source != "synthetic":
                raise PipelineError("config.collect.scripted_per_task > 0 needs the synthetic tasks (their scripted "
                                    "agents); set it to 0 with tasks.source='files'")
            scripted = families.scripted_trajectories(
                family_of(c), load_task_split(run, "train"), seed=c.seed + 1, per_task=c.collect.scripted_per_task,
                policy_weights=_policy_weights(c.init.policy_weights), evaluator=run.evaluator,
                max_turns=c.collect.max_turns)
            trajs += [dict(t, scripted=True) for t in scripted]
        write_jsonl(out, trajs)
        summary = dict(summarize([t for t in trajs if not t.get("scripted")]), scripted=len(trajs) - len(
            [t for t in trajs if not t.get("scripted")]))
    pairs = trajectory_pairs(load_trajectories(out), rule=c.collect.get("pair_rule", "best_success"),
                             min_gap=c.collect.get("min_gap", 0.0))
    summary = dict(summary, trajectories=str(out), critic_pairs=len(pairs),
                   tasks_with_pairs=len({p.task_key for p in pairs}))
    if not pairs:
        raise PipelineError(f"{out}: no critic pairs (no task has a successful trajectory and a worse one); the "
                            "starting policy is too weak or too uniform: raise config.collect.best_of or "
                            "config.tasks.num_train, or train the starting policy longer (config.init.sft)")
    return summary


# ==========================================================================================================
# (4) critics
# ==========================================================================================================

def stage_critic(run: Run, d: pathlib.Path, policy_hf: str, trajectories: str, *, use_info: bool) -> dict:
    tconfig = train_config(run.config, kind="critic", stage=run.config.critic, model_path=policy_hf,
                           tokenizer=run.tokenizer_dir, trajectories=trajectories, use_info=use_info, seed_offset=1)
    out = train_and_export(run, d, tconfig)
    out["use_info"] = use_info
    out["heldout_accuracy"] = out["eval"].get("pair_accuracy")
    return out


# ==========================================================================================================
# (5) candidates and ranking
# ==========================================================================================================

def ranked_prompts(run: Run, trajectories: str, *, balanced: bool = False):
    """The turn prefixes o_t that get candidates (config.rank.turn_selection, configs/pipeline.py). balanced (the
    method sweet_balanced): as many prompts as that selection takes, drawn with up to half of them states where
    every value is known (ranking.select_turn_prompts' 'balanced')."""
    r = run.config.rank
    trajs = load_trajectories(trajectories)
    selection = r.get("turn_selection", "sample")
    every = ranking.turn_prompts(trajs)

    def select(selection, max_prompts):
        return ranking.select_turn_prompts(every, selection, max_prompts=max_prompts,
                                           data_fraction=r.get("data_fraction", 1.0), seed=run.config.seed,
                                           tasks=[t.task.to_json() for t in trajs] if selection == "balanced"
                                           else None, field="config.rank")

    prompts = select(selection, r.max_prompts)
    return select("balanced", len(prompts)) if balanced else prompts


def stage_candidates(run: Run, d: pathlib.Path, policy_hf: str, trajectories: str, *,
                     balanced: bool = False) -> dict:
    """num_candidates replies for every ranked prompt, appended batch by batch: an interrupted stage resumes at
    the first batch not written (each batch's seed is fixed by its position, so the file is the same either way)."""
    c = run.config
    prompts = ranked_prompts(run, trajectories, balanced=balanced)
    out = d / "candidates.jsonl"
    done = {(r["trajectory_index"], r["turn"]) for r in jsonl.read(out, partial="repair")}
    per = c.rank.prompts_per_batch
    starts = [s for s in range(0, len(prompts), per) if any(p.key not in done for p in prompts[s:s + per])]
    if starts:
        with run.policy_sampler(policy_hf, d, seed=c.seed + 200) as sampler:
            for start in tqdm(starts, desc="candidates", unit="batch"):
                batch = prompts[start:start + per]
                cands = ranking.sample_candidates(sampler, batch, n=c.rank.num_candidates,
                                                  max_new_tokens=c.rank.max_new_tokens,
                                                  temperature=c.rank.temperature, seed=c.seed * 1_000_003 + start,
                                                  system_prompt=agent_prompt_for(c))
                jsonl.append(out, [CandidatesRecord(p.trajectory_index, p.turn, cand.texts,
                                                    [float(x) for x in cand.sampler_logp], cand.prompt_text,
                                                    cand.prompt_ids, cand.token_ids)  # the pairs carry the ids
                                   for p, cand in zip(batch, cands) if p.key not in done])
    out.touch()
    rows = load_records(out, CandidatesRecord)
    distinct = np.mean([len(set(r.texts)) for r in rows]) if rows else 0.0
    return {"prompts": len(rows), "candidates": sum(len(r.texts) for r in rows),
            "mean_distinct_per_prompt": float(distinct)}


def recorded_candidates(prompts, candidates: str) -> Callable:
    """sample_fn over the candidates stage's file: the candidates were sampled once, for every ranking."""
    by_key = {r.key: r for r in load_records(candidates, CandidatesRecord)}
    missing = [p.key for p in prompts if p.key not in by_key]
    if missing:
        raise PipelineError(f"{candidates} lacks the candidates of {len(missing)} turn(s) (first {missing[0]}); "
                            f"delete {pathlib.Path(candidates).parent} so the candidates stage runs again")

    def sample_fn(batch):
        return [ranking.Candidates(list(by_key[p.key].texts), np.asarray(by_key[p.key].sampler_logp),
                                   by_key[p.key].prompt_text, prompt_ids=by_key[p.key].prompt_ids,
                                   token_ids=by_key[p.key].token_ids) for p in batch]
    return sample_fn


def stage_rank(run: Run, d: pathlib.Path, policy_hf: str, critic_hf: str, trajectories: str, candidates: str,
               *, use_info: bool, balanced: bool = False) -> dict:
    c = run.config
    prompts = ranked_prompts(run, trajectories, balanced=balanced)
    sample_fn = recorded_candidates(prompts, candidates)
    dtype = c.model.dtype if c.model.dtype != "float32" else None
    critic_logp, reference_logp = ranking.critic_scorers(
        critic_hf, policy_hf, load_tokenizer(run.tokenizer_dir), rank_reference=c.rank.rank_reference, dtype=dtype,
        seed=c.seed, cpu_matmul=c.model.cpu_matmul, info_template=c.rank.info_template,
        info_placement=c.rank.info_placement, use_info=use_info, batch_size=c.rank.score_batch_size,
        bucket=c.train.bucket, max_len=c.train.max_len * 2)
    out = d / "pairs.jsonl"
    result = ranking.rank(prompts, sample_fn, critic_logp, reference_logp, out, rank_reference=c.rank.rank_reference,
                          num_pairs=c.rank.num_pairs, seed=c.seed, prompts_per_batch=c.rank.prompts_per_batch,
                          progress=True, pairing=c.rank.get("pairing", "strict"), scores_path=d / "scores.jsonl")
    pairs = load_records(out, PolicyPair)
    if not pairs:
        raise PipelineError(f"{out}: no step-level pairs (every turn's candidates tied); raise "
                            "config.rank.num_candidates or config.rank.temperature")
    return dict(result, pairs=len(pairs), use_info=use_info, file=str(out))


def stage_rank_oracle(run: Run, d: pathlib.Path, trajectories: str, candidates: str) -> dict:
    """The oracle-ranked control (method sweet_oracle): SWEET-RL's turn prompts and candidates, each candidate scored
    by the synthetic oracle's worth (rl/diagnostics.reply_worth, the task family's) instead of the critic's
    advantage, and paired by the same rule: what step-level pairs can do on a task family at best."""
    c = run.config
    if c.tasks.source != "synthetic":
        raise PipelineError("method sweet_oracle ranks with the synthetic tasks' oracle: it needs "
                            "config.tasks.source='synthetic'")
    prompts = ranked_prompts(run, trajectories)
    tasks = [t["task"] for t in jsonl.read(trajectories)]

    def worth(items):
        return np.array([diagnostics_lib.reply_worth(tasks[p.trajectory_index], p.messages, text,
                                                     max_turns=c.collect.max_turns) for p, text in items])

    out = d / "pairs.jsonl"
    result = ranking.rank_turns(prompts, recorded_candidates(prompts, candidates), worth, None, out,
                                rank_reference="none", num_pairs=c.rank.num_pairs, seed=c.seed,
                                prompts_per_batch=c.rank.prompts_per_batch, progress=True,
                                pairing=c.rank.get("pairing", "strict"), scores_path=d / "scores.jsonl")
    pairs = load_records(out, PolicyPair) if out.exists() else []
    if not pairs:
        raise PipelineError(f"{out}: no step-level pairs (every turn's candidates are worth the same to the oracle; "
                            "config.rank.pairing='official' pairs ties too)")
    return dict(result, pairs=len(pairs), file=str(out))


def pair_agreement(pairs_a: str, pairs_b: str, candidates: str) -> float | None:
    """How often two rankings order the same two candidates the same way: of the pairs of ranking A whose two
    candidates ranking B also compared, the share B put on the same side (a measure of what c changes)."""
    a = {(*r.key, r.chosen, r.rejected) for r in load_records(pairs_a, PolicyPair)}
    same = opposite = 0
    for r in load_records(pairs_b, PolicyPair):
        if (*r.key, r.chosen, r.rejected) in a:
            same += 1
        elif (*r.key, r.rejected, r.chosen) in a:
            opposite += 1
    return 100.0 * same / (same + opposite) if same + opposite else None


# ==========================================================================================================
# (6) policies
# ==========================================================================================================

def policy_train_config(run: Run, method: str, policy_hf: str, *, trajectories: str = "", pairs: str = ""):
    c = run.config
    if method in ("sweet", "sweet_no_info", "sweet_balanced", "sweet_oracle"):
        return train_config(c, kind="dpo", stage=c.sweet, model_path=policy_hf, tokenizer=run.tokenizer_dir,
                            pairs=pairs, seed_offset=2)
    if method == "mtdpo":
        return train_config(c, kind="mtdpo", stage=c.mtdpo, model_path=policy_hf, tokenizer=run.tokenizer_dir,
                            trajectories=trajectories, seed_offset=3)
    if method == "rft":
        return train_config(c, kind="rft", stage=c.rft, model_path=policy_hf, tokenizer=run.tokenizer_dir,
                            trajectories=trajectories, seed_offset=4)
    raise PipelineError(f"no policy training for method {method!r}")


def stage_policy(run: Run, d: pathlib.Path, method: str, policy_hf: str, *, trajectories: str = "",
                 pairs: str = "") -> dict:
    tconfig = policy_train_config(run, method, policy_hf, trajectories=trajectories, pairs=pairs)
    return dict(train_and_export(run, d, tconfig), method=method)


def stage_policy_grid(run: Run, d: pathlib.Path, method: str, policy_hf: str, grid: "Grid", lr: float, *,
                      trajectories: str = "", pairs: str = "") -> dict:
    """One training run of `method` at learning rate lr on a schedule of grid.total_steps steps, trained to the last
    of the grid's steps it needs (frozen: the chosen one), its checkpoints at those steps exported to d/step{N}/hf
    (then the checkpoints, ~3x the model each, are deleted)."""
    tconfig = policy_train_config(run, method, policy_hf, trajectories=trajectories, pairs=pairs)
    steps = grid.steps_of(method)
    tconfig.optim.lr = lr
    tconfig.train.num_steps = grid.total_steps
    tconfig.train.stop_at = max(steps)  # frozen: the chosen checkpoint of the same run, trained no further
    tconfig.train.ckpt_every = int(np.gcd.reduce(steps))
    tconfig.train.keep_ckpts = 1000
    summary = run_training(run, d, tconfig)
    for step in steps:
        export_trained(d / "train", d / f"step{step}" / "hf", step=step)
    shutil.rmtree(d / "train" / CHECKPOINT_DIR, ignore_errors=True)
    return {"method": method, "lr": lr, "steps": summary["steps"], "train_examples": summary["train_examples"],
            "tokens_per_s": summary.get("tokens_per_s"),
            "hf": {str(step): str(d / f"step{step}" / "hf") for step in steps}}


@dataclasses.dataclass
class Grid:
    """What config.select asks: the learning rates and checkpoint steps tried per method, or (frozen) the
    choices of an earlier run's selection.json."""
    lrs: list[float]
    steps: list[int]
    frozen: dict | None = None     # method -> {"lr", "step"}
    method_lrs: dict = dataclasses.field(default_factory=dict)   # method -> its one learning rate (select.method_lrs)

    @property
    def all_lrs(self) -> list[float]:
        return sorted(set(self.lrs) | set(self.method_lrs.values()))

    @property
    def total_steps(self) -> int:
        return max(self.steps)

    @property
    def validate(self) -> bool:
        return self.frozen is None

    def lrs_of(self, method: str) -> list[float]:
        if self.frozen is not None:
            return [self._choice(method)["lr"]]
        return [self.method_lrs[method]] if method in self.method_lrs else self.lrs

    def steps_of(self, method: str) -> list[int]:
        return [self._choice(method)["step"]] if self.frozen is not None else self.steps

    def _choice(self, method):
        if method not in self.frozen:
            raise PipelineError(f"config.select.frozen: its selection has no choice for method {method!r} "
                                f"(it has {', '.join(self.frozen)}); run that method's selection first")
        return self.frozen[method]


def selection_grid(config) -> Grid | None:
    s = config.get("select")
    if s is None or not (s.steps or s.frozen):
        return None
    if s.frozen:
        chosen = read_selection(s.frozen, methods_of(config))
        return Grid(chosen["lrs"], chosen["steps"], frozen={m: v["choice"] for m, v in chosen["methods"].items()})

    def numbers(text, kind, field):
        try:
            values = sorted({kind(x) for x in str(text).split(",") if x.strip()})
        except ValueError:
            raise PipelineError(f"config.select.{field}={text!r}: expected comma-separated numbers") from None
        if not values or values[0] <= 0:
            raise PipelineError(f"config.select.{field}={text!r}: expected positive numbers")
        return values

    if not config.tasks.get("num_validation"):
        raise PipelineError("config.select.steps needs validation tasks to choose on: set config.tasks.num_validation")
    lrs = numbers(s.lrs, float, "lrs") if s.lrs else []
    return Grid(lrs, numbers(s.steps, int, "steps"), method_lrs=method_lrs_of(config))


def method_lrs_of(config) -> dict[str, float]:
    """config.select.method_lrs, "method:lr,...": the one learning rate each named method trains at (its checkpoints
    still chosen on validation), in place of select.lrs."""
    text = config.select.get("method_lrs", "")
    out = {}
    for item in [x.strip() for x in str(text).split(",") if x.strip()]:
        method, _, lr = item.partition(":")
        where = f"config.select.method_lrs={text!r}: {item!r}"
        if method.strip() not in ALL_METHODS or method.strip() in ("zero_shot", "sweet_iterative"):
            raise PipelineError(f"{where}: {method.strip()!r} is not a trained method (one of "
                                f"{', '.join(m for m in ALL_METHODS if m not in ('zero_shot', 'sweet_iterative'))})")
        try:
            value = float(lr)
        except ValueError:
            raise PipelineError(f"{where}: expected method:learning_rate, e.g. sweet:3e-6") from None
        if value <= 0:
            raise PipelineError(f"{where}: the learning rate must be positive")
        out[method.strip()] = value
    return out


def choose(results: dict) -> dict:
    """The selection rule: highest validation success rate, then % tests passed, then fewer steps, then the
    smaller learning rate. results: "lr/step" -> {"lr", "step", "success_rate", "tests_passed_pct"}."""
    best = max(results.values(), key=lambda r: (r["success_rate"], r["tests_passed_pct"], -r["step"], -r["lr"]))
    return {"lr": best["lr"], "step": best["step"]}


# ==========================================================================================================
# (7) evaluation and the report
# ==========================================================================================================

def stage_eval(run: Run, d: pathlib.Path, hf_dir: str, method: str, *, split: str = "heldout") -> dict:
    e = run.config.eval
    summary = run.play(hf_dir, load_task_split(run, split), d / "trajectories.jsonl", e, best_of=e.samples,
                       seed=run.config.seed + (300 if split == "heldout" else 400))
    if summary.get("success_rate") is None:
        raise PipelineError(f"evaluation of {method}: no scored episode in {d / 'trajectories.jsonl'}; see "
                            f"{d / 'trajectories.jsonl.failed.jsonl'}")
    return dict(summary, method=method, policy=hf_dir, success_rate_pct=100.0 * summary["success_rate"])


def stage_eval_copy(run: Run, d: pathlib.Path, played_by: str, summary: dict, method: str) -> dict:
    """A policy another method's evaluation already played (iterative SWEET-RL that chose round 1 is SWEET-RL's
    policy): the evaluation's seed does not depend on the method, so it would play the same episodes; copy them."""
    for f in run.path("eval", played_by).glob("trajectories.jsonl*"):
        shutil.copyfile(f, d / f.name)
    return dict(summary, method=method, episodes_of=f"eval/{played_by}")


def stage_report(run: Run, d: pathlib.Path, summaries: dict, methods: Sequence[str]) -> dict:
    c = run.config
    s = summaries
    records = [json.loads(f.read_text()) for f in run.workdir.glob(f"**/{DONE}")]
    diagnostics = {
        "offline_success_pct": 100.0 * s["offline"]["success_rate"] if s["offline"].get("success_rate") is not None
        else None,
        "offline_tests_passed_pct": s["offline"].get("tests_passed_pct"),
        "critic_pairs": s["offline"].get("critic_pairs"),
        "critic_heldout_pairs": s.get("critic", {}).get("eval_examples"),
        "critic_heldout_accuracy": s.get("critic", {}).get("heldout_accuracy"),
        "critic_no_info_heldout_accuracy": s.get("critic_no_info", {}).get("heldout_accuracy"),
        "policy_pairs": s.get("rank", {}).get("pairs"),
        "policy_pairs_no_info": s.get("rank_no_info", {}).get("pairs"),
        "policy_pairs_balanced": s.get("rank_balanced", {}).get("pairs"),
        "policy_pairs_oracle": s.get("rank_oracle", {}).get("pairs"),
        "pair_agreement": s.get("pair_agreement"),
        # every stage's own wall-clock time, summed over the invocations that ran them (resumes included)
        "minutes": sum(r["seconds"] for r in records) / 60.0,
        "cpu_minutes": sum(r.get("cpu_seconds", 0.0) for r in records) / 60.0,
        "load_average": (lambda loads: float(np.mean(loads)) if loads else None)(
            [x for r in records for x in r.get("load_average", [])]),
        "init_reused_from": s["init"].get("reused_from"),
    }
    if c.tasks.source == "synthetic":  # the synthetic tasks know every reply's worth: check the rankings
        for name, value in diagnostics_lib.run_diagnostics(run.workdir).items():
            diagnostics["pair_oracle_agreement" + name[len("rank"):]] = value["agreement_pct"]
    model = "policy"
    if c.init.kind == "sft" and c.init.pretrained:
        model = f"{pathlib.Path(c.init.pretrained).name}, SFT start"
    elif c.init.kind == "sft":
        m = c.model
        model = f"tiny Llama (h{m.hidden_size}, {m.num_layers} layers), SFT start"
    elif c.init.path:
        model = pathlib.Path(c.init.path).name
    task = {"synthetic": f"synthetic {family_of(c)} tasks", "frontend_files": "ColBench frontend design"}.get(
        c.tasks.source, "ColBench backend")
    results = {
        "preset": c.preset, "seed": c.seed, "task": task, "track": c.get("track", "backend"), "model": model,
        "heldout_tasks": s["tasks"]["heldout"],
        "methods": {m: {k: s[f"eval_{m}"][k] for k in ("success_rate", "success_rate_pct", "tests_passed_pct",
                                                       "turns_per_episode", "episodes")} for m in methods},
        "diagnostics": diagnostics,
        "stages": {k: v for k, v in summaries.items() if isinstance(v, dict)},
    }
    if run.frontend:  # mean CLIP cosine, and win rate against the zero-shot policy's answers to the same tasks
        zero_shot = jsonl.read(run.path("eval", "zero_shot", "trajectories.jsonl")) if "zero_shot" in methods else None
        for m in methods:
            e = frontend_evaluation(jsonl.read(run.path("eval", m, "trajectories.jsonl")), zero_shot)
            win = e.get("win_rate")
            results["methods"][m].update(cosine_pct=100.0 * e["mean_cosine"],
                                         win_rate_pct=100.0 * win if win is not None else None)
    if (run.workdir / "selection.json").exists():
        results["selection"] = json.loads((run.workdir / "selection.json").read_text())
    write_evidence(run, run.workdir / "evidence")
    (run.workdir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    title = f"{results['task']}, preset {c.preset}, seed {c.seed}"
    md, png = results_lib.write_report([results], run.workdir, title=title)
    return {"results": str(run.workdir / "results.json"), "table": str(md), "chart": str(png)}


# ==========================================================================================================
# The run
# ==========================================================================================================

def run_pipeline(config: ml_collections.ConfigDict, workdir, *, accept_config_change: bool = False,
                 carry_dir=None) -> dict:
    """Every stage in order, skipping the finished ones. Returns the stage summaries (and 'report').
    accept_config_change: go on in a workdir whose finished stages used another config (recorded).
    carry_dir: the run's small state is restored from there first and saved there after each stage (carry.py).
    Relative paths (the workdir, the config's) are taken from the working directory, and recorded absolute."""
    config = absolute_paths(config, PIPELINE_PATH_FIELDS)
    check_ranges(config, PIPELINE_RANGES, PipelineError)
    check_stages(config, PipelineError)
    policy_backend.check_backend(config.policy.backend, "config.policy.backend")
    methods = methods_of(config)
    if config.tasks.source == "synthetic":   # the task family and draw, before any stage
        draw_of(config)
        family_of(config)
    check_inputs(config, methods)
    grid = selection_grid(config)
    workdir = pathlib.Path(absolute_path(os.fspath(workdir)))
    workdir.mkdir(parents=True, exist_ok=True)
    if carry_dir is not None:
        carry_dir = pathlib.Path(absolute_path(os.fspath(carry_dir)))
        carry.restore(carry_dir, workdir)
    _check_same_config(config, workdir, accept_change=accept_config_change)
    run = Run(config, workdir, carry_dir=carry_dir)
    s: dict[str, Any] = {}
    try:
        s["tasks"] = run.stage("tasks", "tasks", lambda d: stage_tasks(run, d))
        s["init"] = run.stage("init", "init", lambda d: stage_init(run, d))
        policy_hf = run.starting_policy = s["init"]["policy_hf"]
        s["offline"] = run.stage("offline", "offline", lambda d: stage_offline(run, d, policy_hf))
        traj = s["offline"]["trajectories"]
        needs = {"critic": "sweet" in methods, "critic_no_info": "sweet_no_info" in methods}
        readers = {"critic": ["rank"] + (["rank_balanced"] if "sweet_balanced" in methods else []),
                   "critic_no_info": ["rank_no_info"]}
        for name, use_info in (("critic", True), ("critic_no_info", False)):
            if needs[name]:
                s[name] = run.stage(name, name, lambda d, u=use_info: stage_critic(run, d, policy_hf, traj,
                                                                                   use_info=u),
                                    consumers=readers[name])
        if any(needs.values()) or "sweet_oracle" in methods:
            s["candidates"] = run.stage("candidates", "candidates",
                                        lambda d: stage_candidates(run, d, policy_hf, traj))
            cands = str(run.path("candidates", "candidates.jsonl"))
            if "sweet_oracle" in methods:
                s["rank_oracle"] = run.stage("rank_oracle", "rank_oracle", lambda d: stage_rank_oracle(
                    run, d, traj, cands))
            for name, critic, use_info in (("rank", "critic", True), ("rank_no_info", "critic_no_info", False)):
                if needs[critic]:
                    s[name] = run.stage(name, name, lambda d, cr=critic, u=use_info: stage_rank(
                        run, d, policy_hf, s[cr]["hf"], traj, cands, use_info=u))
            if all(needs.values()):
                s["pair_agreement"] = pair_agreement(s["rank"]["file"], s["rank_no_info"]["file"], cands)
            if "sweet_balanced" in methods:  # its own turn prompts (balanced by state), the same critic with c
                s["candidates_balanced"] = run.stage("candidates_balanced", "candidates_balanced", lambda d: (
                    stage_candidates(run, d, policy_hf, traj, balanced=True)))
                cands_balanced = str(run.path("candidates_balanced", "candidates.jsonl"))
                s["rank_balanced"] = run.stage("rank_balanced", "rank_balanced", lambda d: stage_rank(
                    run, d, policy_hf, s["critic"]["hf"], traj, cands_balanced, use_info=True, balanced=True))
        hf = {"zero_shot": policy_hf}
        played: dict[str, str] = {}   # policy -> the first method whose evaluation played it

        def evaluate(m):
            # each method's held-out play as soon as its policy is chosen, so that a run stopped between methods
            # keeps every finished method's result (its seed does not depend on the order)
            first = played.setdefault(hf[m], m)
            s[f"eval_{m}"] = run.stage(f"eval_{m}", f"eval/{m}", lambda d: stage_eval(
                run, d, hf[m], m) if first == m else stage_eval_copy(run, d, first, s[f"eval_{first}"], m))

        if grid is not None and grid.validate and "zero_shot" in methods:
            s["valid_zero_shot"] = run.stage("valid_zero_shot", "valid/zero_shot", lambda d: stage_eval(
                run, d, policy_hf, "zero_shot", split="validation"))
        if "zero_shot" in methods:
            evaluate("zero_shot")
        selection = {}
        for m in methods:
            if m in ("zero_shot", "sweet_iterative"):
                continue
            pairs = s.get({"sweet": "rank", "sweet_balanced": "rank_balanced", "sweet_oracle": "rank_oracle"}.get(
                m, "rank_no_info"), {}).get("file", "")
            # iterative SWEET-RL's rounds start from SWEET-RL's policy: kept whenever it is gone
            later = None if m == "sweet" and "sweet_iterative" in methods else [f"eval/{m}"]
            if grid is None:
                s[f"policy_{m}"] = run.stage(f"policy_{m}", f"policies/{m}", lambda d, m=m, p=pairs: stage_policy(
                    run, d, m, policy_hf, trajectories=traj, pairs=p), consumers=later)
                hf[m] = s[f"policy_{m}"]["hf"]
                evaluate(m)
                continue
            runs = {}
            for lr in grid.lrs_of(m) or [policy_train_config(run, m, policy_hf).optim.lr]:
                name = f"policy_{m}_lr{lr:g}"
                cells = [] if not grid.validate else [f"valid/{m}/lr{lr:g}_step{step}" for step in grid.steps_of(m)]
                s[name] = run.stage(name, f"policies/{m}/lr{lr:g}", lambda d, m=m, p=pairs, lr=lr: stage_policy_grid(
                    run, d, m, policy_hf, grid, lr, trajectories=traj, pairs=p),
                    consumers=None if later is None else cells + later)
                runs[lr] = s[name]["hf"]
            if not grid.validate:
                choice = grid.frozen[m]
                hf[m] = runs[choice["lr"]][str(choice["step"])]
                evaluate(m)
                continue
            curve = {}
            for lr, by_step in runs.items():
                for step, path in by_step.items():
                    name = f"valid_{m}_lr{lr:g}_step{step}"
                    v = run.stage(name, f"valid/{m}/lr{lr:g}_step{step}", lambda d, m=m, p=path: stage_eval(
                        run, d, p, m, split="validation"))
                    curve[f"{lr:g}/{step}"] = {"lr": lr, "step": int(step), "success_rate": v["success_rate"],
                                               "tests_passed_pct": v["tests_passed_pct"],
                                               "turns_per_episode": v["turns_per_episode"]}
            selection[m] = {"curve": curve, "choice": choose(curve)}
            hf[m] = runs[selection[m]["choice"]["lr"]][str(selection[m]["choice"]["step"])]
            write_selection(run, grid, selection, s.get("valid_zero_shot"))
            evaluate(m)
        if "sweet_iterative" in methods:
            hf["sweet_iterative"], rounds = iterate_sweet(run, s, grid, selection, hf["sweet"], traj)
            if rounds is not None:
                selection["sweet_iterative"] = rounds
                write_selection(run, grid, selection, s.get("valid_zero_shot"))
            evaluate("sweet_iterative")
        s["report"] = run.stage("report", "report", lambda d: stage_report(run, d, s, methods))
    finally:
        run.close()
        if run.carry_dir is not None:   # the run's own files written after its last finished stage
            carry.save(run.workdir, run.carry_dir)
    s["_ran"], s["_skipped"] = run.ran, run.skipped
    return s


def write_evidence(run: Run, out: pathlib.Path) -> None:
    """What explains a run's results, small enough to keep beside them (docs/pipeline.md): every stage's
    record, every training stage's per-step metrics, the ranked prompts' states, each ranking's candidate scores
    and pairs (annotated with the oracle on the synthetic tasks), the validation curves and the policies'
    behaviour."""
    out.mkdir(parents=True, exist_ok=True)
    stages = {}
    for marker in sorted(run.workdir.glob(f"**/{DONE}")):
        if out not in marker.parents:
            stages[str(marker.parent.relative_to(run.workdir))] = json.loads(marker.read_text())
    write_json(out / "stages.json", stages)
    for metrics in sorted(run.workdir.glob("**/train/metrics.jsonl")):
        name = str(metrics.parent.parent.relative_to(run.workdir)).replace("/", "_")
        shutil.copyfile(metrics, out / f"metrics_{name}.jsonl")
    if (run.workdir / "selection.json").exists():
        shutil.copyfile(run.workdir / "selection.json", out / "selection.json")
    offline = run.path("offline", "trajectories.jsonl")
    synthetic = run.config.tasks.source == "synthetic" and offline.exists()
    read = functools.cache(jsonl.read)  # the offline episodes serve the prompts' states and three rankings
    if synthetic and run.path("candidates", DONE).exists():
        trajs = read(offline)
        write_json(out / "prompts.json", diagnostics_lib.prompt_states(ranked_prompts(run, str(offline)), trajs))
    if synthetic and run.path("candidates_balanced", DONE).exists():
        write_json(out / "prompts_balanced.json",
                   diagnostics_lib.prompt_states(ranked_prompts(run, str(offline), balanced=True), trajs))
    for name, (stage, ranked) in diagnostics_lib.rankings(run.workdir).items():
        pairs, scores = stage / "pairs.jsonl", stage / "scores.jsonl"
        if not pairs.exists():
            continue
        annotate = synthetic and ranked.exists()
        if annotate:
            write_jsonl(out / f"pairs_{name}.jsonl", diagnostics_lib.pair_evidence(pairs, ranked,
                                                                               max_turns=run.config.eval.max_turns))
        else:
            write_jsonl(out / f"pairs_{name}.jsonl", [{k: v for k, v in r.items() if not k.endswith("_ids")}
                                                       for r in jsonl.read(pairs)])
        if scores.exists():
            rows = {(r["trajectory_index"], r["turn"]): r for r in jsonl.read(scores)}  # a resumed batch: last
            if annotate:
                rows = {k: diagnostics_lib.annotate_scores(r, read(ranked), max_turns=run.config.eval.max_turns)
                        for k, r in rows.items()}
            write_jsonl(out / f"scores_{name}.jsonl", [rows[k] for k in sorted(rows)])
    if synthetic:
        write_json(out / "behaviour.json", diagnostics_lib.behaviour_diagnostics(run.workdir))
    write_json(out / "episodes.json", heldout_episodes(run.workdir))


def heldout_episodes(workdir: pathlib.Path) -> dict:
    """Every held-out episode's reward, per method: {method: [[task index, sample, reward], ...]}, the records
    pipeline_report's paired per-task intervals read."""
    out = {}
    for path in sorted(workdir.glob("eval/*/trajectories.jsonl")):
        out[path.parent.name] = [[r["rollout"]["task_index"], r["rollout"]["sample"], r.get("reward")]
                                 for r in jsonl.read(path)]
    return out


def iterate_sweet(run: Run, s: dict, grid: Grid | None, selection: dict, round1_hf: str, offline: str):
    """Rounds 2..config.iterate.rounds of SWEET-RL (configs/pipeline.py, `iterate`), each in rounds/<r>/. Returns
    the chosen round's policy and, with validation, the rounds' validation results and the choice."""
    c = run.config
    start = run.starting_policy
    if grid is not None and not grid.validate:
        rounds = grid.frozen["sweet_iterative"]["round"] if "sweet_iterative" in grid.frozen else c.iterate.rounds
    else:
        rounds = c.iterate.rounds
    if rounds < 1:
        raise PipelineError(f"config.iterate.rounds={rounds}: use 1 or more (1 = SWEET-RL itself)")
    policies, curve = {1: round1_hf}, {}
    if grid is not None and grid.validate:
        first = selection["sweet"]["choice"]
        curve["1"] = dict(selection["sweet"]["curve"][f"{first['lr']:g}/{first['step']}"], round=1)
    union = [offline]
    for r in range(2, rounds + 1):
        base, previous = f"rounds/{r}", policies[r - 1]

        def stage(name, fn):
            s[f"round{r}_{name}"] = run.stage(f"round{r}_{name}", f"{base}/{name}", fn)
            return s[f"round{r}_{name}"]

        collected = stage("offline", lambda d: stage_round_offline(run, d, previous, r))["trajectories"]
        union.append(collected)
        episodes = stage("episodes", lambda d: {"trajectories": str(_concatenate(union, d / "trajectories.jsonl"))})
        critic = stage("critic", lambda d: stage_critic(run, d, start, episodes["trajectories"], use_info=True))
        stage("candidates", lambda d: stage_candidates(run, d, previous, collected))
        cands = str(run.path(base, "candidates", "candidates.jsonl"))
        pairs = stage("rank", lambda d: stage_rank(run, d, start, critic["hf"], collected, cands, use_info=True))
        if grid is None:
            policies[r] = stage("policy", lambda d: stage_policy(run, d, "sweet", previous, pairs=pairs["file"]))["hf"]
            continue
        choice = selection["sweet"]["choice"] if grid.validate else grid.frozen["sweet"]
        fixed = Grid([choice["lr"]], grid.steps, frozen={"sweet": choice})
        trained = stage("policy", lambda d: stage_policy_grid(run, d, "sweet", previous, fixed, choice["lr"],
                                                               pairs=pairs["file"]))
        policies[r] = trained["hf"][str(choice["step"])]
        if grid.validate:
            v = stage("valid", lambda d: stage_eval(run, d, policies[r], "sweet_iterative", split="validation"))
            curve[str(r)] = {"round": r, "lr": choice["lr"], "step": choice["step"], "success_rate": v["success_rate"],
                             "tests_passed_pct": v["tests_passed_pct"], "turns_per_episode": v["turns_per_episode"]}
    if not curve:
        return policies[rounds], None
    # the rule of `choose`, over rounds: success, then % tests passed, then fewer rounds
    best = max(curve.values(), key=lambda x: (x["success_rate"], x["tests_passed_pct"], -x["round"]))
    return policies[best["round"]], {"curve": curve, "choice": {"round": best["round"]}}


def stage_round_offline(run: Run, d: pathlib.Path, policy_hf: str, round_index: int) -> dict:
    """A round's episodes: the policy on the training tasks, as the offline stage collects them."""
    c = run.config
    collected = d / "collected.jsonl"
    summary = run.play(policy_hf, load_task_split(run, "train"), collected, c.collect, best_of=c.collect.best_of,
                       seed=c.seed + 100 + 1000 * round_index)
    return dict(summary, trajectories=str(collected))


def _concatenate(paths: Sequence[str], out: pathlib.Path) -> pathlib.Path:
    write_jsonl(out, [r for p in paths for r in jsonl.read(p)])
    return out


def write_selection(run: Run, grid: Grid, selection: dict, zero_shot: dict | None) -> None:
    """workdir/selection.json: every method's validation curve and choice (what select.frozen reads)."""
    record = {"lrs": grid.all_lrs, "steps": grid.steps, "method_lrs": grid.method_lrs, "seed": run.config.seed,
              "validation_tasks": run.config.tasks.num_validation, "episodes_per_task": run.config.eval.samples,
              "zero_shot": None if zero_shot is None else {k: zero_shot[k] for k in ("success_rate",
                                                                                     "tests_passed_pct")},
              "methods": selection}
    write_json(run.workdir / "selection.json", record)


def write_json(path: pathlib.Path, value) -> None:
    """value as indented JSON, written atomically (rundir.write_atomic)."""
    rundir.write_atomic(path, json.dumps(value, indent=2, default=str) + "\n")


def _check_same_config(config, workdir: pathlib.Path, *, accept_change: bool = False) -> None:
    """A workdir belongs to one config (rundir.record_config's rule, as for train, rank and rollout): a rerun
    with other values is refused while a stage has finished, since finished stages would keep the old values'
    results, unless accept_change, which records the change in pipeline_config_changes.jsonl."""
    produced = any(workdir.rglob(DONE))
    changes = rundir.record_config(config, workdir / "pipeline_config.json", produced=produced,
                                   accept_change=accept_change, where=str(workdir), ignore=rundir.TRACKING_FIELDS)
    if changes and produced:
        log.warning("config changed on this rerun (recorded in pipeline_config_changes.jsonl); finished stages keep "
                    "their results, only the remaining ones use the new values: %s",
                    "; ".join(f"{field}: {old!r} -> {new!r}" for field, old, new in changes))
