"""The training input path on several hosts, simulated in one process (process_index / process_count passed
in): each host renders only its slice of the examples, the slices are disjoint and make up the single-host
data, and the hosts' batches agree in shape and together are the single-host batches, resume included."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from sweet_jax.train import model_loading
from sweet_jax.data import datasets

from test_train import demo_config, small_trajectories


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_trajectories(tmp_path_factory.mktemp("data") / "trajectories.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    from sweet_jax.data.tokenizers import load_tokenizer
    return load_tokenizer(model_loading.tokenizer_path(demo_config(file="critic.py", preset="demo")))


def critic_config(data, **overrides):
    return demo_config(file="critic.py", preset="demo", data__trajectories=str(data), train__batch_size=8,
                       data__eval_fraction=0.2, data__bucket=128, **overrides)


def hosts_datasets(config, tokenizer, hosts, monkeypatch):
    """build_datasets on each simulated host, counting the trajectories each one renders; then what
    gather_lengths would tell every host."""
    from sweet_jax.data import batching, pairs

    real_render = pairs.render_trajectory
    rendered = []

    def counting_render(*args, **kwargs):
        rendered[-1] += 1
        return real_render(*args, **kwargs)
    monkeypatch.setattr(pairs, "render_trajectory", counting_render)
    parts = []
    for p in range(hosts):
        rendered.append(0)
        parts.append(datasets.build_datasets(config, tokenizer, process_index=p, process_count=hosts))
    for split in (0, 1):
        ids = np.concatenate([np.asarray(part[split].ids, np.int64) for part in parts])
        lengths = np.concatenate([batching.example_lengths(part[split].examples, scored=True) for part in parts])
        for part in parts:
            part[split].lengths = (ids, lengths)
    return parts, rendered


@pytest.mark.parametrize("hosts", [2, 4])
@pytest.mark.parametrize("max_len,policy", [(4096, "truncate"), (345, "drop")])
def test_hosts_render_disjoint_slices_that_make_up_the_single_host_data(data, tokenizer, monkeypatch, hosts,
                                                                        max_len, policy):
    config = critic_config(data, data__max_len=max_len, data__length_policy=policy)
    (single,), (single_rendered,) = hosts_datasets(config, tokenizer, 1, monkeypatch)
    parts, rendered = hosts_datasets(config, tokenizer, hosts, monkeypatch)
    for split in (0, 1):
        whole = single[split]
        held = [part[split] for part in parts]
        assert all(h.num_global == whole.num_global for h in held)
        ids = [set(h.ids) for h in held]
        assert sum(len(i) for i in ids) == len(set().union(*ids))  # disjoint
        assert set().union(*ids) == set(whole.ids)  # nothing lost, nothing added
        by_id = dict(zip(whole.ids, whole.examples))
        for h in held:
            for i, ex in zip(h.ids, h.examples):
                for got, want in zip(ex, by_id[i]):
                    np.testing.assert_array_equal(got.input_ids, want.input_ids)
                    np.testing.assert_array_equal(got.turn_ids, want.turn_ids)
    if policy == "drop":
        assert len(single[0]) < single[0].num_global  # the length policy dropped some: ids have gaps
    # Each host rendered only its slice: together what one host renders, plus the best trajectory of a task
    # that a slice boundary cuts (its pairs on both sides render it), at most one per boundary and split.
    assert single_rendered <= sum(rendered) <= single_rendered + 2 * (hosts - 1)
    assert max(rendered) < single_rendered


@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_batches_agree_in_shape_and_make_up_the_single_host_batches(data, tokenizer, monkeypatch, hosts):

    config = critic_config(data, data__max_len=345, data__length_policy="drop", data__padding_side="left")
    whole, _ = datasets.build_datasets(config, tokenizer)
    whole.gather_lengths()
    parts, _ = hosts_datasets(config, tokenizer, hosts, monkeypatch)
    single = whole.batches(config, pad_id=0, num_epochs=2)
    its = [part[0].batches(config, pad_id=0, process_index=p, process_count=hosts, num_epochs=2)
           for p, part in enumerate(parts)]
    assert {it.steps_per_epoch for it in its} == {single.steps_per_epoch}
    assert {it.num_examples for it in its} == {single.num_examples} == {len(whole)}
    steps = 0
    for want in single:
        got = [next(it) for it in its]
        assert {g["input_ids"].shape for g in got} == {(8 // hosts,) + want["input_ids"].shape[1:]}
        for k in want:
            np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), want[k], err_msg=k)
        steps += 1
    assert steps == 2 * single.steps_per_epoch


@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_resume_exactly_with_reference_logprobs_in_the_batches(data, tokenizer, monkeypatch, hosts):
    """Per-token extras (the reference pass's ref_logp) travel with each host's rows; a saved position resumes
    each host at exactly its remaining batches."""
    config = critic_config(data, data__max_len=4096)
    parts, _ = hosts_datasets(config, tokenizer, hosts, monkeypatch)
    for part in parts:
        d = part[0]
        d.extras["ref_logp"] = [tuple(s.input_ids.astype(np.float32) / 7 for s in ex) for ex in d.examples]

    def iterators():
        return [part[0].batches(config, pad_id=0, process_index=p, process_count=hosts, num_epochs=2)
                for p, part in enumerate(parts)]
    straight = [list(it) for it in iterators()]
    first = iterators()
    for it in first:
        for _ in range(3):
            next(it)
    state = json.loads(json.dumps(first[0].state()))
    resumed = iterators()
    for p, it in enumerate(resumed):
        it.restore(state)
        rest = list(it)
        assert len(rest) == len(straight[p]) - 3
        for got, want in zip(rest, straight[p][3:]):
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])
            real = got["weight"] == 1
            ref, ids, mask = got["ref_logp"][real], got["input_ids"][real], got["attention_mask"][real] == 1
            np.testing.assert_allclose(ref[mask], ids[mask] / 7, rtol=1e-6)
            assert (ref[~mask] == 0).all()


def test_policy_pairs_train_on_the_sampled_ids_not_their_text_tokenised_again(tokenizer, tmp_path):
    """A reply sampled one character-token at a time decodes to text that the tokenizer encodes with fewer,
    merged tokens. The DPO examples hold the sampled ids (then the end-of-turn token), not the re-encoding."""
    from sweet_jax.data.render import end_of_turn_token

    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    sampled = {}
    for side, word in (("chosen", "def add"), ("rejected", "return")):
        ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch)[0]) for ch in word.replace(" ", "")]
        text = tokenizer.decode(ids)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] != ids  # re-tokenising gives other ids
        sampled[side] = (text, ids)
    row = {"trajectory_index": 0, "turn": 1, "task_key": "t0", "prompt": messages, "prompt_text": prompt_text,
           "chosen": sampled["chosen"][0], "rejected": sampled["rejected"][0], "chosen_score": 1.0,
           "rejected_score": 0.0, "prompt_ids": prompt_ids, "chosen_ids": sampled["chosen"][1],
           "rejected_ids": sampled["rejected"][1] + [end_of_turn_token(tokenizer)]}  # stopped on its own
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(row) + "\n")
    config = demo_config(file="policy.py", preset="demo", data__pairs=str(path), data__eval_fraction=0.0,
                         train__batch_size=1, data__max_len=512, data__bucket=128)
    train_set, _ = datasets.build_datasets(config, tokenizer)
    [(chosen, rejected)] = train_set.examples
    eot = end_of_turn_token(tokenizer)
    for seq, side in ((chosen, "chosen"), (rejected, "rejected")):
        expected = prompt_ids + sampled[side][1] + [eot]
        np.testing.assert_array_equal(seq.input_ids, expected)
        np.testing.assert_array_equal(seq.turn_ids, [0] * len(prompt_ids) + [1] * (len(expected) - len(prompt_ids)))


def test_a_bad_policy_pair_line_names_its_file_line_and_field(tokenizer, tmp_path):
    """sweet_jax.rank lines are read as PolicyPair records: a wrong field is one error naming file:line and it."""
    from sweet_jax.config_utils import TrainConfigError

    good = {"trajectory_index": 0, "turn": 1, "task_key": "t0", "prompt": [{"role": "user", "content": "hi"}],
            "prompt_text": "hi", "chosen": "a", "rejected": "b", "chosen_score": 1.0, "rejected_score": 0.0}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, chosen_score="high")) + "\n")
    config = demo_config(file="policy.py", preset="demo", data__pairs=str(path), data__eval_fraction=0.0)
    with pytest.raises(TrainConfigError, match=re.escape(f"{path}:2: field 'chosen_score': must be int or float, got str")):
        datasets.build_datasets(config, tokenizer)


@pytest.mark.parametrize("kind, expected", [("gzip", "gzip file"), ("binary", "binary file"),
                                            ("latin1", "not UTF-8 text"), ("late_latin1", r":2: not UTF-8 text")])
def test_trajectories_that_are_not_jsonl_text_are_one_config_error(data, tokenizer, tmp_path, kind, expected):
    """The regression of issue 36: a gzip or binary data.trajectories gave a UnicodeDecodeError traceback (the
    emptiness check read the whole file as text). A bad byte past the sniffed head is named with its line."""
    import gzip
    from sweet_jax.config_utils import TrainConfigError
    text = data.read_bytes()
    path = tmp_path / "trajectories.jsonl"
    path.write_bytes({"gzip": lambda: gzip.compress(text), "binary": lambda: bytes(range(256)) * 64,
                      "latin1": lambda: "caf\xe9 ".encode("latin-1") * 10,
                      "late_latin1": lambda: b" " * 9000 + b"\n" + b"\xe9" * 40}[kind]())
    with pytest.raises(TrainConfigError, match=rf"data.trajectories=.*{expected}"):
        datasets.build_datasets(critic_config(path), tokenizer)


def test_a_lone_surrogate_in_a_dialogue_is_one_config_error_naming_its_line_and_field(data, tokenizer, tmp_path):
    from sweet_jax.config_utils import TrainConfigError
    rows = data.read_text().splitlines()
    bad = json.loads(rows[1])
    bad["dialogue_history"][0]["content"] = "caf\ud800"
    path = tmp_path / "trajectories.jsonl"
    path.write_text("\n".join([rows[0], json.dumps(bad)] + rows[2:]) + "\n")  # json.dumps escapes it: \ud800
    with pytest.raises(TrainConfigError, match=re.escape(f"{path}:2: field 'dialogue_history.0.content': holds a "
                                                         "lone surrogate")):
        datasets.build_datasets(critic_config(path), tokenizer)
