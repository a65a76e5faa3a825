"""Playing ColBench episodes: a policy against a human simulator, scored, written to a resumable JSONL file.

`rollout(tasks, policy, simulator, out)` is the loop `python -m sweet_jax.rollout` and the pipeline's offline and
evaluation stages run:

- Batching: the agent turns of all live episodes of a batch go to the policy in one call (`policy.act`); the
  simulator replies of a batch go out concurrently (`Simulator.reply_many`).
- Output: trajectories in the official JSONL format (task, dialogue_history, answer, reward) plus a
  `rollout` field (task_index, sample, turns, passed, total). Each finished batch is appended and
  flushed to disk, so a crash loses at most the batch in flight. Rerunning with the same output resumes:
  episodes whose (task_index, sample) is already in the file are skipped, a half-written last line is
  dropped, so nothing is duplicated or lost.
- Failures: an episode whose simulator failed (after its retries) or whose answer could not be
  evaluated (sandbox infra error) is written to OUTPUT.failed.jsonl with its reason instead; the run
  goes on, and a rerun tries those episodes again.
- Summary: success rate (reward 1.0), % tests passed (mean reward), turns per episode, over the whole
  output file (`summarize`), written to OUTPUT.summary.json.
- The official block layout (`official_blocks`): row b * N + i is sample b of task i, what the official
  `evaluate_code.py --k` expects; failed episodes stay in it as the official collector keeps every episode.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
from typing import Any, Callable, Sequence

import numpy as np
from tqdm import tqdm

from sweet_jax import costs, jsonl
from sweet_jax.config_utils import ROLLOUT_PATH_FIELDS, ROLLOUT_RANGES, absolute_paths, check_ranges
from sweet_jax.data import demo, frontend as frontend_data, loading
from sweet_jax.data.tokenizers import apply_chat_template
from sweet_jax.envs import (AGENT_PROMPT, ColBenchEnv, ModelSimulator, NO_ANSWER, OpenAISimulator, ScriptedSimulator,
                            Simulator, SimulatorError, task_field, task_json)
from sweet_jax.envs.frontend import FRONTEND_AGENT_PROMPT, FrontendEnv, FrontendTrack
from sweet_jax.envs.prompts import SIMULATOR_PROMPT, load_prompt
from sweet_jax.envs.families import simulator_reply
from sweet_jax.errors import SweetJaxError
from sweet_jax.sampling import generate, policy_backend
from sweet_jax.sampling.base import BaseSampler
from sweet_jax.sandbox import Evaluator
from sweet_jax.train import model_loading, rundir

log = logging.getLogger("sweet_jax.rollout")

SIMULATOR_KINDS = ("openai", "model", "scripted", "hidden_info", "synthetic")


class RolloutError(SweetJaxError):
    """A rollout cannot start or resume (bad config, an output file from other tasks, ...)."""


# ----------------------------------------------------------------------------------------------------------
# The policy: dialogues in, replies out, one batched sampler call per agent turn of a batch.
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PolicyReply:
    text: str | None          # the generated reply; None when the episode cannot continue (see error)
    prompt: str | None        # the rendered prompt the agent saw (recorded as the turn's `input`)
    error: str | None = None


class SamplerPolicy:
    """The agent as a sampler (sampling.base.BaseSampler: in process or an engine): each dialogue is rendered with
    the tokenizer's chat template, after an optional system prompt holding the task rules (AGENT_PROMPT)."""

    def __init__(self, sampler: BaseSampler, *, max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, system_prompt: str | None = AGENT_PROMPT, seed: int = 0):
        self.sampler, self.tokenizer = sampler, sampler.tokenizer
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.system_prompt, self.seed = system_prompt, seed
        self.context = int(sampler.config.max_position_embeddings)
        self.calls = 0

    def render(self, messages: Sequence[dict]) -> str:
        messages = list(messages)
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt=True)

    def act(self, dialogues: Sequence[Sequence[dict]]) -> list[PolicyReply]:
        prompts = [self.render(d) for d in dialogues]
        ids = [list(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        replies: list[PolicyReply | None] = [None] * len(prompts)
        runnable = []
        for i, prompt_ids in enumerate(ids):
            if len(prompt_ids) + self.max_new_tokens > self.context:
                replies[i] = PolicyReply(None, prompts[i], f"the dialogue ({len(prompt_ids)} tokens) plus "
                                         f"max_new_tokens={self.max_new_tokens} exceeds the policy's context of "
                                         f"{self.context} tokens")
            else:
                runnable.append(i)
        if runnable:
            samples = self.sampler.generate([ids[i] for i in runnable], max_new_tokens=self.max_new_tokens,
                                            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                            n=1, seed=self.seed * 1_000_003 + self.calls)
            for i, per_prompt in zip(runnable, samples):
                replies[i] = PolicyReply(per_prompt[0].text, prompts[i])
        self.calls += 1
        return replies  # type: ignore[return-value]


class FunctionPolicy:
    """The agent as a plain function `fn(messages) -> reply` (tests, scripted baselines)."""

    def __init__(self, fn: Callable[[Sequence[dict]], str]):
        self.fn = fn

    def act(self, dialogues):
        return [PolicyReply(self.fn(d), None) for d in dialogues]


# ----------------------------------------------------------------------------------------------------------
# Episodes
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Episode:
    task_index: int
    sample: int
    env: ColBenchEnv
    failure: str | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.task_index, self.sample)


def run_episodes(episodes: Sequence[Episode], policy, simulator: Simulator) -> None:
    """Play every episode to its end (answer, turn limit or failure), batching across episodes."""
    live = [e for e in episodes if not e.env.done and e.failure is None]
    while live:
        with costs.timed("policy_act"):   # rendering, sampling, decoding the replies
            replies = policy.act([e.env.messages() for e in live])
        for episode, reply in zip(live, replies):
            if reply.text is None:
                episode.failure = f"policy: {reply.error}"
            else:
                episode.env.act(reply.text, prompt=reply.prompt)
        asking = [e for e in live if e.failure is None and not e.env.done]
        with costs.timed("simulator"):
            answers = simulator.reply_many([(e.env.task, e.env.messages()) for e in asking])
        for episode, answer in zip(asking, answers):
            if isinstance(answer, SimulatorError):
                episode.failure = f"simulator: {answer}"
            else:
                episode.env.observe(answer)
        live = [e for e in asking if e.failure is None]


def task_id(task: Any) -> str:
    """A short fingerprint of a task, stored with each record so a resume can tell the tasks match."""
    text = json.dumps([str(task_field(task, "problem_description", "")), str(task_field(task, "ground_truth", ""))])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------------------------------------
# The output file: append-only JSONL, resumable.
# ----------------------------------------------------------------------------------------------------------

def read_records(path: pathlib.Path, *, repair: bool = False) -> list[dict]:
    """The complete records of an append-only JSONL output. A last line without its newline is the write a crash
    cut short: it is dropped (and, with repair=True, truncated from the file). A bad line elsewhere is an error."""
    return jsonl.read(path, partial="repair" if repair else "drop")


def append_records(path: pathlib.Path, records: Sequence[dict]) -> None:
    """Append, flush and fsync: once this returns the batch survives a crash."""
    jsonl.append(path, records)


def failures_path(out: pathlib.Path) -> pathlib.Path:
    return out.with_name(out.name + ".failed.jsonl")


def summary_path(out: pathlib.Path) -> pathlib.Path:
    return out.with_name(out.name + ".summary.json")


def official_blocks(records: Sequence[dict], failures: Sequence[dict], tasks: Sequence[Any],
                    best_of: int) -> list[dict]:
    """Every episode of the run in the official block order (row b * len(tasks) + i = sample b of task i); a
    failed episode becomes a record (answer "No answer", reward 0.0, rollout.failure = its reason)."""
    by_key = {}
    for f in failures:
        key = (f["task_index"], f["sample"])
        by_key[key] = {"task": tasks[key[0]], "dialogue_history": f["dialogue_history"], "answer": NO_ANSWER,
                       "reward": 0.0, "rollout": {"task_index": key[0], "sample": key[1], "task_id": f["task_id"],
                                                  "turns": f.get("turns"), "failure": f["reason"]}}
    for r in records:  # a later success (a rerun) replaces an earlier failure
        by_key[(r["rollout"]["task_index"], r["rollout"]["sample"])] = r
    missing = [(i, b) for b in range(best_of) for i in range(len(tasks)) if (i, b) not in by_key]
    if missing:
        raise RolloutError(f"{len(missing)} episodes have not run yet (first: task {missing[0][0]}, sample "
                           f"{missing[0][1]}); the official block layout needs every one. Rerun to complete them")
    return [by_key[(i, b)] for b in range(best_of) for i in range(len(tasks))]


def from_official_blocks(records: Sequence[dict], best_of: int) -> dict[tuple[int, int], dict]:
    """The inverse: {(task_index, sample): record} from a file in the official block layout (k = best_of copies
    of the task list, stacked), checking the alignment the official evaluator asserts."""
    if best_of < 1 or len(records) % best_of:
        raise RolloutError(f"{len(records)} records are not {best_of} equal blocks (official --k {best_of})")
    n = len(records) // best_of
    for r in range(n, len(records)):
        if records[r]["task"]["problem_description"] != records[r - n]["task"]["problem_description"]:
            raise RolloutError(f"record {r + 1} is not the same task as record {r + 1 - n}: not the official "
                               f"block layout for k={best_of}")
    return {(r % n, r // n): rec for r, rec in enumerate(records)}


def write_official_layout(out: pathlib.Path, tasks: Sequence[Any], best_of: int) -> int:
    """Rewrite OUTPUT (atomically) in the official block layout, failed episodes included; returns its rows."""
    failures = read_records(failures_path(out)) if failures_path(out).exists() else []
    rows = official_blocks(read_records(out), failures, tasks, best_of)
    jsonl.write(out, rows)
    return len(rows)


def summarize(records: Sequence[dict], *, failed: int = 0) -> dict:
    rewards = np.array([r["reward"] for r in records if r.get("reward") is not None], np.float64)
    turns = np.array([sum(d["role"] == "assistant" for d in r["dialogue_history"]) for r in records], np.float64)
    return {
        "episodes": len(records),
        "failed_episodes": failed,
        "success_rate": float(np.mean(rewards == 1.0)) if rewards.size else None,
        "tests_passed_pct": float(100.0 * rewards.mean()) if rewards.size else None,
        "mean_reward": float(rewards.mean()) if rewards.size else None,   # frontend: the mean CLIP cosine
        "turns_per_episode": float(turns.mean()) if turns.size else None,
    }


# ----------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------

def rollout(tasks: Sequence[Any], policy, simulator: Simulator, out_path, *, best_of: int = 1,
            batch_size: int = 16, max_turns: int = 10, evaluator=None, progress: bool = True,
            on_batch: Callable[[int], None] | None = None, make_env: Callable[..., Any] = ColBenchEnv) -> dict:
    """Play len(tasks) x best_of episodes, append them to out_path batch by batch, return the summary.

    evaluator: a sweet_jax.sandbox.Evaluator (rewards), or None to leave `reward` out; for the frontend track
    an envs.frontend.FrontendScorer. make_env: the environment class (ColBenchEnv, envs.frontend.FrontendEnv).
    on_batch: called with the number of records written after each batch (progress hooks, tests).
    """
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    ids = [task_id(t) for t in tasks]
    done: set[tuple[int, int]] = set()
    for r in read_records(out, repair=True):
        meta = r.get("rollout") or {}
        key = (meta.get("task_index"), meta.get("sample"))
        if key[0] is None or key[1] is None:
            raise RolloutError(f"{out}: a record without rollout.task_index/sample; this file was not written by "
                               "sweet_jax.rollout. Pick another --config.output")
        if key[0] >= len(tasks) or meta.get("task_id") != ids[key[0]]:
            raise RolloutError(f"{out}: record for task {key[0]} does not match the task list of this run (task_id "
                               f"{meta.get('task_id')} vs {ids[key[0]] if key[0] < len(tasks) else 'none'}); the "
                               "file was written for other tasks. Pick another --config.output")
        done.add(key)
    todo = [(i, s) for i in range(len(tasks)) for s in range(best_of) if (i, s) not in done]
    total = len(tasks) * best_of
    bar = None
    if progress:
        bar = tqdm(total=total, initial=total - len(todo), desc="rollout", unit="episode")
    failed = 0
    for start in range(0, len(todo), batch_size):
        episodes = [Episode(i, s, make_env(tasks[i], max_turns=max_turns)) for i, s in todo[start:start + batch_size]]
        run_episodes(episodes, policy, simulator)
        finished = [e for e in episodes if e.failure is None]
        with costs.timed("sandbox"):
            scores = evaluator.score_many([(e.env.task, e.env.answer) for e in finished]) if evaluator else None
        records, failures = [], []
        for j, e in enumerate(finished):
            score = scores[j] if scores is not None else None
            if score is not None and getattr(score, "status", "ok") != "ok":
                e.failure = f"sandbox: {score.status}: {str(getattr(score, 'details', ''))[:300]}"
                continue
            record = e.env.trajectory(reward=score.reward if score is not None else None)
            record["rollout"] = {"task_index": e.task_index, "sample": e.sample, "task_id": ids[e.task_index],
                                 "turns": e.env.turns,
                                 "passed": getattr(score, "passed", None), "total": getattr(score, "total", None)}
            records.append(record)
        for e in episodes:
            if e.failure is not None:
                failures.append({"task_index": e.task_index, "sample": e.sample, "task_id": ids[e.task_index],
                                 "reason": e.failure, "turns": e.env.turns,
                                 "dialogue_history": e.env.dialogue_history})
                log.warning("episode (task %d, sample %d) failed: %s", e.task_index, e.sample, e.failure)
        append_records(out, records)
        append_records(failures_path(out), failures)
        failed += len(failures)
        if bar is not None:
            bar.update(len(episodes))
            bar.set_postfix(failed=failed)
        if on_batch is not None:
            on_batch(len(records))
    if bar is not None:
        bar.close()
    summary = summarize(read_records(out), failed=failed)
    summary_path(out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# ----------------------------------------------------------------------------------------------------------
# Building the pieces from a config
# ----------------------------------------------------------------------------------------------------------

def load_task_list(path: str, num_tasks: int, *, frontend: bool = False) -> list[Any]:
    if not path:
        path = str(demo.paths().frontend_tasks if frontend else demo.paths().tasks)
    tasks = frontend_data.load_frontend_tasks(path) if frontend else loading.load_tasks(path)
    if num_tasks and num_tasks > 0:
        tasks = tasks[:num_tasks]
    if not tasks:
        raise RolloutError(f"no tasks in {path}")
    return [task_json(t) for t in tasks]


def make_simulator(s, *, seed: int = 0, policy_sampler=None, load_sampler: Callable[[], Any] | None = None,
                   field: str = "simulator") -> Simulator:
    """The human simulator a config's `simulator` block names (`field` is its place in the config, for errors):
      openai       an OpenAI-compatible chat endpoint (base_url, model, api_key, timeout_s, max_retries,
                   backoff_s, concurrency, max_tokens)
      model        a sweet_jax model in this process: load_sampler() when s.path is set, else policy_sampler
      scripted, hidden_info   replies with the hidden information
      synthetic    the synthetic task families' scripted human (envs/families.simulator_reply: the task's own)
    s.prompt_path: a template file over {problem_description} {hidden_information} {dialogue_history}."""
    template = load_prompt(s.prompt_path, "simulator") if s.get("prompt_path") else SIMULATOR_PROMPT
    if s.kind == "openai":
        return OpenAISimulator(s.base_url, s.model, api_key=s.api_key, timeout_s=s.timeout_s,
                               max_retries=s.max_retries, backoff_s=s.get("backoff_s", 1.0),
                               concurrency=s.concurrency, max_tokens=s.max_tokens, template=template)
    if s.kind == "model":
        sampler = load_sampler() if s.get("path") and load_sampler is not None else policy_sampler
        if sampler is None:
            raise RolloutError(f"{field}.kind='model' needs {field}.path (an HF directory of the simulator)")
        return ModelSimulator(sampler, max_new_tokens=s.max_tokens, seed=seed, template=template)
    if s.kind in ("scripted", "hidden_info"):
        return ScriptedSimulator()
    if s.kind == "synthetic":
        return ScriptedSimulator(simulator_reply)
    raise RolloutError(f"{field}.kind={s.kind!r}: use openai (an OpenAI-compatible endpoint), model (a sweet_jax "
                       "model in this process), scripted / hidden_info (replies with the hidden information) or "
                       "synthetic (the synthetic task's scripted human)")


def agent_prompt_for(config) -> str | None:
    """The agent's system prompt: agent_prompt_path's file when set, else the track's rules (or none)."""
    if config.get("agent_prompt_path"):
        return load_prompt(config.agent_prompt_path, "agent")
    if not config.agent_prompt:
        return None
    if config.get("track", "backend") == "frontend":
        return FRONTEND_AGENT_PROMPT
    return AGENT_PROMPT


# Fields that change how fast the episodes come, not what they are: a rerun may change them freely.
OPERATIONAL_FIELDS = ("progress", "output", "batch_size", "max_batch_size", "mesh", "sandbox.workers")


def run(config, *, accept_config_change: bool = False) -> dict:
    config = absolute_paths(config, ROLLOUT_PATH_FIELDS)  # relative to the working directory, recorded absolute
    check_ranges(config, ROLLOUT_RANGES, RolloutError)
    record_config(config, accept_config_change=accept_config_change)
    frontend = config.get("track", "backend") == "frontend"
    tasks = load_task_list(config.tasks, config.num_tasks, frontend=frontend)
    if config.get("layout", "by_task") not in ("by_task", "official"):
        raise RolloutError(f"layout={config.layout!r}: use by_task or official (the official block layout)")
    mesh = model_loading.make_mesh(config.mesh.shape)
    p = config.policy
    if p.backend == "openai" and config.simulator.kind == "model" and not config.simulator.path:
        raise RolloutError("simulator.kind='model' with simulator.path='' plays the human with the policy's own "
                           "in-process model; with policy.backend='openai' set simulator.path")
    with policy_backend.policy_sampler(p, p.path, p.tokenizer, seed=config.seed, dtype=p.dtype, mesh=mesh,
                                       max_batch_size=config.max_batch_size) as sampler:
        out = pathlib.Path(config.output)
        settings = dict(best_of=config.best_of, batch_size=config.batch_size, max_turns=config.max_turns,
                        max_new_tokens=config.sampling.max_new_tokens, temperature=config.sampling.temperature,
                        top_p=config.sampling.top_p, top_k=config.sampling.top_k,
                        system_prompt=agent_prompt_for(config), seed=config.seed, progress=config.progress)
        if frontend:  # browsers + CLIP score the answers, the simulator compares pages (sweet_jax.envs.frontend)
            track = FrontendTrack(config.frontend, config.simulator, seed=config.seed)
            try:
                return play(tasks, sampler, out, simulator=config.simulator, frontend=track, **settings)
            finally:
                track.close()
        evaluator = None
        try:
            if config.sandbox.enabled:
                evaluator = Evaluator(workers=config.sandbox.workers or None, timeout_s=config.sandbox.timeout_s,
                                      compat=config.sandbox.compat, degraded_ok=config.sandbox.degraded_ok)
                evaluator.__enter__()
            summary = play(tasks, sampler, out, simulator=config.simulator, evaluator=evaluator,
                           simulator_seed=config.seed, simulator_sampler=sampler, load_simulator=lambda: (
                               generate.load_sampler(config.simulator.path, config.simulator.tokenizer,
                                                     dtype=config.policy.dtype, seed=config.seed, mesh=mesh)),
                           **settings)
        finally:
            if evaluator is not None:
                evaluator.__exit__(None, None, None)
    if config.get("layout", "by_task") == "official":
        write_official_layout(out, tasks, config.best_of)
        summary = dict(summarize(read_records(out)), failed_episodes=summary["failed_episodes"])
        summary_path(out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def play(tasks: Sequence[Any], sampler: BaseSampler, out, *, best_of: int, batch_size: int, max_turns: int,
         max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0, system_prompt: str | None,
         seed: int, simulator, evaluator=None, frontend: FrontendTrack | None = None, progress: bool = True,
         simulator_seed: int = 0, simulator_sampler: BaseSampler | None = None,
         load_simulator: Callable[[], Any] | None = None, field: str = "simulator") -> dict:
    """The episodes of the policy `sampler` (in-process or an engine) on `tasks`, written to out (resumable,
    `rollout`): what `python -m sweet_jax.rollout` and the pipeline's offline and evaluation stages play. The
    human: the frontend track's simulator (its browsers + CLIP score the answers), else the `simulator` config
    block's (make_simulator with simulator_seed, simulator_sampler, load_simulator and field; closed at the end),
    the answers scored by evaluator (the sandbox; None: not scored)."""
    policy = SamplerPolicy(sampler, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                           system_prompt=system_prompt, seed=seed)
    settings = dict(best_of=best_of, batch_size=batch_size, max_turns=max_turns, progress=progress)
    if frontend is not None:
        return rollout(tasks, policy, frontend.simulator, out, evaluator=frontend.scorer, make_env=FrontendEnv,
                       **settings)
    human = make_simulator(simulator, seed=simulator_seed, policy_sampler=simulator_sampler,
                           load_sampler=load_simulator, field=field)
    try:
        return rollout(tasks, policy, human, out, evaluator=evaluator, **settings)
    finally:
        human.close()


def record_config(config, *, accept_config_change: bool = False) -> list:
    """OUTPUT.config.json: the config that produced the episodes in OUTPUT (rundir.record_config's rule: a rerun
    with another config is refused while OUTPUT holds episodes, unless accept_config_change records the change
    in OUTPUT.config_changes.jsonl). Checked before any model loads: a refused run costs nothing."""
    out = pathlib.Path(config.output)
    produced = out.exists() and bool(read_records(out))
    return rundir.record_output_config(config, out, produced=produced, accept_change=accept_config_change,
                                       ignore=OPERATIONAL_FIELDS, what="episodes")


def format_summary(summary: dict, out) -> str:
    pct = lambda x: "n/a" if x is None else f"{x:.1f}%"
    rate = summary["success_rate"]
    turns = summary["turns_per_episode"]
    failed = summary["failed_episodes"]
    failures = failures_path(pathlib.Path(out))
    # Name the failures file only where it exists: no failure in any run writes none.
    where = f", see {failures.name}" if failures.exists() else ""
    head = f"{out}: {summary['episodes']} episodes ({failed} failed this run{where})\n"
    if summary.get("track") == "frontend":
        cosine = summary.get("mean_reward")
        return (head + f"  mean CLIP cosine  {'n/a' if cosine is None else f'{cosine:.4f}'}\n"
                f"  turns per episode {'n/a' if turns is None else f'{turns:.2f}'}")
    return (head + f"  success rate      {pct(None if rate is None else 100 * rate)}\n"
            f"  tests passed      {pct(summary['tests_passed_pct'])}\n"
            f"  turns per episode {'n/a' if turns is None else f'{turns:.2f}'}")
