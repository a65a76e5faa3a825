"""Frontend tasks: loading, the picture-URL rewrite, and HTML extraction from agent replies."""
import json
import re

import pytest

from sweet_jax.data import demo
from sweet_jax.data.frontend import extract_html, load_frontend_tasks, placeholder_url, rewrite_image_urls
from sweet_jax.data.schema import DataError


def test_demo_pages_load_with_their_pictures_local():
    tasks = load_frontend_tasks(demo.paths().frontend_tasks)
    assert len(tasks) == 6
    for task in tasks:
        assert task.ground_truth.startswith("<html") and task.ground_truth.endswith("</html>")
        assert task.hidden_information == task.ground_truth and task.test_cases == {}
        assert re.findall(r"https?://(?!placeholder\.invalid/)", task.ground_truth) == []


def test_official_rows_load_and_their_pictures_become_the_local_placeholder(tmp_path):
    row = {"problem_description": "A travel agency page.",
           "ground_truth": '<html><body><img src="https://source.unsplash.com/random/300x200/?beach">'
                           '<div style="background:url(https://picsum.photos/640/480)"></div></body></html>',
           "source": "websight"}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (task,) = load_frontend_tasks(path)
    assert placeholder_url(300, 200) in task.ground_truth and placeholder_url(640, 480) in task.ground_truth
    assert "unsplash" not in task.ground_truth and "picsum" not in task.ground_truth
    assert task.extra == {"source": "websight"}


@pytest.mark.parametrize("row, field", [
    ({"problem_description": "x", "ground_truth": "no tags here"}, "ground_truth"),
    ({"problem_description": "x", "ground_truth": "<p>x</p>", "test_cases": {"a": "f(1)"}}, "test_cases"),
    ({"ground_truth": "<p>x</p>"}, "problem_description"),
])
def test_bad_rows_name_line_and_field(tmp_path, row, field):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"problem_description": "ok", "ground_truth": "<p>ok</p>"}) + "\n" + json.dumps(row))
    with pytest.raises(DataError, match=rf"tasks.jsonl:2: field '{field}'"):
        load_frontend_tasks(path)


def test_rewrite_keeps_other_urls_and_agent_picsum_ids():
    html = '<img src="https://picsum.photos/id/48/120/90"><a href="https://example.com/">x</a>'
    assert rewrite_image_urls(html) == f'<img src="{placeholder_url(120, 90)}"><a href="https://example.com/">x</a>'


@pytest.mark.parametrize("reply, expected", [
    ("Here it is: <html lang='en'><body>a</body></html> done", "<html lang='en'><body>a</body></html>"),
    ("first <html><p>1</p></html> then <html><p>2</p></html>", "<html><p>1</p></html>"),
    ("no html tag, just <body class='x'><p>b</p></body>!", "<body class='x'><p>b</p></body>"),
    ("<html> never closed <body>c</body>", "<body>c</body>"),
    ("<html</html>", None),
    ("I WANT TO ANSWER: nothing", None),
    ("<HTML><BODY>upper</BODY></HTML>", None),  # case matters, as in the official extraction
])
def test_extract_html_finds_what_the_regex_finds(reply, expected):
    assert extract_html(reply) == expected
    regex = re.search(r"<html.*?>.*?</html>", reply, re.DOTALL) or re.search(r"<body.*?>.*?</body>", reply, re.DOTALL)
    assert (regex.group(0) if regex else None) == expected



def test_frontend_pairs_take_every_two_episodes_at_least_the_gap_apart():
    from sweet_jax.data.pairs import trajectory_pairs
    from sweet_jax.data.schema import Trajectory

    task = {"problem_description": "p", "ground_truth": "<p>x</p>"}
    other = {"problem_description": "q", "ground_truth": "<p>y</p>"}
    rows = [(task, 0.9), (task, 0.85), (task, 0.7), (other, 0.95), (task, 0.5), (other, 0.2)]
    trajectories = [Trajectory.from_json({"task": t, "dialogue_history": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "<p>x</p>"}],
                                          "answer": "", "reward": r}) for t, r in rows]
    pairs = trajectory_pairs(trajectories, rule="all_gaps", min_gap=0.1)
    got = sorted((p.chosen.reward, p.rejected.reward) for p in pairs)
    assert got == [(0.7, 0.5), (0.85, 0.5), (0.85, 0.7), (0.9, 0.5), (0.9, 0.7), (0.95, 0.2)]
    assert trajectory_pairs(trajectories, rule="best_success") == []  # the backend rule needs a reward of 1.0


def test_frontend_presets_build():
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("frontend_configs", pathlib.Path("configs/frontend.py"))
    configs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(configs)
    for preset in configs.ROLLOUT_PRESETS + configs.PIPELINE_PRESETS:
        c = configs.get_config(preset)
        assert c.track == "frontend" and c.frontend.renderers >= 1
    assert configs.get_config("frontend_8b").collect.min_gap == 0.1
    assert configs.get_config("frontend_8b").simulator.kind == "openai"
