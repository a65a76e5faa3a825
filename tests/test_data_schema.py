"""Loading ColBench tasks and trajectories: both turn forms, and every bad-input case's error."""
import json

import pytest

from sweet_jax.data import DataError, Task, Trajectory, load_tasks, load_trajectories, write_jsonl

TASK = {"problem_description": "Write add(a, b).", "ground_truth": "def add(a, b):\n    return a + b",
        "test_cases": {"t1": "add(1, 2)", "t2": "add(-1, 1)"}}


def traj(**over):
    obj = {"task": dict(TASK), "answer": "def add(a, b): return a + b", "reward": 1.0,
           "dialogue_history": [{"role": "user", "content": "Write add(a, b)."},
                                {"role": "assistant", "content": "Which types?"},
                                {"role": "user", "content": "Ints."},
                                {"role": "assistant", "content": "I WANT TO ANSWER:\ndef add(a, b): return a + b"}]}
    obj.update(over)
    return obj


def write_lines(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_task_hidden_information_defaults_to_ground_truth(tmp_path):
    tasks = load_tasks(write_lines(tmp_path / "t.jsonl", [TASK, {**TASK, "hidden_information": "secret"}]))
    assert tasks[0].hidden_information == TASK["ground_truth"]
    assert tasks[1].hidden_information == "secret"
    assert tasks[0].test_cases == TASK["test_cases"]


def test_trajectory_round_trips_through_to_json(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [traj(extra_field=3)])
    [t] = load_trajectories(path)
    assert t.num_replies == 2 and t.reward == 1.0 and not t.prerendered
    write_jsonl(tmp_path / "out.jsonl", [t])
    [again] = load_trajectories(tmp_path / "out.jsonl")
    assert again == t and again.extra == {"extra_field": 3}
    assert again.to_json()["task"]["hidden_information"] == TASK["ground_truth"]


def test_write_jsonl_replaces_the_file_atomically(tmp_path):
    """A failed write leaves the old file whole and no temporary behind; a good one replaces it in one rename."""
    path = tmp_path / "sub" / "rows.jsonl"
    write_jsonl(path, [{"a": 1, "text": "naïve"}])
    assert path.read_text(encoding="utf-8") == '{"a": 1, "text": "naïve"}\n'

    def rows_then_crash():
        yield {"a": 2}
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        write_jsonl(path, rows_then_crash())
    assert path.read_text(encoding="utf-8") == '{"a": 1, "text": "naïve"}\n'
    assert [p.name for p in path.parent.iterdir()] == ["rows.jsonl"]
    write_jsonl(path, [{"a": 3}, {"a": 4}])
    assert [json.loads(line)["a"] for line in path.read_text().splitlines()] == [3, 4]
    assert [p.name for p in path.parent.iterdir()] == ["rows.jsonl"]


def test_official_prerendered_turns_load_without_content(tmp_path):
    hist = [{"role": "user", "content": "Write add."},
            {"role": "assistant", "input": "<prompt 1>", "output": "Which types?"},
            {"role": "user", "content": "Ints."},
            {"role": "assistant", "input": "<prompt 2>", "output": "I WANT TO ANSWER: ..."}]
    [t] = load_trajectories(write_lines(tmp_path / "t.jsonl", [traj(dialogue_history=hist)]))
    assert t.prerendered
    assert t.dialogue_history[1].content == "Which types?"  # content falls back to output
    assert t.dialogue_history[3].input == "<prompt 2>"


def test_reward_is_optional_until_evaluated(tmp_path):
    obj = traj()
    del obj["reward"]
    [t] = load_trajectories(write_lines(tmp_path / "t.jsonl", [obj]))
    assert t.reward is None


BAD_CASES = {
    "malformed_json": ('{"task": {', "malformed JSON", None),
    "missing_task": ({k: v for k, v in traj().items() if k != "task"}, "is missing", "task"),
    "missing_ground_truth": (traj(task={k: v for k, v in TASK.items() if k != "ground_truth"}), "is missing",
                             "task.ground_truth"),
    "reward_wrong_type": (traj(reward="high"), "finite number", "reward"),
    "test_cases_wrong_type": (traj(task={**TASK, "test_cases": ["add(1, 2)"]}), "must be an object",
                              "task.test_cases"),
    "content_wrong_type": (traj(dialogue_history=[{"role": "user", "content": 3},
                                                  {"role": "assistant", "content": "x"}]),
                           "must be a string", "dialogue_history[0].content"),
    "bad_role": (traj(dialogue_history=[{"role": "robot", "content": "x"}]), "must be one of",
                 "dialogue_history[0].role"),
    "empty_dialogue": (traj(dialogue_history=[]), "is empty", "dialogue_history"),
    "no_assistant_turn": (traj(dialogue_history=[{"role": "user", "content": "hi"}]), "no assistant turn",
                          "dialogue_history"),
    "not_an_object": ("[1, 2]", "must be a JSON object", None),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_row_error_names_file_line_and_field(tmp_path, case):
    row, message, field = BAD_CASES[case]
    path = write_lines(tmp_path / "t.jsonl", [traj(), row])
    with pytest.raises(DataError) as e:
        load_trajectories(path)
    assert f"{path}:2" in str(e.value)
    assert message in str(e.value)
    if field:
        assert e.value.field == field and f"field '{field}'" in str(e.value)


def test_skip_bad_reports_count_and_lines(tmp_path, caplog):
    rows = [traj(), BAD_CASES["malformed_json"][0], traj(), BAD_CASES["empty_dialogue"][0], traj()]
    path = write_lines(tmp_path / "t.jsonl", rows)
    with caplog.at_level("WARNING"):
        loaded = load_trajectories(path, skip_bad=True)
    assert len(loaded) == 3 and all(isinstance(t, Trajectory) for t in loaded)
    assert [w for w, _ in loaded.skipped] == [f"{path}:2", f"{path}:4"]
    assert "skipped 2 bad trajectories (lines 2, 4)" in caplog.text


def test_missing_file_and_all_bad_file_raise(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_tasks(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no valid tasks"):
        load_tasks(write_lines(tmp_path / "t.jsonl", ["{oops"]), skip_bad=True)


def test_task_key_groups_by_content_not_by_identity():
    a, b = Task.from_json(TASK), Task.from_json({**TASK, "test_cases": {}})
    assert a.key == b.key
    assert Task.from_json({**TASK, "ground_truth": "def add(a, b): return b + a"}).key != a.key
