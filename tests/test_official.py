"""The official recipe, selectable: the fork's critic mask and loss, the whole-sequence NLL, the right cut, official
pair files. Rows are hand-built in the official layout (task / dialogue_history with `input` + `output`, Llama-3
headers from the demo tokenizer); each expected value is re-derived here in numpy from the official procedure."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

from sweet_jax.train import losses, steps
from sweet_jax.data import demo, load_tokenizer
from sweet_jax.data import pairs as pairs_lib
from sweet_jax.data import render
from sweet_jax.data.batching import collate
from sweet_jax.data.schema import Trajectory
from sweet_jax.models import Llama, LlamaConfig

INFO = "In light that the final answer is: {ground_truth}."
HEADER = "<|start_header_id|>assistant<|end_header_id|>"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(demo.paths().tokenizer))


def official_trajectory(tok, replies, answers, reward):
    """A trajectory as the official files hold it: user turns, assistant turns with the templated `input` the
    agent saw and its raw `output`."""
    task = {"problem_description": "Write f(a, b) for me.", "ground_truth": "def f(a, b):\n    return a + b",
            "test_cases": {"t1": "f(1, 2)"}}
    messages, history = [{"role": "user", "content": task["problem_description"]}], []
    history.append(dict(messages[0]))
    for reply, answer in zip(replies, answers):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        history.append({"role": "assistant", "content": reply, "input": prompt, "output": reply})
        messages.append({"role": "assistant", "content": reply})
        if answer is not None:
            history.append({"role": "user", "content": answer})
            messages.append({"role": "user", "content": answer})
    return Trajectory.from_json({"task": task, "dialogue_history": history, "answer": replies[-1],
                                 "reward": reward})


def np_official_sequence(tok, text, max_len=None):
    """The fork's RewardDataset item, step by step: strip newlines, append ' ' + eos, tokenize, cut from the
    right, force eos last; the mask runs from after each assistant header to the next eos (inclusive)."""
    text = text.rstrip("\n")
    if not text.endswith(tok.eos_token):
        text += " " + tok.eos_token
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    if max_len is not None:
        ids = ids[:max_len]
    ids[-1] = tok.eos_token_id
    header = list(tok(HEADER, add_special_tokens=False)["input_ids"])
    mask = [0] * len(ids)
    for i in range(len(ids)):
        if ids[i:i + len(header)] == header:
            j = i + len(header)
            while ids[j] != tok.eos_token_id:
                j += 1
            for k in range(i + len(header), j + 1):
                mask[k] = 1
    return np.array(ids), np.array(mask)


@nnx.jit
def _logits(model, ids_BT):
    return model(ids_BT, jax.numpy.ones_like(ids_BT))


def np_logps(model, ids):
    padded = np.zeros((1, 256), np.int32)  # one compiled length; right padding leaves a causal model's logits be
    padded[0, :len(ids)] = ids
    logits = np.asarray(_logits(model, padded)[0, :len(ids)], np.float64)
    logits = logits - logits.max(-1, keepdims=True)
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logsm[np.arange(len(ids) - 1), ids[1:]]  # [T-1]: the log-prob of token t+1


def models(tok):
    cfg = LlamaConfig.preset("tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                             num_heads=4, num_kv_heads=2, head_dim=8)
    return Llama(cfg, rngs=nnx.Rngs(0)), Llama(cfg, rngs=nnx.Rngs(1))


def loss_of(spec, policy, reference, examples):
    T = max(len(s) for ex in examples for s in ex)
    batch = collate(examples, length=T, pad_id=0)
    graphdef, params, rest = nnx.split(policy, nnx.Param, ...)
    _, ref_params, _ = nnx.split(reference, nnx.Param, ...)
    batch = jax.tree.map(np.asarray, batch)
    fn = jax.jit(lambda p, b, r: steps.pair_loss(spec, graphdef, p, rest, b, r, spec.denominator(b)))
    loss, metrics = fn(params, batch, ref_params)
    return float(loss), jax.device_get(metrics)


def test_official_mask_labels_the_header_newlines_and_ends_with_space_eos(tok):
    traj = official_trajectory(tok, ["What should f return?", "I WANT TO ANSWER: def f(a, b): return a + b"],
                               ["The sum.", None], 1.0)
    seq = render.render_trajectory(tok, traj, with_info=True, info_template=INFO, mask_style="official")
    turns = render.render_trajectory(tok, traj, with_info=True, info_template=INFO)
    # Reply 1: "\n\n" + text + <|eot_id|>; the last reply: "\n\n" + text + " " + <|eot_id|>.
    first = tok.decode(seq.input_ids[seq.turn_ids == 1].tolist())
    last = tok.decode(seq.input_ids[seq.turn_ids == 2].tolist())
    assert first == "\n\nWhat should f return?<|eot_id|>"
    assert last == "\n\nI WANT TO ANSWER: def f(a, b): return a + b <|eot_id|>"
    assert seq.input_ids[-1] == tok.eos_token_id
    newline_tokens = 2 * len(tok("\n\n", add_special_tokens=False)["input_ids"])
    assert np.count_nonzero(seq.turn_ids) == np.count_nonzero(turns.turn_ids) + newline_tokens + 1  # + " "
    ids, mask = np_official_sequence(tok, INFO.format(ground_truth=traj.task.ground_truth)
                                     + traj.dialogue_history[-1].input + traj.dialogue_history[-1].output)
    np.testing.assert_array_equal(seq.input_ids, ids)
    np.testing.assert_array_equal(seq.turn_ids > 0, mask > 0)


def test_official_critic_loss_equals_numpy_rederivation_of_the_fork(tok):
    policy, reference = models(tok)
    best = official_trajectory(tok, ["Which numbers?", "I WANT TO ANSWER: def f(a, b): return a + b"],
                               ["Two ints.", None], 1.0)
    worse = official_trajectory(tok, ["Hi", "What type?", "I WANT TO ANSWER: def f(a, b): return a * b"],
                                ["Hello.", "Ints.", None], 0.0)
    bad = official_trajectory(tok, ["I WANT TO ANSWER: def f(a, b): return a"], [None], 0.0)
    listed = pairs_lib.critic_pairs([best, worse, bad])
    options = pairs_lib.RenderOptions(info_template=INFO, mask_style="official")
    examples, _ = pairs_lib.pair_examples(tok, listed, with_info=True, options=options)
    spec = steps.LossSpec("critic", beta=0.1, advantage_norm="trajectory_mean")
    loss, metrics = loss_of(spec, policy, reference, list(examples))

    def score(traj):  # the fork with --mean_log_prob: mean over the mask of log pi - log pi_ref
        last = traj.dialogue_history[-1]
        ids, mask = np_official_sequence(tok, INFO.format(ground_truth=traj.task.ground_truth)
                                         + last.input + last.output)
        m = mask[1:]
        return ((np_logps(policy, ids) * m).sum() - (np_logps(reference, ids) * m).sum()) / m.sum()

    margins = [score(best) - score(t) for t in (worse, bad)]
    expected = np.mean([np.logaddexp(0.0, -0.1 * m) for m in margins])  # -log sigmoid(beta * margin)
    assert len(examples) == 2
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["margin"], np.mean(margins), rtol=1e-4)


def official_pair_row(tok, traj_chosen, traj_rejected):
    """A row of the official step-level pairs file: whole strings, prompt + reply + eos."""
    c, r = traj_chosen.dialogue_history[-1], traj_rejected.dialogue_history[-1]
    return {"chosen": c.input + c.output + tok.eos_token, "rejected": r.input + r.output + tok.eos_token}


def test_policy_loss_with_sequence_nll_equals_numpy_rederivation(tok):
    policy, reference = models(tok)
    rows = [official_pair_row(tok, official_trajectory(tok, ["Ask: which inputs?"], [None], 1.0),
                              official_trajectory(tok, ["I WANT TO ANSWER: pass"], [None], 0.0)),
            official_pair_row(tok, official_trajectory(tok, ["Hi", "What type?"], ["Hello.", None], 1.0),
                              official_trajectory(tok, ["Hi", "Bye"], ["Hello.", None], 0.0))]
    examples = [pairs_lib.official_pair_sequences(tok, r) for r in rows]
    spec = steps.LossSpec("dpo", beta=0.1, nll_coef=0.01, nll_scope="sequence")
    loss, metrics = loss_of(spec, policy, reference, examples)

    per_pair, nlls = [], []
    for r in rows:  # the fork without a response template: every token after the first is scored
        ids_c, _ = np_official_sequence(tok, r["chosen"])
        ids_r, _ = np_official_sequence(tok, r["rejected"])
        lc, lr = np_logps(policy, ids_c), np_logps(policy, ids_r)
        h = 0.1 * ((lc.sum() - np_logps(reference, ids_c).sum()) - (lr.sum() - np_logps(reference, ids_r).sum()))
        nlls.append(-lc.mean())
        per_pair.append(np.logaddexp(0.0, -h) + 0.01 * nlls[-1])
    np.testing.assert_allclose(loss, np.mean(per_pair), rtol=1e-4)
    np.testing.assert_allclose(metrics["nll"], np.mean(nlls), rtol=1e-5)
    reply_only, _ = loss_of(steps.LossSpec("dpo", beta=0.1, nll_coef=0.01), policy, reference, examples)
    assert abs(reply_only - loss) > 1e-4  # the default (reply-only NLL) is a different number


def test_sequence_nll_skips_padding_and_each_rows_first_token():
    logp = np.log(np.array([[0.5, 0.25, 0.5, 0.9], [0.9, 0.9, 0.5, 0.25]], np.float32))
    mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1]], np.int32)  # right- and left-padded
    expected = [-(np.log(0.25) + np.log(0.5)) / 2, -(np.log(0.5) + np.log(0.25)) / 2]
    np.testing.assert_allclose(losses.sequence_nll(logp, mask), expected, rtol=1e-6)


def test_cut_right_keeps_max_len_tokens_ends_with_eos_and_masks_after_the_cut(tok):
    traj = official_trajectory(tok, ["What should f return exactly?", "I WANT TO ANSWER: def f(a, b): return a"],
                               ["The sum of the two.", None], 1.0)
    text = render.official_text(tok, traj)
    full, _ = np_official_sequence(tok, text)
    max_len = len(full) - 5  # inside the last reply
    seq = render.render_trajectory(tok, traj, mask_style="official", max_len=max_len)
    ids, mask = np_official_sequence(tok, text, max_len=max_len)
    assert len(seq) == max_len and seq.input_ids[-1] == tok.eos_token_id
    np.testing.assert_array_equal(seq.input_ids, ids)
    np.testing.assert_array_equal(seq.turn_ids > 0, mask > 0)
    # The same policy on the default mask: the cut reply ends at the forced eos, which stays labelled.
    turns = render.render_trajectory(tok, traj)
    fitted, cut = render.fit_length(turns, len(turns) - 3, overflow="cut_right")
    assert cut == 3 and fitted.input_ids[-1] == tok.eos_token_id and fitted.turn_ids[-1] == 2
    np.testing.assert_array_equal(fitted.input_ids[:-1], turns.input_ids[:len(turns) - 4])


def test_official_pair_file_loads_for_policy_training(tok, tmp_path):
    from configs import policy as policy_configs
    from sweet_jax.data import datasets

    rows = [official_pair_row(tok, official_trajectory(tok, [f"Question {i}?"], [None], 1.0),
                              official_trajectory(tok, [f"I WANT TO ANSWER: {i}"], [None], 0.0)) for i in range(6)]
    path = tmp_path / "random_pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = policy_configs.get_config("demo_official")
    with config.unlocked():
        config.data.pairs = str(path)
        config.data.eval_fraction = 0.0
    train_set, _ = datasets.build_datasets(config, tok)
    assert len(train_set) == 6
    chosen, rejected = train_set.examples[0]
    ids, _ = np_official_sequence(tok, rows[0]["chosen"])
    np.testing.assert_array_equal(chosen.input_ids, ids)
    assert tok.decode(chosen.input_ids[chosen.turn_ids > 0].tolist()) == "\n\nQuestion 0?<|eot_id|>"
    assert tok.decode(rejected.input_ids[rejected.turn_ids > 0].tolist()) == "\n\nI WANT TO ANSWER: 0<|eot_id|>"


def test_official_rank_score_is_the_scripts_mean_over_header_and_reply_at_temperature_half(tok):
    from sweet_jax.rl import ranking

    critic, _ = models(tok)
    traj = official_trajectory(tok, ["Which inputs?", "I WANT TO ANSWER: pass"], ["Two ints.", None], 1.0)
    prompt = ranking.turn_prompts([traj])[1]
    replies = ["Do you want a sum?", "I WANT TO ANSWER: def f(a, b): return a + b"]
    scorer = ranking.ReplyScorer(critic, tok, info_template=INFO, style="official", temperature=0.5,
                                  batch_size=2, bucket=64)
    got = scorer([(prompt, r) for r in replies])

    template = HEADER + "\n\n"
    tail = len(tok(template, add_special_tokens=False)["input_ids"])  # 4 on Llama 3
    for reply, score in zip(replies, got):
        # The script: vLLM adds a BOS to info + input + reply + empty header, returns prompt log-probs at
        # temperature 0.5; drop the last header, average what follows the last eos.
        ids = [tok.bos_token_id] + tok(INFO.format(ground_truth=traj.task.ground_truth) + prompt.input_text + reply
                                       + template, add_special_tokens=False)["input_ids"]
        padded = np.zeros((1, 256), np.int32)
        padded[0, :len(ids)] = ids
        logits = np.asarray(_logits(critic, padded)[0, :len(ids)], np.float64) / 0.5
        logsm = logits - logits.max(-1, keepdims=True)
        logsm -= np.log(np.exp(logsm).sum(-1, keepdims=True))
        prompt_logprobs = [logsm[t - 1, ids[t]] for t in range(1, len(ids))][:-tail]
        tokens = ids[1:len(ids) - tail]
        last_eos = max(i for i, t in enumerate(tokens) if t == tok.eos_token_id)
        np.testing.assert_allclose(score, np.mean(prompt_logprobs[last_eos + 1:]), rtol=1e-5)
        seq = ranking.critic_sequence(tok, prompt, reply, info_template=INFO, info_placement="raw_prefix",
                                       style="official")
        assert tok.decode(seq.input_ids[seq.turn_ids > 0].tolist()) == template + reply
        assert seq.input_ids[0] == tok.bos_token_id and INFO[:8] in tok.decode(seq.input_ids[1:4].tolist())
    no_info = ranking.critic_sequence(tok, prompt, replies[0], info_template=INFO, info_placement="raw_prefix",
                                       use_info=False, style="official")
    assert list(no_info.input_ids[:2]) == [tok.bos_token_id] * 2  # the second BOS vLLM adds


def test_official_pairing_draws_with_replacement_across_halves_and_allows_ties():
    scores = [[0.5, 0.5, 0.5, 0.5], [4.0, 3.0, 2.0, 1.0]]
    cands = [["a", "b", "c", "d"], ["w", "x", "y", "z"]]
    strict = pairs_lib.policy_pairs(cands, scores, num_pairs=4, seed=42)
    official = pairs_lib.policy_pairs(cands, scores, num_pairs=4, seed=42, pairing="official")
    assert strict.skipped_groups == [0] and len(strict) == 4
    assert len(official) == 8 and not official.skipped_groups  # all tied: still 4 pairs
    tied = [p for p in official if p.group == 0]
    assert all(p.chosen_index in (0, 1) and p.rejected_index in (2, 3) for p in tied)
    ranked = [p for p in official if p.group == 1]
    assert all(p.chosen in ("w", "x") and p.rejected in ("y", "z") for p in ranked)
    draws = [(p.group, p.chosen_index, p.rejected_index) for p in official]
    assert draws == [(p.group, p.chosen_index, p.rejected_index)
                     for p in pairs_lib.policy_pairs(cands, scores, num_pairs=4, seed=42, pairing="official")]
    # With replacement: 16 draws from 2 x 2 combinations must repeat some.
    many = pairs_lib.policy_pairs(cands[1:], scores[1:], num_pairs=16, seed=0, pairing="official")
    assert len(many) == 16 and len({(p.chosen_index, p.rejected_index) for p in many}) <= 4


def test_rollout_block_layout_keeps_failed_episodes_and_round_trips(tmp_path):
    from sweet_jax.rl import episodes as collect
    from sweet_jax.data.loading import load_trajectories
    from sweet_jax.envs import ANSWER_MARKER, ScriptedSimulator
    from sweet_jax.envs.simulators import SimulatorError

    tasks = [{"problem_description": f"Task {i}: write f(x).", "ground_truth": f"def f(x):\n    return x + {i}",
              "test_cases": {"a": "f(1)"}, "hidden_information": f"My number is {i}."} for i in range(3)]

    def policy(messages):
        asked = sum(m["role"] == "assistant" for m in messages)
        return "What is your number?" if asked == 0 else f"{ANSWER_MARKER}\ndef f(x):\n    return x"

    def simulator(task, dialogue):
        if "Task 1" in task["problem_description"]:
            raise SimulatorError("endpoint down")
        return task["hidden_information"]

    out = tmp_path / "traj.jsonl"
    collect.rollout(tasks, collect.FunctionPolicy(policy), ScriptedSimulator(simulator), out, best_of=2,
                        batch_size=4, progress=False)
    assert len(collect.read_records(out)) == 4  # by task: the two failed episodes are apart
    rows = collect.write_official_layout(out, tasks, best_of=2)
    records = collect.read_records(out)
    assert rows == 6 == len(records)
    # Row b * N + i is sample b of task i: the alignment the official evaluate_code.py --k 2 asserts.
    assert [(r["rollout"]["task_index"], r["rollout"]["sample"]) for r in records] == \
        [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    for i in range(3):
        assert records[i]["task"]["problem_description"] == records[i + 3]["task"]["problem_description"]
    failed = [r for r in records if "failure" in r["rollout"]]
    assert [r["rollout"]["task_index"] for r in failed] == [1, 1]
    assert all(r["answer"] == "No answer" and r["reward"] == 0.0 and r["dialogue_history"][1]["role"] == "assistant"
               for r in failed)
    assert len(load_trajectories(out)) == 6  # our loader reads it back
    back = collect.from_official_blocks(records, best_of=2)
    assert sorted(back) == [(i, b) for i in range(3) for b in range(2)]
    assert all(rec["rollout"]["task_index"] == i and rec["rollout"]["sample"] == b for (i, b), rec in back.items())
    with pytest.raises(collect.RolloutError, match="have not run yet"):
        collect.official_blocks([r for r in records if "failure" not in r["rollout"]], [], tasks, 2)
    with pytest.raises(collect.RolloutError, match="not the same task"):
        by_task = sorted(records, key=lambda r: (r["rollout"]["task_index"], r["rollout"]["sample"]))
        collect.from_official_blocks(by_task, best_of=2)


def test_prompts_load_from_files_with_the_official_placeholders(tmp_path):
    from sweet_jax.envs.prompts import load_prompt, simulator_dialogue_text
    from sweet_jax.envs.simulators import simulator_messages
    from sweet_jax.errors import SweetJaxError

    sim = tmp_path / "sim.txt"
    sim.write_text("You are a user with {{braces}}. Task: {problem_description}\nSecret: {hidden_information}\n"
                   "So far:\n{dialogue_history}")
    template = load_prompt(str(sim), "simulator")
    task = {"problem_description": "Sum two numbers.", "ground_truth": "g", "hidden_information": "Use ints."}
    dialogue = [{"role": "user", "content": "Sum two numbers."}, {"role": "assistant", "content": "Which type?"}]
    messages = simulator_messages(task, dialogue, template=template)
    assert messages[1]["content"] == ("You are a user with {braces}. Task: Sum two numbers.\nSecret: Use ints.\n"
                                      "So far:\n" + simulator_dialogue_text(dialogue))
    agent = tmp_path / "agent.txt"
    agent.write_text("Rules {as written}.")
    assert load_prompt(str(agent), "agent") == "Rules {as written}."
    bad = tmp_path / "bad.txt"
    bad.write_text("{hidden_information} {ground_truth}")
    with pytest.raises(SweetJaxError, match=r"unknown placeholder\(s\) \['ground_truth'\]"):
        load_prompt(str(bad), "simulator")
    bad.write_text("{problem_description} only")
    with pytest.raises(SweetJaxError, match="hidden_information"):
        load_prompt(str(bad), "simulator")


def test_official_presets_select_the_official_behaviour():
    from configs import critic, policy, rank, rollout

    c = critic.get_config("official")
    assert (c.data.mask_style, c.data.length_policy, c.loss.advantage_norm) == ("official", "cut_right",
                                                                               "trajectory_mean")
    p = policy.get_config("official")
    assert (p.loss.nll_scope, p.loss.nll_coef, p.data.max_len) == ("sequence", 0.01, 16384)
    r = rank.get_config("official")
    assert (r.rank_reference, r.score_style, r.critic_temperature, r.pairing, r.seed) == \
        ("sampler", "official", 0.5, "official", 42)
    e = rollout.get_config("official_eval")
    assert (e.sampling.temperature, e.sampling.max_new_tokens, e.sandbox.timeout_s, e.sandbox.compat, e.layout) == \
        (1.0, 1024, 1.0, "sweet_rl", "official")
    # The paper's defaults stay.
    assert critic.get_config("llama3_8b").loss.advantage_norm == "turn_mean"
    assert policy.get_config("llama3_8b").loss.nll_scope == "reply"


def test_first_rows_eval_split_evaluates_the_first_rows_and_trains_on_all(tok, tmp_path):
    from configs import policy as policy_configs
    from sweet_jax.data import datasets

    rows = [official_pair_row(tok, official_trajectory(tok, [f"Q{i}?"], [None], 1.0),
                              official_trajectory(tok, [f"A{i}"], [None], 0.0)) for i in range(40)]
    path = tmp_path / "random_pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = policy_configs.get_config("demo_official")  # eval_split first_rows, eval_fraction 0.03
    with config.unlocked():
        config.data.pairs = str(path)
    train_set, eval_set = datasets.build_datasets(config, tok)
    assert len(train_set) == 40 and len(eval_set) == 1  # int(0.03 * 40) = 1: row 0, trained on as well
    np.testing.assert_array_equal(eval_set.examples[0][0].input_ids, train_set.examples[0][0].input_ids)


def _official_pass(reference, answer, call):
    """The official evaluator's per-case rule, re-stated for benign probes (run here, in-process): exec each
    code into a function's locals, eval the call there, pass when equal by == and the reference is not None."""
    def run(code):
        scope = {}
        try:
            exec(code, {"__builtins__": __builtins__}, scope)
            return eval(call, {"__builtins__": __builtins__}, scope)
        except Exception:
            return None
    expected, got = run(reference), run(answer)
    return bool(expected == got) and expected is not None


