"""The whole SWEET-RL pipeline, reduced (configs/pipeline.py:test): every stage runs end to end through the
real trainer, sampler, environment, scripted human and sandbox, and leaves valid artifacts; a rerun skips it all."""
import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from sweet_jax.pipeline import stages as pipeline
from sweet_jax.rl import results as results_lib
from sweet_jax.data import load_tasks, load_trajectories
from draws import assert_mostly_identical, assert_same_draws

REPO = pathlib.Path(__file__).resolve().parents[1]
STAGES = ["tasks", "init", "offline", "critic", "critic_no_info", "candidates", "rank", "rank_no_info",
          "eval_zero_shot", "policy_rft", "eval_rft", "policy_mtdpo", "eval_mtdpo", "policy_sweet_no_info",
          "eval_sweet_no_info", "policy_sweet", "eval_sweet", "report"]
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
    paper = [m for m in pipeline.ALL_METHODS if m not in ("sweet_oracle", "sweet_balanced", "sweet_iterative")]
    assert list(results["methods"]) == paper   # the paper's methods, the preset's default
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
    for method in results["methods"]:
        name = results_lib.METHOD_NAMES[method]
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


def test_a_run_goes_on_from_its_carried_state_on_a_new_machine(workdir, tmp_path):
    """The finished run's small state as a run stopped after SWEET-RL's training left it, restored into an empty
    workdir (another path): the starting policy and SWEET-RL's policy are trained again (their plays are still to
    run), no critic (their rankings are done) and no other policy (their plays are done); SWEET-RL's held-out
    episodes are the uninterrupted run's."""
    from sweet_jax.pipeline import carry
    state = tmp_path / "state"
    carry.save(workdir, state)
    assert not list(state.rglob("*.safetensors")) and not list(state.rglob("checkpoints"))
    assert (state / "report/done.json").exists() and (state / "evidence/stages.json").exists()
    for gone in ("eval/sweet", "report", "evidence"):
        shutil.rmtree(state / gone)
    for gone in ("results.json", "results.md", "results.png"):
        (state / gone).unlink(missing_ok=True)
    new = tmp_path / "new_machine" / "run"
    proc = run_cli(new, f"--carry={state}", timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ran, skipped = stages_line(proc.stdout)
    assert ran == ["init", "policy_sweet", "eval_sweet", "report"]
    assert skipped == [x for x in STAGES if x not in ran]
    assert read_jsonl(new / "eval/sweet/trajectories.jsonl") == read_jsonl(workdir / "eval/sweet/trajectories.jsonl")
    assert read_jsonl(new / "rank/pairs.jsonl") == read_jsonl(workdir / "rank/pairs.jsonl")
    assert json.loads((new / "offline/done.json").read_text())["summary"]["trajectories"] == str(
        new / "offline/trajectories.jsonl")     # the records' paths moved to the new workdir
    assert (state / "eval/sweet/done.json").exists() and (state / "results.json").exists()   # saved back


@pytest.mark.slow
def test_every_stage_records_wall_and_cpu_time_load_and_memory(workdir):
    for stage in ("init", "critic", "eval/sweet"):
        record = json.loads((workdir / stage / "done.json").read_text())
        assert record["seconds"] > 0 and record["cpu_seconds"] > 0 and len(record["load_average"]) == 2
        assert len(record["rss_gb"]) == 2 and all(0.05 < gb < 64 for gb in record["rss_gb"])  # this process's
    diagnostics = json.loads((workdir / "results.json").read_text())["diagnostics"]
    assert diagnostics["cpu_minutes"] > 0 and diagnostics["minutes"] > 0
    # the critic's held-out accuracy comes with the pairs it counts
    critic = json.loads((workdir / "critic/done.json").read_text())["summary"]
    assert diagnostics["critic_heldout_pairs"] == critic["eval_examples"]
    assert diagnostics["critic_heldout_accuracy"] == critic["eval"].get("pair_accuracy")


@pytest.mark.slow
def test_every_stage_records_where_its_seconds_went(workdir):
    def costs(stage):
        return json.loads((workdir / stage / "done.json").read_text())["costs"]

    critic = costs("critic")   # 3 steps, the reference pass before them, its held-out evaluation after
    seconds = json.loads((workdir / "critic" / "done.json").read_text())["seconds"]
    assert critic["train_step_calls"] == 3
    assert 0 < critic["train_step_s"] + critic["ref_logp_pass_s"] + critic["train_eval_s"] <= seconds
    assert critic["ref_logp_pass_calls"] >= 1 and critic["train_eval_calls"] >= 1
    assert 0 < critic["train_tokens"] <= critic["train_padded_tokens"]
    assert 0 < critic["ref_logp_tokens"] <= critic["ref_logp_padded_tokens"]
    rank = costs("rank")
    assert rank["score_pass_calls"] >= 2 and 0 < rank["score_tokens"] <= rank["score_padded_tokens"]
    for stage in ("offline", "eval/sweet"):
        c = costs(stage)
        assert c["sample_prefill_calls"] >= 1 and c["sample_decode_s"] > 0 and c["sandbox_calls"] >= 1
        assert 0 < c["sample_prompt_tokens"] <= c["sample_prompt_padded_tokens"]
        assert 0 < c["sample_new_tokens"] <= c["sample_new_padded_tokens"]
        # a stage's timers never hold more than its wall time (they do not overlap)
        record = json.loads((workdir / stage / "done.json").read_text())
        assert c["policy_act_s"] + c["sandbox_s"] + c["simulator_s"] <= record["seconds"]
        assert c["sample_prefill_s"] + c["sample_decode_s"] <= c["policy_act_s"]


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


def test_the_ranking_keeps_every_candidates_scores_and_the_run_its_evidence(workdir):
    cands = {(c["trajectory_index"], c["turn"]): c for c in read_jsonl(workdir / "candidates/candidates.jsonl")}
    for rank_dir in ("rank", "rank_no_info"):
        scores = {(r["trajectory_index"], r["turn"]): r for r in read_jsonl(workdir / rank_dir / "scores.jsonl")}
        assert scores.keys() == cands.keys()
        for key, r in scores.items():
            assert r["texts"] == cands[key]["texts"]
            np.testing.assert_allclose(r["advantage"], np.subtract(r["critic_logp"], r["reference_logp"]))
        for p in read_jsonl(workdir / rank_dir / "pairs.jsonl"):   # each pair's scores are its candidates'
            r = scores[(p["trajectory_index"], p["turn"])]
            assert p["chosen_score"] == pytest.approx(r["advantage"][r["texts"].index(p["chosen"])])
    evidence = workdir / "evidence"
    stages = json.loads((evidence / "stages.json").read_text())
    assert {"init", "critic", "rank", "policies/sweet", "eval/sweet"} <= set(stages)
    metrics = read_jsonl(evidence / "metrics_policies_sweet.jsonl")
    steps = [m["step"] for m in metrics if "chosen_logp" in m]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == 2    # every step of the DPO run
    pairs = read_jsonl(evidence / "pairs_rank.jsonl")
    assert len(pairs) == len(read_jsonl(workdir / "rank/pairs.jsonl"))
    assert all(p["verdict"] in ("agree", "disagree", "tie") and p["chosen_kind"] for p in pairs)
    assert json.loads((evidence / "prompts.json").read_text())["prompts"] == 8
    assert all(len(r["kinds"]) == 4 for r in read_jsonl(evidence / "scores_rank.jsonl"))


def _selection_run(workdir, dst, *extra):
    """A copy of the finished test run with the tasks stage redone (to draw validation tasks) and no policy, eval
    or report stage, rerun with `extra`: the selection reuses its starting policy, critics and rankings."""
    import shutil
    shutil.copytree(workdir, dst, ignore=shutil.ignore_patterns("policies", "eval", "report", "evidence"))
    (dst / "tasks" / "done.json").unlink()
    return run_cli(dst, "--accept_config_change", "--config.methods=zero_shot,sweet,sweet_balanced,sweet_iterative",
                   "--config.iterate.rounds=2",
                   "--config.tasks.num_validation=3", "--config.select.lrs=1e-3,3e-3", *extra, timeout=1500)


def test_settings_are_chosen_on_validation_tasks_and_frozen_for_other_seeds(workdir, tmp_path):
    proc = _selection_run(workdir, tmp_path / "select", "--config.select.steps=1,2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    sel_dir = tmp_path / "select"
    validation = {t.key for t in load_tasks(sel_dir / "tasks/validation.jsonl")}
    others = {t.key for split in ("train", "heldout") for t in load_tasks(sel_dir / f"tasks/{split}.jsonl")}
    demos = {t.task.key for t in load_trajectories(sel_dir / "init/demos.jsonl")}
    assert len(validation) == 3 and not validation & others and not validation & demos
    assert load_tasks(sel_dir / "tasks/train.jsonl") == load_tasks(workdir / "tasks/train.jsonl")  # unchanged draw
    selection = json.loads((sel_dir / "selection.json").read_text())
    curve = selection["methods"]["sweet"]["curve"]
    assert sorted(curve) == ["0.001/1", "0.001/2", "0.003/1", "0.003/2"]
    for cell in curve.values():   # each point of the curve is its checkpoint played on the validation tasks
        trajs = load_trajectories(sel_dir / f"valid/sweet/lr{cell['lr']:g}_step{cell['step']}/trajectories.jsonl")
        assert {t.task.key for t in trajs} == validation
        assert cell["success_rate"] == pytest.approx(np.mean([t.reward == 1.0 for t in trajs]))
    best = max(curve.values(), key=lambda r: (r["success_rate"], r["tests_passed_pct"], -r["step"], -r["lr"]))
    choice = selection["methods"]["sweet"]["choice"]
    assert choice == {"lr": best["lr"], "step": best["step"]}
    policy = json.loads((sel_dir / "eval/sweet/done.json").read_text())["summary"]["policy"]
    assert policy == str(sel_dir / f"policies/sweet/lr{choice['lr']:g}/step{choice['step']}/hf")
    assert not list(sel_dir.glob("policies/sweet/*/train/checkpoints"))   # exported, then deleted
    assert json.loads((sel_dir / "results.json").read_text())["selection"]["methods"]["sweet"]["choice"] == choice

    # iterative SWEET-RL: round 2 collects the chosen SWEET-RL policy's episodes and trains DPO from that policy
    rounds = selection["methods"]["sweet_iterative"]
    assert sorted(rounds["curve"]) == ["1", "2"] and rounds["curve"]["1"]["success_rate"] == best["success_rate"]
    round1 = str(sel_dir / f"policies/sweet/lr{choice['lr']:g}/step{choice['step']}/hf")
    offline2 = json.loads((sel_dir / "rounds/2/offline/done.json").read_text())["summary"]
    assert offline2["episodes"] == 12 * 2
    config2 = json.loads((sel_dir / "rounds/2/policy/train/config.json").read_text())
    assert config2["model"]["path"] == round1 and config2["optim"]["lr"] == choice["lr"]
    critic2 = json.loads((sel_dir / "rounds/2/critic/train/config.json").read_text())
    start = json.loads((sel_dir / "init/done.json").read_text())["summary"]["policy_hf"]
    assert critic2["model"]["path"] == start      # every critic starts from pi_ref
    assert len(read_jsonl(sel_dir / "rounds/2/episodes/trajectories.jsonl")) == 48 + 24   # both rounds' episodes
    best_round = rounds["choice"]["round"]
    iterative = json.loads((sel_dir / "eval/sweet_iterative/done.json").read_text())["summary"]["policy"]
    assert iterative == (round1 if best_round == 1 else str(sel_dir / f"rounds/2/policy/step{choice['step']}/hf"))
    if best_round == 1:   # SWEET-RL's policy: its held-out episodes, not a second play of the same seed
        record = json.loads((sel_dir / "eval/sweet_iterative/done.json").read_text())["summary"]
        assert record["episodes_of"] == "eval/sweet" and record["method"] == "sweet_iterative"
        assert ((sel_dir / "eval/sweet_iterative/trajectories.jsonl").read_text()
                == (sel_dir / "eval/sweet/trajectories.jsonl").read_text())

    # SWEET-RL on turn prompts balanced by state: as many prompts as SWEET-RL's ranking, up to half of them states
    # where every value is known, ranked by the same critic; its own grid and choice
    from sweet_jax.rl import diagnostics, ranking
    offline = load_trajectories(sel_dir / "offline/trajectories.jsonl")
    every = ranking.turn_prompts(offline)
    ready = sum(diagnostics.turn_state(offline[p.trajectory_index].task.to_json(), p.messages)["all_known"]
                for p in every)
    balanced = json.loads((sel_dir / "evidence/prompts_balanced.json").read_text())
    assert balanced["prompts"] == json.loads((sel_dir / "evidence/prompts.json").read_text())["prompts"] == 8
    assert balanced["all_known"] == min(ready, 4)
    rank_config = json.loads((sel_dir / "rank_balanced/done.json").read_text())["summary"]
    assert rank_config["use_info"] and rank_config["pairs"] == len(read_jsonl(sel_dir / "rank_balanced/pairs.jsonl"))
    assert sorted(selection["methods"]["sweet_balanced"]["curve"]) == sorted(curve)
    pairs = json.loads((sel_dir / "policies/sweet_balanced/lr0.001/train/config.json").read_text())["data"]["pairs"]
    assert pairs == str(sel_dir / "rank_balanced/pairs.jsonl")
    from sweet_jax.commands import pipeline_diagnostics
    pipeline_diagnostics.main([str(sel_dir), "--out", str(tmp_path / "diagnostics.json")])
    rankings = json.loads((tmp_path / "diagnostics.json").read_text())["rankings"]
    # every ranking with its pairs by kind, iterative round 2's over the episodes of round 1's policy
    assert set(rankings) == {"rank", "rank_no_info", "rank_balanced", "rank_round2"}
    round2_pairs = read_jsonl(sel_dir / "evidence/pairs_rank_round2.jsonl")
    assert len(round2_pairs) == rankings["rank_round2"]["pairs"] == len(read_jsonl(sel_dir / "rounds/2/rank/pairs.jsonl"))
    assert "pair_oracle_agreement_round2" in json.loads((sel_dir / "results.json").read_text())["diagnostics"]
    behaviour = json.loads((tmp_path / "diagnostics.json").read_text())["behaviour"]
    assert behaviour["round 2 offline (round 1's policy, training tasks)"]["episodes"] == 24
    for r in rankings.values():   # each pair once by kind (the keys without a state in front)
        assert sum(sum(v.values()) for k, v in r["by_kind"].items() if ":" not in k) == r["pairs"]

    # another seed trains the chosen learning rate on the same schedule and plays the chosen step, no validation
    proc = _selection_run(workdir, tmp_path / "frozen", f"--config.select.frozen={sel_dir / 'selection.json'}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    frozen = tmp_path / "frozen"
    assert not (frozen / "valid").exists() and [d.name for d in (frozen / "policies/sweet").iterdir()] == [
        f"lr{choice['lr']:g}"]
    summary = json.loads((frozen / f"policies/sweet/lr{choice['lr']:g}/done.json").read_text())["summary"]
    assert summary["steps"] == choice["step"] and list(summary["hf"]) == [str(choice["step"])]  # trained no further
    assert (frozen / "rounds/2").exists() == (best_round == 2) and not list(frozen.glob("rounds/*/valid"))
    # the same seed, data and schedule: the chosen checkpoint is the same model
    a = hf_params(frozen / "policies/sweet/lr{:g}/step{}/hf".format(choice["lr"], choice["step"]))
    b = hf_params(sel_dir / "policies/sweet/lr{:g}/step{}/hf".format(choice["lr"], choice["step"]))
    assert all(np.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_turn_selection_follows_the_official_rule_or_balances_states():
    from sweet_jax.rl import diagnostics, ranking
    from sweet_jax.envs import synthetic
    from sweet_jax.data.schema import Trajectory

    tasks = synthetic.make_tasks(10, seed=3, min_keys=2, max_keys=2)
    trajs = []
    for i, task in enumerate(tasks):    # even trajectories ask every key before answering, odd ones answer at once
        replies = synthetic.scripted_replies(task, "thorough" if i % 2 == 0 else "naive", random.Random(i))
        dialogue = [{"role": "user", "content": task["problem_description"]}]
        for r in replies:
            dialogue.append({"role": "assistant", "content": r})
            dialogue.append({"role": "user", "content": synthetic.simulator_reply(task, dialogue)})
        trajs.append(Trajectory.from_json({"task": task, "dialogue_history": dialogue[:-1], "reward": 0.5}))
    prompts = ranking.turn_prompts(trajs)
    official = ranking.select_turn_prompts(prompts, "trajectories", max_prompts=0, data_fraction=0.2, seed=0)
    assert official == [p for p in prompts if p.trajectory_index in (0, 1)]   # every turn of the first 20%
    assert ranking.select_turn_prompts(prompts, "trajectories", max_prompts=2, data_fraction=0.2, seed=0) == \
        official[:2]
    def ready(ps):
        return sum(diagnostics.turn_state(tasks[p.trajectory_index], p.messages)["all_known"] for p in ps)
    assert ready(prompts) == 5                        # the thorough episodes' answer turns
    balanced = ranking.select_turn_prompts(prompts, "balanced", max_prompts=8, data_fraction=1.0, seed=0,
                                            tasks=tasks)
    assert len(balanced) == 8 and ready(balanced) == 4
    sampled = ranking.select_turn_prompts(prompts, "sample", max_prompts=8, data_fraction=1.0, seed=0)
    assert len(sampled) == 8 and len(set(p.key for p in sampled)) == 8
    with pytest.raises(ranking.RankError, match="data_fraction"):
        ranking.select_turn_prompts(prompts, "trajectories", max_prompts=0, data_fraction=0.01, seed=0)


def test_probes_of_a_run_match_transformers_and_the_reference(workdir):
    import torch
    import transformers

    from sweet_jax.rl import probes, ranking
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.envs import ANSWER_MARKER
    from sweet_jax.models import load_hf
    from sweet_jax.rl.probes import run_probes

    report = run_probes(workdir)
    start = report["starting policy"]
    assert start["answer_over_repeat"]["prompts"] > 0 and start["answer_over_repeat"]["mean_margin"] == 0.0
    assert report["sweet step 2"]["answer_over_repeat"]["prompts"] == start["answer_over_repeat"]["prompts"]
    for key in ("starting policy", "starting policy, agent prompt on", "sweet (final)"):
        p = report[key]["answer_probability"]["all prompts"]
        assert p["prompts"] == 8 and 0.0 < p["mean"] < 1.0
    assert report["critic"]["turns_scored"] > 0 and set(report["critic"]["pair_accuracy"]) == {
        "turn_mean", "trajectory_mean"}

    # P(reply starts with the answer marker) is the product of the marker tokens' probabilities in transformers
    trajs = load_trajectories(workdir / "offline/trajectories.jsonl")
    prompt = ranking.turn_prompts(trajs)[0]
    hf = str(workdir / "init/policy_hf")
    tok = load_tokenizer(hf)
    ids, turns = probes.prefix_sequence(tok, prompt, ANSWER_MARKER)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    want = sum(float(logp[i - 1, ids[i]]) for i in range(len(ids)) if turns[i] == 1)
    got = probes.summed_logps(load_hf(hf), tok, [(ids, turns)])[0]
    assert got == pytest.approx(want, abs=1e-3)


def test_mean_table_over_seeds():
    def run(seed, sweet):
        return {"seed": seed, "model": "m", "heldout_tasks": 4, "methods": {
            "zero_shot": {"tests_passed_pct": 10.0, "success_rate_pct": 0.0, "episodes": 4},
            "sweet": {"tests_passed_pct": sweet, "success_rate_pct": sweet / 2, "episodes": 4}}}
    runs = [run(0, 20.0), run(1, 40.0)]
    for r, balanced, round2 in zip(runs, (60.0, 70.0), (40.0, 50.0)):
        r["diagnostics"] = {"pair_oracle_agreement_balanced": balanced, "pair_oracle_agreement_round2": round2}
    table = results_lib.results_table(runs)
    assert "| SWEET-RL | 30.0 ± 10.0 | 15.0 ± 5.0 |" in table
    assert ("| pairs on prompts balanced by state whose chosen reply is truly better (%) | 60 | 70 |\n"
            "| iterative round 2: pairs with c whose chosen reply is truly better (%) | 40 | 50 |") in table
    assert "| Zero-Shot | 10.0 ± 0.0 | 0.0 ± 0.0 |" in table
    assert "seeds: 0, 1" in table


def test_the_report_sums_stage_times_by_group_and_reads_them_from_a_run(tmp_path):
    record = lambda seconds, cpu: {"seconds": seconds, "cpu_seconds": cpu}  # noqa: E731
    stages = {"critic": record(600, 900), "policies/sweet/lr1e-05": record(120, 180),
              "policies/sweet/lr3e-06": record(60, 90), "valid/sweet/lr1e-05_step8": record(30, 60),
              "rounds/2/critic": record(300, 420), "rounds/2/rank": record(60, 60), "eval/sweet": record(90, 120)}
    run = {"seed": 0, "model": "m", "heldout_tasks": 4, "methods": {
        "sweet": {"tests_passed_pct": 10.0, "success_rate_pct": 5.0, "episodes": 4}}}
    (tmp_path / "results.json").write_text(json.dumps(run))
    (tmp_path / "evidence").mkdir()
    (tmp_path / "evidence" / "stages.json").write_text(json.dumps(stages))
    table = results_lib.results_table([results_lib.read_results(tmp_path)])
    assert "| critic | 10 / 15 |" in table
    assert "| policies/sweet | 3 / 4 |" in table          # two learning rates: 180 s wall, 270 s CPU
    assert "| rounds/2 | 6 / 8 |" in table              # critic and rank of round 2: 360 s, 480 s
    assert "| valid/sweet | 0 / 1 |" in table and "| eval/sweet | 2 / 2 |" in table
    assert "| all | 21 / 30 |" in table                 # 1260 s wall, 1830 s CPU
    assert results_lib.stage_group("valid/sweet/lr1e-05_step8") == "valid/sweet"


def test_the_report_tables_each_policys_behaviour_and_each_ranking_from_the_diagnostics_beside_it(tmp_path):
    run = {"seed": 3, "model": "m", "heldout_tasks": 4, "methods": {
        "sweet": {"tests_passed_pct": 75.0, "success_rate_pct": 50.0, "turns_per_episode": 4.25, "episodes": 8}}}
    kinds = {"question over answer": {"agree": 9, "disagree": 2, "tie": 0},
             "answer over question": {"agree": 1, "disagree": 4, "tie": 0},
             "all values known: question over answer": {"agree": 0, "disagree": 2, "tie": 0},
             "question over question": {"agree": 3, "disagree": 0, "tie": 5}}
    diagnostics = {"behaviour": {"eval sweet": {"questions_per_episode": 3.125, "episodes_with_answer_pct": 87.5}},
                   "rankings": {"rank_round2": {"decided": 19, "agreement_pct": 68.42, "by_kind": kinds},
                                "rank": {"decided": 19, "agreement_pct": 68.42, "by_kind": kinds}}}
    (tmp_path / "results.json").write_text(json.dumps(run))
    without = results_lib.results_table([results_lib.read_results(tmp_path)])
    (tmp_path / "diagnostics.json").write_text(json.dumps(diagnostics))
    table = results_lib.results_table([results_lib.read_results(tmp_path)])
    assert "Q > A" not in without and "questions an episode" not in without
    assert "| SWEET-RL | 50.0 | 75.0 | 4.2 | 3.12 | 87.5 |" in table
    # the kinds' counts are agree + disagree (ties are not decided), the oracle's wrong ones in brackets
    assert ("| SWEET-RL (with c) | 3 | 19 | 68.4 | 11 (2) | 5 (4) | 2 (2) | 0 (0) |\n"
            "| iterative round 2 (with c) | 3 | 19 |") in table
    # an older diagnostics file: [agree, decided] per kind, no states
    diagnostics["rankings"] = {"rank": {"decided": 6, "agreement_pct": 50.0, "by_kind": {
        "question over answer": [2, 5], "answer over question": [1, 1]}}}
    (tmp_path / "diagnostics.json").write_text(json.dumps(diagnostics))
    table = results_lib.results_table([results_lib.read_results(tmp_path)])
    assert "| SWEET-RL (with c) | 3 | 6 | 50.0 | 5 (3) | 1 (0) | n/a | n/a |" in table


def test_the_table_shows_the_validation_grid_with_the_choice():
    cell = lambda lr, step, success: {"lr": lr, "step": step, "success_rate": success,  # noqa: E731
                                      "tests_passed_pct": 50.0}
    selection = {"seed": 0, "validation_tasks": 32, "episodes_per_task": 2, "zero_shot": {"success_rate": 0.2},
                 "methods": {
                     "sweet": {"curve": {"3e-06/8": cell(3e-6, 8, 0.25), "1e-05/8": cell(1e-5, 8, 0.5)},
                               "choice": {"lr": 1e-5, "step": 8}},
                     "sweet_iterative": {"curve": {"1": {"success_rate": 0.5}, "2": {"success_rate": 0.625}},
                                         "choice": {"round": 2}}}}
    table = results_lib.selection_table(selection)
    assert "| method | lr 3e-06, 8 steps | lr 1e-05, 8 steps |" in table
    assert "| SWEET-RL | 25.0 | **50.0** |" in table
    assert "50.0 (round 1) · **62.5** (round 2)" in table
    assert "the starting policy: 20.0" in table


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


def _floor_task():
    from sweet_jax.envs import synthetic
    task = synthetic.make_tasks(1, seed=0)[0]          # floor(team): sales 7, design 6, finance 4
    theme, truth = synthetic.task_theme(task), synthetic.hidden_constants(task)
    def answer(values):
        return "I WANT TO ANSWER:\n" + synthetic.lookup_code(theme.function, theme.argument, values)
    return task, truth, answer


def _told(task, keys, *, extra_turns=0):
    """The dialogue after asking about `keys` one a turn (and `extra_turns` vague exchanges before them)."""
    from sweet_jax.envs import synthetic
    messages = [{"role": "user", "content": task["problem_description"]}]
    for _ in range(extra_turns):
        messages += [{"role": "assistant", "content": "Could you tell me more?"},
                     {"role": "user", "content": "Ask me about a specific one."}]
    for k in keys:
        question = f"Which floor is the {k} team on?"
        messages += [{"role": "assistant", "content": question},
                     {"role": "user", "content": synthetic.simulator_reply(task, [{"content": question}])}]
    return messages


def test_synthetic_oracle_values_answers_and_questions():
    from sweet_jax.rl.diagnostics import TURN_COST, reply_worth

    task, truth, answer = _floor_task()
    start = _told(task, [])
    one_wrong = dict(truth, sales=truth["sales"] + 1)
    assert reply_worth(task, start, answer(truth)) == 1.0
    assert reply_worth(task, start, answer(one_wrong)) == pytest.approx(2 / 3)
    # a question learns its key; one more question (two keys a reply) and the answer reach every value
    assert reply_worth(task, start, "Which floor is the design team on?") == pytest.approx(1 - 2 * TURN_COST)
    told = _told(task, ["design"])
    assert reply_worth(task, told, "Which floor is the sales team on?") == pytest.approx(1 - 2 * TURN_COST)
    assert reply_worth(task, told, "What about sales and finance?") == pytest.approx(1 - TURN_COST)


def test_oracle_ranks_a_correct_answer_above_a_repeated_question_when_everything_is_known():
    from sweet_jax.rl.diagnostics import reply_kind, reply_worth, turn_state

    task, truth, answer = _floor_task()
    everything = _told(task, ["design", "sales", "finance"])
    assert turn_state(task, everything) == {"turn": 4, "known": 3, "keys": 3, "all_known": True}
    correct, repeat = answer(truth), "Which floor is the sales team on?"
    assert reply_worth(task, everything, correct) > reply_worth(task, everything, repeat)
    assert reply_worth(task, everything, repeat) > reply_worth(task, everything, answer(dict(truth, sales=0)))
    assert [reply_kind(task, everything, r) for r in (correct, repeat, "Anything else?")] == \
        ["answer_correct", "question_repeat", "question_other"]
    assert reply_kind(task, _told(task, ["design"]), repeat) == "question_new"


def test_oracle_knows_the_turn_limit():
    from sweet_jax.rl.diagnostics import TURN_COST, reply_worth

    task, truth, answer = _floor_task()
    # agent turn 9 of 10 with finance unknown: this question is the last one, the 10th reply must answer
    late = _told(task, ["design", "sales"], extra_turns=6)
    assert reply_worth(task, late, "Which floor is the finance team on?") == pytest.approx(1 - TURN_COST)
    assert reply_worth(task, late, "Which floor is the sales team on?") == pytest.approx(2 / 3 - TURN_COST)
    # agent turn 10: a question ends the episode without an answer
    last = _told(task, ["design", "sales"], extra_turns=7)
    assert reply_worth(task, last, "Which floor is the finance team on?") == 0.0
    assert reply_worth(task, last, answer(dict(truth, finance=0))) == pytest.approx(2 / 3)
    # with a limit of 3 turns, asking at turn 2 about one key leaves one unknown that no question can learn
    assert reply_worth(task, _told(task, ["design"]), "Which floor is the sales team on?",
                       max_turns=3) == pytest.approx(2 / 3 - TURN_COST)


def test_pair_kinds_count_every_pair_ties_included(tmp_path):
    from sweet_jax import jsonl
    from sweet_jax.data.schema import PolicyPair
    from sweet_jax.rl.diagnostics import pair_evidence, pair_kinds

    task, truth, answer = _floor_task()
    everything, start = _told(task, ["design", "sales", "finance"]), _told(task, [])
    trajs = tmp_path / "trajectories.jsonl"
    jsonl.write(trajs, [{"task": task, "dialogue_history": everything, "reward": 1.0}])
    pair = lambda prompt, chosen, rejected: dataclasses.asdict(PolicyPair(  # noqa: E731
        0, 1 + sum(m["role"] == "assistant" for m in prompt), "k", prompt, "", chosen, rejected, 1.0, 0.0,
        "ref_with_info"))
    jsonl.write(tmp_path / "pairs.jsonl", [
        pair(everything, "Which floor is the sales team on?", answer(truth)),           # wrong: should answer
        pair(start, "Which floor is the sales team on?", answer(truth)),                # wrong: a correct answer
        pair(start, "Which floor is the design team on?", "Which floor is the sales team on?"),   # a tie
        pair(start, "Which floor is the design team on?", answer(dict(truth, sales=0)))])         # right
    rows = pair_evidence(tmp_path / "pairs.jsonl", trajs)
    assert [r["verdict"] for r in rows] == ["disagree", "disagree", "tie", "agree"]
    assert rows[0]["all_known"] and not rows[1]["all_known"]
    kinds = pair_kinds(tmp_path / "pairs.jsonl", trajs)
    assert kinds["question over answer"] == {"agree": 1, "disagree": 2, "tie": 0}
    assert kinds["question over question"] == {"agree": 0, "disagree": 0, "tie": 1}
    assert kinds["all values known: question over answer"] == {"agree": 0, "disagree": 1, "tie": 0}


def test_policy_behaviour_measures_questions_and_copy_accuracy():
    from sweet_jax.envs import synthetic
    from sweet_jax.rl.diagnostics import policy_behaviour

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
