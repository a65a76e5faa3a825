r"""A synthetic collaborative task family where credit assignment matters, small enough for CPU.

Each task asks for a lookup function whose constants only the (scripted) human knows:

    user:  Write a Python function points(color) that returns how many points a color is worth in my
           game. The colors are red, blue and green; any other color is worth 0.
    agent: How many points is blue worth?
    user:  blue is worth 7 points.
    ...
    agent: I WANT TO ANSWER:
           def points(color):
               values = {'red': 4, 'blue': 7, 'green': 1}
               return values.get(color, 0)

The tasks are ColBench backend tasks (problem_description, ground_truth, test_cases, hidden_information),
scored by the real sandbox: one test per key plus one for a name outside the table, so the reward is
the fraction of constants the answer got right (plus the default case). Each constant is learnable only
by a turn that asks about its key, and the simulator answers only those, so each useful question is a
turn with its own credit — what a step-level critic has to find. Values are uniform digits, so a guess
is right one time in ten.

    tasks = make_tasks(200, seed=0)
    sim = ScriptedSimulator(simulator_reply)                 # sweet_jax.envs
    demos = scripted_trajectories(tasks, seed=0, policy_weights={"thorough": 1, "partial": 2, "naive": 1})

    python -m sweet_jax.commands.synthetic --num-tasks 200 --out tasks.jsonl \
        [--trajectories demos.jsonl --per-task 4]            # demos scored by the sandbox
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Mapping, Sequence

from sweet_jax.envs import ColBenchEnv, ScriptedSimulator
from sweet_jax.errors import SweetJaxError


class SyntheticTaskError(SweetJaxError):
    """A task given to the synthetic-family helpers is not one of this family."""


@dataclasses.dataclass(frozen=True)
class Theme:
    function: str          # name of the function the user wants
    argument: str          # its one parameter
    plural: str            # "colors": how the user lists the keys
    returns: str           # what the function returns, in the user's words
    question: str          # a question about one key ({key})
    statement: str         # the user's answer about one key ({key}, {value})
    keys: tuple[str, ...]  # the pool the task's keys are drawn from


THEMES: tuple[Theme, ...] = (
    Theme("points", "color", "colors", "how many points a color is worth in my game",
          "How many points is {key} worth?", "{key} is worth {value} points.",
          ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")),
    Theme("price", "fruit", "fruits", "the price of a fruit at my stall",
          "What does a {key} cost?", "A {key} costs {value} dollars.",
          ("apple", "pear", "fig", "plum", "kiwi", "lime", "mango", "peach")),
    Theme("danger", "animal", "animals", "the danger level of an animal in my board game",
          "What is the danger level of the {key}?", "The {key} has danger level {value}.",
          ("cat", "dog", "owl", "fox", "bee", "cow", "wolf", "bear")),
    Theme("floor", "team", "teams", "the floor a team works on in our building",
          "Which floor is the {key} team on?", "The {key} team is on floor {value}.",
          ("sales", "legal", "design", "support", "finance", "research", "security", "marketing")),
    Theme("bonus", "day", "days", "the bonus points for a day of the week",
          "What is the bonus on {key}?", "The bonus on {key} is {value}.",
          ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")),
)
VAGUE_QUESTION = "Could you tell me more about what you need?"
POLICIES = ("thorough", "pairs", "partial", "naive", "vague")


def _listing(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def lookup_code(function: str, argument: str, values: Mapping[str, int]) -> str:
    """The answer (and reference) form: a dict literal of the constants and a default of 0."""
    table = ", ".join(f"'{k}': {v}" for k, v in values.items())
    return f"def {function}({argument}):\n    values = {{{table}}}\n    return values.get({argument}, 0)\n"


def make_task(rng: random.Random, *, min_keys: int = 2, max_keys: int = 4, max_value: int = 9,
              themes: Sequence[Theme] = THEMES) -> dict:
    """One task of the family: a theme, 2-4 keys of its pool, a digit for each (drawn from rng)."""
    theme = rng.choice(themes)
    keys = rng.sample(theme.keys, rng.randint(min_keys, min(max_keys, len(theme.keys) - 1)))
    values = {k: rng.randint(0, max_value) for k in keys}
    other = rng.choice([k for k in theme.keys if k not in values])
    description = (f"Write a Python function {theme.function}({theme.argument}) that returns {theme.returns}. "
                   f"The {theme.plural} are {_listing(keys)}; any other "
                   f"{theme.argument} gives 0. I know the numbers, so ask me.")
    tests = {f"{theme.function}_{k}": f"{theme.function}('{k}')" for k in keys}
    tests[f"{theme.function}_other"] = f"{theme.function}('{other}')"
    hidden = "\n".join(theme.statement.format(key=k, value=v) for k, v in values.items())
    return {"problem_description": description, "ground_truth": lookup_code(theme.function, theme.argument, values),
            "test_cases": tests, "hidden_information": hidden}


def make_tasks(num_tasks: int, *, seed: int = 0, **options) -> list[dict]:
    """`num_tasks` distinct tasks of the family, deterministic by seed (options: see make_task)."""
    return distinct_tasks(make_task, num_tasks, seed=seed, key=lambda t: t["ground_truth"], **options)


def distinct_tasks(make_one, num_tasks: int, *, seed: int, key, **options) -> list[dict]:
    """The first `num_tasks` tasks of make_one(rng, **options) with distinct key(task), from one seeded stream."""
    rng, tasks, seen = random.Random(seed), [], set()
    for _ in range(100 * num_tasks):
        if len(tasks) == num_tasks:
            break
        task = make_one(rng, **options)
        if key(task) not in seen:
            seen.add(key(task))
            tasks.append(task)
    if len(tasks) < num_tasks:
        raise SyntheticTaskError(f"only {len(tasks)} distinct synthetic tasks exist with options {options}; "
                                 f"ask for fewer or change the options")
    return tasks


def _field(task: Any, name: str) -> str:
    return task[name] if isinstance(task, Mapping) else getattr(task, name)


def task_theme(task: Any) -> Theme:
    """The theme of a task of this family (from the function named in its reference)."""
    match = re.match(r"def (\w+)\((\w+)\)", _field(task, "ground_truth"))
    for theme in THEMES:
        if match and (theme.function, theme.argument) == match.groups():
            return theme
    raise SyntheticTaskError(f"not a synthetic lookup task (its ground_truth starts "
                             f"{_field(task, 'ground_truth')[:40]!r}); use tasks from make_tasks()")


def hidden_constants(task: Any) -> dict[str, int]:
    """key -> value, read back from the task's reference solution."""
    table = re.search(r"values = \{(.*)\}", _field(task, "ground_truth"))
    return {k: int(v) for k, v in re.findall(r"'(\w+)': (-?\d+)", table.group(1) if table else "")}