PROBES = [  # (reference, answer), call f(2, 3); the honest answers import inside the function (exec-into-locals)
    ("def f(a, b):\n    return a + b", "def f(a, b):\n    import numpy as np\n    return np.add(a, b)"),
    ("def f(a, b):\n    return (a + b) / 2", "def f(a, b):\n    import numpy as np\n    return np.mean([a, b])"),
    ("def f(a, b):\n    return {'x': a, 'y': b}",
     "def f(a, b):\n    import collections\n    return collections.Counter({'x': a, 'y': b})"),
    ("def f(a, b):\n    return {'x': a}",
     "def f(a, b):\n    import collections\n    d = collections.defaultdict(int)\n    d['x'] += a\n    return d"),
    ("def f(a, b):\n    return {'x': a, 'y': b}",
     "def f(a, b):\n    import collections\n    return collections.OrderedDict(y=b, x=a)"),
    ("def f(a, b):\n    return (a, b)",
     "def f(a, b):\n    import collections\n    P = collections.namedtuple('P', 'a b')\n    return P(a, b)"),
    ("def f(a, b):\n    return a / 4", "def f(a, b):\n    import decimal\n    return decimal.Decimal(a) / 4"),
    ("def f(a, b):\n    return 0.1", "def f(a, b):\n    import decimal\n    return decimal.Decimal('0.1')"),
    ("def f(a, b):\n    return b / 2", "def f(a, b):\n    import fractions\n    return fractions.Fraction(b, 2)"),
    ("def f(a, b):\n    import math\n    return [math.nan, a]", "def f(a, b):\n    import math\n    return [math.nan, a]"),
    ("def f(a, b):\n    import math\n    return [math.nan]", "def f(a, b):\n    return [float('nan')]"),
    ("def f(a, b):\n    import math\n    return math.nan", "def f(a, b):\n    import math\n    return math.nan"),
    ("def f(a, b):\n    import numpy as np\n    return {'m': np.nan}",
     "def f(a, b):\n    import numpy as np\n    return {'m': np.nan}"),
    ("def f(a, b):\n    return [a, b]", "def f(a, b):\n    return [a, b + 1]"),
]
ALWAYS_EQUAL = [  # the official evaluator passes these; they stay refused here
    "def f(a, b):\n    class E:\n        def __eq__(s, o):\n            return True\n    return E()",
    "def f(a, b):\n    import collections\n    class C(collections.Counter):\n        def __eq__(s, o):\n"
    "            return True\n    return C()",
    "def f(a, b):\n    class P(tuple):\n        _fields = ('a',)\n        def __eq__(s, o):\n            return True\n"
    "    return P((0,))",
    "def f(a, b):\n    import numpy as np\n    class A(np.ndarray):\n        def __eq__(s, o):\n            return True\n"
    "        def tolist(s):\n            return s\n    return np.zeros(1).view(A)",
]


