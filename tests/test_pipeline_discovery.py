"""The comparison's protocol on the discovery family at tiny size (configs/pipeline.py:test with the protocol's
settings): task draws by run seed, the family's turn limit, the oracle-ranked control on SWEET-RL's candidates,
every held-out episode kept, and the report's paired intervals."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from sweet_jax.data import load_trajectories
from sweet_jax.envs import discovery
from sweet_jax.pipeline import stages
from sweet_jax.rl import diagnostics, intervals

from test_pipeline import REPO, cli, read_jsonl

PROTOCOL = ["--config.tasks.family=discovery", "--config.tasks.draw=seeded", "--config.collect.max_turns=4",
            "--config.eval.max_turns=4", "--config.methods=zero_shot,mtdpo,sweet,sweet_oracle",
            "--config.rank.pairing=official", "--config.rank.turn_selection=trajectories",
            "--config.rank.data_fraction=0.25", "--config.rank.max_prompts=0",
            "--config.init.policy_weights=efficient:1,everything:1,naive:1", "--config.eval.samples=2"]


def protocol_config(preset="smollm2_discovery", **tasks):
    spec = importlib.util.spec_from_file_location("pipeline_config", REPO / "configs" / "pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(preset)
    config.tasks.update(tasks)
    return config


def keys(tasks):
    return {t["ground_truth"] + t["problem_description"] for t in tasks}


def test_each_run_seed_draws_its_own_disjoint_tasks_outside_the_demonstrations():
    config = protocol_config()
    demos = {t["ground_truth"] for t in stages.demonstration_pool(config, 0)}
    assert len(demos) == config.init.num_tasks
    draws = {}
    for seed in (0, 1):
        config.seed = seed
        train, heldout, validation = stages.seeded_draw(config)
        assert (len(train), len(heldout), len(validation)) == (64, 100, 48)
        assert all(discovery.is_task(t) for t in train + heldout + validation)
        assert not keys(train) & keys(heldout) and not keys(train) & keys(validation)
        assert not keys(heldout) & keys(validation)
        assert not {t["ground_truth"] for t in train + heldout + validation} & demos
        draws[seed] = keys(heldout)
        assert stages.seeded_draw(config)[1] == heldout           # a rerun of the seed draws the same tasks
    assert draws[0] != draws[1]
    lookup = protocol_config("smollm2_lookup")
    assert lookup.tasks.family == "lookup" and lookup.eval.max_turns == 10
    assert not any(discovery.is_task(t) for t in stages.seeded_draw(lookup)[0])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    wd = tmp_path_factory.mktemp("discovery")
    argv, env = cli(wd, *PROTOCOL)
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return wd


def test_the_protocol_runs_on_the_discovery_family_within_its_turn_limit(run):
    tasks = {split: read_jsonl(run / f"tasks/{split}.jsonl") for split in ("train", "heldout")}
    assert all(discovery.is_task(t) for split in tasks.values() for t in split)
    demos = read_jsonl(run / "init/demos.jsonl")
    assert {d["scripted_policy"] for d in demos} <= {"efficient", "everything", "naive"}
    assert not {d["task"]["ground_truth"] for d in demos} & {t["ground_truth"] for t in tasks["train"]}
    for path in ("offline/trajectories.jsonl", "eval/sweet_oracle/trajectories.jsonl"):
        for t in read_jsonl(run / path):
            assert sum(m["role"] == "assistant" for m in t["dialogue_history"]) <= 4


def test_the_oracle_control_pairs_sweets_candidates_by_the_oracles_worth(run):
    trajs = read_jsonl(run / "offline/trajectories.jsonl")
    oracle, sweet = read_jsonl(run / "rank_oracle/pairs.jsonl"), read_jsonl(run / "rank/pairs.jsonl")
    assert {(p["trajectory_index"], p["turn"]) for p in oracle} == {(p["trajectory_index"], p["turn"]) for p in sweet}
    candidates = {(c["trajectory_index"], c["turn"]): c["texts"] for c in read_jsonl(run / "candidates/candidates.jsonl")}
    for p in oracle:
        task = trajs[p["trajectory_index"]]["task"]
        worth = [diagnostics.reply_worth(task, p["prompt"], p[side], max_turns=4) for side in ("chosen", "rejected")]
        assert [p["chosen_score"], p["rejected_score"]] == pytest.approx(worth)
        assert worth[0] >= worth[1]
        assert {p["chosen"], p["rejected"]} <= set(candidates[(p["trajectory_index"], p["turn"])])
    config = json.loads((run / "policies/sweet_oracle/train/config.json").read_text())
    assert config["data"]["pairs"] == str(run / "rank_oracle/pairs.jsonl") and config["loss"]["kind"] == "dpo"
    sweet_config = json.loads((run / "policies/sweet/train/config.json").read_text())
    assert config["optim"] == sweet_config["optim"] and config["loss"] == sweet_config["loss"]


def test_every_heldout_episode_is_kept_and_the_report_gives_paired_intervals(run, tmp_path):
    episodes = json.loads((run / "evidence/episodes.json").read_text())
    assert sorted(episodes) == ["mtdpo", "sweet", "sweet_oracle", "zero_shot"]
    for method, rows in episodes.items():
        trajs = load_trajectories(run / f"eval/{method}/trajectories.jsonl")
        assert sorted((r[0], r[1]) for r in rows) == [(i, s) for i in range(6) for s in range(2)]
        assert sorted(r[2] for r in rows) == sorted(t.reward for t in trajs)
    # the rankings' agreement with the oracle by state and the policies' replies by kind, beside results.json
    diagnostics = run / "diagnostics.json"
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.pipeline_diagnostics", str(run), "--out", str(diagnostics)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        proc = subprocess.run([sys.executable, "-m", "sweet_jax.pipeline_report", str(run), "--out",
                               str(tmp_path / "rep")], cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        diagnostics.unlink()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "oracle agreement (%)" in proc.stdout and "| SWEET-RL (with c) | 0 |" in proc.stdout
    assert "| the oracle (control) | 0 |" in proc.stdout and "iterative round" not in proc.stdout
    est = intervals.bootstrap_interval(intervals.paired_differences([episodes], "sweet", "mtdpo"))
    assert f"| SWEET-RL - Multi-Turn DPO | {100 * est[0]:+.1f} [{100 * est[1]:+.1f}, {100 * est[2]:+.1f}]" in \
        proc.stdout
    behaviour = json.loads((run / "evidence/behaviour.json").read_text())
    assert set(behaviour["eval sweet"]["replies_per_episode"]) <= {
        "answer_correct", "answer_wrong", "question_new", "question_discovery", "question_no_hidden",
        "question_untested", "question_repeat", "question_other"}
    assert pathlib.Path(run / "evidence/pairs_rank_oracle.jsonl").exists()
