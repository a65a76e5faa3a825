"""The reports check every run file they read as they read it (sweet_jax.rl.run_files): a truncated or binary
results.json, a damaged stages.json or diagnostics.json, a NaN or out-of-range figure, a link to an endless device,
a pair whose trajectory index is outside the episodes: one `error:` line naming the file and the field, exit 2,
and no number printed as if it were measured. Their honest counterparts give the table."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from sweet_jax.commands import pipeline_diagnostics, pipeline_report
from sweet_jax.errors import SweetJaxError
from sweet_jax.rl import diagnostics, results as results_lib, run_files

REPO = pathlib.Path(__file__).resolve().parents[1]


def honest_run(workdir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A finished run's report files, as the pipeline's report stage and `pipeline_diagnostics --out` write them."""
    workdir.mkdir(parents=True)
    (workdir / "evidence").mkdir()
    results = {"preset": "test", "seed": seed, "task": "synthetic lookup tasks", "track": "backend", "model": "m",
               "heldout_tasks": 4, "methods": {
                   "zero_shot": {"success_rate": 0.25, "success_rate_pct": 25.0, "tests_passed_pct": 40.0,
                                 "turns_per_episode": 3.0, "episodes": 8},
                   "sweet": {"success_rate": 0.5, "success_rate_pct": 50.0, "tests_passed_pct": 62.5,
                             "turns_per_episode": 2.5, "episodes": 8}},
               "diagnostics": {"critic_pairs": 12, "pair_agreement": 75.0, "minutes": 3.5, "load_average": None,
                               "init_reused_from": None},
               "selection": {"lrs": [0.001], "steps": [1, 2], "seed": 0, "zero_shot": {"success_rate": 0.25},
                             "methods": {"sweet": {"curve": {"0.001/2": {"lr": 0.001, "step": 2, "success_rate": 0.5}},
                                                   "choice": {"lr": 0.001, "step": 2}}}}}
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    (workdir / "evidence" / "stages.json").write_text(json.dumps(
        {"init": {"seconds": 60.0, "cpu_seconds": 90.0, "summary": {}}, "eval/sweet": {"seconds": 30.0}}))
    (workdir / "evidence" / "episodes.json").write_text(json.dumps(
        {"zero_shot": [[t, k, float(t == 0 and k == 0)] for t in range(4) for k in range(2)],
         "sweet": [[t, k, float(t < 2)] for t in range(4) for k in range(2)]}))
    (workdir / "diagnostics.json").write_text(json.dumps(
        {"rankings": {"rank": {"pairs": 10, "decided": 8, "ties": 2, "agreement_pct": 62.5,
                               "by_kind": {"question over answer": {"agree": 3, "disagree": 1, "tie": 0}}}},
         "behaviour": {"eval sweet": {"questions_per_episode": 1.5, "episodes_with_answer_pct": 87.5,
                                      "copy_accuracy_pct": None}}}))
    return workdir


def edit_json(path: pathlib.Path, change):
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))   # json.dumps writes NaN and Infinity as the pipeline's json would


