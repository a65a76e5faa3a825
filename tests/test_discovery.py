"""The discovery task family (docs/discovery.md): its tasks, its scripted human, its oracle and scoring, each
against the family's written rules, and its episodes in the real environment and sandbox."""
import random

import pytest

from sweet_jax.envs import ColBenchEnv, ScriptedSimulator, discovery
from sweet_jax.envs.synthetic import SyntheticTaskError, hidden_constants, lookup_code
from sweet_jax.sandbox import Evaluator


@pytest.fixture(scope="module")
def evaluator():
    with Evaluator(workers=2) as ev:
        yield ev


def task_with(named, hidden, untested, values, other="black"):
    """A hand-made task of the family (theme: points of a color)."""
    listed = named + untested
    ending = "never comes up, so its number does" if len(untested) == 1 else "never come up, so their numbers do"
    return {"problem_description": (
        "Write a Python function points(color) that returns how many points a color is worth in my game. "
        f"The colors include {', '.join(listed[:-1])} and {listed[-1]}; {' and '.join(untested)} {ending} not "
        "matter. Any other color gives 0. I know the numbers, so ask me."),
        "ground_truth": lookup_code("points", "color", values),
        "test_cases": {**{f"points_{k}": f"points('{k}')" for k in values}, "points_other": f"points('{other}')"}}


TASK = task_with(["red", "blue"], ["green", "purple"], ["white"], {"red": 4, "blue": 7, "green": 1, "purple": 2})


def say(task, *agent_turns):
    """The dialogue after the agent's turns, each answered by the scripted human."""
    messages = [{"role": "user", "content": task["problem_description"]}]
    for text in agent_turns:
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": discovery.simulator_reply(task, messages)})
    return messages


def test_the_layout_reads_named_hidden_and_untested_keys_back_from_the_task():
    layout = discovery.Layout(TASK)
    assert layout.named == ["red", "blue"] and layout.untested == ["white"]
    assert layout.hidden == ["green", "purple"] and layout.tested == ["red", "blue", "green", "purple"]
    assert discovery.is_task(TASK)
    with pytest.raises(SyntheticTaskError, match="not a discovery task"):
        discovery.Layout({"problem_description": "Write f.", "ground_truth": "def f(x): pass"})


def test_generated_tasks_follow_the_rules():
    tasks = discovery.make_tasks(300, seed=5)
    assert len({t["problem_description"] + t["ground_truth"] for t in tasks}) == 300
    assert tasks == discovery.make_tasks(300, seed=5) and tasks != discovery.make_tasks(300, seed=6)
    hidden_counts = set()
    for t in tasks:
        layout = discovery.Layout(t)
        assert 2 <= len(layout.named) <= 3 and 1 <= len(layout.untested) <= 2
        assert len(layout.tested) <= discovery.MAX_TESTED
        hidden_counts.add(len(layout.hidden))
        for k in layout.hidden + list(layout.values):   # hidden keys are nowhere in the statement
            assert (k in t["problem_description"]) == (k in layout.named)
        calls = set(t["test_cases"].values())
        assert all(f"{layout.theme.function}('{k}')" in calls for k in layout.tested)
        assert not any(f"'{k}'" in c for k in layout.untested for c in calls)
        assert len(calls) == len(layout.tested) + 1
    assert hidden_counts == {0, 1, 2}


def test_the_human_states_two_named_values_reveals_hidden_names_to_a_discovery_question_and_is_vague_otherwise():
    reply = lambda text: discovery.simulator_reply(TASK, [{"role": "user", "content": "..."},  # noqa: E731
                                                         {"role": "assistant", "content": text}])
    assert reply("What are blue, red and green worth?") == "blue is worth 7 points. red is worth 4 points."
    assert reply("How many points is white worth?") == "white never comes up, any number is fine."
    assert reply("Are there other colors?") == "The other colors are green and purple."
    assert reply("Which other colors are there?") == "The other colors are green and purple."
    assert reply("What about purple?") == "purple is worth 2 points."     # a right guess of a hidden name works
    assert reply("What about orange?") == "That color is not one of mine, so it gives 0."
    assert reply("Could you tell me more about what you need?").startswith("I know a number for each color")
    none = task_with(["red", "blue"], [], ["white"], {"red": 4, "blue": 7})
    assert discovery.simulator_reply(none, [{"role": "assistant", "content": "Any other colors?"}]) == \
        "No, those are all the colors."


def test_what_the_dialogue_reveals():
    messages = say(TASK, "Are there other colors?", "What are the numbers for red and green?", "Is white used?")
    known, discovered = discovery.revealed(TASK, messages)
    assert known == {"red", "green"} and discovered == {"green", "purple"}
    state = discovery.turn_state(TASK, messages)
    assert state == {"turn": 4, "known": 2, "keys": 4, "all_known": False, "undiscovered": 0}
    assert discovery.turn_state(TASK, say(TASK))["undiscovered"] == 2


def answer(values, default=0):
    body = lookup_code("points", "color", values).replace(".get(color, 0)", f".get(color, {default})")
    return "I WANT TO ANSWER:\n" + body


