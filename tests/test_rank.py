"""Best-of-N ranking: turn prompts, critic scores with both references, top/bottom-half pairs, the scorer."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sweet_jax.rl import ranking
from sweet_jax.data.schema import Trajectory

TASK = {"problem_description": "Write f(x) adding my number.", "ground_truth": "def f(x):\n    return x + 3",
        "test_cases": {"a": "f(1)"}}


def trajectory(replies, reward=1.0):
    history = [{"role": "user", "content": TASK["problem_description"]}]
    for k, r in enumerate(replies):
        history.append({"role": "assistant", "content": r})
        if k < len(replies) - 1:
            history.append({"role": "user", "content": f"answer {k + 1}"})
    return Trajectory.from_json({"task": TASK, "dialogue_history": history, "answer": replies[-1], "reward": reward})


def test_one_prompt_per_reply_holding_the_dialogue_before_it():
    prompts = ranking.turn_prompts([trajectory(["q1?", "q2?", "I WANT TO ANSWER: code"]), trajectory(["ans"])])
    assert [p.key for p in prompts] == [(0, 1), (0, 2), (0, 3), (1, 1)]
    assert [m["content"] for m in prompts[1].messages] == [TASK["problem_description"], "q1?", "answer 1"]
    assert prompts[0].ground_truth == TASK["ground_truth"] and prompts[0].input_text is None


# Hand-set critic: six candidates per turn; critic and reference mean log-probs chosen so that the two
# references rank them differently.
CRITIC = {"c0": -1.0, "c1": -2.0, "c2": -3.0, "c3": -4.0, "c4": -5.0, "c5": -6.0}
REFERENCE = {"c0": -0.5, "c1": -4.0, "c2": -1.0, "c3": -6.0, "c4": -2.0, "c5": -9.0}
SAMPLER = {"c0": -5.0, "c1": -1.0, "c2": -1.0, "c3": -1.0, "c4": -9.0, "c5": -1.0}


def stub_sample_fn(prompts):
    names = list(CRITIC)
    return [ranking.Candidates(names, np.array([SAMPLER[n] for n in names]), f"prompt {p.key}") for p in prompts]


def critic_logp(items):
    return np.array([CRITIC[text] for _, text in items])


def reference_logp(items):
    return np.array([REFERENCE[text] for _, text in items])


@pytest.mark.parametrize("rank_reference, expected_score", [
    ("ref_with_info", {n: CRITIC[n] - REFERENCE[n] for n in CRITIC}),  # c5 3, c1 2, c3 2 | c2 -2, c4 -3, c0 -.5
    ("sampler", {n: CRITIC[n] - SAMPLER[n] for n in CRITIC}),          # c4 4, c0 4, c1 -1 | c2 -2, c3 -3, c5 -5
])
def test_pairs_take_chosen_from_the_top_half_and_rejected_from_the_bottom(tmp_path, rank_reference,
                                                                           expected_score):
    prompts = ranking.turn_prompts([trajectory(["q1?", "q2?", "ans"]), trajectory(["ans"])])
    out = tmp_path / "pairs.jsonl"
    result = ranking.rank_turns(prompts, stub_sample_fn, critic_logp, reference_logp, out,
                                 rank_reference=rank_reference, num_pairs=4, seed=0, prompts_per_batch=3,
                                 progress=False)
    ranked = sorted(CRITIC, key=lambda n: -expected_score[n])
    top, bottom = set(ranked[:3]), set(ranked[3:])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["pairs_written_now"] == len(records) == 4 * len(prompts)
    for r in records:
        assert r["chosen"] in top and r["rejected"] in bottom
        assert r["chosen_score"] == pytest.approx(expected_score[r["chosen"]])
        assert r["rejected_score"] == pytest.approx(expected_score[r["rejected"]])
        assert r["chosen_score"] > r["rejected_score"] and r["rank_reference"] == rank_reference
    per_turn = {}
    for r in records:
        per_turn.setdefault((r["trajectory_index"], r["turn"]), []).append((r["chosen"], r["rejected"]))
    assert sorted(per_turn) == [p.key for p in prompts]
    assert all(len(set(pairs)) == 4 for pairs in per_turn.values())  # distinct pairs within a turn
    first = next(r for r in records if (r["trajectory_index"], r["turn"]) == (0, 2))
    assert [m["content"] for m in first["prompt"]] == [TASK["problem_description"], "q1?", "answer 1"]
    assert first["prompt_text"] == "prompt (0, 2)"


def test_pairs_are_seeded_and_a_rerun_skips_ranked_turns(tmp_path):
    prompts = ranking.turn_prompts([trajectory(["q1?", "q2?", "ans"])])
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    kw = dict(rank_reference="ref_with_info", num_pairs=2, seed=7, progress=False)
    ranking.rank_turns(prompts, stub_sample_fn, critic_logp, reference_logp, a, prompts_per_batch=1, **kw)
    # Batching differs, pairs do not: each turn's draw depends only on (seed, trajectory, turn).
    ranking.rank_turns(prompts[:1], stub_sample_fn, critic_logp, reference_logp, b, prompts_per_batch=2, **kw)
    rerun = ranking.rank_turns(prompts, stub_sample_fn, critic_logp, reference_logp, b, prompts_per_batch=2, **kw)
    assert rerun["turns_ranked_now"] == 2
    assert a.read_text() == b.read_text()


def test_each_scorer_gets_every_candidate_of_a_batch_in_one_call(tmp_path):
    """The critic and the reference score a batch's candidates together (their fixed-size batches fill across
    prompts), and each prompt still gets its own candidates' scores: the pairs equal one-prompt batches'."""
    prompts = ranking.turn_prompts([trajectory(["q1?", "q2?", "ans"]), trajectory(["ans"])])
    calls = []

    def counted(fn):
        def score(items):
            calls.append([(p.key, t) for p, t in items])
            return fn(items)
        return score

    kw = dict(rank_reference="ref_with_info", num_pairs=3, seed=5, progress=False)
    together, alone = tmp_path / "together.jsonl", tmp_path / "alone.jsonl"
    ranking.rank_turns(prompts, stub_sample_fn, counted(critic_logp), counted(reference_logp), together,
                       prompts_per_batch=4, **kw)
    assert len(calls) == 2 and all(len(c) == 4 * len(CRITIC) for c in calls)
    assert calls[0] == [(p.key, t) for p in prompts for t in CRITIC]
    ranking.rank_turns(prompts, stub_sample_fn, critic_logp, reference_logp, alone, prompts_per_batch=1, **kw)
    assert together.read_text() == alone.read_text()


def test_unscorable_candidates_take_no_part_in_pairs(tmp_path):
    prompts = ranking.turn_prompts([trajectory(["ans"])])
    out = tmp_path / "pairs.jsonl"
    nan_for_c5 = lambda items: np.array([np.nan if t == "c5" else CRITIC[t] for _, t in items])
    ranking.rank_turns(prompts, stub_sample_fn, nan_for_c5, reference_logp, out, num_pairs=10, progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # Five scored: c1 2, c3 2 | (c0 -.5 in the middle) | c2 -2, c4 -3: all 4 top x bottom pairs, c5 nowhere.
    assert sorted((r["chosen"], r["rejected"]) for r in records) == [("c1", "c2"), ("c1", "c4"), ("c3", "c2"),
                                                                     ("c3", "c4")]


def test_ref_with_info_needs_a_reference_scorer(tmp_path):
    with pytest.raises(ranking.RankError, match="reference"):
        ranking.rank_turns([], stub_sample_fn, critic_logp, None, tmp_path / "p.jsonl", progress=False)


@pytest.fixture(scope="module")
def tiny_model_and_tokenizer():
    from flax import nnx

    from sweet_jax.data import demo, tokenizers
    from sweet_jax.models import Llama, LlamaConfig

    tok = tokenizers.load_tokenizer(demo.paths().tokenizer)
    model = Llama(LlamaConfig.preset("tiny", vocab_size=len(tok)), rngs=nnx.Rngs(3))
    return model, tok


def test_reply_scorer_is_the_mean_teacher_forced_logprob_of_the_reply_tokens(tiny_model_and_tokenizer):
    import jax
    from flax import nnx

    model, tok = tiny_model_and_tokenizer
    prompts = ranking.turn_prompts([trajectory(["What is your number?", "I WANT TO ANSWER: def f(x): return x"])])
    items = [(prompts[1], "def f(x): return x + 3"), (prompts[0], "Which number?"),
             (prompts[1], "Sure, one more question: do you want ints only, or floats as well?")]
    scorer = ranking.ReplyScorer(model, tok, info_template="Reference: {ground_truth}", batch_size=2, bucket=16)
    got = scorer(items)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))  # unpadded, one sequence at a time
    for (prompt, text), score in zip(items, got):
        seq = ranking.critic_sequence(tok, prompt, text, info_template="Reference: {ground_truth}",
                                       info_placement="system")
        assert "Reference: def f(x)" in tok.decode(seq.input_ids.tolist())  # the critic sees c
        logits = np.asarray(forward(state, seq.input_ids[None]))[0]
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        reply = np.nonzero(seq.turn_ids)[0]
        assert tok.decode(seq.input_ids[reply].tolist()).startswith(text)
        want = np.mean([logp[t - 1, seq.input_ids[t]] for t in reply])
        assert score == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("layout", ["packed", "prefix_cache"])
@pytest.mark.parametrize("scan_layers", [False, True])  # a critic training run restores the scanned layout
def test_shared_prefix_scoring_gives_the_whole_sequence_scores_once_per_distinct_sequence(
        tiny_model_and_tokenizer, scan_layers, layout):
    from flax import nnx

    from sweet_jax.models import Llama, LlamaConfig

    _, tok = tiny_model_and_tokenizer
    model = Llama(LlamaConfig.preset("tiny", vocab_size=len(tok), scan_layers=scan_layers), rngs=nnx.Rngs(5))
    prompts = ranking.turn_prompts([trajectory(["What is your number?", "Ints?", "I WANT TO ANSWER: def f(x): 1"])])
    replies = ["Which number?", "def f(x): return x + 3", "Which number?", "Ints or floats, and how many?",
               "Which number?", "I WANT TO ANSWER:\ndef f(x):\n    return x + 3  # " + "the number you gave " * 6,
               "ok"]
    items = [(prompt, text) for text in replies for prompt in prompts]  # interleaved turn prompts
    kw = dict(info_template="Reference: {ground_truth}", batch_size=4, bucket=128)
    shared = ranking.ReplyScorer(model, tok, layout=layout, **kw)
    rows = []
    score_rows = shared.mean_logp
    if layout == "packed":  # sequences in a row: its segment ids past the prefix's (1); one alone is all prefix
        count = lambda arrays: len(set(arrays["segments"][0].tolist()) - {0, 1}) or 1  # noqa: E731
    else:  # rows with tokens
        count = lambda *arrays: int((arrays[3].sum(axis=1) > 0).sum())  # noqa: E731
    shared.mean_logp = lambda *arrays: rows.append(count(*arrays)) or score_rows(*arrays)
    got = shared(items)
    want = ranking.ReplyScorer(model, tok, layout="whole", **kw)(items)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert np.all(np.isfinite(got)) and len(set(np.round(want, 4))) > len(prompts)
    assert sum(rows) == len(prompts) * len(set(replies))  # "Which number?" three times, scored once a prompt
    assert len(rows) == len(prompts) * 2  # 6 distinct candidates a prompt, at most 4 a call


def test_packed_scoring_runs_each_prompt_once_and_pads_the_row_little(tiny_model_and_tokenizer):
    """One call a turn prompt (up to batch_size candidates): the row holds the prompt once and every candidate's
    tokens after it, under 25% padding past 32 tokens, instead of batch_size rows padded to the longest."""
    from flax import nnx

    from sweet_jax.models import Llama, LlamaConfig

    _, tok = tiny_model_and_tokenizer
    model = Llama(LlamaConfig.preset("tiny", vocab_size=len(tok)), rngs=nnx.Rngs(2))
    prompt = ranking.turn_prompts([trajectory(["What is your number?", "I WANT TO ANSWER: def f(x): 1"])])[-1]
    replies = ["Which?", "I WANT TO ANSWER:\ndef f(x):\n    return x + 3  # " + "a long comment " * 20] + \
        [f"Is it {i}?" for i in range(6)]
    seqs = [ranking.critic_sequence(tok, prompt, r, info_template="Ref: {ground_truth}", info_placement="system")
            for r in replies]
    shared = len(seqs[0].input_ids[:ranking.reply_start(seqs[0].turn_ids)])
    real = shared + sum(len(s.input_ids) - shared for s in seqs)
    calls = []
    scorer = ranking.ReplyScorer(model, tok, info_template="Ref: {ground_truth}", batch_size=16)
    score_row = scorer.mean_logp
    scorer.mean_logp = lambda arrays: calls.append(arrays["ids"].shape) or score_row(arrays)
    scorer([(prompt, r) for r in replies])
    assert len(calls) == 1 and calls[0][0] == 1 and real <= calls[0][1] < 1.25 * real
    longest = max(len(s.input_ids) for s in seqs) - shared
    assert calls[0][1] < 0.5 * (shared + len(replies) * longest)  # the prefix cache's rows, padded to the longest


def test_models_of_one_architecture_share_the_packed_scoring_programs(tiny_model_and_tokenizer):
    """A second model of the same graph (the critic without c after the critic, pi_ref) compiles nothing new for
    the row widths the first compiled, and still scores with its own parameters."""
    from flax import nnx

    from sweet_jax.models import Llama, LlamaConfig
    from sweet_jax.train import steps

    _, tok = tiny_model_and_tokenizer
    config = LlamaConfig.preset("tiny", vocab_size=len(tok))
    prompt = ranking.turn_prompts([trajectory(["What is your number?", "I WANT TO ANSWER: def f(x): 1"])])[-1]
    items = [(prompt, r) for r in ["Which?", "Is it 3?", "I WANT TO ANSWER:\ndef f(x):\n    return x + 3"]]
    kw = dict(info_template="Ref: {ground_truth}", batch_size=16)
    a, b = (Llama(config, rngs=nnx.Rngs(seed)) for seed in (3, 4))
    program = steps._packed_logp_program(nnx.split(a, nnx.Param, ...)[0], 1.0, None)
    got_a = ranking.ReplyScorer(a, tok, **kw)(items)
    compiled = program._cache_size()
    got_b = ranking.ReplyScorer(b, tok, **kw)(items)
    assert compiled >= 1 and program._cache_size() == compiled
    assert not np.allclose(got_a, got_b)
    np.testing.assert_allclose(got_b, ranking.ReplyScorer(b, tok, layout="whole", **kw)(items), atol=2e-5, rtol=0)


def test_score_shapes_pad_little_in_few_row_counts():
    # A turn prompt of 200 tokens, 9 distinct candidates of 8-40 tokens, calls of up to 16 rows.
    assert ranking.score_shape(200, [8, 12, 40] + [10] * 6, 16) == (224, 12, 40)
    assert ranking.score_shape(20, [5], 16) == (32, 4, 16)
    for rows in range(1, 17):   # rows a multiple of 4, never past the batch
        assert ranking.score_shape(64, [9] * rows, 16)[1] in (4, 8, 12, 16) and \
            ranking.score_shape(64, [9] * rows, 16)[1] >= rows
    for n in range(33, 3000, 11):   # under 25% padding past 32 tokens, prefix and rows alike
        S, _, T = ranking.score_shape(n, [n], 16)
        assert n <= S < 1.25 * n and n <= T < 1.25 * n


def test_rank_cli_config_end_to_end_on_tiny_models(tmp_path):
    """configs/rank.py:demo through rank.run: sample with the tiny policy, score with a tiny critic, write pairs."""
    import importlib.util
    import pathlib

    from sweet_jax.rl import ranking as rank

    spec = importlib.util.spec_from_file_location("rank_config", pathlib.Path(__file__).parents[1] / "configs/rank.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("demo")
    trajectories = tmp_path / "traj.jsonl"
    trajectories.write_text("\n".join(json.dumps(trajectory(r).to_json()) for r in
                                      (["q1?", "I WANT TO ANSWER: def f(x): return x"], ["def f(x): return 1"])))
    config.trajectories = str(trajectories)
    config.output = str(tmp_path / "pairs.jsonl")
    config.max_new_tokens = 8
    config.progress = False
    result = rank.run(config)
    records = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert result["turns"] == 3 and result["pairs_written_now"] == len(records) > 0
    from sweet_jax.train import model_loading
    tokenizer = model_loading.load_tokenizer_for("")
    for r in records:
        assert r["chosen_score"] > r["rejected_score"]
        assert r["prompt_text"].startswith("<|begin_of_text|>") and r["prompt"][0]["role"] == "user"
        # The sampled ids travel with the texts (the DPO step trains on them): they decode to the texts.
        assert r["prompt_ids"] == tokenizer(r["prompt_text"], add_special_tokens=False)["input_ids"]
        for side in ("chosen", "rejected"):
            assert 0 < len(r[f"{side}_ids"]) <= config.max_new_tokens
            assert r[side] == tokenizer.decode(r[f"{side}_ids"], skip_special_tokens=True)
