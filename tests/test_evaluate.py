"""`python -m sweet_jax.evaluate`: rewards written back, other fields kept, summary printed."""
import json
import subprocess
import sys

from sweet_jax.commands import evaluate

TASK = {"problem_description": "Add two numbers.", "ground_truth": "def add(a, b):\n    return a + b\n",
        "test_cases": {"t1": "add(1, 2)", "t2": "add(-1, 1)", "t3": "add(10, 5)", "t4": "add(0, 0)"}}


def _trajectory(answer, **extra):
    return {"task": TASK, "dialogue_history": [{"role": "user", "content": "Add two numbers."},
                                               {"role": "assistant", "content": answer}],
            "answer": answer, **extra}


ANSWERS = [
    ("```python\nimport os\ndef add(a, b):\n    return a + b\n```", 1.0, 0.0),  # os: official deny-list
    ("def add(a, b):\n    return a - b if a > 5 else a + b\n", 0.75, 0.75),
    ("def add(a, b):\n    return abs(a) + b\n", 0.75, 0.75),
    ("def add(a, b):\n    while True:\n        pass\n", 0.0, 0.0),
]


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_cli_writes_rewards_back_and_keeps_unknown_fields(tmp_path, capsys):
    src, out = tmp_path / "traj.jsonl", tmp_path / "scored.jsonl"
    _write(src, [_trajectory(a, reward=0.123, run_id=f"r{i}") for i, (a, _, _) in enumerate(ANSWERS)])
    assert evaluate.main([str(src), "--out", str(out), "--timeout-s", "0.5", "--workers", "2",
                          "--details"]) == 0
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["reward"] for s in scored] == [strict for _, strict, _ in ANSWERS]
    assert [s["run_id"] for s in scored] == ["r0", "r1", "r2", "r3"]
    assert scored[3]["evaluation"]["details"]["cases"][0]["outcome"] == "timeout"
    printed = capsys.readouterr().out
    assert "tests passed: 62.5% (mean reward" in printed  # (1 + 0.75 + 0.75 + 0) / 4
    assert "success rate: 25.0%" in printed
    assert "evals/min" in printed


def test_cli_sweet_rl_compat_applies_the_official_rules(tmp_path):
    src, out = tmp_path / "traj.jsonl", tmp_path / "scored.jsonl"
    _write(src, [_trajectory(a) for a, _, _ in ANSWERS])
    result = subprocess.run([sys.executable, "-m", "sweet_jax.evaluate", str(src), "--out", str(out),
                             "--compat", "sweet_rl", "--timeout-s", "0.5"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["reward"] for line in out.read_text().splitlines()] == [
        official for _, _, official in ANSWERS]
    assert "compat: sweet_rl" in result.stdout and "success rate: 0.0%" in result.stdout
