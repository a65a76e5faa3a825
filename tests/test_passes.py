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
