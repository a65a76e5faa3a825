r"""The discovery task family: ColBench's structure at CPU size, where turns differ in worth and the budget binds.

The design, its rules and why each is there: docs/discovery.md. In short, a task asks for a lookup function whose
constants only the (scripted) human knows, as in the lookup family (envs/synthetic.py), and adds what makes credit
assignment matter in ColBench:

    user:  Write a Python function points(color) that returns how many points a color is worth in my game. The
           colors include red, blue and white; white never comes up, so its number does not matter. Any other
           color gives 0. I know the numbers, so ask me.
    agent: Are there other colors?                          (discovery: the statement does not name every tested key)
    user:  The other colors are green and black.
    agent: What are the numbers for red and green?          (two tested keys: the most a reply states)
    user:  red is worth 4 points. green is worth 1 points.
    agent: What are the numbers for blue and black?
    user:  blue is worth 7 points. black is worth 2 points.
    agent: I WANT TO ANSWER:
           def points(color):
               values = {'red': 4, 'green': 1, 'blue': 7, 'black': 2}
               return values.get(color, 0)

- Named keys (2-3) are listed in the statement; hidden keys (0-2) are tested but not named: only a discovery
  question ("Are there other colors?") reveals their names. Untested keys (1-2) are listed and said never to come
  up: a question about one is a wasted turn.
- The human states the values of at most two task keys a question names; answers a discovery question with the
  hidden keys' names (no values); is vague otherwise.
- The turn limit is MAX_TURNS = 5 agent turns, the 5th reply being the answer: the shortest successful episode
  (discovery, ceil(tested / 2) questions of two keys, the answer) always fits, asking one key a turn or asking about
  the untested keys does not fit a task with many keys.
- Reward: the sandbox's fraction of tests passed (one test per tested key, one for a key outside the table).

    tasks = make_tasks(200, seed=0)
    sim = ScriptedSimulator(simulator_reply)
    demos = scripted_trajectories(tasks, seed=0, policy_weights={"efficient": 1, "everything": 1})
    worth = reply_worth(task, messages, reply)     # the exact oracle (docs/discovery.md)
"""
from __future__ import annotations

import functools
import math
import random
import re
from typing import Any, Mapping, Sequence

from sweet_jax.envs.prompts import ANSWER_MARKER
from sweet_jax.envs.synthetic import (THEMES, SyntheticTaskError, Theme, _field, _listing, hidden_constants,
                                      distinct_tasks, lookup_code, scripted_episodes,
                                      task_theme)

MAX_TURNS = 4            # agent turns an episode may take; the last reply is the answer
KEYS_PER_REPLY = 2       # the human states at most two values a reply
TURN_COST = 0.01         # the oracle's price of a turn: breaks ties between replies that reach the same reward
NAMED = (2, 3)           # tested keys listed in the statement (inclusive range)
HIDDEN_WEIGHTS = {0: 1, 1: 2, 2: 2}   # tested keys the statement does not name: how many, by weight
MAX_TESTED = 4           # named + hidden: discovery and two questions of two keys, then the answer, fit MAX_TURNS
UNTESTED = (1, 2)        # keys listed in the statement that the tests never call
DISCOVERY = re.compile(r"\b(other|else|more|rest|remaining|missing|additional|all)\b")
VAGUE_QUESTION = "Could you tell me more about what you need?"
POLICIES = ("efficient", "everything", "pairs_all", "no_discovery", "partial", "vague", "naive")


def _statement(theme: Theme, named: Sequence[str], untested: Sequence[str]) -> str:
    listed = list(named) + list(untested)
    verb = "never comes up" if len(untested) == 1 else "never come up"
    pronoun = "its number does" if len(untested) == 1 else "their numbers do"
    return (f"Write a Python function {theme.function}({theme.argument}) that returns {theme.returns}. "
            f"The {theme.plural} include {_listing(listed)}; {_listing(list(untested))} {verb}, so {pronoun} not "
            f"matter. Any other {theme.argument} gives 0. I know the numbers, so ask me.")


STATEMENT = re.compile(r"The (\w+) include (.*?); (.*?) never comes? up, so")