def test_the_oracle_values_replies_by_the_best_continuation_within_the_turn_limit():
    worth = discovery.reply_worth
    start = say(TASK)
    # turn 1 of 4: three questions left. Discovery, then two pairs, reaches all 4 tested values (3 questions).
    assert worth(TASK, start, "Are there other colors?") == pytest.approx(5 / 5 - 0.03)
    # Two named keys now: discovery and one pair reach the other two (3 questions in all)
    assert worth(TASK, start, "What are the numbers for red and blue?") == pytest.approx(5 / 5 - 0.03)
    # One key now: then discovery and one pair reach 1 + 2 = 3 of 4; or a pair and one more: 3. (3 + 1) / 5
    assert worth(TASK, start, "How many points is red worth?") == pytest.approx(4 / 5 - 0.03)
    # An untested key wastes the turn: the two questions left reach 2 values (one pair does; discovery + a pair
    # reaches no more) -> 3 / 5, two questions in all
    assert worth(TASK, start, "How many points is white worth?") == pytest.approx(3 / 5 - 0.02)
    # A vague question the same
    assert worth(TASK, start, discovery.VAGUE_QUESTION) == pytest.approx(3 / 5 - 0.02)
    # An answer is worth its reward: 2 of 4 values right, the default right -> 3 / 5
    assert worth(TASK, start, answer({"red": 4, "blue": 7})) == pytest.approx(3 / 5)
    assert worth(TASK, start, answer({"red": 4, "blue": 7, "green": 1, "purple": 2})) == 1.0
    assert worth(TASK, start, answer({"red": 4, "blue": 7, "green": 1, "purple": 2}, default=5)) == pytest.approx(0.8)
    # the last turn: a question is an answer without code
    late = say(TASK, "Are there other colors?", "What are the numbers for red and blue?",
               "What are the numbers for green and purple?")
    assert worth(TASK, late, "Anything else?") == 0.0
    assert worth(TASK, late, answer({"red": 4, "blue": 7, "green": 1, "purple": 2})) == 1.0
    # with nothing to discover, a discovery question is worth less than a question that learns values
    none = task_with(["red", "blue", "green"], [], ["white"], {"red": 4, "blue": 7, "green": 1})
    assert worth(none, say(none), "Are there other colors?") < worth(none, say(none), "What are red and blue worth?")


def test_the_oracle_kinds():
    start = say(TASK)
    kind = lambda text, messages=start: discovery.reply_kind(TASK, messages, text)  # noqa: E731
    assert kind("What is red worth?") == "question_new"
    assert kind("Are there other colors?") == "question_discovery"
    assert kind("And white?") == "question_untested"
    assert kind("What is red worth?", say(TASK, "What is red worth?")) == "question_repeat"
    assert kind("Hello?") == "question_other"
    assert kind(answer({"red": 4, "blue": 7, "green": 1, "purple": 2})) == "answer_correct"
    assert kind(answer({"red": 4})) == "answer_wrong"
    none = task_with(["red", "blue"], [], ["white"], {"red": 4, "blue": 7})
    assert discovery.reply_kind(none, say(none), "Any other colors?") == "question_no_hidden"


@pytest.mark.parametrize("policy", discovery.POLICIES)
def test_scripted_episodes_score_in_the_sandbox_as_the_oracle_says(policy, evaluator):
    tasks = discovery.make_tasks(40, seed=2)
    trajs = discovery.scripted_trajectories(tasks, seed=3, policy_weights={policy: 1}, evaluator=evaluator)
    for t in trajs:
        history = t["dialogue_history"]
        replies = [i for i, m in enumerate(history) if m["role"] == "assistant"]
        assert len(replies) <= discovery.MAX_TURNS and "I WANT TO ANSWER:" in history[replies[-1]]["content"]
        assert discovery.reply_worth(t["task"], history[:replies[-1]], history[replies[-1]]["content"]) == \
            pytest.approx(t["reward"])
        assert t["scripted_policy"] == policy
    success = [t["reward"] == 1.0 for t in trajs]
    if policy == "efficient":
        assert all(success)
    if policy in ("everything", "naive"):
        assert sum(success) < len(success) / 2     # the budget binds / nothing is asked


def test_the_environment_ends_an_episode_at_the_family_turn_limit():
    env = ColBenchEnv(TASK, ScriptedSimulator(discovery.simulator_reply), max_turns=discovery.MAX_TURNS)
    assert not any(env.step(f"Is red worth {i}?") for i in range(discovery.MAX_TURNS - 1))
    assert env.step("One more question?")          # the 4th reply is the answer, whatever it is
    assert env.answer == "One more question?"


def test_scripted_answers_write_what_was_learned_and_guess_the_rest():
    rng = random.Random(0)
    replies = discovery.scripted_replies(TASK, "efficient", rng)
    assert replies[0] == "Are there other colors?" and len(replies) == 4
    assert hidden_constants({"ground_truth": replies[-1].split("ANSWER:")[1]}) == discovery.Layout(TASK).values
    naive = discovery.scripted_replies(TASK, "naive", rng)
    assert len(naive) == 1 and set(hidden_constants({"ground_truth": naive[0]})) == {"red", "blue"}
    with pytest.raises(SyntheticTaskError, match="unknown scripted policy"):
        discovery.scripted_replies(TASK, "clever", rng)
