"""The whole SWEET-RL pipeline, reduced (configs/pipeline.py:test): every stage runs end to end through the
real trainer, sampler, environment, scripted human and sandbox, and leaves valid artifacts; a rerun skips it all."""
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from sweet_jax import pipeline
from sweet_jax import results as results_lib
from sweet_jax.data import load_tasks, load_trajectories
from draws import assert_mostly_identical, assert_same_draws

REPO = pathlib.Path(__file__).resolve().parents[1]
STAGES = ["tasks", "init", "offline", "critic", "critic_no_info", "candidates", "rank", "rank_no_info",
          "policy_rft", "policy_mtdpo", "policy_sweet_no_info", "policy_sweet", "eval_zero_shot", "eval_rft",
          "eval_mtdpo", "eval_sweet_no_info", "eval_sweet", "report"]
POLICY_DIRS = {"rft": "policies/rft/hf", "mtdpo": "policies/mtdpo/hf", "sweet_no_info": "policies/sweet_no_info/hf",
               "sweet": "policies/sweet/hf"}


def cli(workdir, *extra):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)   # one CPU device: the demo's setting, and one compilation per shape
    env["JAX_PLATFORMS"] = "cpu"
    return [sys.executable, "-m", "sweet_jax.pipeline", "--config", "configs/pipeline.py:test", "--workdir",
            str(workdir), *extra], env


def run_cli(workdir, *extra, timeout=900):
    argv, env = cli(workdir, *extra)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# The policy's sampling through the `openai` backend: `python -m sweet_jax.serve` engines the pipeline starts for
# each policy it samples from, after exporting it (the command template).
ENGINE = "{python} -m sweet_jax.serve --model {hf_dir} --port {port} --served-model-name policy"