def simulator_reply(task: Any, dialogue: Sequence[Mapping[str, str]]) -> str:
    """The scripted human (use as ScriptedSimulator(simulator_reply)): states the value of each of the
    task's keys the agent's last message names (at most two, one sentence each, in the order named);
    otherwise asks for a specific key."""
    theme, values = task_theme(task), hidden_constants(task)
    text = dialogue[-1]["content"].lower()
    named = sorted((m.start(), k) for k in values for m in [re.search(rf"\b{re.escape(k)}\b", text)] if m)
    if named:
        return " ".join(theme.statement.format(key=k, value=values[k]) for _, k in named[:2])
    if any(re.search(rf"\b{re.escape(k)}\b", text) for k in theme.keys):
        return "That one is not in my list, so it gives 0."
    return f"I know a number for each {theme.argument}; ask me about a specific one."


def _question(theme: Theme, keys: Sequence[str]) -> str:
    if len(keys) == 1:
        return theme.question.format(key=keys[0])
    return f"What are the numbers for {_listing(list(keys))}?"


def scripted_replies(task: Any, policy: str, rng: random.Random) -> list[str]:
    """A scripted agent's replies for one episode (last = the answer), by policy:
    thorough asks about every key, one a turn; pairs asks two keys a turn; partial asks some and guesses
    the others; naive guesses at once; vague asks an unhelpful question, then guesses."""
    if policy not in POLICIES:
        raise SyntheticTaskError(f"unknown scripted policy {policy!r}; choose from {POLICIES}")
    theme, values = task_theme(task), hidden_constants(task)
    keys = list(values)
    order = rng.sample(keys, len(keys))
    if policy in ("thorough", "pairs"):
        asked = order
    elif policy == "partial" and len(keys) > 1:
        asked = order[: rng.randint(1, len(keys) - 1)]
    else:
        asked = []
    step = 2 if policy == "pairs" else 1
    replies = [_question(theme, asked[i:i + step]) for i in range(0, len(asked), step)]
    if policy == "vague":
        replies.insert(0, VAGUE_QUESTION)
    known = {k: values[k] if k in asked else rng.randint(0, 9) for k in keys}
    return replies + ["I WANT TO ANSWER:\n" + lookup_code(theme.function, theme.argument, known)]


def scripted_trajectories(tasks: Sequence[Any], *, seed: int = 0, per_task: int = 1,
                          policy_weights: Mapping[str, float] | None = None, evaluator=None) -> list[dict]:
    """Episodes of the scripted agent with the scripted human, played in the real ColBenchEnv; policies
    drawn by weight (default: equal). With an `evaluator` (sweet_jax.sandbox.Evaluator) every trajectory
    gets its reward."""
    return scripted_episodes(tasks, scripted_replies, simulator_reply, POLICIES, seed=seed, per_task=per_task,
                             policy_weights=policy_weights, evaluator=evaluator)


def scripted_episodes(tasks: Sequence[Any], replies_of, reply_of_human, policies: Sequence[str], *, seed: int,
                      per_task: int, policy_weights: Mapping[str, float] | None, evaluator=None,
                      max_turns: int = 10, record_policy: bool = False) -> list[dict]:
    """A task family's scripted agents (replies_of(task, policy, rng) -> replies, the last the answer) against its
    scripted human (reply_of_human(task, dialogue)) in the real ColBenchEnv with max_turns, policies drawn by weight
    from one seeded stream (default: equal); record_policy keeps each episode's policy name; with an `evaluator`
    (sweet_jax.sandbox.Evaluator) every trajectory gets its reward."""
    weights = dict(policy_weights or {p: 1.0 for p in policies})
    for name in weights:
        if name not in policies:
            raise SyntheticTaskError(f"unknown scripted policy {name!r} in policy_weights; choose from {policies}")
    names = list(weights)
    rng = random.Random(seed)
    simulator = ScriptedSimulator(reply_of_human)
    out = []
    for task in tasks:
        for _ in range(per_task):
            policy = rng.choices(names, [weights[n] for n in names])[0]
            env = ColBenchEnv(task, simulator, max_turns=max_turns)
            for reply in replies_of(task, policy, rng):
                if env.step(reply):
                    break
            record = env.trajectory()
            record["dialogue_history"] = [{"role": d["role"], "content": d["content"]}
                                          for d in record["dialogue_history"]]
            if record_policy:
                record["scripted_policy"] = policy
            out.append(record)
    if evaluator is not None:
        scores = evaluator.score_many([(t["task"], t["answer"]) for t in out])
        for t, s in zip(out, scores):
            if s.status != "ok":
                raise SyntheticTaskError(f"sandbox infrastructure error while scoring: {s}")
            t["reward"] = float(s.reward)
    return out
