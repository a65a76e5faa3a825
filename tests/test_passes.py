"""sweet_jax.train.passes: the reference pass runs each distinct sequence once, with the values of the pass over
every example's sequences."""
import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from sweet_jax.data.datasets import Dataset
from sweet_jax.data.render import Rendered
from sweet_jax.models import Llama, LlamaConfig
from sweet_jax.train import passes, steps

CFG = LlamaConfig.preset("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)


def sequence(rng, length: int) -> Rendered:
    ids = rng.integers(3, CFG.vocab_size, length).astype(np.int32)
    turns = np.zeros(length, np.int32)
    turns[length // 2:] = 1
    return Rendered(ids, turns)


def pairs_with_repeats(seed: int = 0) -> Dataset:
    """DPO-like pairs: 3 turn prompts, 4 pairs each drawn with replacement from 4 candidates of various lengths;
    one pair whose two sides are the same sequence."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(3):
        candidates = [sequence(rng, int(n)) for n in rng.integers(5, 40, 4)]
        for _ in range(4):
            a, b = rng.integers(0, 4, 2)
            examples.append((candidates[a], candidates[b]))
    examples.append((examples[0][0], examples[0][0]))
    dataset = Dataset(examples=examples, ids=list(range(len(examples))), num_global=len(examples), tasks=3,
                      num_sequences=2)
    dataset.gather_lengths()
    return dataset


def make_batches(dataset, **kwargs):
    config = ml_collections.ConfigDict({"train": {"batch_size": 4, "seed": 0}, "loss": {"score_positions": False},
                                        "data": {"padding_side": "right", "max_len": 64, "bucket": 16}})
    return dataset.batches(config, pad_id=0, **kwargs)


def test_distinct_sequences_keep_each_sequence_once_and_say_where_each_example_went():
    dataset = pairs_with_repeats()
    distinct, where = passes.distinct_sequences(dataset)
    keys = {s.input_ids.tobytes() for ex in dataset.examples for s in ex}
    listed = [s.input_ids.tobytes() for ex in distinct.examples for s in ex]
    assert set(listed) == keys and len(listed) - len(keys) in (0, 1)   # one repeat fills the last example
    assert len(keys) < 2 * len(dataset)
    for example, at in zip(dataset.examples, where):
        for seq, (e, p) in zip(example, at):
            assert np.array_equal(distinct.examples[e][p].input_ids, seq.input_ids)
    lengths = [len(s) for ex in distinct.examples for s in ex]
    assert lengths == sorted(lengths, reverse=True)   # longest first: an example's sequences pad little


def test_the_deduplicated_reference_pass_equals_the_pass_over_every_example_and_runs_fewer_rows():
    dataset = pairs_with_repeats()
    model = Llama(CFG, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_fn = steps.make_ref_logp_fn(graphdef, rest=rest, chunk_size=8)
    batches = []

    def counted(params, batch):
        batches.append(batch["input_ids"].shape)
        return ref_fn(params, batch)

    sharding = steps.batch_sharding(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                                                      ("data", "fsdp", "tensor")))
    every = passes.reference_pass(counted, params, dataset, make_batches, sharding, "right", deduplicate=False)
    every_batches, batches[:] = len(batches), []
    once = passes.reference_pass(counted, params, dataset, make_batches, sharding, "right")
    distinct, _ = passes.distinct_sequences(dataset)
    assert every_batches == -(-len(dataset) // 4) and len(batches) == -(-len(distinct.examples) // 4) < every_batches
    assert len(once) == len(every) == len(dataset)
    for a, b, example in zip(once, every, dataset.examples):
        for x, y, seq in zip(a, b, example):
            assert x.shape == y.shape == (len(seq),)
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def prompt_pairs(seed: int = 0) -> Dataset:
    """Step-level pairs: 5 turn prompts of 33-48 tokens, 4 pairs each drawn with replacement from 5 candidate
    replies of 1-16 tokens; two prompts share their first 32 tokens (one dialogue's turns), and one sequence
    is a prefix of another (a reply that another continues)."""
    rng = np.random.default_rng(seed)
    opening = rng.integers(3, CFG.vocab_size, 32).astype(np.int32)
    examples = []
    for t in range(5):
        prompt = np.concatenate([opening if t < 2 else rng.integers(3, CFG.vocab_size, 32).astype(np.int32),
                                 rng.integers(3, CFG.vocab_size, int(rng.integers(1, 17))).astype(np.int32)])
        replies = [rng.integers(3, CFG.vocab_size, int(n)).astype(np.int32) for n in rng.integers(1, 9, 5)]
        replies[1] = np.concatenate([replies[0], replies[1]])
        candidates = []
        for reply in replies:
            turns = np.concatenate([np.zeros(len(prompt), np.int32), np.ones(len(reply), np.int32)])
            candidates.append(Rendered(np.concatenate([prompt, reply]), turns))
        for _ in range(4):
            a, b = rng.integers(0, 5, 2)
            examples.append((candidates[a], candidates[b]))
    dataset = Dataset(examples=examples, ids=list(range(len(examples))), num_global=len(examples), tasks=5,
                      num_sequences=2)
    dataset.gather_lengths()
    return dataset


def test_the_packed_reference_pass_equals_the_pass_over_every_example_and_runs_each_prefix_once():
    """Each distinct sequence once, behind the prefix it shares with others (a row a call): the values of every
    example's sequences run apart (float32), in fewer tokens; with `only`, the examples asked for get exactly the
    values of the whole pass (a run stopped at a step computes what the whole run computed) and the others None."""
    from sweet_jax import costs

    dataset = prompt_pairs()
    model = Llama(CFG, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sharding = steps.batch_sharding(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                                                      ("data", "fsdp", "tensor")))
    every = passes.reference_pass(steps.make_ref_logp_fn(graphdef, rest=rest, chunk_size=8), params, dataset,
                                  make_batches, sharding, "right", deduplicate=False)
    packed_fn = steps.make_packed_logp_fn(graphdef, rest=rest, chunk_size=8)
    costs.reset()
    packed = passes.reference_pass(None, params, dataset, make_batches, sharding, "right", packed=packed_fn)
    run = costs.snapshot()
    assert len(packed) == len(dataset)
    for a, b, example in zip(packed, every, dataset.examples):
        for x, y, seq in zip(a, b, example):
            assert x.shape == y.shape == (len(seq),) and x.dtype == np.float32
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    distinct = {seq.input_ids.tobytes(): len(seq) for ex in dataset.examples for seq in ex}
    prompts = {key[:32 * 4] for key in distinct}   # int32: a sequence's first 32 tokens
    assert len(prompts) == 4   # two of the five prompts share their first 32 tokens
    assert run["ref_logp_tokens"] <= sum(distinct.values()) - (len(distinct) - len(prompts)) * 32

    only = {0, 3, 4, 9, 17}
    part = passes.reference_pass(None, params, dataset, make_batches, sharding, "right", packed=packed_fn, only=only)
    for i, (a, b) in enumerate(zip(part, packed)):
        if i not in only:
            assert a is None
            continue
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_prefix_groups_put_sequences_that_share_a_prefix_in_one_row_within_its_limits():
    from sweet_jax.data import batching

    rng = np.random.default_rng(1)
    a, b = rng.integers(3, 60, 40), rng.integers(3, 60, 40)
    seqs = [np.concatenate([a, [3 + i], rng.integers(3, 60, 4)]) for i in range(5)] + \
        [b, np.concatenate([b, [7, 8]])] + \
        [np.concatenate([a[:10], rng.integers(3, 60, 30)])]
    groups = batching.prefix_groups(seqs, max_tokens=1000, max_sequences=16, min_shared=32)
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 3, 4], [5, 6], [7]]   # 10 shared tokens are too few
    groups = batching.prefix_groups(seqs, max_tokens=1000, max_sequences=3, min_shared=32)
    assert sorted(map(len, groups)) == [1, 2, 2, 3]
    groups = batching.prefix_groups(seqs, max_tokens=40 + 3 * 5, max_sequences=16, min_shared=32)
    assert all(batching.packed_length([seqs[j] for j in g]) <= 55 or len(g) == 1 for g in groups)
    assert sorted(j for g in groups for j in g) == list(range(len(seqs)))
    row = [seqs[j] for j in [0, 1, 2]]
    n = batching.packed_length(row)
    assert batching.shared_length(row) == 40 and n == 40 + 3 * 5
    arrays, where = batching.pack_rows([row], width=lambda n: n + 3, pad=0)
    assert arrays["ids"].shape == (1, n + 3) and list(map(len, where[0])) == [44, 44, 44]
    assert len(set(np.concatenate(where[0]).tolist())) == n - 1   # every token read once, the prefix's shared


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_reference_pass_cut_to_each_batch_s_longest_sequence_has_the_bucketed_values(side):
    """length_multiple: each batch runs at its longest sequence rounded up to 4 (the buckets double: 16, 32, 64),
    with the same values on either padding side."""
    dataset = pairs_with_repeats(seed=3)
    model = Llama(CFG, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_fn = steps.make_ref_logp_fn(graphdef, rest=rest, chunk_size=8)
    widths = []

    def counted(params, batch):
        widths.append(batch["input_ids"].shape[-1])
        return ref_fn(params, batch)

    def sided(dataset, **kwargs):
        config = ml_collections.ConfigDict({"train": {"batch_size": 4, "seed": 0}, "loss": {"score_positions": False},
                                            "data": {"padding_side": side, "max_len": 64, "bucket": 16}})
        return dataset.batches(config, pad_id=0, **kwargs)

    sharding = steps.batch_sharding(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                                                      ("data", "fsdp", "tensor")))
    bucketed = passes.reference_pass(counted, params, dataset, sided, sharding, side)
    bucket_widths, widths[:] = list(widths), []
    cut = passes.reference_pass(counted, params, dataset, sided, sharding, side, length_multiple=4)
    assert all(w % 4 == 0 for w in widths) and sum(widths) < sum(bucket_widths)
    assert set(bucket_widths) <= {16, 32, 64} and not set(widths) <= {16, 32, 64}
    for a, b, example in zip(cut, bucketed, dataset.examples):
        for x, y, seq in zip(a, b, example):
            assert x.shape == y.shape == (len(seq),)
            # A sequence's first token has no label log-prob (left-padded, it reads whatever padding precedes it)
            np.testing.assert_allclose(x[1:], y[1:], rtol=1e-5, atol=1e-5)


def test_a_run_that_stops_early_gets_reference_log_probs_for_the_examples_its_steps_reach_only():
    dataset = pairs_with_repeats()
    batches = make_batches(dataset)   # 4 examples a batch, shuffled: 13 examples in 4 batches an epoch
    reached = passes.trained_examples(batches, 2)
    assert reached == {int(i) for step in (0, 1) for i in batches.local_indices(0, step) if i >= 0}
    assert len(reached) == 8 and passes.trained_examples(batches, 5) == set(range(len(dataset)))
    model = Llama(CFG, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_fn = steps.make_ref_logp_fn(graphdef, rest=rest, chunk_size=8)
    sharding = steps.batch_sharding(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                                                      ("data", "fsdp", "tensor")))
    every = passes.reference_pass(ref_fn, params, dataset, make_batches, sharding, "right", deduplicate=False)
    some = passes.reference_pass(ref_fn, params, dataset, make_batches, sharding, "right", only=reached)
    for i, (a, b) in enumerate(zip(some, every)):
        if i not in reached:
            assert a is None
            continue
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_a_critic_run_has_the_old_per_step_losses_with_each_distinct_sequence_referenced_once(tmp_path, monkeypatch):
    """The critic's pairs repeat each task's best trajectory (chosen against every worse one): the trainer with
    the reference pass over every example's sequences (the old way) and with each distinct one once."""
    import functools
    import json
    import pathlib

    from test_train import demo_config, small_trajectories

    from sweet_jax.train import trainer

    data = small_trajectories(tmp_path / "trajectories.jsonl")
    config = demo_config(file="critic.py", preset="demo", data__trajectories=str(data), data__max_len=256,
                         data__bucket=256, train__batch_size=8, train__num_steps=3, train__eval_every=0,
                         train__ckpt_every=0, data__eval_fraction=0.0)
    runs = {}
    for way, deduplicate in (("every", False), ("once", True)):
        with monkeypatch.context() as m:
            m.setattr(passes, "reference_pass", functools.partial(passes.reference_pass, deduplicate=deduplicate))
            trainer.run(config, tmp_path / way)
        runs[way] = [json.loads(line) for line in pathlib.Path(tmp_path / way / "metrics.jsonl").read_text().splitlines()]
    every, once = ([r for r in runs[w] if r["split"] == "train"] for w in ("every", "once"))
    assert [r["step"] for r in every] == [r["step"] for r in once] == [1, 2, 3]
    for a, b in zip(every, once):
        for k in ("loss", "pair_accuracy", "margin", "chosen_score", "rejected_score", "grad_norm"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=f"{k} at step {a['step']}")


def test_the_trainer_cuts_host_loop_micro_batches_at_data_micro_bucket_and_the_smollm2_stages_at_32(tmp_path):
    import contextlib
    import sys

    from test_train import REPO, demo_config

    from sweet_jax import config_utils
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.train import model_loading, trainer

    config = demo_config(file="critic.py", preset="demo", data__micro_bucket=16, data__bucket=256)
    tr = trainer.Trainer(config, tmp_path, model_loading.make_mesh((1, 1, 1)))
    tokenizer = load_tokenizer(model_loading.tokenizer_path(config))
    tr.load_data(tokenizer)
    with contextlib.ExitStack() as scope:
        tr.build_steps(tokenizer, scope)
    assert isinstance(tr.train_step, steps.HostLoopStep) and tr.train_step.length_multiple == 16

    sys.path.insert(0, str(REPO))
    from configs import pipeline as pipeline_configs
    pipeline = pipeline_configs.get_config("smollm2_select")
    for stage in config_utils.TRAINING_STAGES:
        section = pipeline
        for part in stage.split("."):
            section = section[part]
        train = config_utils.stage_train_config(pipeline, section)
        assert (train.data.bucket, train.data.micro_bucket) == (128, 32), stage
    assert pipeline_configs.get_config("demo").train.micro_bucket == 0   # elsewhere: data.bucket, as before