def make_task(rng: random.Random, *, max_value: int = 9, themes: Sequence[Theme] = THEMES) -> dict:
    """One task: a theme, its named, hidden and untested keys (drawn from the theme's pool), a digit for each tested
    key. The hidden keys' names and every value are in the reference (the training-time information c) and in the
    hidden information, never in the statement."""
    theme = rng.choice(themes)
    hidden = rng.choices(list(HIDDEN_WEIGHTS), list(HIDDEN_WEIGHTS.values()))[0]
    named, untested = rng.randint(*NAMED), rng.randint(*UNTESTED)
    hidden = min(hidden, MAX_TESTED - named)
    while named + hidden + untested + 1 > len(theme.keys):   # one pool key stays outside the task for the test
        untested, hidden = (untested - 1, hidden) if untested > 1 else (untested, hidden - 1)
    keys = rng.sample(theme.keys, named + hidden + untested + 1)
    named_keys, hidden_keys = keys[:named], keys[named:named + hidden]
    untested_keys, other = keys[named + hidden:-1], keys[-1]
    tested = named_keys + hidden_keys
    values = {k: rng.randint(0, max_value) for k in tested}
    tests = {f"{theme.function}_{k}": f"{theme.function}('{k}')" for k in tested}
    tests[f"{theme.function}_other"] = f"{theme.function}('{other}')"
    hidden_info = [theme.statement.format(key=k, value=values[k]) for k in tested]
    hidden_info.append(_discovery_reply(theme, hidden_keys))
    hidden_info += [_untested_reply(k) for k in untested_keys]
    return {"problem_description": _statement(theme, named_keys, untested_keys),
            "ground_truth": lookup_code(theme.function, theme.argument, values), "test_cases": tests,
            "hidden_information": "\n".join(hidden_info)}


def make_tasks(num_tasks: int, *, seed: int = 0, **options) -> list[dict]:
    """`num_tasks` distinct tasks (statement and reference), deterministic by seed (options: see make_task)."""
    return distinct_tasks(make_task, num_tasks, seed=seed, key=lambda t: t["problem_description"] + t["ground_truth"],
                          **options)


def is_task(task: Any) -> bool:
    """Whether a task is of this family (its statement lists keys that include untested ones)."""
    return bool(STATEMENT.search(str(_field(task, "problem_description"))))


class Layout:
    """A task's keys as the family's rules see them: named (listed and tested), hidden (tested, not listed),
    untested (listed, never called), their values, and the pool of its theme."""

    def __init__(self, task: Any):
        match = STATEMENT.search(str(_field(task, "problem_description")))
        if not match:
            raise SyntheticTaskError(f"not a discovery task (its statement starts "
                                     f"{str(_field(task, 'problem_description'))[:60]!r}); use make_tasks()")
        self.theme = task_theme(task)
        self.values = hidden_constants(task)
        listed = _unlist(match.group(2))
        self.untested = _unlist(match.group(3))
        self.named = [k for k in listed if k not in self.untested]
        self.hidden = [k for k in self.values if k not in self.named]

    @property
    def tested(self) -> list[str]:
        return self.named + self.hidden


def _unlist(text: str) -> list[str]:
    return [w for w in re.split(r",\s*|\s+and\s+", text.strip()) if w]


def _discovery_reply(theme: Theme, hidden: Sequence[str]) -> str:
    if not hidden:
        return f"No, those are all the {theme.plural}."
    if len(hidden) == 1:
        return f"The other {theme.argument} is {hidden[0]}."
    return f"The other {theme.plural} are {_listing(list(hidden))}."


def _untested_reply(key: str) -> str:
    return f"{key} never comes up, any number is fine."


def _named_in(text: str, keys: Sequence[str]) -> list[str]:
    """The keys `text` names, in the order it names them."""
    found = sorted((m.start(), k) for k in keys for m in [re.search(rf"\b{re.escape(k)}\b", text.lower())] if m)
    return [k for _, k in found]


def is_discovery(theme: Theme, text: str) -> bool:
    """A question about which keys there are: a word such as "other" and the theme's plural (or argument)."""
    text = text.lower()
    return bool(DISCOVERY.search(text)) and bool(re.search(rf"\b({theme.plural}|{theme.argument})\b", text))


def simulator_reply(task: Any, dialogue: Sequence[Mapping[str, str]]) -> str:
    """The scripted human (ScriptedSimulator(simulator_reply)), by the last agent message: the first two of the
    task's keys it names (tested: the value; untested: that it never comes up), else, for a discovery question, the
    hidden keys' names, else a vague reply. A key of the theme outside the task gives 0."""
    layout = Layout(task)
    text = dialogue[-1]["content"]
    named = _named_in(text, layout.tested + layout.untested)
    if named:
        return " ".join(layout.theme.statement.format(key=k, value=layout.values[k]) if k in layout.values
                        else _untested_reply(k) for k in named[:KEYS_PER_REPLY])
    if is_discovery(layout.theme, text):
        return _discovery_reply(layout.theme, layout.hidden)
    if _named_in(text, layout.theme.keys):
        return f"That {layout.theme.argument} is not one of mine, so it gives 0."
    return f"I know a number for each {layout.theme.argument}; ask me about specific ones."


