"""Critic / MT-DPO / RFT data follow the official rule; policy pairs follow the top/bottom-half rule."""
import json
import random

import numpy as np
import pytest

from sweet_jax.data import (DataError, RenderOptions, critic_pairs, demo_paths, load_tokenizer, load_trajectories,
                            mtdpo_pairs, pair_examples, policy_pairs, rft_examples, sft_examples)

# 4 tasks x 3 stacked copies (the official file layout: copy j of task i is row j * num_tasks + i).
REWARDS = {"A": [1.0, 0.5, 0.0], "B": [0.5, 1.0, 1.0], "C": [0.8, 0.3, 0.0], "D": [1.0, 1.0, 1.0]}


def make_rows():
    rows = []
    for j in range(3):
        for name, rewards in REWARDS.items():
            task = {"problem_description": f"Task {name}: write f(x).", "ground_truth": f"def f(x): return '{name}'",
                    "test_cases": {"t": "f(1)"}}
            rows.append({"task": task, "answer": f"{name}{j}", "reward": rewards[j],
                         "dialogue_history": [{"role": "user", "content": task["problem_description"]},
                                              {"role": "assistant", "content": f"Answer {name} try {j}."}]})
    return rows


def official_pairs(rows, k):
    """The official evaluate_code.py rule on the stacked layout, as (chosen answer, rejected answer)."""
    num_tasks = len(rows) // k
    r = np.array([x["reward"] for x in rows]).reshape(k, -1)
    out = []
    for i in range(num_tasks):
        if np.max(r[:, i]) >= 1:
            best = int(np.argmax(r[:, i]))
            for j in range(k):
                if j != best and r[j, i] < np.max(r[:, i]):
                    out.append((rows[num_tasks * best + i]["answer"], rows[num_tasks * j + i]["answer"]))
    return out


@pytest.fixture
def traj_file(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_rows()))
    return path


def as_answers(pairs):
    return sorted((p.chosen.answer, p.rejected.answer) for p in pairs)


def test_critic_pairs_match_the_official_rule(traj_file):
    pairs = critic_pairs(load_trajectories(traj_file))
    expected = official_pairs(make_rows(), k=3)
    assert as_answers(pairs) == sorted(expected)
    assert as_answers(pairs) == [("A0", "A1"), ("A0", "A2"), ("B1", "B0")]
    assert all(p.chosen.task.key == p.rejected.task.key == p.task_key for p in pairs)


def test_critic_pairs_group_by_content_not_file_position(tmp_path):
    rows = make_rows()
    random.Random(0).shuffle(rows)
    path = tmp_path / "shuffled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = as_answers(critic_pairs(load_trajectories(path)))
    # The best is the first maximum in input order: B1 and B2 tie, whichever comes first is chosen.
    b_best = next(r["answer"] for r in rows if r["answer"] in ("B1", "B2"))
    assert got == sorted([("A0", "A1"), ("A0", "A2"), (b_best, "B0")])


def test_min_gap_keeps_only_clear_preferences(traj_file):
    pairs = critic_pairs(load_trajectories(traj_file), min_gap=0.6)
    assert as_answers(pairs) == [("A0", "A2")]


def test_mtdpo_pairs_are_the_critic_pairs_and_rft_keeps_successes(traj_file):
    trajs = load_trajectories(traj_file)
    assert as_answers(mtdpo_pairs(trajs)) == as_answers(critic_pairs(trajs))
    assert sorted(t.answer for t in rft_examples(trajs)) == ["A0", "B1", "B2", "D0", "D1", "D2"]


def test_pairs_need_rewards(traj_file):
    trajs = load_trajectories(traj_file)
    unscored = [type(t)(t.task, t.dialogue_history, t.answer, None) for t in trajs]
    with pytest.raises(DataError, match="no reward"):
        critic_pairs(unscored)


def test_pair_examples_carry_the_ground_truth_only_for_the_critic(traj_file, caplog):
    tok = load_tokenizer(demo_paths().tokenizer)
    trajs = load_trajectories(traj_file)
    pairs = critic_pairs(trajs)
    critic, stats = pair_examples(tok, pairs, with_info=True)
    mtdpo, _ = pair_examples(tok, pairs, with_info=False)
    assert len(critic) == len(mtdpo) == len(pairs) == stats.kept == 3
    for (chosen, rejected), (c0, r0), p in zip(critic, mtdpo, pairs):
        assert p.chosen.task.ground_truth in tok.decode(chosen.input_ids)
        assert p.chosen.task.ground_truth in tok.decode(rejected.input_ids)
        assert p.chosen.task.ground_truth not in tok.decode(c0.input_ids)
        assert tok.decode(chosen.input_ids[chosen.turn_ids == 1][:-1]) == p.chosen.dialogue_history[1].content
    sft, _ = sft_examples(tok, rft_examples(trajs))
    assert len(sft) == 6 and all(len(ex) == 1 for ex in sft)
    # Length policy: a single-reply trajectory over max_len cannot be truncated, so it is dropped and counted.
    shortest = min(len(ex[0]) for ex in critic)
    with caplog.at_level("WARNING"):
        dropped, stats = pair_examples(tok, pairs, with_info=True, options=RenderOptions(max_len=shortest - 1))
    assert dropped == [] and (stats.total, stats.dropped) == (3, 3)
    assert "3 dropped as longer than max_len" in caplog.text