DAMAGES = {
    "truncated results": ("results.json", lambda p: p.write_text(p.read_text()[:120]),
                          r"results.json:\d+: malformed JSON .*the file ends early"),
    "binary results": ("results.json", lambda p: p.write_bytes(bytes(range(256)) * 4), r"results.json: is not UTF-8"),
    "gzip results": ("results.json", lambda p: p.write_bytes(b"\x1f\x8b\x08" + b"\x00" * 40), r"is a gzip file"),
    "results a link to /dev/zero": ("results.json", lambda p: (p.unlink(), p.symlink_to("/dev/zero")),
                                    r"results.json: is not a regular file"),
    "NaN success": ("results.json", lambda p: edit_json(p, lambda r: r["methods"]["sweet"].update(
        success_rate_pct=math.nan)), r"field 'methods.sweet.success_rate_pct': NaN is not a finite number"),
    "infinite tests": ("results.json", lambda p: edit_json(p, lambda r: r["methods"]["zero_shot"].update(
        tests_passed_pct=math.inf)), r"field 'methods.zero_shot.tests_passed_pct': Infinity is not a finite"),
    "success of 150%": ("results.json", lambda p: edit_json(p, lambda r: r["methods"]["sweet"].update(
        success_rate_pct=150.0)), r"field 'methods.sweet.success_rate_pct': 150.0 is outside \[0, 100\]"),
    "a figure that is text": ("results.json", lambda p: edit_json(p, lambda r: r["methods"]["sweet"].update(
        tests_passed_pct="62.5")), r"field 'methods.sweet.tests_passed_pct': \"62.5\" is not a number"),
    "a missing figure": ("results.json", lambda p: edit_json(p, lambda r: r["methods"]["sweet"].pop(
        "success_rate_pct")), r"field 'methods.sweet.success_rate_pct': missing"),
    "NaN diagnostic": ("results.json", lambda p: edit_json(p, lambda r: r["diagnostics"].update(
        pair_agreement=math.nan)), r"field 'diagnostics.pair_agreement': NaN"),
    "selection curve NaN": ("results.json", lambda p: edit_json(p, lambda r: r["selection"]["methods"]["sweet"][
        "curve"]["0.001/2"].update(success_rate=math.nan)),
        r"field 'selection.methods.sweet.curve.0.001/2.success_rate': NaN"),
    "selection without its choice": ("results.json", lambda p: edit_json(p, lambda r: r["selection"]["methods"][
        "sweet"].pop("choice")), r"field 'selection.methods.sweet.choice': expected an object, got null"),
    "truncated stages": ("evidence/stages.json", lambda p: p.write_text(p.read_text()[:30]),
                         r"stages.json:1: malformed JSON"),
    "stages seconds text": ("evidence/stages.json", lambda p: edit_json(p, lambda r: r["init"].update(seconds="60")),
                            r"stages.json: field 'init.seconds': \"60\" is not a number"),
    "negative stage time": ("evidence/stages.json", lambda p: edit_json(p, lambda r: r["init"].update(
        cpu_seconds=-5.0)), r"field 'init.cpu_seconds': -5.0 is outside"),
    "stages a link to /dev/zero": ("evidence/stages.json", lambda p: (p.unlink(), p.symlink_to("/dev/zero")),
                                   r"stages.json: is not a regular file"),
    "diagnostics agreement NaN": ("diagnostics.json", lambda p: edit_json(p, lambda r: r["rankings"]["rank"].update(
        agreement_pct=math.nan)), r"diagnostics.json: field 'rankings.rank.agreement_pct': NaN"),
    "diagnostics negative count": ("diagnostics.json", lambda p: edit_json(p, lambda r: r["rankings"]["rank"][
        "by_kind"]["question over answer"].update(disagree=-1)),
        r"field 'rankings.rank.by_kind.question over answer.disagree': -1 is not a count"),
    "diagnostics behaviour inf": ("diagnostics.json", lambda p: edit_json(p, lambda r: r["behaviour"][
        "eval sweet"].update(questions_per_episode=math.inf)),
        r"field 'behaviour.eval sweet.questions_per_episode': Infinity"),
    "diagnostics a list": ("diagnostics.json", lambda p: p.write_text("[1, 2]"),
                           r"diagnostics.json: field '\(top\)': expected an object"),
    "episodes reward NaN": ("evidence/episodes.json", lambda p: edit_json(p, lambda r: r["sweet"][3].__setitem__(
        2, math.nan)), r"episodes.json: field 'sweet\[3\]\[2\] \(reward\)': NaN"),
    "episodes negative task": ("evidence/episodes.json", lambda p: edit_json(p, lambda r: r["sweet"][0].__setitem__(
        0, -1)), r"episodes.json: field 'sweet\[0\]\[0\] \(task index\)': -1 is not a count"),
    "episodes not rows": ("evidence/episodes.json", lambda p: edit_json(p, lambda r: r.update(sweet=[1, 2])),
                          r"episodes.json: field 'sweet\[0\]': expected \[task index, sample, reward\]"),
    "truncated episodes": ("evidence/episodes.json", lambda p: p.write_text(p.read_text()[:40]),
                           r"episodes.json:1: malformed JSON"),
}