def stages_line(stdout):
    m = re.search(r"stages run: (.*); skipped \(already done\): (.*)", stdout)
    assert m, stdout[-2000:]
    split = lambda s: [] if s.strip() == "none" else [x.strip() for x in s.split(",")]  # noqa: E731
    return split(m.group(1)), split(m.group(2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The test preset run twice at the same time: sampling in-process, and through the openai backend."""
    wd, other = tmp_path_factory.mktemp("pipeline"), tmp_path_factory.mktemp("pipeline_openai")
    argv, env = cli(other, "--config.policy.backend=openai", f"--config.policy.openai.command={ENGINE}")
    with open(other / "stdout.txt", "w") as out, open(other / "stderr.txt", "w") as err:
        openai_run = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err)
    try:
        yield wd, run_cli(wd, timeout=1800), other, openai_run
    finally:
        if openai_run.poll() is None:
            openai_run.kill()
            openai_run.wait()


@pytest.fixture(scope="module")
def workdir(runs):
    wd, proc = runs[:2]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ran, skipped = stages_line(proc.stdout)
    assert ran == STAGES and skipped == []
    return wd


def read_jsonl(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def hf_params(path):
    from safetensors.numpy import load_file
    out = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.slow
def test_tasks_split_into_train_and_heldout(workdir):
    train, heldout = load_tasks(workdir / "tasks/train.jsonl"), load_tasks(workdir / "tasks/heldout.jsonl")
    assert (len(train), len(heldout)) == (12, 6)
    assert not {t.key for t in train} & {t.key for t in heldout}


@pytest.mark.slow
def test_starting_policy_is_sft_on_scored_mixed_demonstrations(workdir):
    demos = read_jsonl(workdir / "init/demos.jsonl")
    rewards = np.array([d["reward"] for d in demos])
    assert len(demos) == 24 and ((rewards >= 0) & (rewards <= 1)).all()   # init.num_tasks fresh tasks, 1 each
    used = {t.key for split in ("train", "heldout") for t in load_tasks(workdir / f"tasks/{split}.jsonl")}
    assert not {load_trajectories(workdir / "init/demos.jsonl")[i].task.key for i in range(24)} & used
    assert (rewards == 1.0).any() and (rewards < 1.0).any()          # mixed quality
    init, trained = hf_params(workdir / "init/random_hf"), hf_params(workdir / "init/policy_hf")
    assert init.keys() == trained.keys()
    assert any(not np.array_equal(init[k], trained[k]) for k in init)   # SFT changed the weights
    assert (workdir / "init/policy_hf/tokenizer.json").exists()


@pytest.mark.slow
def test_offline_trajectories_are_scored_and_give_critic_pairs(workdir):
    trajs = load_trajectories(workdir / "offline/trajectories.jsonl")
    assert len(trajs) == 12 * 2 + 12 * 2   # best_of 2 collected by the policy + 2 scripted per task
    assert all(t.reward is not None and 0.0 <= t.reward <= 1.0 for t in trajs)
    collected = read_jsonl(workdir / "offline/collected.jsonl")
    assert all("input" in turn for r in collected for turn in r["dialogue_history"] if turn["role"] == "assistant")
    done = json.loads((workdir / "offline/done.json").read_text())["summary"]
    assert done["critic_pairs"] > 0


@pytest.mark.slow
def test_critics_and_policies_are_trained_from_the_starting_policy(workdir):
    start = hf_params(workdir / "init/policy_hf")
    for d in ["critic/hf", "critic_no_info/hf", *POLICY_DIRS.values()]:
        params = hf_params(workdir / d)
        assert params.keys() == start.keys(), d
        assert any(not np.array_equal(start[k], params[k]) for k in start), f"{d} equals the starting policy"
    with_c = json.loads((workdir / "critic/train/config.json").read_text())
    without_c = json.loads((workdir / "critic_no_info/train/config.json").read_text())
    assert with_c["loss"]["use_info"] is True and without_c["loss"]["use_info"] is False
    for name, kind in [("rft", "rft"), ("mtdpo", "mtdpo"), ("sweet", "dpo"), ("sweet_no_info", "dpo")]:
        cfg = json.loads((workdir / f"policies/{name}/train/config.json").read_text())
        assert cfg["loss"]["kind"] == kind and cfg["model"]["path"] == str(workdir / "init/policy_hf")
    assert json.loads((workdir / "policies/sweet/train/config.json").read_text())["data"]["pairs"] == \
        str(workdir / "rank/pairs.jsonl")


@pytest.mark.slow
def test_candidates_and_step_level_pairs(workdir):
    cands = read_jsonl(workdir / "candidates/candidates.jsonl")
    assert len(cands) == 8 and all(len(c["texts"]) == 4 and len(c["sampler_logp"]) == 4 for c in cands)
    for rank_dir in ("rank", "rank_no_info"):
        pairs = read_jsonl(workdir / rank_dir / "pairs.jsonl")
        assert pairs
        by_key = {(c["trajectory_index"], c["turn"]): c for c in cands}
        for p in pairs:
            texts = by_key[(p["trajectory_index"], p["turn"])]["texts"]
            assert p["chosen"] in texts and p["rejected"] in texts   # pairs are made of the shared candidates
            assert p["chosen_score"] > p["rejected_score"]
            assert p["prompt_text"] == by_key[(p["trajectory_index"], p["turn"])]["prompt_text"]


@pytest.mark.slow
def test_every_policy_is_evaluated_on_the_heldout_tasks(workdir):
    heldout = {t.key for t in load_tasks(workdir / "tasks/heldout.jsonl")}
    results = json.loads((workdir / "results.json").read_text())
    assert list(results["methods"]) == list(pipeline.ALL_METHODS)
    for method, row in results["methods"].items():
        trajs = load_trajectories(workdir / f"eval/{method}/trajectories.jsonl")
        assert {t.task.key for t in trajs} == heldout and len(trajs) == 6
        rewards = np.array([t.reward for t in trajs])
        assert row["success_rate_pct"] == pytest.approx(100 * np.mean(rewards == 1.0))
        assert row["tests_passed_pct"] == pytest.approx(100 * rewards.mean())
        policy = json.loads((workdir / f"eval/{method}/done.json").read_text())["summary"]["policy"]
        assert policy == str(workdir / ("init/policy_hf" if method == "zero_shot" else POLICY_DIRS[method]))


@pytest.mark.slow
def test_results_table_and_chart(workdir):
    results = json.loads((workdir / "results.json").read_text())
    table = (workdir / "results.md").read_text()
    for method, name in results_lib.METHOD_NAMES.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) == pytest.approx(results["methods"][method]["tests_passed_pct"], abs=0.051)
        assert float(cells[2]) == pytest.approx(results["methods"][method]["success_rate_pct"], abs=0.051)
    assert "critic with c: held-out pair accuracy" in table
    png = (workdir / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    assert matplotlib.image.imread(str(workdir / "results.png")).shape[0] > 100


@pytest.mark.slow
def test_rerun_skips_every_completed_stage(workdir):
    watched = [workdir / "results.md", workdir / "policies/sweet/hf/config.json", workdir / "rank/pairs.jsonl",
               workdir / "eval/sweet/trajectories.jsonl"]
    before = [p.stat().st_mtime_ns for p in watched]
    proc = run_cli(workdir, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran, skipped = stages_line(proc.stdout)
    assert ran == [] and skipped == STAGES
    assert [p.stat().st_mtime_ns for p in watched] == before
    assert "| SWEET-RL |" in proc.stdout   # the table is printed again


@pytest.mark.slow
def test_every_stage_records_wall_and_cpu_time_and_load(workdir):
    for stage in ("init", "critic", "eval/sweet"):
        record = json.loads((workdir / stage / "done.json").read_text())
        assert record["seconds"] > 0 and record["cpu_seconds"] > 0 and len(record["load_average"]) == 2
    diagnostics = json.loads((workdir / "results.json").read_text())["diagnostics"]
    assert diagnostics["cpu_minutes"] > 0 and diagnostics["minutes"] > 0


@pytest.mark.slow
def test_another_seed_reuses_the_starting_policy_of_a_finished_run(workdir, tmp_path):
    sys.path.insert(0, str(REPO))
    from configs import pipeline as pipeline_configs

    c = pipeline_configs.get_config("test")
    c.seed, c.init.from_run = 1, str(workdir)
    run = pipeline.Run(c, tmp_path)
    summary = pipeline.stage_init(run, tmp_path)
    assert summary["reused_from"] == str(workdir) and summary["policy_hf"] == str(tmp_path / "policy_hf")
    assert hf_params(tmp_path / "policy_hf").keys() == hf_params(workdir / "init/policy_hf").keys()
    assert all(np.array_equal(a, b) for a, b in zip(hf_params(tmp_path / "policy_hf").values(),
                                                    hf_params(workdir / "init/policy_hf").values()))
    c.model.remat = "full"     # a memory layout of the same model: the same starting policy
    assert pipeline.stage_init(pipeline.Run(c, tmp_path / "remat"), tmp_path / "remat")["reused_from"] == str(workdir)
    c.model.hidden_size = 64   # another starting policy: reusing would mix two comparisons
    with pytest.raises(pipeline.PipelineError, match="model.hidden_size"):
        pipeline.stage_init(pipeline.Run(c, tmp_path / "other"), tmp_path / "other")


def test_mean_table_over_seeds():
    def run(seed, sweet):
        return {"seed": seed, "model": "m", "heldout_tasks": 4, "methods": {
            "zero_shot": {"tests_passed_pct": 10.0, "success_rate_pct": 0.0, "episodes": 4},
            "sweet": {"tests_passed_pct": sweet, "success_rate_pct": sweet / 2, "episodes": 4}}}
    table = results_lib.results_table([run(0, 20.0), run(1, 40.0)])
    assert "| SWEET-RL | 30.0 ± 10.0 | 15.0 ± 5.0 |" in table
    assert "| Zero-Shot | 10.0 ± 0.0 | 0.0 ± 0.0 |" in table
    assert "seeds: 0, 1" in table


def test_colbench_8b_preset_is_complete():
    """The paper's preset loads and every training stage's config passes the trainer's own checks."""
    sys.path.insert(0, str(REPO))
    from configs import pipeline as pipeline_configs
    from sweet_jax import config_utils

    c = pipeline_configs.get_config("colbench_8b")
    assert (c.tasks.source, c.init.kind, c.simulator.kind) == ("files", "path", "openai")
    assert (c.rank.num_candidates, c.rank.num_pairs, c.collect.best_of) == (16, 4, 3)
    assert (c.critic.lr, c.critic.epochs, c.sweet.nll_coef, c.sweet.beta) == (2e-7, 4, 0.01, 0.1)
    for kind, stage, info in [("critic", c.critic, True), ("critic", c.critic, False), ("dpo", c.sweet, False),
                              ("mtdpo", c.mtdpo, False), ("rft", c.rft, False)]:
        tc = pipeline.train_config(c, kind=kind, stage=stage, model_path="", use_info=info)
        config_utils.check_config(tc)
        assert tc.data.max_len == 8192 and tc.model.dtype == "bfloat16" and tc.loss.use_info == info
    with pytest.raises(pipeline.PipelineError, match="init.path"):
        pipeline.stage_init(pipeline.Run(c, pathlib.Path("/nonexistent")), pathlib.Path("/nonexistent"))


def test_synthetic_oracle_values_answers_and_questions():
    from sweet_jax.data import synthetic
    from sweet_jax.diagnostics import reply_worth

    task = synthetic.make_tasks(1, seed=0)[0]          # floor(team): sales 7, design 6, finance 4
    theme, truth = synthetic.task_theme(task), synthetic.hidden_constants(task)
    start = [{"role": "user", "content": task["problem_description"]}]
    one_wrong = dict(truth, sales=truth["sales"] + 1)
    answer = lambda values: "I WANT TO ANSWER:\n" + synthetic.lookup_code(theme.function, theme.argument, values)  # noqa: E731
    assert reply_worth(task, start, answer(truth)) == 1.0
    assert reply_worth(task, start, answer(one_wrong)) == pytest.approx(2 / 3)
    assert reply_worth(task, start, "Which floor is the design team on?") == pytest.approx(1 / 3)
    told = start + [{"role": "assistant", "content": "Which floor is the design team on?"},
                    {"role": "user", "content": "The design team is on floor 6."}]
    assert reply_worth(task, told, "Which floor is the sales team on?") == pytest.approx(2 / 3)
    assert reply_worth(task, told, "Could you tell me more?") == pytest.approx(1 / 3)


def test_policy_behaviour_measures_questions_and_copy_accuracy():
    from sweet_jax.data import synthetic
    from sweet_jax.diagnostics import policy_behaviour

    task = synthetic.make_tasks(1, seed=0)[0]          # floor(team): sales 7, design 6, finance 4
    theme, truth = synthetic.task_theme(task), synthetic.hidden_constants(task)
    answer = dict(truth, sales=(truth["sales"] + 1) % 10, finance=(truth["finance"] + 1) % 10)
    dialogue = [{"role": "user", "content": task["problem_description"]},
                {"role": "assistant", "content": "Which floor is the design team on?"},
                {"role": "user", "content": synthetic.simulator_reply(task, [{"content": "design"}])},
                {"role": "assistant", "content": "Which floor is the sales team on?"},
                {"role": "user", "content": synthetic.simulator_reply(task, [{"content": "sales"}])},
                {"role": "assistant", "content": "Which floor is the legal team on?"},   # not a key of the task
                {"role": "user", "content": "That one is not in my list, so it gives 0."},
                {"role": "assistant", "content": "I WANT TO ANSWER:\n" + synthetic.lookup_code(
                    theme.function, theme.argument, answer)}]
    scripted = {"task": task, "dialogue_history": dialogue[:2], "reward": 1.0, "scripted": True}
    b = policy_behaviour([{"task": task, "dialogue_history": dialogue, "reward": 0.5}, scripted])
    assert b["episodes"] == 1 and b["success_pct"] == 0.0          # the scripted episode is not the policy's
    assert b["questions_per_episode"] == 3
    assert b["questions_naming_a_task_key_pct"] == pytest.approx(200 / 3)
    assert b["questions_naming_another_key_pct"] == pytest.approx(100 / 3)
    assert b["answer_key_coverage_pct"] == 100.0
    assert b["copy_accuracy_pct"] == 50.0          # design copied, sales stated but written wrong
    assert b["guess_accuracy_pct"] == 0.0          # finance never asked, guessed wrong


@pytest.mark.slow
def test_the_openai_backend_through_sweet_jax_serve_gives_the_same_run(workdir, runs):
    """The test preset with every policy sampled through the `openai` backend by `python -m sweet_jax.serve`
    engines the pipeline starts after exporting each policy (the command template). The starting policy's draws
    (offline episodes, candidates, zero-shot episodes) are the in-process ones up to rare CDF-boundary flips (the
    engine batches requests its own way: tests/draws.py), with the same log-probs where the tokens are the same;
    the later stages run on them and give the same pair slots and the same results table."""
    other, openai_run = runs[2:]
    assert openai_run.wait(timeout=1800) == 0, ((other / "stdout.txt").read_text()[-3000:] +
                                                (other / "stderr.txt").read_text()[-5000:])
    for stage in ("offline", "candidates", "eval/zero_shot", "eval/sweet"):
        assert "serving policy on http://127.0.0.1:" in (other / stage / "engine.log").read_text()
    want, got = (read_jsonl(w / "candidates" / "candidates.jsonl") for w in (workdir, other))
    assert [(r["trajectory_index"], r["turn"], r["prompt_ids"]) for r in got] == [
        (r["trajectory_index"], r["turn"], r["prompt_ids"]) for r in want]
    flat = lambda rows, key: [x for r in rows for x in r[key]]  # noqa: E731
    same = assert_same_draws(flat(got, "token_ids"), flat(want, "token_ids"))
    np.testing.assert_allclose([g for g, s in zip(flat(got, "sampler_logp"), same) if s],
                               [w for w, s in zip(flat(want, "sampler_logp"), same) if s], atol=1e-4)
    for name in ("offline/trajectories.jsonl", "eval/zero_shot/trajectories.jsonl"):
        episodes = lambda w: read_jsonl(w / name)  # noqa: E731
        assert [e["task"] for e in episodes(other)] == [e["task"] for e in episodes(workdir)], name
        assert_mostly_identical(episodes(other), episodes(workdir), what=name)
    slots = lambda w: [(p["trajectory_index"], p["turn"]) for p in read_jsonl(w / "rank/pairs.jsonl")]  # noqa: E731
    assert slots(other) == slots(workdir)
    # The results table is the same either way (the acceptance): the test preset's random policies solve
    # nothing, so a flipped draw does not move it.
    methods = lambda w: json.loads((w / "results.json").read_text())["methods"]  # noqa: E731
    assert methods(other) == methods(workdir)
    table = lambda w: (w / "results.md").read_text().split("\n\n")[:3]  # noqa: E731 (title, tasks, table)
    assert table(other) == table(workdir)
