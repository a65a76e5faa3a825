"""The synthetic task families, one interface: which family a task is of, its scripted human, its task generator and
its scripted agents. lookup: envs/synthetic.py (every key named, one decision); discovery: envs/discovery.py
(hidden and untested keys, a binding turn budget; docs/discovery.md)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from sweet_jax.envs import discovery, synthetic
from sweet_jax.envs.synthetic import SyntheticTaskError

FAMILIES = {"lookup": synthetic, "discovery": discovery}
# The turn limit each family is played with (lookup: ColBench's 10; discovery: its binding budget)
MAX_TURNS = {"lookup": 10, "discovery": discovery.MAX_TURNS}


def family(name: str, field: str = "tasks.family"):
    if name not in FAMILIES:
        raise SyntheticTaskError(f"{field}={name!r}: use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def name_of(task: Any) -> str:
    """The family a synthetic task is of, from its statement."""
    return "discovery" if discovery.is_task(task) else "lookup"


def module_of(task: Any):
    return FAMILIES[name_of(task)]


def simulator_reply(task: Any, dialogue: Sequence[Mapping[str, str]]) -> str:
    """The scripted human of the task's family (ScriptedSimulator(simulator_reply))."""
    return module_of(task).simulator_reply(task, dialogue)


def make_tasks(name: str, num_tasks: int, *, seed: int, min_keys: int = 2, max_keys: int = 4) -> list[dict]:
    """num_tasks distinct tasks of a family, deterministic by seed (min_keys / max_keys: the lookup family's)."""
    if name == "lookup":
        return synthetic.make_tasks(num_tasks, seed=seed, min_keys=min_keys, max_keys=max_keys)
    return family(name).make_tasks(num_tasks, seed=seed)


def scripted_trajectories(name: str, tasks: Sequence[Any], *, seed: int, per_task: int,
                          policy_weights: Mapping[str, float], evaluator=None, max_turns: int | None = None):
    """The family's scripted agents' episodes with its scripted human, scored by the evaluator when given."""
    if name == "lookup":   # the lookup family's agents never reach its turn limit
        return synthetic.scripted_trajectories(tasks, seed=seed, per_task=per_task, policy_weights=policy_weights,
                                               evaluator=evaluator)
    return family(name).scripted_trajectories(tasks, seed=seed, per_task=per_task, policy_weights=policy_weights,
                                              evaluator=evaluator, max_turns=max_turns or MAX_TURNS[name])