@pytest.mark.parametrize("name", DAMAGES)
def test_a_damaged_run_file_is_refused_naming_the_file_and_the_field(tmp_path, name):
    file, damage, message = DAMAGES[name]
    run = honest_run(tmp_path / "run")
    damage(run / file)
    with pytest.raises(SweetJaxError, match=message) as refused:
        pipeline_report.main([str(run), "--out", str(tmp_path / "report")])
    assert str(run / file) in str(refused.value)
    assert not (tmp_path / "report").exists()   # nothing written, no number printed


def test_honest_run_files_give_the_table(tmp_path, capsys):
    runs = [honest_run(tmp_path / f"seed{s}", seed=s) for s in (0, 1)]
    pipeline_report.main([*map(str, runs), "--out", str(tmp_path / "report")])
    table = (tmp_path / "report" / "results.md").read_text()
    assert "| SWEET-RL | 62.5 ± 0.0 | 50.0 ± 0.0 |" in table and "| SWEET-RL (with c) | 0 | 8 | 62.5 |" in table
    assert "| init | 1 / 2 | 1 / 2 |" in table and (tmp_path / "report" / "results.png").stat().st_size > 0
    assert "| SWEET-RL - Zero-Shot |" not in table   # not one of the differences the comparison reports
    assert run_files.read_run(runs[0])["episodes"]["sweet"][0] == [0, 0, 1.0]


@pytest.mark.parametrize("path", sorted(str(p.parent) for p in (REPO / "bench" / "results").glob("*/results.json")))
def test_every_kept_run_of_the_repository_passes_the_checks(path):
    results = results_lib.read_results(path)
    assert results["methods"] and all(math.isfinite(m["success_rate_pct"]) for m in results["methods"].values())


def test_a_frontend_run_without_a_win_rate_prints_n_a_not_nan(tmp_path):
    run = honest_run(tmp_path / "run")
    edit_json(run / "results.json", lambda r: (r.update(track="frontend"), [m.update(cosine_pct=70.0, win_rate_pct=None)
                                                                             for m in r["methods"].values()]))
    table = results_lib.results_table([results_lib.read_results(run)])
    assert "| SWEET-RL | 70.0 | n/a |" in table and "nan" not in table.lower()


def test_an_older_runs_nan_for_an_unmeasured_win_rate_reads_as_n_a(tmp_path):
    """Before unmeasured figures were written as null the pipeline wrote NaN for these two; a NaN anywhere else is
    refused (above)."""
    run = honest_run(tmp_path / "run")
    edit_json(run / "results.json", lambda r: (r.update(track="frontend"), r["diagnostics"].update(
        load_average=math.nan), [m.update(cosine_pct=70.0, win_rate_pct=math.nan) for m in r["methods"].values()]))
    table = results_lib.results_table([results_lib.read_results(run)])
    assert "| SWEET-RL | 70.0 | n/a |" in table and "nan" not in table.lower()


def test_the_command_refuses_a_damaged_results_file_in_one_line(tmp_path):
    run = honest_run(tmp_path / "run")
    (run / "results.json").write_text((run / "results.json").read_text()[:100])
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.pipeline_report", str(run), "--out",
                           str(tmp_path / "report")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert f"{run / 'results.json'}:" in lines[0] and proc.stdout == ""


def test_a_report_never_overwrites_an_existing_out_or_a_runs_own_results(tmp_path):
    run = honest_run(tmp_path / "run")
    (run / "results.md").write_text("the run's own table\n")
    with pytest.raises(SweetJaxError, match="is a run's own directory"):
        pipeline_report.main([str(run), "--out", str(run)])
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "results.md").write_text("an earlier report\n")
    with pytest.raises(SweetJaxError, match="already exists"):
        pipeline_report.main([str(run), "--out", str(tmp_path / "earlier")])
    assert (run / "results.md").read_text() == "the run's own table\n"
    assert (tmp_path / "earlier" / "results.md").read_text() == "an earlier report\n"
    (tmp_path / "empty").mkdir()
    pipeline_report.main([str(run), "--out", str(tmp_path / "empty")])   # the control: a new (empty) directory
    assert "| SWEET-RL |" in (tmp_path / "empty" / "results.md").read_text()


# ----------------------------------------------------------------------------------------------------------
# pipeline_diagnostics: the ranked pairs and the episodes they point into
# ----------------------------------------------------------------------------------------------------------