# ----------------------------------------------------------------------------------------------------------
# What the dialogue has revealed, and the oracle
# ----------------------------------------------------------------------------------------------------------

def revealed(task: Any, prompt_messages: Sequence[Mapping[str, str]]) -> tuple[set[str], set[str]]:
    """(tested keys whose value the human has stated, hidden keys whose name the human has said) so far."""
    layout = Layout(task)
    told = [m["content"] for m in prompt_messages if m["role"] == "user"][1:]
    known = {k for t in told for k in _named_in(t, layout.tested)
             if re.search(rf"\b{re.escape(k)}\b[^.]*\d", t.lower())}
    named = {k for t in told for k in _named_in(t, layout.hidden)}
    return known, named


def agent_turn(prompt_messages: Sequence[Mapping[str, str]]) -> int:
    return 1 + sum(m["role"] == "assistant" for m in prompt_messages)


def answer_reward(task: Any, answer_code: str) -> float:
    """The fraction of the task's tests an answer of the lookup form passes: each tested key's value, and 0 for a
    key outside the table (the default of `.get`)."""
    layout = Layout(task)
    written = hidden_constants({"ground_truth": answer_code})
    default = re.search(r"\.get\(\s*\w+\s*,\s*(-?\d+)\s*\)", answer_code)
    default_value = int(default.group(1)) if default else None
    right = sum(written.get(k, default_value) == v for k, v in layout.values.items())
    return (right + (default_value == 0)) / (len(layout.values) + 1)


def best_continuation(known: int, unknown_named: int, undiscovered: int, questions: int) -> tuple[int, int]:
    """(tested values known at the answer, questions used) of the best continuation with `questions` questions
    left: two named unknown keys a question, or first a discovery question and then two keys a question over the
    named and the discovered ones; the most values, then the fewest questions."""
    plain = min(unknown_named, KEYS_PER_REPLY * questions)
    options = [(known + plain, math.ceil(plain / KEYS_PER_REPLY))]
    if undiscovered and questions >= 1:
        reach = min(unknown_named + undiscovered, KEYS_PER_REPLY * (questions - 1))
        options.append((known + reach, 1 + math.ceil(reach / KEYS_PER_REPLY)))
    return max(options, key=lambda o: (o[0], -o[1]))


def reply_worth(task: Any, prompt_messages: Sequence[Mapping[str, str]], reply: str, *,
                max_turns: int = MAX_TURNS) -> float:
    """The oracle (docs/discovery.md): the reward the best continuation reaches after `reply`, less TURN_COST for
    each question it takes (the reply itself included). An answer is worth its reward; a question at the last turn
    is an answer without code (0); a question before it is worth what the continuation from the state it leads to
    can reach with the turns left."""
    layout = Layout(task)
    n = len(layout.values)
    if ANSWER_MARKER in reply:
        return answer_reward(task, reply.split(ANSWER_MARKER, 1)[1])
    t = agent_turn(prompt_messages)
    if t >= max_turns:
        return 0.0
    after = list(prompt_messages) + [{"role": "assistant", "content": reply},
                                     {"role": "user", "content": simulator_reply(task, list(prompt_messages) + [
                                         {"role": "assistant", "content": reply}])}]
    known, discovered = revealed(task, after)
    unknown_named = len([k for k in layout.named + sorted(discovered) if k not in known])
    undiscovered = len([k for k in layout.hidden if k not in discovered and k not in known])
    reach, questions = best_continuation(len(known), unknown_named, undiscovered, max_turns - t - 1)
    return (reach + 1) / (n + 1) - TURN_COST * (1 + questions)


def reply_kind(task: Any, prompt_messages: Sequence[Mapping[str, str]], reply: str) -> str:
    """answer_correct / answer_wrong; question_new (learns a tested value), question_discovery (reveals hidden
    names), question_no_hidden (a discovery question where there is none), question_untested (names only untested
    keys), question_repeat (names only known keys), question_other (names no key of the task, asks nothing)."""
    layout = Layout(task)
    if ANSWER_MARKER in reply:
        return "answer_correct" if answer_reward(task, reply.split(ANSWER_MARKER, 1)[1]) == 1.0 else "answer_wrong"
    named = _named_in(reply, layout.tested + layout.untested)[:KEYS_PER_REPLY]
    known, discovered = revealed(task, prompt_messages)
    if named:
        if [k for k in named if k in layout.values and k not in known]:
            return "question_new"
        return "question_untested" if all(k in layout.untested for k in named) else "question_repeat"
    if is_discovery(layout.theme, reply):
        return "question_discovery" if set(layout.hidden) - discovered - known else "question_no_hidden"
    return "question_other"