def test_policy_pairs_take_chosen_from_top_half_and_rejected_from_bottom_half():
    rng = np.random.default_rng(0)
    scores = [rng.normal(size=16) for _ in range(50)]
    candidates = [[f"g{g}c{i}" for i in range(16)] for g in range(50)]
    pairs = policy_pairs(candidates, scores, num_pairs=4, seed=1)
    assert len(pairs) == 200 and not pairs.skipped_groups
    for p in pairs:
        rank = np.argsort(-scores[p.group])
        assert p.chosen_index in rank[:8] and p.rejected_index in rank[8:]
        assert p.chosen_score > p.rejected_score
        assert p.chosen == candidates[p.group][p.chosen_index]
    per_group = {}
    for p in pairs:
        per_group.setdefault(p.group, set()).add((p.chosen_index, p.rejected_index))
    assert all(len(s) == 4 for s in per_group.values())  # distinct pairs within a group


def test_policy_pairs_are_reproducible_by_seed():
    rng = np.random.default_rng(1)
    scores = [rng.normal(size=16) for _ in range(20)]
    cands = [list(range(16))] * 20

    def picks(seed):
        pairs = policy_pairs(cands, scores, num_pairs=4, seed=seed)
        return [(p.group, p.chosen_index, p.rejected_index) for p in pairs]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)


def test_policy_pairs_draw_uniformly_within_halves():
    scores = [[4.0, 3.0, 2.0, 1.0]]  # top = {0, 1}, bottom = {2, 3}
    chosen, rejected = np.zeros(4), np.zeros(4)
    for seed in range(2000):
        [p] = policy_pairs([[0, 1, 2, 3]], scores, num_pairs=1, seed=seed)
        chosen[p.chosen_index] += 1
        rejected[p.rejected_index] += 1
    assert chosen[2:].sum() == 0 and rejected[:2].sum() == 0
    assert np.all(np.abs(chosen[:2] / 2000 - 0.5) < 0.05) and np.all(np.abs(rejected[2:] / 2000 - 0.5) < 0.05)


def test_policy_pairs_ties_and_small_groups():
    cands = [list(range(6)), list(range(4)), list(range(1)), list(range(5))]
    scores = [[1, 1, 1, 1, 0, 0],   # one tied 1 falls into the bottom half: never rejected against a 1
              [2, 2, 2, 2],         # all tied: no pair
              [5],                  # one candidate: no pair
              [5, 4, 3, 2, 1]]      # odd: the middle (3) is in neither half
    pairs = policy_pairs(cands, scores, num_pairs=16, seed=0)
    assert pairs.skipped_groups == [1, 2]
    g0 = [p for p in pairs if p.group == 0]
    assert len(g0) == 6 and all(p.chosen_score == 1 and p.rejected_score == 0 for p in g0)
    g3 = [(p.chosen_index, p.rejected_index) for p in pairs if p.group == 3]
    assert sorted(g3) == [(0, 3), (0, 4), (1, 3), (1, 4)]
    with pytest.raises(DataError, match="2 candidates but 3 scores"):
        policy_pairs([[0, 1]], [[1.0, 2.0, 3.0]], num_pairs=1, seed=0)


def test_demo_trajectories_become_critic_batches():
    from sweet_jax.data import pad_id
    from sweet_jax.data.batching import BatchIterator

    tok = load_tokenizer(demo_paths().tokenizer)
    trajs = load_trajectories(demo_paths().trajectories)[:80]
    pairs = critic_pairs(trajs)
    examples, stats = pair_examples(tok, pairs, with_info=True, options=RenderOptions(max_len=1024))
    assert stats.kept == len(examples) == len(pairs) > 0
    batch = next(BatchIterator(examples, batch_size=4, max_len=1024, pad_id=pad_id(tok)))
    B, P, T = batch["input_ids"].shape
    assert (B, P) == (4, 2) and T in (128, 256, 512, 1024)
    # Reply tokens are real tokens, and every sequence has at least one reply.
    assert np.all(batch["attention_mask"][batch["turn_ids"] > 0] == 1)
    assert np.all(batch["turn_ids"].max(-1) >= 1)
    assert all(p.chosen.reward == 1.0 and p.rejected.reward < 1.0 for p in pairs)