def ranked_run(workdir: pathlib.Path, indices) -> pathlib.Path:
    """offline/trajectories.jsonl (two synthetic tasks, one question each) and rank/pairs.jsonl: at each index a
    pair whose chosen reply answers the task's values right and whose rejected one asks off the task."""
    from sweet_jax.envs import synthetic

    tasks = synthetic.make_tasks(2, seed=0)
    episodes = [{"task": t, "reward": 0.0, "dialogue_history": [{"role": "user", "content": t["problem_description"]},
                                                                 {"role": "assistant", "content": "Which values?"}]}
                for t in tasks]
    (workdir / "offline").mkdir(parents=True)
    (workdir / "rank").mkdir()
    (workdir / "offline" / "trajectories.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
    pairs = []
    for i in indices:
        task = tasks[i % len(tasks)]   # -1 is the last task, as Python would read it
        answer = "I WANT TO ANSWER:\n" + task["ground_truth"]
        pairs.append({"trajectory_index": i, "turn": 1, "task_key": "",
                      "prompt": episodes[i % 2]["dialogue_history"][:1],
                      "prompt_text": "", "chosen": answer, "rejected": "Tell me about the weather.",
                      "chosen_score": 1.0, "rejected_score": 0.0, "rank_reference": "ref_with_info"})
    (workdir / "rank" / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return workdir


@pytest.mark.parametrize("index", [-1, 2, -3])
def test_a_pair_pointing_outside_the_episodes_is_refused_naming_its_line(tmp_path, index):
    """-1 would silently read the last episode (right-looking diagnostics of the wrong task, exit 0)."""
    run = ranked_run(tmp_path / "run", [0, 1, index] if index >= 0 else [0, index])
    with pytest.raises(SweetJaxError, match=rf"pairs.jsonl:{3 if index >= 0 else 2}: field 'trajectory_index': "
                                            rf"{index} is not the index of one of the 2 episodes"):
        pipeline_diagnostics.main([str(run), "--out", str(tmp_path / "diagnostics.json")])
    assert not (tmp_path / "diagnostics.json").exists()


def test_honest_pairs_give_the_oracle_agreement(tmp_path, capsys):
    run = ranked_run(tmp_path / "run", [0, 1])
    pipeline_diagnostics.main([str(run), "--out", str(tmp_path / "diagnostics.json")])
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    assert report["rankings"]["rank"] == {"pairs": 2, "decided": 2, "ties": 0, "agreement_pct": 100.0,
                                          "by_kind": report["rankings"]["rank"]["by_kind"]}
    assert report["behaviour"]["offline (starting policy, training tasks)"]["episodes"] == 2
    with pytest.raises(SweetJaxError, match="already exists"):   # the diagnostics just written stay as they are
        pipeline_diagnostics.main([str(run), "--out", str(tmp_path / "diagnostics.json")])


@pytest.mark.parametrize("damage, message", [
    (lambda e: e.update(reward=math.nan), r"trajectories.jsonl:1: field 'reward': NaN is not a finite number"),
    (lambda e: e.pop("task"), r"trajectories.jsonl:1: field 'task': expected an object, got null"),
    (lambda e: e["dialogue_history"].append({"role": "assistant"}), r"field 'dialogue_history.2': expected"),
])
def test_a_damaged_episode_is_refused_naming_its_line_and_field(tmp_path, damage, message):
    run = ranked_run(tmp_path / "run", [0, 1])
    path = run / "offline" / "trajectories.jsonl"
    episodes = [json.loads(line) for line in path.read_text().splitlines()]
    damage(episodes[0])
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    with pytest.raises(SweetJaxError, match=message):
        diagnostics.run_diagnostics(run)


def test_a_scores_line_of_a_turn_the_episode_does_not_have_is_refused(tmp_path):
    run = ranked_run(tmp_path / "run", [0])
    episodes = run_files.read_episodes(run / "offline" / "trajectories.jsonl")
    row = {"trajectory_index": 0, "turn": 1, "texts": ["Which values?"]}
    assert diagnostics.annotate_scores(row, episodes)["turn"] == 1   # the control
    with pytest.raises(SweetJaxError, match=r"field 'turn': not one of the episode's 1 agent turns"):
        diagnostics.annotate_scores(dict(row, turn=0), episodes)   # 0 - 1 would read the last turn