def test_sweet_rl_compat_scores_well_known_value_types_as_the_official_evaluator():
    from sweet_jax.sandbox import Evaluator

    official = [_official_pass(ref, ans, "f(2, 3)") for ref, ans in PROBES]
    assert official == [True] * 7 + [False, True, True, False, False, True, False]  # the rule re-stated
    tasks = [({"ground_truth": ref, "test_cases": {"t": "f(2, 3)"}}, ans) for ref, ans in PROBES]
    tasks += [({"ground_truth": "def f(a, b):\n    return a + b", "test_cases": {"t": "f(2, 3)"}}, ans)
              for ans in ALWAYS_EQUAL]
    with Evaluator(workers=2, timeout_s=5.0, compat="sweet_rl") as evaluator:
        scores = evaluator.score_many(tasks)
    assert [s.reward == 1.0 for s in scores[:len(PROBES)]] == official
    assert [s.reward for s in scores[len(PROBES):]] == [0.0] * len(ALWAYS_EQUAL)
    assert all("rejected" in s.details["cases"][0].get("message", "") for s in scores[len(PROBES):])


def test_official_plain_converts_only_real_numpy_and_known_types():
    import collections
    import sys
    import types

    from sweet_jax.sandbox import protocol

    import numpy as np
    got = protocol.official_plain({"a": np.arange(3), "b": (np.float32(0.5), collections.Counter("aab"))},
                                  sys.modules)
    assert got == {"a": [0, 1, 2], "b": (0.5, {"a": 2, "b": 1})} and type(got["b"][1]) is dict
    fake = types.ModuleType("numpy")
    fake.ndarray = type("ndarray", (), {"tolist": lambda s: [1]})
    fake.generic = type("generic", (), {})
    value = fake.ndarray()
    assert protocol.official_plain(value, {"numpy": fake}) is value  # a stand-in numpy converts nothing
    with pytest.raises(protocol.ValueRejected):
        protocol.encode_value(protocol.official_plain(value, {"numpy": fake}))


