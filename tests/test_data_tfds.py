"""The TFDS `colbench` builder builds from the official manual layout and reads back the JSONL records."""
import json

import pytest
import tensorflow_datasets as tfds

from sweet_jax.data import DataError, load_tasks, load_trajectories
from sweet_jax.data import tfds_colbench


def task(i):
    return {"problem_description": f"Write f{i}(x).", "ground_truth": f"def f{i}(x):\n    return x + {i}",
            "test_cases": {"a": f"f{i}(1)", "b": f"f{i}(2)"}}


def trajectory(i, reward):
    t = task(i % 3)
    hist = [{"role": "user", "content": t["problem_description"]},
            {"role": "assistant", "input": "<|begin_of_text|>...", "output": "Which x?"},
            {"role": "user", "content": "An int."},
            {"role": "assistant", "content": "I WANT TO ANSWER: ...", "input": "<|begin_of_text|>......",
             "output": "I WANT TO ANSWER: ..."}]
    row = {"task": t, "dialogue_history": hist, "answer": f"answer {i}"}
    if reward is not None:
        row["reward"] = reward
    return row


@pytest.fixture(scope="module")
def manual_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("manual")
    (d / "backend_tasks").mkdir()
    (d / "backend_tasks" / "train.jsonl").write_text("".join(json.dumps(task(i)) + "\n" for i in range(7)))
    (d / "backend_tasks" / "test.jsonl").write_text("".join(json.dumps(task(i)) + "\n" for i in range(7, 10)))
    rows = [trajectory(i, r) for i, r in enumerate([1.0, 0.5, None, 0.0, 1.0, 0.25, 1.0, 0.0, 0.75, 1.0, 0.5, 0.0])]
    (d / tfds_colbench.OFFLINE_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_tfds_yields_the_same_records_as_the_jsonl_loader(manual_dir, tmp_path):
    data_dir = tmp_path / "tfds"
    for config, split, rel, load in [
            ("offline_trajectories", "train", tfds_colbench.OFFLINE_FILE, load_trajectories),
            ("backend_tasks", "train", "backend_tasks/train.jsonl", load_tasks),
            ("backend_tasks", "test", "backend_tasks/test.jsonl", load_tasks)]:
        uri = f"tfds://colbench/{config}/{split}?data_dir={data_dir}&manual_dir={manual_dir}"
        from_tfds = load(uri)
        from_jsonl = load(manual_dir / rel)
        assert from_tfds == from_jsonl and len(from_tfds) > 0
        assert [x.to_json() for x in from_tfds] == [x.to_json() for x in from_jsonl]
    # Once built, reading needs only the data dir.
    again = load_trajectories(f"tfds://colbench/offline_trajectories?data_dir={data_dir}")
    assert [t.answer for t in again] == [f"answer {i}" for i in range(12)]
    b = tfds.builder("colbench/offline_trajectories", data_dir=str(data_dir))
    assert b.info.splits["train"].num_examples == 12


def test_bad_rows_stop_the_build_with_file_and_line(tmp_path):
    d = tmp_path / "manual"
    (d / "backend_tasks").mkdir(parents=True)
    (d / "backend_tasks" / "train.jsonl").write_text(json.dumps(task(0)) + "\n" + '{"problem_description": 3}\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: field 'problem_description'"):
        load_tasks(f"tfds://colbench/backend_tasks/train?data_dir={tmp_path / 'tfds'}&manual_dir={d}")
    with pytest.raises(DataError, match="not prepared"):
        load_tasks(f"tfds://colbench/backend_tasks/train?data_dir={tmp_path / 'empty'}")
    with pytest.raises(DataError, match="bad TFDS path"):
        load_tasks("tfds://other/thing")