def turn_state(task: Any, prompt_messages: Sequence[Mapping[str, str]]) -> dict:
    """Where a turn prompt stands: its agent turn, how many tested values are known of how many, whether every
    one is (answering is right now), and how many hidden keys are still undiscovered."""
    layout = Layout(task)
    known, discovered = revealed(task, prompt_messages)
    return {"turn": agent_turn(prompt_messages), "known": len(known), "keys": len(layout.values),
            "all_known": len(known) == len(layout.values),
            "undiscovered": len([k for k in layout.hidden if k not in discovered and k not in known])}


# ----------------------------------------------------------------------------------------------------------
# Scripted agents: the starting policy's demonstrations
# ----------------------------------------------------------------------------------------------------------

def _ask(theme: Theme, keys: Sequence[str]) -> str:
    if len(keys) == 1:
        return theme.question.format(key=keys[0])
    return f"What are the numbers for {_listing(list(keys))}?"


def _discover(theme: Theme) -> str:
    return f"Are there other {theme.plural}?"


def scripted_replies(task: Any, policy: str, rng: random.Random, *, max_turns: int = MAX_TURNS) -> list[str]:
    """A scripted agent's replies for one episode (the last is the answer, at the turn limit at the latest):
      efficient     discovery, then two unknown tested keys a question, then the answer (always succeeds)
      everything    every listed key one a question (untested ones too), discovery, the hidden ones one a question
      pairs_all     two listed keys a question (untested ones too), discovery, two hidden keys a question
      no_discovery  two listed tested keys a question, then the answer (guesses the hidden ones)
      partial       one or two questions about listed tested keys, then the answer
      vague         a vague question, then as no_discovery
      naive         the answer at once
    A value never asked is guessed (a digit); questions past the budget are dropped for the answer."""
    if policy not in POLICIES:
        raise SyntheticTaskError(f"unknown scripted policy {policy!r}; choose from {POLICIES}")
    layout = Layout(task)
    theme = layout.theme
    named = rng.sample(layout.named, len(layout.named))
    listed = rng.sample(layout.named + layout.untested, len(layout.named) + len(layout.untested))
    hidden = rng.sample(layout.hidden, len(layout.hidden))

    def ask_each(keys, step):  # (question, the tested keys whose value it learns)
        return [(_ask(theme, keys[i:i + step]), [k for k in keys[i:i + step] if k in layout.values])
                for i in range(0, len(keys), step)]

    discover = [(_discover(theme), [])]
    plan = {"efficient": lambda: discover + ask_each(named + hidden, 2),
            "everything": lambda: ask_each(listed, 1) + discover + ask_each(hidden, 1),
            "pairs_all": lambda: ask_each(listed, 2) + discover + ask_each(hidden, 2),
            "no_discovery": lambda: ask_each(named, 2),
            "vague": lambda: [(VAGUE_QUESTION, [])] + ask_each(named, 2),
            "partial": lambda: ask_each(named, 1)[:rng.randint(1, 2)],
            "naive": lambda: []}[policy]()[:max_turns - 1]
    learned = {k for _, keys in plan for k in keys}
    discovered = discover[0] in plan
    table = {k: layout.values[k] if k in learned else rng.randint(0, 9)
             for k in layout.named + (hidden if discovered else [])}
    answer = ANSWER_MARKER + "\n" + lookup_code(theme.function, theme.argument, table)
    return [q for q, _ in plan] + [answer]


def scripted_trajectories(tasks: Sequence[Any], *, seed: int = 0, per_task: int = 1,
                          policy_weights: Mapping[str, float] | None = None, evaluator=None,
                          max_turns: int = MAX_TURNS) -> list[dict]:
    """Episodes of the scripted agents with the scripted human in the real ColBenchEnv (turn limit max_turns),
    policies drawn by weight, each episode's policy kept (`scripted_policy`); with an `evaluator`
    (sweet_jax.sandbox.Evaluator) each gets its reward."""
    return scripted_episodes(tasks, functools.partial(scripted_replies, max_turns=max_turns), simulator_reply,
                             POLICIES, seed=seed, per_task=per_task, policy_weights=policy_weights,
                             evaluator=evaluator, max_turns=max_turns, record_policy=True)