def test_sweet_rl_on_python_313_warns_why_the_official_code_scores_zero():
    from sweet_jax.sandbox import evaluator

    assert evaluator.official_exec_warning((3, 12, 0)) is None
    message = evaluator.official_exec_warning((3, 13, 1))
    assert "3.13" in message and "PEP 667" in message and "scores every answer 0" in message


def test_official_rank_sequence_of_a_message_form_turn_uses_the_prompt_the_candidates_came_from(tok):
    from sweet_jax.rl import ranking
    from sweet_jax.data.schema import Trajectory

    traj = Trajectory.from_json({"task": {"problem_description": "Write f.", "ground_truth": "def f(): pass",
                                          "test_cases": {}},
                                 "dialogue_history": [{"role": "user", "content": "Write f."},
                                                      {"role": "assistant", "content": "Which f?"}]})
    prompt = ranking.turn_prompts([traj])[0]
    _, sampled_from = ranking.prompt_ids(tok, prompt, system_prompt="Rules.")
    seq = ranking.critic_sequence(tok, prompt, "The f.", info_template=INFO, info_placement="raw_prefix",
                                   use_info=False, style="official", system_prompt="Rules.")
    expected = [tok.bos_token_id] + tok(sampled_from + "The f.", add_special_tokens=False)["input_ids"]
    assert seq.input_ids.tolist() == expected and "Rules." in sampled_from


