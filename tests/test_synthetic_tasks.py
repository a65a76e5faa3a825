"""The synthetic collaborative task family: ColBench tasks whose constants only the scripted human knows."""
import json
import random
from collections import Counter

import pytest

from sweet_jax.data import critic_pairs, load_tasks, load_trajectories
from sweet_jax.envs.synthetic import (POLICIES, SyntheticTaskError, hidden_constants, lookup_code, make_tasks,
                                      scripted_replies, scripted_trajectories, simulator_reply, task_theme)
from sweet_jax.envs import HUMAN_RESPONSE_CHAR_LIMIT
from sweet_jax.sandbox import Evaluator


@pytest.fixture(scope="module")
def evaluator():
    with Evaluator(degraded_ok=True) as ev:
        yield ev


def test_tasks_are_deterministic_distinct_and_load_as_colbench(tmp_path):
    tasks = make_tasks(60, seed=3)
    assert tasks == make_tasks(60, seed=3) and tasks != make_tasks(60, seed=4)
    assert len({t["ground_truth"] for t in tasks}) == 60
    path = tmp_path / "synthetic.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    loaded = load_tasks(path)
    assert [t.to_json() for t in loaded] == tasks
    for task in tasks:
        constants = hidden_constants(task)
        assert 2 <= len(constants) <= 4
        assert len(task["test_cases"]) == len(constants) + 1  # one per key and one outside the table
        assert all(str(v) not in task["problem_description"] for v in constants.values() if v > 4)
        assert all(k in task["problem_description"] for k in constants)


def test_reward_is_the_fraction_of_constants_right(evaluator):
    rng = random.Random(0)
    tasks = make_tasks(12, seed=1)
    pairs, expected = [], []
    for task in tasks:
        theme, constants = task_theme(task), hidden_constants(task)
        right = rng.randint(0, len(constants))
        guess = {k: (v if i < right else (v + 1) % 10) for i, (k, v) in enumerate(constants.items())}
        pairs.append((task, lookup_code(theme.function, theme.argument, guess)))
        expected.append((right + 1) / (len(constants) + 1))  # + the default case, right in every guess
        pairs.append((task, task["ground_truth"]))
        expected.append(1.0)
    scores = evaluator.score_many(pairs)
    assert [s.reward for s in scores] == pytest.approx(expected)


def test_simulator_states_only_the_constants_the_question_names():
    task = make_tasks(1, seed=5, min_keys=3, max_keys=3)[0]
    theme, constants = task_theme(task), hidden_constants(task)
    first, second, third = constants
    one = simulator_reply(task, [{"role": "assistant", "content": theme.question.format(key=second)}])
    assert one == theme.statement.format(key=second, value=constants[second])
    both = simulator_reply(task, [{"role": "assistant", "content": f"And {third}? Also {first}, {second}."}])
    assert both == " ".join(theme.statement.format(key=k, value=constants[k]) for k in (third, first))
    vague = simulator_reply(task, [{"role": "assistant", "content": "What do you need exactly?"}])
    assert not any(str(v) in vague for v in constants.values())
    for reply in (one, both, vague):
        assert len(reply) <= HUMAN_RESPONSE_CHAR_LIMIT and reply.count(".") <= 2


def test_scripted_policies_reach_the_rewards_their_questions_allow(evaluator):
    tasks = make_tasks(20, seed=2)
    by_policy = {}
    for policy in ("thorough", "pairs", "naive"):
        episodes = scripted_trajectories(tasks, seed=0, policy_weights={policy: 1.0}, evaluator=evaluator)
        by_policy[policy] = [t["reward"] for t in episodes]
        for t in episodes:
            user_said = " ".join(d["content"] for d in t["dialogue_history"][1:] if d["role"] == "user")
            revealed = sum(line in user_said for line in t["task"]["hidden_information"].splitlines())
            assert revealed == (len(hidden_constants(t["task"])) if policy != "naive" else 0)
    assert by_policy["thorough"] == [1.0] * 20 and by_policy["pairs"] == [1.0] * 20
    assert sum(by_policy["naive"]) / 20 < 0.5


def test_mixed_demonstrations_give_critic_pairs_and_varied_rewards(evaluator, tmp_path):
    tasks = make_tasks(30, seed=0)
    demos = scripted_trajectories(tasks, seed=0, per_task=4, evaluator=evaluator)
    assert demos == scripted_trajectories(tasks, seed=0, per_task=4, evaluator=evaluator)
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in demos))
    trajectories = load_trajectories(path)
    pairs = critic_pairs(trajectories)
    assert len({p.task_key for p in pairs}) >= 10
    assert len(Counter(round(t.reward, 3) for t in trajectories)) >= 5


def test_unknown_policy_and_foreign_task_are_refused():
    task = make_tasks(1)[0]
    with pytest.raises(SyntheticTaskError, match="unknown scripted policy"):
        scripted_replies(task, "clever", random.Random(0))
    with pytest.raises(SyntheticTaskError, match="not a synthetic lookup task"):
        task_theme({"ground_truth": "def f(x):\n    return x\n"})
    assert set(POLICIES) >= {"thorough", "partial", "naive"}