def test_turn_selection_of_a_fraction_takes_the_rows_the_official_file_would_give_whatever_the_layout():
    """sample_best_of_n.py --data_fraction f keeps data[:int(len(data) * f)] of a file whose row b * N + i is sample
    b of task i: one trajectory of each of the first tasks. Our rollouts write the k samples of a task on
    consecutive rows; the selection must take the same (task, sample) trajectories from either file."""
    from sweet_jax.rl import ranking

    n_tasks, k = 20, 3

    def trajectory(i, b):
        task = {"problem_description": f"Task {i}: write f(x).", "ground_truth": f"def f(x):\n    return x + {i}",
                "test_cases": {"a": "f(1)"}}
        dialogue = [{"role": "user", "content": task["problem_description"]},
                    {"role": "assistant", "content": f"Sample {b}: what should f add?"},
                    {"role": "user", "content": f"It adds {i}."},
                    {"role": "assistant", "content": f"I WANT TO ANSWER:\ndef f(x):\n    return x + {i}"}]
        return Trajectory.from_json({"task": task, "dialogue_history": dialogue, "reward": 1.0})

    official_rows = [(i, b) for b in range(k) for i in range(n_tasks)]      # row b * N + i
    by_task_rows = [(i, b) for i in range(n_tasks) for b in range(k)]       # ours
    for fraction in (0.1, 0.25, 0.5):
        want = official_rows[:int(len(official_rows) * fraction)]           # the official script's slice
        for rows in (official_rows, by_task_rows):
            prompts = ranking.turn_prompts([trajectory(i, b) for i, b in rows])
            picked = ranking.select_turn_prompts(prompts, "trajectories", max_prompts=0, data_fraction=fraction,
                                                 seed=0)
            got = sorted({rows[p.trajectory_index] for p in picked})
            assert got == sorted(want)
            assert len(picked) == 2 * len(want)     # every turn of each kept trajectory

    # tasks: every turn of every trajectory of a seeded fraction of the tasks
    prompts = ranking.turn_prompts([trajectory(i, b) for i, b in by_task_rows])
    picked = ranking.select_turn_prompts(prompts, "tasks", max_prompts=0, data_fraction=0.25, seed=4)
    kept = {by_task_rows[p.trajectory_index][0] for p in picked}
    assert len(kept) == 5 and len(picked) == 5 * k * 2
    assert picked == ranking.select_turn_prompts(prompts, "tasks", max_prompts=0, data_fraction=0.25, seed=4)
    other = ranking.select_turn_prompts(prompts, "tasks", max_prompts=0, data_fraction=0.25, seed=5)
    assert {by_task_rows[p.trajectory_index][0] for p in other} != kept
